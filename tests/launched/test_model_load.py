"""`examples/train.py --model DIR` under ZeRO-3 on 2 CPU ranks (tests/ds_scripts/load_job.py): an HF checkpoint is
loaded file by file into the partitions (coat_ds.workloads.causal_lm.load_partitioned), each rank's host memory
stays within its partition plus a couple of checkpoint files and a fixed overhead, and every weight arrives as
saved. What a rank holds beyond its partition is the same at two sizes, which is why this stand-in speaks for 70B
(docs/train.md, "`--model` under ZeRO-3: a checkpoint larger than the host")."""
import json
import subprocess

import numpy as np
import pytest
import torch

from coat_ds.workloads.causal_lm import from_shape
from harness import DS_SCRIPTS, ROOT, child_env, ranks_launcher, run_one_rank_job

# Llamas of 120M and 325M parameters (8 and 24 layers): 239 and 650 MB in bf16, saved in 20 MB files
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, intermediate_size=2816, vocab_size=8192,
             max_position_embeddings=256)
SHARD = "20MB"
OVERHEAD = 128 * 2**20   # what a rank adds whatever the model's size (measured: ~95 MB at both sizes)


def load(tmp_path, layers: int) -> tuple[list[dict], int, int]:
    """The main job's load of a save_pretrained checkpoint of random weights with `layers` layers, on 2 ranks ->
    (each rank's record from load_job.py, the number of parameters, the largest checkpoint file's bytes)."""
    model_dir, tokens, out = tmp_path / f"model{layers}", tmp_path / "tokens.npy", tmp_path / f"r{layers}.json"
    model = from_shape(dict(SHAPE, num_hidden_layers=layers), seed=0, dtype=torch.bfloat16)
    n_params = len(list(model.parameters()))
    model.save_pretrained(model_dir, max_shard_size=SHARD)
    del model
    np.save(tokens, np.random.default_rng(0).integers(0, SHAPE["vocab_size"], 20_000).astype(np.uint16))
    cmd = [*ranks_launcher(2), str(DS_SCRIPTS / "load_job.py"), "--out", str(out),
           "--deepspeed", "ds_configs/zero3_largest_model.json", "--model", str(model_dir), "--data", str(tokens),
           "--seq-len", "32", "--micro-batch", "1", "--steps", "1", "--save-dir", str(tmp_path / "run")]
    # glibc's mmap threshold fixed at its initial 128 KiB: freed tensors go back to the OS, so RSS follows what the
    # rank holds. By default glibc raises it up to 32 MiB as tensors are freed and keeps freed gathers in its heap,
    # which on CPU ranks grows with the model (docs/train.md gives both)
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(MALLOC_MMAP_THRESHOLD_="131072"), capture_output=True,
                          text=True, timeout=600)
    paths = [tmp_path / f"r{layers}.json.rank{rank}" for rank in (0, 1)]
    assert proc.returncode == 0 and all(p.is_file() for p in paths), (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(p.read_text()) for p in paths], n_params, max(f.stat().st_size for f in model_dir.glob("*"))


def test_model_dir_loads_file_by_file_in_bounded_host_memory(tmp_path):
    """Each rank's peak RSS growth over the load is its partition plus at most 2 files and OVERHEAD, the same
    excess at both sizes (so at any size), and the loaded weights are the saved ones."""
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs: on GPUs the partitions are device memory")
    excess = {}
    for layers in (8, 24):
        records, n_params, shard = load(tmp_path, layers)
        for r in records:
            assert r["dtype"] == "torch.bfloat16" and r["world"] == 2, r
            assert r["checked"] == n_params and r["differ"] == [] and r["absent"] == [], r   # loaded as saved
            assert abs(r["partition_bytes"] - r["model_bytes"] / 2) < 2**20, r                # half the model
            growth = r["peak"] - r["rss_before"]
            assert growth <= r["partition_bytes"] + 2 * shard + OVERHEAD, (layers, growth, r)
            if layers == 24:   # a rank that held the whole model beside its partition: >= 1.5x
                assert growth < 0.8 * r["model_bytes"], (growth, r)
            excess[layers, r["rank"]] = growth - r["partition_bytes"]
    for rank in (0, 1):   # 2.7 times the model, not more beside the partition
        assert excess[24, rank] <= excess[8, rank] + shard, excess


CHECKS_JOB = r'''
import json, shutil, sys
from pathlib import Path

import deepspeed
import torch
from safetensors.torch import load_file, save_file

from coat_ds.workloads.causal_lm import from_shape, load_partitioned

tmp = Path(sys.argv[0]).parent
cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=192,
            vocab_size=256)
saved = from_shape(dict(tiny, tie_word_embeddings=True), seed=0)   # fp32, tied; every checkpoint is written before
saved.save_pretrained(tmp / "tied")                               # a load leaves HF's ZeRO-3 switch on
state = saved.state_dict()
from_shape(tiny, seed=0).save_pretrained(tmp / "short")   # one tensor left out of the file
weights = load_file(tmp / "short" / "model.safetensors")
del weights["model.norm.weight"]
save_file(weights, tmp / "short" / "model.safetensors", metadata={"format": "pt"})
shutil.copytree(tmp / "tied", tmp / "wide")              # the config asks for a larger vocabulary
conf = json.loads((tmp / "wide" / "config.json").read_text())
(tmp / "wide" / "config.json").write_text(json.dumps(dict(conf, vocab_size=320)))
shutil.copytree(tmp / "tied", tmp / "bin")               # the same weights as an older pytorch_model.bin
torch.save(load_file(tmp / "bin" / "model.safetensors"), tmp / "bin" / "pytorch_model.bin")
(tmp / "bin" / "model.safetensors").unlink()

out = {}
for name in ("tied", "bin"):
    model = load_partitioned(str(tmp / name), cfg, torch.bfloat16)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out[f"{name}_equal"] = all(torch.equal(p.data, state[n].to(torch.bfloat16))
                                   for n, p in model.named_parameters())
    out[f"{name}_tied"] = model.lm_head.weight is model.model.embed_tokens.weight
out["dtype"] = str(model.lm_head.weight.dtype)
for name in ("short", "wide"):
    try:
        load_partitioned(str(tmp / name), cfg, torch.bfloat16)
        out[name] = None
    except ValueError as e:
        out[name] = str(e)
print("RESULT " + json.dumps(out))
'''


def test_load_partitioned_converts_ties_and_refuses_what_does_not_fit(tmp_path):
    """An fp32 checkpoint of tied embeddings into a bf16 model built under zero.Init, from safetensors and from a
    pytorch_model.bin: every value as saved, rounded to bf16, the tie kept. A checkpoint that lacks a parameter, or
    holds one of another shape, is refused in one line that names it (a partly loaded model would train from random
    weights without a word)."""
    out = run_one_rank_job(tmp_path, CHECKS_JOB)
    assert out["tied_equal"] and out["tied_tied"] and out["dtype"] == "torch.bfloat16", out
    assert out["bin_equal"] and out["bin_tied"], out
    assert "lacks 1 of the model's parameters (model.norm.weight)" in out["short"], out
    assert "holds tensors of other shapes: model.embed_tokens.weight (256, 64) (model (320, 64))" in out["wide"], out
