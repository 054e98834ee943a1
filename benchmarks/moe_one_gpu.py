"""Qwen3-30B-A3B full-parameter training on ONE GPU capped at an 80 GB card's memory (issue 60): tokens/s and peak GiB
of coat_ds's FP8 layers (experts in grouped FP8 GEMMs) against the stock HF layers, both with CoatAdamW, FP8 moments
in pinned host memory, the bf16 master and gradient release (ds_configs/zero3_offload_largest_model.json, whose
"coat.activation" the stock rows switch off). One worker process per (configuration, micro-batch); a configuration's
micro-batches rise until the first that does not fit. Rows are merged into the results file by (config, micro_batch),
so a sweep can be split over several calls.

    python -m benchmarks.moe_one_gpu --configs coat,stock --micro-batches 1,2,4 --seq 4096 --cap-gib 79
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import GIB, RESULTS, ROOT, proc_bytes, provenance, read_json, write_json
from coat_ds.workloads import causal_lm as train_lib
from coat_ds.workloads.shapes import SHAPES

MODEL = "qwen3-30b-a3b"
PRESET = "ds_configs/zero3_offload_largest_model.json"
CONFIGS = {"coat": "coat_ds FP8 layers (experts: grouped FP8 GEMMs) + CoatAdamW, host FP8 states, bf16 master, "
                   "release, recompute (the preset as written)",
           "stock": "stock HF layers (transformers' grouped_mm experts) + CoatAdamW, host FP8 states, bf16 master, "
                    "release (the preset with coat.activation enabled: false)"}
TAG = "RESULT "


def ds_config(name: str, micro_batch: int) -> dict:
    cfg = json.loads((ROOT / PRESET).read_text())
    cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1)
    if name == "stock":
        cfg["coat"]["activation"] = {"enabled": False}
    return cfg


def worker(args: argparse.Namespace) -> dict:
    """One configuration at one micro-batch: build partitioned in bf16 on the GPU, `--steps` timed steps after one
    warm-up step."""
    train_lib.default_allocator()
    train_lib.set_single_process_env()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    cfg = ds_config(args.config, args.micro_batch)
    shape = dict(SHAPES[MODEL], max_position_embeddings=max(args.seq, 4096),
                 **({"num_hidden_layers": args.layers} if args.layers else {}))
    with train_lib.built_partitioned(cfg):
        model = train_lib.from_shape(shape, seed=0, device="cuda", dtype=torch.bfloat16)
    engine = train_lib.initialize(model, cfg)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        loss = train_lib.lm_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    step()
    torch.cuda.synchronize()
    t0, losses = time.perf_counter(), [step() for _ in range(args.steps)]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n_params = sum(p.ds_numel for p in model.parameters())
    return {"config": args.config, "micro_batch": args.micro_batch, "seq": args.seq, "fits": True,
            "tokens_per_s": args.micro_batch * args.seq * args.steps / elapsed, "step_time_s": elapsed / args.steps,
            "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB, "host_peak_rss_gib": proc_bytes("VmHWM") / GIB,
            "host_bytes_per_param": proc_bytes("VmHWM") / n_params, "params": n_params,
            "layers": shape["num_hidden_layers"], "losses": losses}


def run_one(args: argparse.Namespace, name: str, micro_batch: int) -> dict:
    """A worker process's row; one that fails says how (out of memory: fits false)."""
    cmd = [sys.executable, "-m", "benchmarks.moe_one_gpu", "--worker", "--config", name, "--micro-batch",
           str(micro_batch), "--seq", str(args.seq), "--steps", str(args.steps), "--cap-gib", str(args.cap_gib),
           *(["--layers", str(args.layers)] if args.layers else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    rows = [json.loads(line[len(TAG):]) for line in proc.stdout.splitlines() if line.startswith(TAG)]
    if rows:
        return rows[-1]
    text = proc.stdout + proc.stderr
    oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
    tail = [line for line in text.splitlines() if line.strip()][-3:]
    return {"config": name, "micro_batch": micro_batch, "seq": args.seq, "fits": False, "oom": oom,
            "returncode": proc.returncode, "error": " | ".join(tail)[-800:]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="coat,stock", help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--micro-batches", default="1,2,4", help="rising; a configuration stops at its first that fails")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--cap-gib", type=float, default=79.0,
                   help="torch.cuda.set_per_process_memory_fraction's cap: an 80 GB card's usable memory")
    p.add_argument("--layers", type=int, default=None, help="a shallower stand-in (smoke runs); default: all 48")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per worker")
    p.add_argument("--out", default=str(RESULTS / "moe_one_gpu.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config_names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_names if c not in CONFIGS]
    if bad or not args.config_names:
        p.error(f"--configs {args.configs!r}: {bad or 'none'} unknown; allowed: {list(CONFIGS)}")
    try:
        args.batches = sorted({int(b) for b in args.micro_batches.split(",")})
    except ValueError:
        p.error(f"--micro-batches {args.micro_batches!r}: allowed: comma-separated whole numbers >= 1")
    for key in ("seq", "steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key} {getattr(args, key)}: allowed: a whole number >= 1")
    if not args.batches or args.batches[0] < 1 or args.cap_gib <= 0:
        p.error("--micro-batches must be >= 1 and --cap-gib > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(TAG + json.dumps(worker(args)), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("moe_one_gpu: needs a CUDA GPU (allowed here: none)", file=sys.stderr)
        return 2
    rows = []
    for name in args.config_names:
        for b in args.batches:
            row = run_one(args, name, b)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if not row["fits"]:
                break
    old = read_json(args.out, {}) or {}
    keep = [r for r in old.get("rows", []) if (r["config"], r["micro_batch"], r["seq"]) not in
            {(r2["config"], r2["micro_batch"], r2["seq"]) for r2 in rows}]
    write_json(args.out, {**provenance(), "model": MODEL, "shape": SHAPES[MODEL], "preset": PRESET,
                          "cap_gib": args.cap_gib, "configs": CONFIGS, "rows": keep + rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
