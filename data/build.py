"""A corpus's documents into one of the main job's token folders: split by file, the kernel's train split capped
to what the carry can hold, then coat_ds.workloads.data.write_token_folder, the function behind the main job's
own cache: the BPE trained on the train split (the kernel's; the fine-tuning corpora reuse it, as a trained
model's vocabulary is fixed) and each split tokenized once, documents ending in <|endoftext|>."""
from __future__ import annotations

import shutil
import zlib
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from data.sources import Doc
from coat_ds.workloads import data


def split(docs: list[Doc], held_out: Callable[[str], bool]) -> tuple[list[Doc], list[Doc]]:
    """(train, validation), each in path order: alike files side by side, which the carry's compressor likes."""
    ordered = sorted(docs, key=lambda d: d.rel)
    return [d for d in ordered if not held_out(d.rel)], [d for d in ordered if held_out(d.rel)]


def cap(docs: list[Doc], budget: int, keep: Callable[[str], bool]) -> list[Doc]:
    """Every document that `keep` names, then the others in the order of their path's crc32 (spread over the
    whole tree, no subsystem favoured) while the total stays within `budget` bytes; returned in path order."""
    chosen = [d for d in docs if keep(d.rel)]
    total = sum(d.size for d in chosen)
    for d in sorted((d for d in docs if not keep(d.rel)), key=lambda d: zlib.crc32(d.rel.encode())):
        if total + d.size <= budget:
            chosen.append(d)
            total += d.size
    return sorted(chosen, key=lambda d: d.rel)


def _texts(docs: list[Doc], labels: list[str]) -> Callable[[], Iterator[str]]:
    """The documents' texts, each pass under a progress bar in bytes (labelled in turn from `labels`)."""
    passes = iter(labels)

    def texts() -> Iterator[str]:
        with tqdm(total=sum(d.size for d in docs), unit="B", unit_scale=True, mininterval=2.0,
                  desc=next(passes, "reading")) as bar:
            for d in docs:
                yield d.text
                bar.update(d.size)
    return texts


def tokenize(name: str, train: list[Doc], val: list[Doc], out: Path, tok_json: Path | None,
             vocab_size: int) -> dict:
    """Tokenize both splits into `out` (replaced), with the BPE at `tok_json`, or one trained on `train` when
    None; the folder gets its own tokenizer.json either way. meta.json's contents are returned."""
    if out.exists():
        shutil.rmtree(out)
    tok = None
    if tok_json is not None:
        out.mkdir(parents=True)
        shutil.copyfile(tok_json, out / "tokenizer.json")
        tok = data.bpe_tok(out / "tokenizer.json")
    first = [] if tok else [f"{name} train: reading for the BPE"]
    _, meta = data.write_token_folder(
        out, f"{name}: {len(train):,} train and {len(val):,} validation files",
        _texts(train, first + [f"{name} train: tokenizing"]), _texts(val, [f"{name} validation: tokenizing"]),
        tok, vocab_size, show_progress=tok is None)
    return meta


def text_facts(train: list[Doc], val: list[Doc]) -> dict:
    return {"train_files": len(train), "val_files": len(val), "train_text_bytes": sum(d.size for d in train),
            "val_text_bytes": sum(d.size for d in val)}
