"""Prepare the real corpora of the accuracy runs at scale (issue 46) and carry them to a machine without network.

Here (network, any CPU): `python -m data.prepare_corpus` fetches the Debian packages (`apt-get download`),
checks each against apt's index (size, SHA256), splits each corpus by file, trains the BPE on the kernel's train
split and tokenizes every split once through the main job's data pipeline, into .data/corpora/<name>/ (a folder
that `examples/train.py --data` reads, tokenizer included), then packs .data/carry/ (<= --carry-limit-mib).
On the device: `python -m data.prepare_corpus --from-carry` unpacks .data/carry/ into .data/corpora/ in
seconds, checking every file against the manifest. data/ has the parts; docs/benchmarks.md the numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from data import carry, debian, sources

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
TRAIN_MIB = 272                  # the kernel train text kept: ~115M tokens, what 48 MiB of carry holds
CARRY_LIMIT_MIB = 48             # of the device's 64 MiB working tree: the rest is the repo and its wheels
MIN_TOKENS = {"pretraining": (100_000_000, 2_000_000), "fine-tuning": (1_000_000, 200_000)}   # (train, validation)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=ROOT / ".data",
                   help="holds debs/ (the packages), corpora/ (the token folders) and carry/ (default: .data)")
    p.add_argument("--from-carry", action="store_true", help="only unpack ROOT/carry into ROOT/corpora (the device)")
    p.add_argument("--offline", action="store_true", help="never run apt-get: the .debs must be in ROOT/debs")
    p.add_argument("--kernel-package", default=sources.KERNEL_PACKAGE, help="the linux-source package")
    p.add_argument("--train-mib", type=float, default=TRAIN_MIB, help="the kernel's train text kept, in MiB")
    p.add_argument("--vocab-size", type=int, help="the BPE's vocabulary (default: the main job's, 8192)")
    p.add_argument("--carry-limit-mib", type=float, default=CARRY_LIMIT_MIB, help="largest carry allowed")
    p.add_argument("--min-tokens", type=int, nargs=4, metavar=("PRE_TRAIN", "PRE_VAL", "FT_TRAIN", "FT_VAL"),
                   help="fewest tokens per split accepted (default: %s)" % " ".join(
                       f"{n:_}" for pair in MIN_TOKENS.values() for n in pair))
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="threads for xz and SHA256")
    args = p.parse_args(argv)
    for name in ("train_mib", "carry_limit_mib", "workers"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    pairs = args.min_tokens or [n for pair in MIN_TOKENS.values() for n in pair]
    args.min_tokens = {"pretraining": tuple(pairs[:2]), "fine-tuning": tuple(pairs[2:])}
    return args


def fetch(folder: Path, packages: list[str], offline: bool,
          index_of=debian.apt_index) -> dict[str, debian.Deb]:
    """Every package's checked .deb: those already in `folder`, the others downloaded unless `offline`."""
    found, missing = debian.find(folder, packages) if folder.is_dir() else ({}, list(packages))
    if missing and not offline:
        debian.download(folder, missing)
        found, missing = debian.find(folder, packages)
    if missing:
        raise debian.CorpusError(f"missing in {folder}: {', '.join(m + '_*.deb' for m in missing)} (run without "
                                 f"--offline, or `apt-get download {' '.join(missing)}` in that folder)")
    return {d.package: d for d in debian.check(found, index_of(packages))}


def build_one(src: sources.Source, debs: dict[str, debian.Deb], out: Path, tok_json: Path | None,
              args: argparse.Namespace) -> dict:
    """One corpus read, split, capped and tokenized into `out`; the facts the manifest records of it."""
    from data import build

    read = src.read({p: debs[p].path for p in src.packages})
    train, val = build.split(read.docs, src.held_out)
    pool = sum(d.size for d in train)
    budget = int(args.train_mib * MIB) if src.uncapped else None
    if budget is not None:
        train = build.cap(train, budget, src.uncapped)
    if not train or not val:
        raise debian.CorpusError(f"{src.name}: {len(train)} train and {len(val)} validation files from "
                                 f"{', '.join(src.packages)}; both splits need files (held out: {src.held_out_rule})")
    empty = [d for d in src.held_out_dirs if not any(v.rel.startswith(d) for v in val)]
    if empty:
        raise debian.CorpusError(f"{src.name}: no files in the held-out folders {', '.join(empty)} of "
                                 f"{', '.join(src.packages)}; another layout? (see data/sources.py)")
    build.tokenize(src.name, train, val, out, tok_json, args.vocab_size)
    return {"role": src.role, "held_out": src.held_out_rule, **read.facts, **build.text_facts(train, val),
            "train_pool_bytes": pool, "train_budget_bytes": budget,
            "packages": [{"package": d.package, "version": d.version, "file": d.path.name, "bytes": d.size,
                          "sha256": d.sha256} for d in (debs[p] for p in src.packages)]}


