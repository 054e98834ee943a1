"""data/prepare_corpus.py on small synthetic Debian packages (no network, a few seconds): the files each
corpus takes and holds out, the BPE trained on the kernel's train split through the main job's data pipeline
and shared by the fine-tuning corpora, the carry's round trip, and the one-line errors for what is missing or
changed."""
from __future__ import annotations

import gzip
import hashlib
import io
import random
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data import prepare_corpus  # noqa: E402
from data import build, debian, sources  # noqa: E402
from coat_ds.workloads import data  # noqa: E402

KERNEL_TRAIN = ["kernel/sched/core.c", "mm/slab.c", "drivers/net/foo.c", "include/linux/list.h",
                "Documentation/process/howto.rst"]
KERNEL_VAL = ["fs/btrfs/ctree.c", "net/ipv6/route.c", "drivers/md/raid1.c", "Documentation/filesystems/ext4.rst"]
KERNEL_LEFT_OUT = ["drivers/gpu/drm/amd/include/asic_reg/gc_sh_mask.h", "Documentation/logo.svg",
                   "scripts/checkpatch.pl", "Makefile"]
PODS = [f"perl{name}.pod" for name in ("intro", "syn", "data", "op", "sub", "func", "re", "run", "var", "mod",
                                          "obj", "ipc", "io", "sec", "faq1", "faq2", "faq3", "faq4", "style", "debug",
                                          "guts", "api", "call", "hack", "port", "unicode", "lol", "dsc", "ref",
                                          "pod")]
MANS = [f"usr/share/man/man2/{n}.2.gz" for n in ("open", "read", "write", "close", "mmap", "fork", "clone", "pipe",
                                                  "dup", "stat", "kill", "socket")]
MANS_DEV = [f"usr/share/man/man3/{n}.3.gz" for n in ("printf", "malloc", "strlen", "qsort", "fopen", "errno",
                                                      "getopt", "exit", "atoi", "memcpy", "strtok", "puts")]


def _words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["lock", "buffer", "device", "page", "queue", "state", "flags", "count", "node", "entry", "value", "len"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(9)) for _ in range(n))


