"""coat_ds.workloads.data and examples/train.py's input checks: every source format, deterministic batches, and a
clear error (before DeepSpeed or any device memory) for every bad input we handle."""
import contextlib
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from coat_ds.workloads import data
from coat_ds.workloads.causal_lm import ALLOCATOR_VARS, default_allocator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train  # noqa: E402  (the script under test)

TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i * i}  # line {i}" for i in range(400))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COAT_DATA_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def no_device(monkeypatch):
    """Fail the test if main() gets as far as starting DeepSpeed."""
    import deepspeed

    def boom(*a, **k):
        raise AssertionError("bad input reached deepspeed.init_distributed")

    monkeypatch.setattr(deepspeed, "init_distributed", boom)


def run_main(*argv):
    """What the main job says when it refuses its input: exit 2 and one `error: ...` line (workloads/cli.refuse)."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        train.main(["--deepspeed", str(ROOT / "ds_configs/zero2_coat.json"), *argv])
    said = err.getvalue()
    assert e.value.code == 2 and said.splitlines()[-1].startswith("error: ") and said.count("error") == 1, \
        (e.value.code, said)   # a warning line may come first (a trained --model at a pretraining rate)
    return said


# --- sources ------------------------------------------------------------------------------------------------

def test_text_file_trains_bpe_and_caches(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)
    td = data.load(str(f), 16, vocab_size=300)
    assert td.vocab_size == 300 and td.train.dtype == np.uint16
    assert len(td.train) > 10 * len(td.val) > 0
    assert int(np.max(td.train)) < td.vocab_size
    assert td.tokenizer.decode(np.asarray(td.train[:20]).tolist()) in TEXT   # round trip
    cached = sorted((tmp_path / "cache").iterdir())
    again = data.load(str(f), 16, vocab_size=300)                           # second call reads the cache
    assert sorted((tmp_path / "cache").iterdir()) == cached
    np.testing.assert_array_equal(np.asarray(again.train), np.asarray(td.train))


def test_text_folder_splits_by_file(tmp_path):
    for i in range(6):
        (tmp_path / "d" / f"part{i}").mkdir(parents=True)
        (tmp_path / "d" / f"part{i}" / "a.txt").write_text(TEXT[i * 1000:(i + 1) * 4000])
    (tmp_path / "d" / "blob.bin.dat").write_bytes(b"\0\1\2" * 100)           # binary: skipped
    td = data.load(str(tmp_path / "d"), 16, vocab_size=300)
    assert len(td.val) > 16 and len(td.train) > len(td.val)


def test_npy_bin_and_nanogpt_folder(tmp_path):
    ids = np.random.default_rng(0).integers(0, 70000, size=5000).astype(np.uint32)
    np.save(tmp_path / "t.npy", ids)
    td = data.load(str(tmp_path / "t.npy"), 32)
    assert td.vocab_size == int(ids.max()) + 1
    np.testing.assert_array_equal(np.concatenate([td.train, td.val]), ids)
    ids.tofile(tmp_path / "t.bin")
    td = data.load(str(tmp_path / "t.bin"), 32, data_dtype="uint32")
    np.testing.assert_array_equal(np.concatenate([td.train, td.val]), ids)
    (tmp_path / "ng").mkdir()
    ids[:4000].astype(np.uint16).tofile(tmp_path / "ng" / "train.bin")     # values wrap: fine for the test
    ids[4000:].astype(np.uint16).tofile(tmp_path / "ng" / "val.bin")
    td = data.load(str(tmp_path / "ng"), 32)
    assert len(td.train) == 4000 and len(td.val) == 1000


def test_a_written_token_folder_brings_its_vocabulary_dtype_and_tokenizer(tmp_path):
    """What write_token_folder writes (a corpus prepared ahead, a cache folder) loads with the BPE's vocabulary,
    not the largest id seen, its meta.json's dtype over --data-dtype, and its tokenizer (which --export saves)."""
    lines = TEXT.splitlines()
    tok, meta = data.write_token_folder(tmp_path / "f", "test text", lambda: lines[:700], lambda: lines[700:], None,
                                        300)
    assert meta["vocab_size"] == tok.vocab_size == 300 and (tmp_path / "f" / "tokenizer.json").exists()
    td = data.load(str(tmp_path / "f"), 16, data_dtype="uint32")
    assert td.vocab_size == 300 and td.train.dtype == np.uint16
    assert td.tokenizer.decode(np.asarray(td.val).tolist()).replace(data.EOS, "") == "".join(lines[700:])
    (tmp_path / "f" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 512}))
    assert data.load(str(tmp_path / "f"), 16).vocab_size == 512
    (tmp_path / "f" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 100}))
    with pytest.raises(data.DataError, match="token ids go up to .* but its meta.json says vocab_size 100"):
        data.load(str(tmp_path / "f"), 16)
    (tmp_path / "f" / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
    with pytest.raises(data.DataError, match="meta.json needs a dtype in"):
        data.load(str(tmp_path / "f"), 16)


def test_saved_datasets_text_and_input_ids(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = [TEXT[i:i + 700] for i in range(0, len(TEXT), 700)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:-3]}),
                          "validation": datasets.Dataset.from_dict({"text": docs[-3:]})}).save_to_disk(tmp_path / "t")
    td = data.load(str(tmp_path / "t"), 16, vocab_size=300)
    assert td.vocab_size == 300 and len(td.val) > 16
    rows = [list(range(i, i + 50)) for i in range(40)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "ids")
    td = data.load(str(tmp_path / "ids"), 16)
    assert td.vocab_size == 39 + 49 + 1
    np.testing.assert_array_equal(np.asarray(td.train[:50]), np.arange(50))


