"""Qwen3-30B-A3B full-parameter training on ONE GPU capped at an 80 GB card's memory (issue 60): tokens/s and peak GiB
of coat_ds's FP8 layers (experts in grouped FP8 GEMMs) against the stock HF layers, both with CoatAdamW, FP8 moments
in pinned host memory, the bf16 master and gradient release (ds_configs/zero3_offload_largest_model.json, whose
"coat.activation" the stock rows switch off). A case over benchmarks/harness.py: one worker process per
(configuration, micro-batch), a configuration's micro-batches rising until the first that does not fit; rows merge
into moe_one_gpu.json by (config, micro_batch, seq, grad_accum), so a sweep can be split over several calls.
docs/benchmarks.md, "Qwen3-30B-A3B on one GPU", has the commands.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks import harness
from benchmarks.common import GIB, ROOT, call_ms, check_positive, names_of, proc_bytes, worker_cmd, write_json
from benchmarks.configs import MODELS
from benchmarks.memory_trace import recorded
from coat_ds.hf import loss as hf_loss
from coat_ds.workloads import causal_lm as train_lib
from coat_ds.workloads.shapes import SHAPES

NAME, MODEL, SMOKE_MODEL = "moe_one_gpu", "qwen3-30b-a3b", "tiny-qwen3_moe"
PRESET = "ds_configs/zero3_offload_largest_model.json"
CONFIGS = {"coat": "coat_ds FP8 layers (experts: grouped FP8 GEMMs) + CoatAdamW, host FP8 states, bf16 master, "
                   "release, recompute (the preset as written)",
           "stock": "stock HF layers (transformers' grouped_mm experts) + CoatAdamW, host FP8 states, bf16 master, "
                    "release (the preset with coat.activation enabled: false)",
           "bf16_cpu_adam": "BF16 + DeepSpeedCPUAdam: stock HF layers, the preset's ZeRO-3 with the optimizer "
                            "offloaded (fp32 master, gradients and moments in pinned host memory), no coat section"}
PHASES = ("forward", "backward", "step")
SETTING = ("model", "shape", "preset", "cap_gib")   # what rows of one file share; a file of another is refused
ACCUMULATING = {"gradients": "per_parameter", "states": "device"}   # what coat allows with --grad-accum > 1
WORKER_FLAGS = ("model", "seq", "steps", "cap_gib", "layers", "grad_accum", "breakdown", "memory_trace")


def ds_config(name: str, micro_batch: int, grad_accum: int = 1) -> dict:
    """The preset at this micro-batch and accumulation. Accumulating, gradients are kept per parameter and the FP8
    states on the device: release steps each bucket as backward reduces it, and host states step with release, so
    coat refuses both with more than one micro-batch a step."""
    cfg = json.loads((ROOT / PRESET).read_text())
    cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum)
    if grad_accum > 1:
        cfg["coat"].update(ACCUMULATING)
    if name == "stock":
        cfg["coat"]["activation"] = {"enabled": False}
    if name == "bf16_cpu_adam":   # the baseline a DeepSpeed user runs instead: only the optimizer and coat change
        del cfg["coat"]
        params = {k: cfg["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")}
        cfg["optimizer"] = {"type": "AdamW", "params": params}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def shape(args: argparse.Namespace) -> dict:
    """The model's HF config fields as the file records them: --layers deep where given."""
    return dict(MODELS[args.model], **({"num_hidden_layers": args.layers} if args.layers else {}))


def stem(args: argparse.Namespace) -> str:
    """The results file's name: the model's own depth in moe_one_gpu.json, a shallower stand-in's in its own file
    (a file's rows share one shape)."""
    return NAME if args.layers in (None, SHAPES[MODEL]["num_hidden_layers"]) else f"{NAME}_{args.layers}_layers"


def identity(row: dict) -> tuple:
    """A row's key in the file (rows from before --grad-accum ran one micro-batch a step)."""
    return row["config"], row["micro_batch"], row["seq"], row.get("grad_accum", 1)


# --- The worker: one configuration at one micro-batch ----------------------------------------------------------------
def train_step(engine, micro: list, device: str, split: bool) -> tuple[float, dict[str, float]]:
    """One optimizer step over `micro`'s micro-batches -> its last loss and, where `split`, the seconds of its
    forwards, backwards and engine.step calls, each timed alone (CUDA event pairs on the GPU, perf_counter on the
    CPU: common.call_ms)."""
    secs, out = dict.fromkeys(PHASES, 0.0), {}
    for x, y in micro:
        for phase, fn in zip(PHASES, (lambda: out.update(loss=train_lib.lm_loss(engine, x, y)),
                                      lambda: engine.backward(out["loss"]), engine.step)):
            if split:
                secs[phase] += call_ms(fn, device) / 1e3
            else:
                fn()
    return out["loss"].item(), secs