def _text(rel: str) -> str:
    """A file that names itself, so that a split's decoded tokens show which files it holds."""
    body = "\n".join(f"    x = {_words(rel + str(i), 8)};" for i in range(40))
    return f"/* FILE {rel} */\nstatic int f(void)\n{{\n{body}\n}}\n"


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, raw in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def _deb(folder: Path, package: str, files: dict[str, bytes]) -> Path:
    """A .deb as dpkg writes it: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    out = b"!<arch>\n"
    for name, raw in (("debian-binary", b"2.0\n"), ("control.tar.xz", _tar_xz({})),
                      ("data.tar.xz", _tar_xz({f"./{k}": v for k, v in files.items()}))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(raw):<10}`\n".encode() + raw + b"\n" * (len(raw) % 2)
    path = folder / f"{package}_1.0-1_all.deb"
    path.write_bytes(out)
    return path


def _packages(root: Path, kernel_files: list[str]) -> dict:
    """The four packages in root/debs (the kernel's tarball with `kernel_files`); the apt index that lists them."""
    folder = root / "debs"
    folder.mkdir()
    kernel = {f"linux-source-6.1/{rel}": _text(rel).encode() for rel in kernel_files}
    kernel["linux-source-6.1/drivers/net/blob.c"] = b"\0\1\2 binary"
    paths = [
        _deb(folder, "linux-source-6.1", {"usr/src/linux-source-6.1.tar.xz": _tar_xz(kernel),
                                          "usr/share/doc/linux-source-6.1/copyright": b"GPL-2.0"}),
        _deb(folder, "perl-doc", {**{f"usr/share/perl/5.36.0/pod/{p}": f"=head1 {p}\n\n{_words(p, 300)}\n".encode()
                                     for p in PODS + ["perltoc.pod"]},
                                  "usr/share/man/man1/perlintro.1.gz": gzip.compress(b".TH PERLINTRO 1")}),
        _deb(folder, "manpages", {m: gzip.compress(f".TH {m}\n{_words(m, 300)}\n".encode()) for m in MANS}),
        _deb(folder, "manpages-dev", {**{m: gzip.compress(f".TH {m}\n{_words(m, 300)}\n".encode()) for m in MANS_DEV},
                                      "usr/share/man/man3/vprintf.3.gz": gzip.compress(b".so man3/printf.3\n")}),
    ]
    return {(p.name.split("_")[0], "1.0-1"): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in paths}


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("corpus")
    return root, _packages(root, KERNEL_TRAIN + KERNEL_VAL + KERNEL_LEFT_OUT)


def _main(root: Path, index: dict, *extra: str) -> None:
    argv = ["--root", str(root), "--offline", "--vocab-size", "300", "--min-tokens", "1", "1", "1", "1",
            "--workers", "2", *extra]
    assert prepare_corpus.main(argv, index_of=lambda packages: index) == 0


def _error(argv_root: Path, index: dict, *extra: str) -> str:
    with pytest.raises(SystemExit) as e:
        _main(argv_root, index, *extra)
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def prepared(debs) -> Path:
    root, index = debs
    _main(root, index)
    return root


def _decoded(folder: Path, split: str) -> str:
    td = data.load(str(folder), 8)
    return td.tokenizer.decode(np.asarray(getattr(td, split), dtype=np.int64).tolist())


def test_the_kernel_is_split_by_held_out_folder_and_takes_c_and_documentation_only(prepared):
    folder = prepared / "corpora" / "kernel"
    train, val = _decoded(folder, "train"), _decoded(folder, "val")
    assert [r for r in KERNEL_TRAIN + KERNEL_VAL + KERNEL_LEFT_OUT if f"FILE {r} " in train] == KERNEL_TRAIN
    assert [r for r in KERNEL_TRAIN + KERNEL_VAL + KERNEL_LEFT_OUT if f"FILE {r} " in val] == KERNEL_VAL
    assert "binary" not in train + val


def test_one_bpe_trained_on_the_kernel_train_split_tokenizes_every_corpus(prepared):
    tokenizers = {(prepared / "corpora" / n / "tokenizer.json").read_bytes() for n in ("kernel", "perldoc", "manpages")}
    assert len(tokenizers) == 1
    for name in ("kernel", "perldoc", "manpages"):
        td = data.load(str(prepared / "corpora" / name), 8)
        assert td.vocab_size == 300 and td.tokenizer is not None and td.train.dtype == np.uint16
    # the fine-tuning splits: every pod but perltoc, every man page but the .so redirect, each file in one split
    pods = _decoded(prepared / "corpora" / "perldoc", "train") + _decoded(prepared / "corpora" / "perldoc", "val")
    assert sorted(p for p in PODS if f"=head1 {p}\n" in pods) == sorted(PODS) and "perltoc" not in pods
    mans = {s: _decoded(prepared / "corpora" / "manpages", s) for s in ("train", "val")}
    assert [m for m in MANS + MANS_DEV if f".TH {m}\n" in mans["train"] + mans["val"]] == MANS + MANS_DEV
    assert 0 < sum(f".TH {m}\n" in mans["val"] for m in MANS + MANS_DEV) < len(MANS + MANS_DEV)
    assert ".so man3" not in mans["train"] + mans["val"]


def test_the_carry_unpacks_to_the_same_token_files(prepared):
    corpora = prepared / "corpora"
    before = {p.relative_to(corpora): p.read_bytes() for p in sorted(corpora.rglob("*")) if p.is_file()}
    for p in corpora.rglob("train.bin"):
        p.write_bytes(b"")
    assert prepare_corpus.main(["--root", str(prepared), "--from-carry"]) == 0
    after = {p.relative_to(corpora): p.read_bytes() for p in sorted(corpora.rglob("*")) if p.is_file()}
    assert after == before


def test_a_changed_or_missing_carry_file_is_one_line(prepared, tmp_path):
    import shutil

    carry = tmp_path / "carry"
    shutil.copytree(prepared / "carry", carry)
    chunk = carry / "perldoc.train.00.xz"
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"x")
    (carry / "manpages.val.00.xz").unlink()
    with pytest.raises(SystemExit) as e:
        prepare_corpus.main(["--root", str(tmp_path), "--from-carry"])
    assert str(e.value) == (f"error: {carry}: missing manpages.val.00.xz; changed perldoc.train.00.xz (copy the "
                            f"folder again, or prepare it again)")
    (carry / "manifest.json").unlink()
    with pytest.raises(SystemExit) as e:
        prepare_corpus.main(["--root", str(tmp_path), "--from-carry"])
    assert "no manifest.json" in str(e.value)


