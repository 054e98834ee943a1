"""The prepared token folders packed into the few MiB that may travel to a machine without network (a device
call's working tree is limited to 64 MiB), and unpacked there in seconds: xz chunks of the token ids, the one
tokenizer.json, and a manifest with every file's size and SHA256, so that what is unpacked there is checked to be
byte for byte what was prepared here. The token ids travel rather than the text: they compress as well (both
~0.37 bytes a token), and tokenizing again there would take minutes. Standard library only (tqdm where present):
it is the first thing to run on a bare machine."""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data.debian import CorpusError, sha256_file

FORMAT = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
CHUNK_BYTES = 64 << 20      # xz -9's dictionary, so a cut costs no match; chunks (de)compress on all cores


def _compress(src: Path, offset: int, length: int, dest: Path) -> dict:
    with open(src, "rb") as fh:
        fh.seek(offset)
        raw = fh.read(length)
    # xz -9, its dictionary no larger than the chunk: as small, with less memory on both sides for a small chunk
    dict_size = max(1 << 16, min(len(raw), 64 << 20))
    packed = lzma.compress(raw, filters=[{"id": lzma.FILTER_LZMA2, "preset": 9, "dict_size": dict_size}])
    dest.write_bytes(packed)
    return {"file": dest.name, "offset": offset, "bytes": length, "xz_bytes": len(packed),
            "sha256": hashlib.sha256(packed).hexdigest()}


def _jobs(folders: dict[str, Path], carry: Path) -> list[tuple[str, str, Path, int, int, Path]]:
    """(corpus, split, source file, offset, length, chunk file) for every chunk of every split."""
    jobs = []
    for name, folder in folders.items():
        for split in SPLITS:
            src = folder / f"{split}.bin"
            size = src.stat().st_size
            for i, offset in enumerate(range(0, size, CHUNK_BYTES)):
                jobs.append((name, split, src, offset, min(CHUNK_BYTES, size - offset),
                             carry / f"{name}.{split}.{i:02d}.xz"))
    return jobs


def pack(folders: dict[str, Path], carry: Path, facts: dict[str, dict], workers: int) -> dict:
    """Write `carry` afresh: every folder's splits as xz chunks, the tokenizer.json they share, manifest.json
    (each corpus's meta.json and `facts`, each split's size and SHA256, each chunk's). The manifest is returned."""
    from tqdm import tqdm

    tokenizers = {sha256_file(f / "tokenizer.json") for f in folders.values()}
    if len(tokenizers) != 1:
        raise CorpusError(f"the corpora {', '.join(folders)} were tokenized by {len(tokenizers)} tokenizers; "
                          f"a fine-tuned model needs its pretraining one")
    shutil.rmtree(carry, ignore_errors=True)
    carry.mkdir(parents=True)
    shutil.copyfile(next(iter(folders.values())) / "tokenizer.json", carry / "tokenizer.json")
    jobs = _jobs(folders, carry)
    with ThreadPoolExecutor(workers) as pool:
        chunks = list(tqdm(pool.map(lambda j: _compress(*j[2:]), jobs), total=len(jobs), desc="xz -9 chunks"))
    corpora = {}
    for name, folder in folders.items():
        splits = {s: {"bytes": (folder / f"{s}.bin").stat().st_size, "sha256": sha256_file(folder / f"{s}.bin"),
                      "chunks": [c for j, c in zip(jobs, chunks) if j[:2] == (name, s)]} for s in SPLITS}
        corpora[name] = {"meta": json.loads((folder / "meta.json").read_text()), "facts": facts.get(name, {}),
                         "splits": splits}
    manifest = {"format": FORMAT, "tokenizer": {"file": "tokenizer.json", "sha256": tokenizers.pop(),
                                                "bytes": (carry / "tokenizer.json").stat().st_size},
                "corpora": corpora}
    write_manifest(carry, manifest)
    return manifest


def write_manifest(carry: Path, manifest: dict) -> None:
    (carry / MANIFEST).write_text(json.dumps(manifest, indent=1))


def carry_files(manifest: dict) -> dict[str, tuple[int, str]]:
    """file name -> (size, sha256) of every file the manifest names."""
    files = {manifest["tokenizer"]["file"]: (manifest["tokenizer"]["bytes"], manifest["tokenizer"]["sha256"])}
    for c in manifest["corpora"].values():
        for s in c["splits"].values():
            files.update({ch["file"]: (ch["xz_bytes"], ch["sha256"]) for ch in s["chunks"]})
    return files


def check(carry: Path) -> dict:
    """The manifest, once every file it names is in `carry` with its size and SHA256; else one line that names
    what is missing or changed."""
    try:
        manifest = json.loads((carry / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorpusError(f"{carry}: no {MANIFEST}; prepare the corpora where there is network "
                          f"(python -m data.prepare_corpus) and carry that folder") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorpusError(f"{carry / MANIFEST}: not a format-{FORMAT} manifest; prepare the corpora again")
    files = carry_files(manifest)
    missing = [f for f in files if not (carry / f).is_file()]
    changed = [f for f, (size, digest) in files.items() if f not in missing and (
        (carry / f).stat().st_size != size or sha256_file(carry / f) != digest)]
    if missing or changed:
        said = [f"missing {', '.join(missing)}"] * bool(missing) + [f"changed {', '.join(changed)}"] * bool(changed)
        raise CorpusError(f"{carry}: {'; '.join(said)} (copy the folder again, or prepare it again)")
    return manifest


def _decompress(chunk: Path, dest: Path, offset: int, length: int) -> None:
    raw = lzma.decompress(chunk.read_bytes())
    if len(raw) != length:
        raise CorpusError(f"{chunk}: gives {len(raw)} bytes, the manifest says {length}")
    fd = os.open(dest, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, offset)
    finally:
        os.close(fd)


def unpack(carry: Path, out: Path, workers: int) -> dict:
    """Every corpus of `carry` as a token folder under `out` (replacing one there), checked against the
    manifest's SHA256 of each split; the manifest is returned."""
    manifest = check(carry)
    tmp = {name: out / f".{name}.tmp" for name in manifest["corpora"]}
    jobs = []
    for name, c in manifest["corpora"].items():
        shutil.rmtree(tmp[name], ignore_errors=True)
        tmp[name].mkdir(parents=True)
        for split, s in c["splits"].items():
            dest = tmp[name] / f"{split}.bin"
            with open(dest, "wb") as fh:
                fh.truncate(s["bytes"])
            jobs += [(carry / ch["file"], dest, ch["offset"], ch["bytes"]) for ch in s["chunks"]]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda j: _decompress(*j), jobs))
        wanted = [(tmp[n] / f"{s}.bin", d["sha256"]) for n, c in manifest["corpora"].items()
                  for s, d in c["splits"].items()]
        wrong = [str(p) for (p, want), got in zip(wanted, pool.map(lambda w: sha256_file(w[0]), wanted)) if got != want]
    if wrong:
        raise CorpusError(f"unpacked {', '.join(wrong)} differ from what was prepared (SHA256); prepare again")
    for name, c in manifest["corpora"].items():
        (tmp[name] / "meta.json").write_text(json.dumps(c["meta"], indent=1))
        shutil.copyfile(carry / manifest["tokenizer"]["file"], tmp[name] / "tokenizer.json")
        shutil.rmtree(out / name, ignore_errors=True)
        os.replace(tmp[name], out / name)
    return manifest
