"""Training data for examples/train.py, examples/hf_trainer.py and the training benchmarks.

Default corpus: the source files of the running interpreter's standard library (on every machine with
Python, no network), split into train/validation by file and tokenized with a byte-level BPE trained on the
train split. `--data` also takes a text file or folder, a tokenized `.npy`/`.bin` memmap (uint16/uint32), or
a dataset saved with `datasets.save_to_disk`.

Every source ends as two flat token files (train.bin, val.bin) in a cache directory keyed by the source's
identity (paths, sizes, mtimes) and the tokenizer, so a second run (or a resumed one) reads the same tokens.
Several processes may ask at once (the launcher's ranks): the first builds under a file lock, the others
wait and read. All input checks happen here, before any model or device memory exists.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

EOS = "<|endoftext|>"
DEFAULT_VOCAB = 8192
VAL_FRACTION = 0.05
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


class DataError(ValueError):
    """A --data path or format that cannot be used; raised before any model or device memory is touched."""


def cache_root() -> Path:
    """Where tokenizers and token files are cached: $COAT_DATA_CACHE, else ~/.cache/coat_ds/data."""
    env = os.environ.get("COAT_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "coat_ds" / "data"


# ---------------------------------------------------------------------------------------------------------
# Token streams and batches
# ---------------------------------------------------------------------------------------------------------

@dataclass
class TokenData:
    """Train and validation token streams plus what the model needs to know about them."""
    train: np.ndarray          # 1-D uint16/uint32, usually a read-only memmap
    val: np.ndarray
    vocab_size: int            # ids are < vocab_size
    source: str                # human-readable description, for logs
    tokenizer: object | None = None   # a transformers tokenizer when we know one (for --export)


def _n_chunks(stream: np.ndarray, seq_len: int) -> int:
    return (len(stream) - 1) // seq_len


class Batches:
    """Deterministic (x, y) batches: the sample at a global index depends only on (seed, index).

    Train: the stream is cut into non-overlapping windows of seq_len + 1 tokens, visited in a fresh
    permutation each epoch. Global sample index = ((step * grad_accum + micro) * world + rank) * micro_bs + b,
    so a resumed run at step s reads exactly what the uninterrupted run would have read.
    Validation: fixed windows spread evenly over the validation stream, shared across ranks.
    """

    def __init__(self, data: TokenData, seq_len: int, micro_bs: int, grad_accum: int, rank: int, world: int,
                 seed: int) -> None:
        self.data, self.seq_len, self.micro_bs, self.grad_accum = data, seq_len, micro_bs, grad_accum
        self.rank, self.world, self.seed = rank, world, seed
        self.n_train = _n_chunks(data.train, seq_len)
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _window(self, stream: np.ndarray, start: int) -> np.ndarray:
        return np.asarray(stream[start:start + self.seq_len + 1], dtype=np.int64)

    def _chunk(self, index: int) -> int:
        epoch, pos = divmod(index, self.n_train)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def train_batch(self, step: int, micro: int):
        """Micro-batch `micro` of optimizer step `step` for this rank, as two int64 torch tensors (B, T)."""
        import torch

        first = ((step * self.grad_accum + micro) * self.world + self.rank) * self.micro_bs
        rows = np.stack([self._window(self.data.train, self._chunk(first + b) * self.seq_len)
                         for b in range(self.micro_bs)])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def val_batches(self, n_batches: int) -> Iterator:
        """This rank's share of `n_batches * world` fixed validation micro-batches."""
        import torch

        n_val = _n_chunks(self.data.val, self.seq_len)
        total = n_batches * self.world * self.micro_bs
        starts = np.linspace(0, (n_val - 1) * self.seq_len, num=total).astype(np.int64) if n_val > 0 else []
        for i in range(n_batches):
            first = (i * self.world + self.rank) * self.micro_bs
            rows = np.stack([self._window(self.data.val, int(s)) for s in starts[first:first + self.micro_bs]])
            t = torch.from_numpy(rows)
            yield t[:, :-1], t[:, 1:]


# ---------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Tok:
    """A tokenizer reduced to what the pipeline needs; `hf` is a transformers tokenizer (for --export)."""
    key: str                                       # identity for cache keys
    encode: Callable[[list[str]], list[list[int]]]
    eos_id: int | None
    vocab_size: int
    hf: object | None = None


def _hf_wrap(tok_json: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tok_json), eos_token=EOS, bos_token=EOS, unk_token=EOS)