def test_a_missing_package_is_named_in_one_line(debs, tmp_path):
    root, index = debs
    (tmp_path / "debs").mkdir()
    for deb in (root / "debs").glob("*.deb"):
        if not deb.name.startswith(("perl-doc", "manpages-dev")):
            (tmp_path / "debs" / deb.name).write_bytes(deb.read_bytes())
    msg = _error(tmp_path, index)
    assert msg.startswith(f"error: missing in {tmp_path / 'debs'}: perl-doc_*.deb, manpages-dev_*.deb (")


def test_a_package_unlike_apt_index_is_refused(debs):
    root, index = debs
    bad = {**index, ("perl-doc", "1.0-1"): (index[("perl-doc", "1.0-1")][0], "0" * 64)}
    assert "perl-doc_1.0-1_all.deb:" in _error(root, bad) and "apt's index says" in _error(root, bad)
    assert "not in apt's index" in _error(root, {k: v for k, v in index.items() if k[0] != "manpages"})


def test_an_empty_held_out_folder_is_one_line(tmp_path):
    index = _packages(tmp_path, [r for r in KERNEL_TRAIN + KERNEL_VAL if not r.startswith("drivers/md/")])
    assert _error(tmp_path, index) == ("error: kernel: no files in the held-out folders drivers/md/ of "
                                       "linux-source-6.1; another layout? (see data/sources.py)")


def test_too_few_tokens_is_one_line():
    metas = {"kernel": {"train_tokens": 90, "val_tokens": 5}, "perldoc": {"train_tokens": 50, "val_tokens": 1}}
    roles = {"kernel": "pretraining", "perldoc": "fine-tuning"}
    with pytest.raises(debian.CorpusError, match=r"^too few tokens: kernel train 90 < 100; perldoc val 1 < 2 \("):
        prepare_corpus.check_tokens(metas, roles, {"pretraining": (100, 5), "fine-tuning": (50, 2)})


def test_the_train_budget_spreads_over_the_tree_and_keeps_documentation():
    docs = [sources.Doc(f"drivers/d{i}.c", "x", 100) for i in range(50)]
    docs.append(sources.Doc("Documentation/a.rst", "y", 300))
    kept = build.cap(docs, 1000, lambda rel: rel.startswith("Documentation/"))
    assert sum(d.size for d in kept) == 1000 and "Documentation/a.rst" in [d.rel for d in kept]
    assert [d.rel for d in kept] == sorted(d.rel for d in kept)
    first_in_path_order = sorted(d.rel for d in docs if d.rel.endswith(".c"))[:7]
    assert [d.rel for d in kept if d.rel.endswith(".c")] != first_in_path_order


def test_apt_index_stanzas_are_read():
    text = ("Package: perl-doc\nVersion: 5.36.0-7\nSize: 12\nSHA256: ab\nDescription: x\n continued: y\n\n"
            "Package: perl-doc\nVersion: 5.36.0-8\nSize: 13\nSHA256: cd\n")
    assert debian.parse_index(text) == {("perl-doc", "5.36.0-7"): (12, "ab"), ("perl-doc", "5.36.0-8"): (13, "cd")}
