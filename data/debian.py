"""Debian packages as a corpus's source: fetched with `apt-get download` (no root needed), each checked against
apt's own index (the size and SHA256 of that version), and read without dpkg: a .deb is an ar archive whose
data.tar.* member holds the files, so this runs wherever Python does."""
from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

_TAR_MODES = {"data.tar.xz": "r|xz", "data.tar.gz": "r|gz", "data.tar.bz2": "r|bz2", "data.tar": "r|"}


class CorpusError(ValueError):
    """An input that cannot make the corpus, said in one line (what is missing or wrong, and what to do)."""


@dataclass(frozen=True)
class Deb:
    """A .deb whose size and SHA256 matched apt's index for its version."""
    package: str
    version: str
    path: Path
    size: int
    sha256: str


class Tap(io.RawIOBase):
    """A read-only view of a stream that stops after `limit` bytes (None: at the stream's end) and hashes what
    passes, so a member is checked while it is read, without a second pass or a copy on disk."""

    def __init__(self, fh: BinaryIO, limit: int | None = None) -> None:
        super().__init__()
        self.fh, self.left, self.hash, self.count = fh, limit, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        view = memoryview(buf)
        if self.left is not None:
            view = view[:self.left]
        data = self.fh.read(len(view))
        view[:len(data)] = data
        self.hash.update(data)
        self.count += len(data)
        if self.left is not None:
            self.left -= len(data)
        return len(data)

    def drain(self) -> str:
        """Read to the end (what a tar reader leaves after its end marker counts too); the SHA256 of all of it."""
        while self.read(1 << 20):
            pass
        return self.hash.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return Tap(fh).drain()


def find(folder: Path, packages: list[str]) -> tuple[dict[str, Path], list[str]]:
    """Each package's .deb in `folder`, and the packages that have none. Two versions of one package are an
    error: which one the numbers came from would be a guess."""
    found, missing = {}, []
    for pkg in packages:
        hits = sorted(folder.glob(f"{pkg}_*.deb"))
        if len(hits) > 1:
            raise CorpusError(f"{folder}: several {pkg} packages ({', '.join(h.name for h in hits)}); keep one")
        if hits:
            found[pkg] = hits[0]
        else:
            missing.append(pkg)
    return found, missing


def download(folder: Path, packages: list[str]) -> None:
    """`apt-get download` into `folder`: the version apt's index names now, checked by apt on the way."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["apt-get", "download", *packages], cwd=folder, capture_output=True, text=True)
    except FileNotFoundError:
        raise CorpusError(f"missing {', '.join(packages)} in {folder}, and no apt-get here to fetch them") from None
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise CorpusError(f"apt-get download {' '.join(packages)} failed in {folder}: {last}")


def parse_index(text: str) -> dict[tuple[str, str], tuple[int, str]]:
    """(package, version) -> (size, sha256) from `apt-cache show` stanzas."""
    out = {}
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[:1] != " ")
        if {"Package", "Version", "Size", "SHA256"} <= fields.keys():
            out[(fields["Package"], fields["Version"])] = (int(fields["Size"]), fields["SHA256"])
    return out


def apt_index(packages: list[str]) -> dict[tuple[str, str], tuple[int, str]]:
    """What apt's index says of every listed version of `packages` (empty where there is no apt-cache)."""
    try:
        r = subprocess.run(["apt-cache", "show", *packages], capture_output=True, text=True)
    except FileNotFoundError:
        return {}
    return parse_index(r.stdout)


def check(found: dict[str, Path], index: dict[tuple[str, str], tuple[int, str]]) -> list[Deb]:
    """Each .deb against the index entry of the version its file name gives; every mismatch in one line."""
    debs, bad = [], []
    for pkg, path in found.items():
        version = urllib.parse.unquote(path.name.split("_")[1])
        size, digest = path.stat().st_size, sha256_file(path)
        want = index.get((pkg, version))
        if want is None:
            bad.append(f"{path.name}: version {version} is not in apt's index, so it cannot be checked")
        elif want != (size, digest):
            bad.append(f"{path.name}: {size} bytes, sha256 {digest[:16]}..., but apt's index says {want[0]} bytes, "
                       f"sha256 {want[1][:16]}...")
        else:
            debs.append(Deb(pkg, version, path, size, digest))
    if bad:
        raise CorpusError("; ".join(bad) + " (delete the file to fetch the indexed version)")
    return debs


def _data_member(fh: BinaryIO, path: Path) -> tuple[str, int]:
    """Move `fh` to the start of the .deb's data.tar.* member; its name and size."""
    if fh.read(8) != b"!<arch>\n":
        raise CorpusError(f"{path}: not a .deb (no ar archive header)")
    while len(header := fh.read(60)) == 60:
        name, size = header[:16].decode("ascii", "replace").strip().rstrip("/"), int(header[48:58])
        if name.startswith("data.tar"):
            if name not in _TAR_MODES:
                raise CorpusError(f"{path}: its {name} is not readable here; allowed: {', '.join(_TAR_MODES)}")
            return name, size
        fh.seek(size + size % 2, 1)
    raise CorpusError(f"{path}: a .deb without a data.tar member")


def regular_files(path: Path) -> Iterator[tuple[str, int, BinaryIO]]:
    """(name without './', size, stream) of every regular file of a .deb, in archive order; a stream is valid
    until the next item."""
    with open(path, "rb") as fh:
        name, size = _data_member(fh, path)
        try:
            with tarfile.open(fileobj=Tap(fh, size), mode=_TAR_MODES[name]) as tar:
                for m in tar:
                    if m.isfile():
                        yield m.name.removeprefix("./"), m.size, tar.extractfile(m)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise CorpusError(f"{path}: its {name} is unreadable ({e}); delete it to fetch it again") from None