def train_bpe(texts: Callable[[], Iterable[str]], vocab_size: int, path: Path, show_progress: bool = False) -> None:
    """Train a byte-level BPE (the GPT-2 scheme, so any byte sequence is encodable) and save it to `path`."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts(), vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                            show_progress=show_progress)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


def bpe_tok(path: Path) -> Tok:
    """Load a BPE saved by `train_bpe` as a Tok."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    digest = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    return Tok(key=f"bpe-{digest}", encode=lambda b: [e.ids for e in tok.encode_batch(b)],
               eos_id=tok.token_to_id(EOS), vocab_size=tok.get_vocab_size(), hf=_hf_wrap(path))


def hf_tok(name_or_path: str) -> Tok:
    """The tokenizer that ships with an HF model (used when --model names one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path)
    key = "hf-" + hashlib.sha1(f"{name_or_path}:{len(tok)}".encode()).hexdigest()[:12]
    return Tok(key=key, encode=lambda b: tok(b, add_special_tokens=False)["input_ids"], eos_id=tok.eos_token_id,
               vocab_size=len(tok), hf=tok)


class _LazyTok:
    """The --model tokenizer, loaded only when a text source needs encoding (token files never do)."""

    def __init__(self, name: str) -> None:
        self.name, self._tok = name, None

    def _get(self) -> Tok:
        if self._tok is None:
            try:
                self._tok = hf_tok(self.name)
            except (OSError, ValueError) as e:
                raise DataError(f"--model {self.name}: cannot load its tokenizer to encode text data ({e}); "
                                f"pass pre-tokenized data (.npy/.bin) instead") from None
        return self._tok

    def __getattr__(self, attr: str):
        if attr in ("key", "encode", "eos_id", "vocab_size", "hf"):
            return getattr(self._get(), attr)
        raise AttributeError(attr)


# ---------------------------------------------------------------------------------------------------------
# Caching
# ---------------------------------------------------------------------------------------------------------

@contextmanager
def _locked(directory: Path):
    """An exclusive lock on `directory` (created if missing), held across processes of this machine."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield directory
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _digest(parts: Iterable[str]) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _file_ids(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        st = f.stat()
        out.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return out


def _write_tokens(docs: Iterable[str], tok: Tok, path: Path, dtype) -> int:
    """Tokenize documents in batches, appending each document's ids (then EOS) to a flat binary file."""
    tmp = path.with_suffix(".tmp")
    n, batch = 0, []
    with open(tmp, "wb") as fh:
        def flush():
            nonlocal n
            for ids in tok.encode(batch):
                if tok.eos_id is not None:
                    ids = list(ids) + [tok.eos_id]
                arr = np.asarray(ids, dtype=dtype)
                fh.write(arr.tobytes())
                n += len(arr)
            batch.clear()

        for doc in docs:
            batch.append(doc)
            if len(batch) >= 256:
                flush()
        flush()
    os.replace(tmp, path)
    return n


def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def _load_cached(d: Path) -> tuple[np.ndarray, np.ndarray, dict] | None:
    meta_path = d / "meta.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    dt = TOKEN_DTYPES[meta["dtype"]]
    return np.memmap(d / "train.bin", dtype=dt, mode="r"), np.memmap(d / "val.bin", dtype=dt, mode="r"), meta


def write_token_folder(d: Path, source: str, train_docs: Callable[[], Iterable[str]],
                       val_docs: Callable[[], Iterable[str]], tok: Tok | None, vocab_size: int,
                       show_progress: bool = False) -> tuple[Tok, dict]:
    """Tokenize a text source's two splits into `d` (train.bin, val.bin, meta.json), training a BPE on the train
    split first when `tok` is None (kept as d/tokenizer.json): the cache's layout, which `load` reads back as a
    tokenized folder. One function for the cache and for a corpus prepared ahead (data/)."""
    d.mkdir(parents=True, exist_ok=True)
    if tok is None:
        if not (d / "tokenizer.json").exists():
            train_bpe(train_docs, vocab_size, d / "tokenizer.json", show_progress)
        tok = bpe_tok(d / "tokenizer.json")
    dt = _token_dtype(tok.vocab_size)
    n_train = _write_tokens(train_docs(), tok, d / "train.bin", dt)
    n_val = _write_tokens(val_docs(), tok, d / "val.bin", dt)
    meta = {"dtype": np.dtype(dt).name, "vocab_size": tok.vocab_size, "train_tokens": n_train,
            "val_tokens": n_val, "tokenizer": tok.key, "source": source}
    (d / "meta.json").write_text(json.dumps(meta, indent=1))
    return tok, meta


def _build_text_cache(kind: str, ident: list[str], train_docs: Callable[[], Iterable[str]],
                      val_docs: Callable[[], Iterable[str]], tok: Tok | None, vocab_size: int) -> TokenData:
    """Tokenize a text source into the cache (training a BPE on its train split when `tok` is None)."""
    tok_key = tok.key if tok is not None else f"bpe{vocab_size}"
    d = cache_root() / f"{kind}-{_digest(ident + [tok_key])}"
    with _locked(d):
        if tok is None and (d / "tokenizer.json").exists():
            tok = bpe_tok(d / "tokenizer.json")
        cached = _load_cached(d)
        if cached is None:
            tok, _ = write_token_folder(d, ident[0], train_docs, val_docs, tok, vocab_size)
            cached = _load_cached(d)
    train, val, meta = cached
    return TokenData(train=train, val=val, vocab_size=meta["vocab_size"], source=f"{ident[0]} (cache {d})",
                     tokenizer=tok.hf)


# ---------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _is_val(rel: str) -> bool:
    """A file belongs to validation when its relative path hashes into the first VAL_FRACTION of buckets."""
    return zlib.crc32(rel.encode()) % 1000 < VAL_FRACTION * 1000


def _split_files(root: Path, files: list[Path]) -> tuple[list[Path], list[Path]]:
    train = [f for f in files if not _is_val(str(f.relative_to(root)))]
    val = [f for f in files if _is_val(str(f.relative_to(root)))]
    if not val:       # tiny folders: hold out the last file
        train, val = train[:-1], train[-1:]
    return train, val


def stdlib_files() -> tuple[Path, list[Path]]:
    """The .py files of the running interpreter's standard library (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise DataError(f"no standard-library sources found under {root}; pass --data")
    return root, files


def stdlib_corpus(tok: Tok | None, vocab_size: int = DEFAULT_VOCAB) -> TokenData:
    root, files = stdlib_files()
    train, val = _split_files(root, files)
    ident = [f"python{sys.version_info.major}.{sys.version_info.minor} stdlib {root}"] + _file_ids(files)
    return _build_text_cache("stdlib", ident, lambda: map(_read_text, train), lambda: map(_read_text, val),
                             tok, vocab_size)


def _text_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if f.startswith(".") or not p.is_file():
                continue
            with open(p, "rb") as fh:
                head = fh.read(8192)
            if b"\0" in head:       # binary file
                continue
            try:
                head.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.start < len(head) - 4:     # not just a multi-byte char cut at the 8 KiB boundary
                    continue
            files.append(p)
    return files


def _capped(root: Path, files: list[Path], max_bytes: int) -> list[Path]:
    """Files in an order spread over the whole tree (by a hash of the relative path), up to max_bytes in all."""
    keep, total = [], 0
    for f in sorted(files, key=lambda f: zlib.crc32(str(f.relative_to(root)).encode())):
        size = f.stat().st_size
        if total + size <= max_bytes:
            keep.append(f)
            total += size
    return sorted(keep)


def text_folder(root: Path, tok: Tok | None, vocab_size: int, max_bytes: int | None = None) -> TokenData:
    files = _text_files(root)
    if max_bytes is not None:
        files = _capped(root, files, max_bytes)
    if len(files) < 2:
        raise DataError(f"--data {root}: a text folder needs at least 2 UTF-8 text files (one is held out for "
                        f"validation); found {len(files)}")
    train, val = _split_files(root, files)
    cap = f", files up to {max_bytes:,} bytes" if max_bytes is not None else ""
    ident = [f"text folder {root}{cap}"] + _file_ids(files)
    return _build_text_cache("text", ident, lambda: map(_read_text, train), lambda: map(_read_text, val), tok,
                             vocab_size)


def text_file(path: Path, tok: Tok | None, vocab_size: int) -> TokenData:
    with open(path, "rb") as fh:
        head = fh.read(8192)
    if b"\0" in head:
        raise DataError(f"--data {path}: not a text file (binary content); tokenized data must end in .npy or "
                        f".bin, datasets must be a folder written by datasets.save_to_disk")
    text = _read_text(path)
    if not text.strip():
        raise DataError(f"--data {path}: the file is empty")
    cut = text.rfind("\n", 0, int(len(text) * (1 - VAL_FRACTION)))
    cut = cut if cut > 0 else int(len(text) * (1 - VAL_FRACTION))
    ident = [f"text file {path}"] + _file_ids([path])
    return _build_text_cache("text", ident, lambda: [text[:cut]], lambda: [text[cut:]], tok, vocab_size)


def _check_ids(arr: np.ndarray, what: str) -> int:
    """Largest id in a token array, read in chunks so a big memmap is never loaded whole."""
    if arr.ndim != 1:
        raise DataError(f"{what}: token arrays must be 1-D (one flat stream); got shape {arr.shape}")
    if len(arr) == 0:
        raise DataError(f"{what}: holds no tokens")
    step = 1 << 24
    return int(max(int(arr[i:i + step].max()) for i in range(0, len(arr), step)))


def _open_tokens(path: Path, dtype: str) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"--data {path}: not a readable .npy array ({e})") from None
        if arr.dtype.name not in TOKEN_DTYPES:
            raise DataError(f"--data {path}: dtype {arr.dtype.name} is not allowed; allowed: "
                            f"{', '.join(TOKEN_DTYPES)}")
        return arr
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"--data-dtype {dtype!r} is invalid; allowed: {', '.join(TOKEN_DTYPES)}")
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"--data {path}: {size} bytes is not a multiple of {itemsize} ({dtype}); is "
                        f"--data-dtype right?")
    if size == 0:
        raise DataError(f"--data {path}: the file is empty")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def _folder_meta(path: Path) -> dict | None:
    """meta.json of a folder that `write_token_folder` wrote (its dtype and vocabulary), else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"--data {path}: meta.json is unreadable ({e})") from None
    if not (isinstance(meta, dict) and meta.get("dtype") in TOKEN_DTYPES and isinstance(meta.get("vocab_size"), int)):
        raise DataError(f"--data {path}: meta.json needs a dtype in {list(TOKEN_DTYPES)} and an integer vocab_size")
    return meta