def worker(args: argparse.Namespace) -> int:
    """Build partitioned (bf16 on the GPU, capped at --cap-gib; fp32 on the CPU), one warm-up step, then `--steps`
    timed ones on the same --grad-accum micro-batches; the row written to --result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_lib.set_single_process_env()
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    cfg, built = ds_config(args.config, args.micro_batch, args.grad_accum), shape(args)
    with train_lib.built_partitioned(cfg):
        model = train_lib.from_shape(dict(built, max_position_embeddings=max(args.seq, 4096)), seed=0, device=device,
                                     dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    engine = train_lib.initialize(model, cfg)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, built["vocab_size"], (args.micro_batch, args.seq + 1), generator=gen).to(device)
              for _ in range(args.grad_accum)]
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens]
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    train_step(engine, micro, device, False)
    sync()
    t0 = time.perf_counter()
    with recorded(0, args.memory_trace) as trace:
        steps = [train_step(engine, micro, device, args.breakdown) for _ in range(args.steps)]
    sync()
    elapsed, n_params = time.perf_counter() - t0, sum(p.ds_numel for p in model.parameters())
    peak = (lambda f: f() / GIB) if device == "cuda" else (lambda f: None)
    write_json(args.result, {
        "config": args.config, "micro_batch": args.micro_batch, "seq": args.seq, "grad_accum": args.grad_accum,
        "fits": True, "tokens_per_s": args.micro_batch * args.grad_accum * args.seq * args.steps / elapsed,
        "step_time_s": elapsed / args.steps, "peak_alloc_gib": peak(torch.cuda.max_memory_allocated),
        "peak_reserved_gib": peak(torch.cuda.max_memory_reserved), "host_peak_rss_gib": proc_bytes("VmHWM") / GIB,
        "host_bytes_per_param": proc_bytes("VmHWM") / n_params, "params": n_params,
        "layers": built["num_hidden_layers"], **{k: cfg.get("coat", {}).get(k) for k in ACCUMULATING},
        "loss": "chunked" if hf_loss.is_applied(model) else "stock",
        "losses": [loss for loss, _ in steps],
        **({f"{k}_s": statistics.mean(s[k] for _, s in steps) for k in PHASES} if args.breakdown else {}),
        **({"memory_trace": trace} if trace else {})})
    return 0


# --- The case: its jobs and its file ---------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, name: str, micro_batch: int) -> dict:
    """A worker process's row; one that fails says how (out of memory: fits false)."""
    return harness.worker_row(lambda result: worker_cmd(f"benchmarks.{NAME}", args, WORKER_FLAGS, config=name,
                                                        micro_batch=micro_batch, result=result), args.timeout,
                              config=name, micro_batch=micro_batch, seq=args.seq, grad_accum=args.grad_accum)


def results(args: argparse.Namespace, rows: list[dict], call: dict) -> dict:
    """--out's file with this call's rows merged in by identity; exits in one line where its rows follow another
    setting (model, shape, preset, cap)."""
    ours = {"model": args.model, "shape": shape(args), "preset": PRESET, "cap_gib": args.cap_gib, "configs": CONFIGS}
    return harness.into_file(args.out / f"{stem(args)}.json", rows, identity, ours, call, SETTING)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="coat,stock", help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--seq", type=int, help="default 4096 (--smoke 32)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="DeepSpeed's gradient_accumulation_steps: micro-batches a step (tokens/s counts them all); "
                        f"above 1 the preset runs with {ACCUMULATING} (coat refuses release and host states there)")
    p.add_argument("--breakdown", action="store_true",
                   help="time each step's forward, backward and engine.step apart (forward_s, backward_s, step_s)")
    p.add_argument("--memory-trace", action="store_true", help="the allocator's trace over the timed steps: the "
                   "blocks alive at their peak by allocating line (benchmarks/memory_trace.py; use --steps 1)")
    harness.one_gpu_options(p, NAME, "micro-batches", "default 1,2,4; --smoke 1,2", SHAPES[MODEL]["num_hidden_layers"])
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config_names = names_of(p, "configs", args.configs, CONFIGS)
    args.batches = harness.one_gpu_checked(p, args, NAME, "micro-batches", "1,2" if args.smoke else "1,2,4",
                                           (MODEL, SMOKE_MODEL))
    args.seq = (32 if args.smoke else 4096) if args.seq is None else args.seq
    check_positive(p, args, ("seq", "steps", "grad_accum"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.one_gpu_case(args, stem(args), worker, lambda name, b: run_one(args, name, b), args.config_names,
                                args.batches, lambda rows, call: results(args, rows, call))


if __name__ == "__main__":
    sys.exit(main())