def check_tokens(metas: dict[str, dict], roles: dict[str, str], minimums: dict[str, tuple[int, int]]) -> None:
    """Every split holds its corpus role's fewest tokens; else one line naming each that falls short."""
    short = []
    for name, meta in metas.items():
        for split, least in zip(("train", "val"), minimums[roles[name]]):
            if meta[f"{split}_tokens"] < least:
                short.append(f"{name} {split} {meta[f'{split}_tokens']:,} < {least:,}")
    if short:
        raise debian.CorpusError(f"too few tokens: {'; '.join(short)} (raise --train-mib for the kernel's train "
                                 f"split, or lower --min-tokens)")


def carry_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def prepare(args: argparse.Namespace, index_of=debian.apt_index) -> dict:
    """The whole preparation; the manifest, with how long each part took."""
    from coat_ds.workloads import data

    args.vocab_size = args.vocab_size or data.DEFAULT_VOCAB
    t0, seconds, srcs, load = time.time(), {}, sources.sources(args.kernel_package), os.getloadavg()[0]
    debs = fetch(args.root / "debs", [p for s in srcs.values() for p in s.packages], args.offline, index_of)
    seconds["fetch_and_check"] = time.time() - t0
    folders, facts = {}, {}
    for name, src in srcs.items():       # the pretraining corpus first: its BPE tokenizes the others
        t = time.time()
        folders[name] = args.root / "corpora" / name
        tok_json = None if src.role == "pretraining" else next(iter(folders.values())) / "tokenizer.json"
        facts[name] = build_one(src, debs, folders[name], tok_json, args)
        seconds[name] = time.time() - t
    check_tokens({n: json.loads((f / "meta.json").read_text()) for n, f in folders.items()},
                 {n: s.role for n, s in srcs.items()}, args.min_tokens)
    t = time.time()
    manifest = carry.pack(folders, args.root / "carry", facts, args.workers)
    seconds["pack"] = time.time() - t
    seconds["total"] = time.time() - t0
    manifest["prepared"] = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
                            "tokenizers": _version("tokenizers"), "cpus": os.cpu_count(), "load_at_start": load,
                            "seconds": seconds,
                            "vocab_size": args.vocab_size, "train_mib": args.train_mib}
    carry.write_manifest(args.root / "carry", manifest)
    size = carry_bytes(args.root / "carry")
    if size > args.carry_limit_mib * MIB:
        raise debian.CorpusError(f"the carry {args.root / 'carry'} is {size / MIB:.1f} MiB, over "
                                 f"--carry-limit-mib {args.carry_limit_mib:g}: lower --train-mib "
                                 f"(now {args.train_mib:g})")
    return manifest


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def summary(manifest: dict, where: Path) -> str:
    """One line per corpus (files, text, tokens, carried bytes) and one for the carry."""
    lines = []
    for name, c in manifest["corpora"].items():
        f, m = c["facts"], c["meta"]
        xz = sum(ch["xz_bytes"] for s in c["splits"].values() for ch in s["chunks"])
        text = (f"{f['train_files']:,}/{f['val_files']:,} files, {f['train_text_bytes'] / MIB:,.1f}/"
                f"{f['val_text_bytes'] / MIB:,.1f} MiB text, " if "train_files" in f else "")
        lines.append(f"{name:9s} {f.get('role', ''):12s} {text}{m['train_tokens']:,}/{m['val_tokens']:,} tokens "
                     f"(train/val), {xz / MIB:.1f} MiB carried")
    lines.append(f"carry {where}: {carry_bytes(where) / MIB:.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None, index_of=debian.apt_index) -> int:
    args = parse_args(argv)
    t0 = time.time()
    try:
        if args.from_carry:
            manifest = carry.unpack(args.root / "carry", args.root / "corpora", args.workers)
        else:
            manifest = prepare(args, index_of)
    except debian.CorpusError as e:
        raise SystemExit(f"error: {e}") from None
    print(summary(manifest, args.root / "carry"))
    print(f"{'unpacked into' if args.from_carry else 'prepared'} {args.root / 'corpora'} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