def _with_meta(td: TokenData, path: Path, meta: dict) -> TokenData:
    """A folder's own vocabulary and tokenizer.json, so that the model's vocabulary is the tokenizer's (not the
    largest id seen) and --export saves the tokenizer beside the model."""
    if td.vocab_size > meta["vocab_size"]:
        raise DataError(f"--data {path}: token ids go up to {td.vocab_size - 1} but its meta.json says vocab_size "
                        f"{meta['vocab_size']}")
    tok_json = path / "tokenizer.json"
    td.vocab_size, td.tokenizer = meta["vocab_size"], _hf_wrap(tok_json) if tok_json.exists() else None
    return td


def token_files(path: Path, dtype: str) -> TokenData:
    """A tokenized memmap: one file (the last VAL_FRACTION of tokens is validation) or a folder holding
    train.{bin,npy} and val.{bin,npy} (nanoGPT's layout), with a meta.json (whose dtype overrides `dtype`) and a
    tokenizer.json where `write_token_folder` wrote it."""
    meta = _folder_meta(path) if path.is_dir() else None
    dtype = meta["dtype"] if meta else dtype
    if path.is_dir():
        def pick(stem):
            for ext in (".bin", ".npy"):
                if (path / f"{stem}{ext}").exists():
                    return path / f"{stem}{ext}"
            raise DataError(f"--data {path}: has train.bin/.npy but no {stem}.bin/.npy")
        train, val = _open_tokens(pick("train"), dtype), _open_tokens(pick("val"), dtype)
    else:
        arr = _open_tokens(path, dtype)
        cut = int(len(arr) * (1 - VAL_FRACTION))
        train, val = arr[:cut], arr[cut:]
    top = max(_check_ids(train, f"--data {path} (train)"), _check_ids(val, f"--data {path} (val)"))
    td = TokenData(train=train, val=val, vocab_size=top + 1, source=f"tokens {path}")
    return _with_meta(td, path, meta) if meta else td