def test_batches_are_deterministic_disjoint_and_shifted():
    stream = np.arange(10_000, dtype=np.uint32)
    td = data.TokenData(train=stream, val=stream[:500], vocab_size=10_000, source="arange")
    r0 = data.Batches(td, 32, micro_bs=2, grad_accum=2, rank=0, world=2, seed=7)
    r1 = data.Batches(td, 32, micro_bs=2, grad_accum=2, rank=1, world=2, seed=7)
    x, y = r0.train_batch(5, 1)
    assert x.shape == (2, 32) and (y == x + 1).all()
    assert (x[:, 0] % 32 == 0).all()                       # windows start on chunk boundaries
    fresh = data.Batches(td, 32, micro_bs=2, grad_accum=2, rank=0, world=2, seed=7)
    assert (fresh.train_batch(5, 1)[0] == x).all()         # a resumed run reads the same batch
    seen = {int(v) for s in range(20) for m in range(2) for b in (r0, r1) for v in b.train_batch(s, m)[0][:, 0]}
    assert len(seen) == 20 * 2 * 2 * 2                     # no window twice within the epoch
    v0, v1 = list(r0.val_batches(2)), list(r1.val_batches(2))
    assert len(v0) == 2 and not (v0[0][0] == v1[0][0]).all()


# --- bad inputs: each is a clear error before DeepSpeed starts -------------------------------------------------

def test_missing_data_path(no_device, tmp_path):
    assert "no such file or directory" in run_main("--data", str(tmp_path / "nope"))


def test_npy_wrong_dtype_and_shape(no_device, tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(100, dtype=np.float32))
    assert "dtype float32 is not allowed; allowed: uint16, uint32" in run_main("--data", str(tmp_path / "f.npy"))
    np.save(tmp_path / "m.npy", np.ones((10, 10), dtype=np.uint16))
    assert "must be 1-D" in run_main("--data", str(tmp_path / "m.npy"))


