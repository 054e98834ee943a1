"""Which files of which Debian packages make each corpus, and which of them are held out for validation.

kernel (pretraining): the C sources (.c, .h) and Documentation of the Linux kernel, from the tarball inside
linux-source-X.Y. Left out: the generated register maps (`asic_reg/` folders, files over 1 MiB), which are
megabytes of #defines that no one wrote line by line, and Documentation's images. Validation is whole held-out
folders (KERNEL_VAL_DIRS), so no file of a validation folder's subsystem is seen in training. The train split is
capped in bytes (what the carry holds): Documentation, the corpus's prose, is kept whole, the C files are sampled.
perldoc and manpages (fine-tuning, prose of another kind): perl's POD documentation and the roff manual pages
of sections 1-8, split by a hash of each file's path.
"""
from __future__ import annotations

import gzip
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from data.debian import CorpusError, Tap, regular_files

KERNEL_PACKAGE = "linux-source-6.1"           # bookworm's; trixie has linux-source-6.12
KERNEL_VAL_DIRS = ("fs/btrfs/", "drivers/md/", "net/ipv6/", "Documentation/filesystems/")
MAX_FILE_BYTES = 1 << 20
_SKIP_DOC_SUFFIXES = (".svg", ".png", ".jpg", ".gif", ".pdf", ".dia", ".ico")
FINE_TUNE_VAL_PER_MILLE = 100                # 10%: a small corpus still gets a validation set worth measuring


@dataclass
class Doc:
    """One file of a corpus: its path inside the package (the split and the order are decided on it)."""
    rel: str
    text: str
    size: int


@dataclass
class Read:
    """What a corpus's packages gave: its documents and the facts to record (hashes, counts)."""
    docs: list[Doc]
    facts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """A corpus: its packages, how their files become documents, and which documents are held out."""
    name: str
    role: str                                          # "pretraining" or "fine-tuning"
    packages: tuple[str, ...]
    read: Callable[[dict[str, Path]], Read]            # package -> its checked .deb, to the documents
    held_out_dirs: tuple[str, ...] = ()                # validation: these folders; none: files by path hash
    uncapped: Callable[[str], bool] | None = None      # train documents a byte budget never drops; None: no budget

    def held_out(self, rel: str) -> bool:
        if self.held_out_dirs:
            return rel.startswith(self.held_out_dirs)
        return zlib.crc32(rel.encode()) % 1000 < FINE_TUNE_VAL_PER_MILLE

    @property
    def held_out_rule(self) -> str:
        """The same, in words, for the manifest and the errors."""
        if self.held_out_dirs:
            return "the folders " + ", ".join(self.held_out_dirs)
        return f"the files whose path's crc32 % 1000 < {FINE_TUNE_VAL_PER_MILLE}"


def decode(raw: bytes) -> str | None:
    """Text as the main job reads it (UTF-8, bad bytes replaced); None for a binary file (a NUL in its head)."""
    return None if b"\0" in raw[:8192] else raw.decode("utf-8", errors="replace")


def is_kernel_text(rel: str, size: int) -> bool:
    if size > MAX_FILE_BYTES or "/asic_reg/" in f"/{rel}":
        return False
    if rel.startswith("Documentation/"):
        return not rel.lower().endswith(_SKIP_DOC_SUFFIXES)
    return rel.endswith((".c", ".h"))


def read_kernel(debs: dict[str, Path], package: str) -> Read:
    """The kernel tarball's text files, read as a stream inside the .deb (its SHA256 taken on the way)."""
    tarball = f"usr/src/{package}.tar.xz"
    for name, _, stream in regular_files(debs[package]):
        if name != tarball:
            continue
        tap, docs = Tap(stream), []
        with tarfile.open(fileobj=tap, mode="r|xz") as tar:
            for m in tar:
                rel = m.name.split("/", 1)[-1]
                if m.isfile() and is_kernel_text(rel, m.size):
                    text = decode(tar.extractfile(m).read())
                    if text is not None:
                        docs.append(Doc(rel, text, m.size))
        digest = tap.drain()
        return Read(docs, {"tarball": tarball, "tarball_bytes": tap.count, "tarball_sha256": digest})
    raise CorpusError(f"{debs[package].name}: no {tarball} inside; is it a linux-source package?")


def read_members(debs: dict[str, Path], keep: Callable[[str], bool], gunzip: bool) -> Read:
    """Every regular file of the packages that `keep` names (gunzipped when `gunzip`); roff `.so` redirects,
    which hold no text, are skipped."""
    docs = []
    for pkg, path in debs.items():
        for name, _, stream in regular_files(path):
            if not keep(name):
                continue
            raw = stream.read()
            text = decode(gzip.decompress(raw) if gunzip else raw)
            if text is not None and not text.startswith(".so "):
                docs.append(Doc(f"{pkg}/{name}", text, len(text.encode())))
    return Read(docs)


def _is_pod(name: str) -> bool:
    """perl's .pod files, but perltoc.pod: generated from all the others, it would carry validation's headings
    into training."""
    parts = name.split("/")
    return name.startswith("usr/share/perl/") and parts[-2:-1] == ["pod"] and parts[-1].endswith(".pod") \
        and parts[-1] != "perltoc.pod"


def _is_manpage(name: str) -> bool:
    return name.startswith("usr/share/man/man") and name.endswith(".gz")


def sources(kernel_package: str = KERNEL_PACKAGE) -> dict[str, Source]:
    """The corpora by name, the pretraining one first: the others are tokenized with its BPE."""
    return {s.name: s for s in (
        Source("kernel", "pretraining", (kernel_package,), lambda d: read_kernel(d, kernel_package),
               held_out_dirs=KERNEL_VAL_DIRS, uncapped=lambda rel: rel.startswith("Documentation/")),
        Source("perldoc", "fine-tuning", ("perl-doc",), lambda d: read_members(d, _is_pod, gunzip=False)),
        Source("manpages", "fine-tuning", ("manpages", "manpages-dev"),
               lambda d: read_members(d, _is_manpage, gunzip=True)),
    )}