def _dataset_splits(ds) -> tuple:
    from datasets import DatasetDict

    if not isinstance(ds, DatasetDict):
        n_val = max(1, int(len(ds) * VAL_FRACTION))
        if len(ds) < 2:
            raise DataError("the saved dataset needs at least 2 rows (one is held out for validation)")
        return ds.select(range(len(ds) - n_val)), ds.select(range(len(ds) - n_val, len(ds)))
    if "train" not in ds:
        raise DataError(f"the saved DatasetDict has splits {list(ds)}; it needs a 'train' split")
    for name in ("validation", "valid", "val", "test"):
        if name in ds:
            return ds["train"], ds[name]
    return _dataset_splits(ds["train"])


def saved_dataset(path: Path, tok: Tok | None, vocab_size: int) -> TokenData:
    """A dataset written by `datasets.save_to_disk`, with a `text` column (tokenized here) or an
    `input_ids` column (used as is, documents concatenated)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for a malformed folder
        raise DataError(f"--data {path}: looks like a saved dataset but datasets.load_from_disk failed: {e}") from None
    train, val = _dataset_splits(ds)
    cols = train.column_names
    fp = f"{getattr(train, '_fingerprint', '')}:{getattr(val, '_fingerprint', '')}"
    ident = [f"dataset {path}", fp] + _file_ids(sorted(p for p in path.rglob("*") if p.is_file()))
    if "text" in cols:
        return _build_text_cache("dataset", ident, lambda: (r["text"] for r in train),
                                 lambda: (r["text"] for r in val), tok, vocab_size)
    if "input_ids" in cols:
        d = cache_root() / f"dataset-{_digest(ident + ['input_ids'])}"
        with _locked(d):
            cached = _load_cached(d)
            if cached is None:
                top = max(max((max(r) for r in split["input_ids"] if len(r)), default=0) for split in (train, val))
                dt = _token_dtype(top + 1)
                ident_tok = Tok(key="ids", encode=lambda b: b, eos_id=None, vocab_size=top + 1)
                n_tr = _write_tokens((r for r in train["input_ids"]), ident_tok, d / "train.bin", dt)
                n_va = _write_tokens((r for r in val["input_ids"]), ident_tok, d / "val.bin", dt)
                (d / "meta.json").write_text(json.dumps({"dtype": np.dtype(dt).name, "vocab_size": top + 1,
                                                         "train_tokens": n_tr, "val_tokens": n_va}))
                cached = _load_cached(d)
        tr, va, meta = cached
        return TokenData(train=tr, val=va, vocab_size=meta["vocab_size"], source=f"dataset {path} (cache {d})")
    raise DataError(f"--data {path}: the saved dataset has columns {cols}; allowed: a 'text' column or an "
                    f"'input_ids' column")


def load(data: str | None, seq_len: int, *, tokenizer: str | None = None, vocab_size: int = DEFAULT_VOCAB,
         data_dtype: str = "uint16", model_vocab: int | None = None, max_bytes: int | None = None) -> TokenData:
    """Resolve --data into train/val token streams, checking everything the training loop relies on.

    data: None for the embedded stdlib corpus, else a path (see the module docstring).
    tokenizer: an HF model name/path whose tokenizer encodes text sources; None trains a BPE of `vocab_size`.
    model_vocab: when the model is fixed (--model), every token id must be below it.
    max_bytes: a text folder contributes files (spread over its tree) up to this many bytes: a big package's
    source stays quick to tokenize.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"--seq-len={seq_len!r} is invalid; allowed: an integer >= 1")
    if not isinstance(vocab_size, int) or not 256 + 1 <= vocab_size <= 1 << 20:
        raise DataError(f"--vocab-size={vocab_size!r} is invalid; allowed: an integer in [257, 1048576] "
                        f"(byte-level BPE starts from 256 byte tokens)")
    tok = _LazyTok(tokenizer) if tokenizer else None
    if max_bytes is not None and (data is None or not Path(data).expanduser().is_dir()):
        raise DataError(f"--data-bytes={max_bytes!r} applies to a text folder only; got --data {data or 'stdlib'}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise DataError(f"--data-bytes={max_bytes!r} is invalid; allowed: an integer >= 1")
    if data is None:
        td = stdlib_corpus(tok, vocab_size)
    else:
        path = Path(data).expanduser().resolve()
        if not path.exists():
            raise DataError(f"--data {data}: no such file or directory")
        if path.is_dir():
            if any((path / m).exists() for m in _DATASET_MARKERS):
                td = saved_dataset(path, tok, vocab_size)
            elif any((path / f"train{e}").exists() for e in (".bin", ".npy")):
                td = token_files(path, data_dtype)
            else:
                td = text_folder(path, tok, vocab_size, max_bytes)
        elif path.suffix in (".npy", ".bin"):
            td = token_files(path, data_dtype)
        else:
            td = text_file(path, tok, vocab_size)
    for name, stream in (("train", td.train), ("validation", td.val)):
        if len(stream) < seq_len + 1:
            raise DataError(f"--data {data or 'stdlib'}: the {name} split holds {len(stream)} tokens; "
                            f"--seq-len {seq_len} needs at least {seq_len + 1}")
    if model_vocab is not None and td.vocab_size > model_vocab:
        raise DataError(f"--data {data or 'stdlib'}: token ids go up to {td.vocab_size - 1} but the model's "
                        f"vocabulary has {model_vocab} entries; tokenize with the model's tokenizer")
    return td
