"""Long context on ONE GPU capped at an 80 GB card's memory (issue 61): Llama-3.1-8B (or a shallower stand-in of its
width) at one micro-batch of `--seqs` tokens, through ds_configs/zero2_largest_model.json with each layer recomputed
in backward ("coat.activation.checkpoint"). Configurations differ in where a recomputed layer's input waits
("checkpoint_store") and whether the MLP runs over sequence tiles ("tile_tokens"). Per row: peak GPU memory, the
memory a step leaves resident, GPU bytes per token of sequence ((peak - resident) / seq), host peak, tokens/s. One
worker process per (configuration, layers, seq), a configuration's lengths rising until the first that does not
fit; rows merge into long_context.json by that identity. A case over benchmarks/harness.py.

    python -m benchmarks.long_context --configs gpu,host_fp8_tiled --seqs 32768,131072 --cap-gib 79
    python -m benchmarks.long_context --layers 2 --seqs 524288 --configs host_fp8_tiled --steps 0
    python -m benchmarks.long_context --smoke --out /tmp/long      # CPU, tiny Llama
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks import harness
from benchmarks.common import GIB, ROOT, names_of, proc_bytes, worker_cmd, write_json
from benchmarks.configs import MODELS
from coat_ds.workloads import causal_lm as train_lib

NAME, MODEL, SMOKE_MODEL = "long_context", "llama3.1-8b", "tiny"
PRESET = "ds_configs/zero2_largest_model.json"
TILE = 16384
CONFIGS = {  # name -> (what it is, the coat.activation keys it sets over the preset's)
    "gpu": ("recompute, each layer's bf16 input kept on the GPU (torch's checkpoint)", {"checkpoint": True}),
    "gpu_fp8": ("recompute, each layer's input kept on the GPU in FP8 (per 16-group scales)",
                {"checkpoint": True, "checkpoint_store": "gpu_fp8"}),
    "host_fp8": ("recompute, each layer's input in FP8 in pinned host memory, streamed back a layer ahead",
                 {"checkpoint": True, "checkpoint_store": "host_fp8"}),
    "host_fp8_tiled": (f"host_fp8, and the MLP over tiles of {TILE} tokens in forward and recompute",
                       {"checkpoint": True, "checkpoint_store": "host_fp8", "tile_tokens": TILE}),
}
SETTING = ("model", "preset", "cap_gib")   # what rows of one file share; a file of another is refused
WORKER_FLAGS = ("model", "seq", "steps", "cap_gib", "layers")


def ds_config(name: str) -> dict:
    cfg = json.loads((ROOT / PRESET).read_text())
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    cfg["coat"]["activation"].update(CONFIGS[name][1])
    return cfg


def identity(row: dict) -> tuple:
    return row["config"], row["layers"], row["seq"]


def worker(args: argparse.Namespace) -> int:
    """Build (bf16 on the GPU, capped at --cap-gib; fp32 on the CPU), one step, then `--steps` timed ones (0: the
    first step's memory only, its time not a speed); the row written to --result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_lib.set_single_process_env()
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    shape = dict(MODELS[args.model], max_position_embeddings=args.seq,
                 **({"num_hidden_layers": args.layers} if args.layers else {}))
    cfg = ds_config(args.config)
    model = train_lib.from_shape(shape, seed=0, device=device,
                                 dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    engine = train_lib.initialize(model, cfg)
    tokens = torch.randint(0, shape["vocab_size"], (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mem = (lambda f: f() / GIB) if device == "cuda" else (lambda f: None)

    def step() -> float:
        loss = train_lib.lm_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    t0 = time.perf_counter()
    losses = [step()]
    sync()
    first_s, resident = time.perf_counter() - t0, mem(torch.cuda.memory_allocated)
    t0 = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    sync()
    step_s = (time.perf_counter() - t0) / args.steps if args.steps else None
    peak = mem(torch.cuda.max_memory_allocated)
    write_json(args.result, {
        "config": args.config, "layers": shape["num_hidden_layers"], "seq": args.seq, "fits": True,
        "tokens_per_s": args.seq / step_s if step_s else None, "step_time_s": step_s, "first_step_s": first_s,
        "peak_alloc_gib": peak, "peak_reserved_gib": mem(torch.cuda.max_memory_reserved), "resident_gib": resident,
        "gpu_bytes_per_token": (peak - resident) * GIB / args.seq if peak is not None else None,
        "host_peak_rss_gib": proc_bytes("VmHWM") / GIB, "losses": losses})
    return 0


def run_one(args: argparse.Namespace, name: str, seq: int) -> dict:
    """A worker process's row; one that fails says how (out of memory: fits false)."""
    return harness.worker_row(lambda result: worker_cmd(f"benchmarks.{NAME}", args, WORKER_FLAGS, config=name,
                                                        seq=seq, result=result),
                              args.timeout, config=name, seq=seq,
                              layers=args.layers or MODELS[args.model]["num_hidden_layers"])


def results(args: argparse.Namespace, rows: list[dict], call: dict) -> dict:
    """This call's rows merged into --out's file by identity (a file of another model, preset or cap refused)."""
    ours = {"model": args.model, "shape": MODELS[args.model], "preset": PRESET, "cap_gib": args.cap_gib,
            "configs": {k: v[0] for k, v in CONFIGS.items()}}
    rows = [dict(r, date=call.get("date")) for r in rows]   # each row its call's date: the code it ran
    return harness.into_file(args.out / f"{NAME}.json", rows, identity, ours, call, SETTING)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="gpu,host_fp8_tiled", help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the first (0: memory only)")
    harness.one_gpu_options(p, NAME, "seqs", "default 32768,131072; --smoke 64,128",
                            MODELS[MODEL]["num_hidden_layers"])
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config_names = names_of(p, "configs", args.configs, CONFIGS)
    if args.steps < 0:
        p.error(f"--steps={args.steps} is invalid; allowed: an integer >= 0")
    args.seq_list = harness.one_gpu_checked(p, args, NAME, "seqs", "64,128" if args.smoke else "32768,131072",
                                            (MODEL, SMOKE_MODEL))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.one_gpu_case(args, NAME, worker, lambda name, seq: run_one(args, name, seq), args.config_names,
                                args.seq_list, lambda rows, call: results(args, rows, call))


if __name__ == "__main__":
    sys.exit(main())