def test_bin_size_and_empty(no_device, tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\1" * 7)
    assert "not a multiple of 4 (uint32)" in run_main("--data", str(tmp_path / "odd.bin"), "--data-dtype", "uint32")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "empty" in run_main("--data", str(tmp_path / "empty.bin"))


def test_binary_file_and_empty_text(no_device, tmp_path):
    (tmp_path / "x.dat").write_bytes(b"\0\1\2\3" * 50)
    assert "not a text file" in run_main("--data", str(tmp_path / "x.dat"))
    (tmp_path / "e.txt").write_text("  \n")
    assert "the file is empty" in run_main("--data", str(tmp_path / "e.txt"))


def test_folder_with_one_file(no_device, tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text(TEXT)
    assert "at least 2 UTF-8 text files" in run_main("--data", str(tmp_path / "one"))


def test_too_few_tokens_for_seq_len(no_device, tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "s.bin")
    msg = run_main("--data", str(tmp_path / "s.bin"), "--seq-len", "64")
    assert "the validation split holds 5 tokens; --seq-len 64 needs at least 65" in msg


def test_dataset_without_usable_column_or_train_split(no_device, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": ["a", "b", "c"]}).save_to_disk(tmp_path / "c")
    assert "allowed: a 'text' column or an 'input_ids' column" in run_main("--data", str(tmp_path / "c"))
    datasets.DatasetDict({"dev": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp_path / "d")
    assert "needs a 'train' split" in run_main("--data", str(tmp_path / "d"))


def test_token_ids_beyond_model_vocab(no_device, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32).save_pretrained(tmp_path / "m")
    np.arange(10_000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    msg = run_main("--data", str(tmp_path / "t.bin"), "--model", str(tmp_path / "m"))
    assert "token ids go up to 9999 but the model's vocabulary has 128 entries" in msg


def test_bad_config_and_resume(no_device, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{ not json")
    for argv, msg in ((["--deepspeed", str(tmp_path / "none.json")], "no such file"),
                      (["--deepspeed", str(tmp_path / "bad.json")], "not valid JSON"),
                      (["--resume", "--save-dir", str(tmp_path / "run")], "no checkpoint to resume from")):
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err   # config errors: exit 2, like argparse


def test_bad_flags(capsys):
    for argv, msg in ((["--steps", "0"], "--steps=0 is invalid; allowed: an integer >= 1"),
                      (["--model-size", "huge"], "invalid choice: 'huge'"),
                      (["--data-dtype", "int8"], "invalid choice: 'int8'"),
                      (["--lr", "nan"], "--lr=nan is invalid")):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert msg in capsys.readouterr().err
    with pytest.raises(data.DataError, match="--vocab-size=100 is invalid"):
        data.load(None, 16, vocab_size=100)


def test_every_config_parses_and_names_known_keys():
    import coat_ds.deepspeed as cds
    from coat_ds.deepspeed.optimizer_type import validate_params

    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        cfg = json.loads(path.read_text())
        cds.coat_section(cfg)                       # raises on unknown coat keys / values
        if cfg["optimizer"]["type"] == "CoatAdamW":
            validate_params(cfg["optimizer"]["params"])
        args = train.parse_args(["--deepspeed", str(path), "--steps", "7"])
        out = train.load_ds_config(args)
        assert out["scheduler"]["params"]["total_num_steps"] == 7


def test_bad_model_and_export_paths(no_device, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert f"--model {tmp_path / 'no_model'}: no such directory" in run_main("--model", str(tmp_path / "no_model"))
    (tmp_path / "empty").mkdir()
    assert "cannot load its config" in run_main("--model", str(tmp_path / "empty"))
    (tmp_path / "f").write_text("x")
    assert "is a file; give a directory" in run_main("--export", str(tmp_path / "f"))


@pytest.mark.parametrize("user", [None, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
                                  ("PYTORCH_ALLOC_CONF", "backend:native")])
def test_the_main_job_sets_expandable_segments_unless_the_user_set_the_allocator(monkeypatch, user):
    for var in ALLOCATOR_VARS:
        monkeypatch.delenv(var, raising=False)
    if user:
        monkeypatch.setenv(*user)
    default_allocator()
    got = {v: os.environ.get(v) for v in ALLOCATOR_VARS if os.environ.get(v)}
    assert got == (dict([user]) if user else {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
