"""ZeRO-2 + ZeRO-Offload (optimizer on the host): host memory per parameter, GPU peak, tokens/s; one process per row.

A row predicted not to fit the host (`predict_host`) is skipped instead of taking the node down; rows merge into
--out's offload.json as they finish (docs/benchmarks.md; docs/notes_offload.md: where every host byte goes)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.common import (GIB, T0, check_positive, device_name, names_of, parser, proc_bytes, versions,
                               worker_cmd)
from benchmarks.configs import MODELS as SHAPES, build_model, ds_config
from benchmarks.worker import StorageCounter, Worker, _tensors, base_optimizer
from benchmarks.render_tables import render
from coat_ds.workloads.causal_lm import param_groups

CONFIGS = {"bf16": "BF16 + DeepSpeedCPUAdam", "coat_full": "coat_ds full (fp32 master)",
           "coat_full_bf16sr": "coat_ds full, bf16 master (stochastic rounding)"}
MODELS = ("llama-1b", "llama2-7b", "llama2-13b")
MICRO_BATCH = {"tiny": 2, "llama-1b": 8, "llama2-7b": 4, "llama2-13b": 2}
BASE_RSS = 5 * GIB    # a CUDA worker's RSS before any training state (torch, CUDA context, transformers, DeepSpeed)
EST_S = {"tiny": 40, "llama-1b": 120, "llama2-7b": 330, "llama2-13b": 520}   # a row's wall time, set-up included
# a row runs only if its predicted peak is under this share of MemAvailable: at 0.95 the 7B rows (predicted
# 110-114 GiB of ~123) took the node down; the prediction's base RSS and the page cache are not exact
HOST_MARGIN = 0.85
# host bytes per parameter of the optimizer states: fp32 m and v; FP8 m and v + fp32 (scale, exponent) per 128
STATE_B = {"bf16": 8.0, "coat_full": 2 + 16 / 128, "coat_full_bf16sr": 2 + 16 / 128}


# --- Prediction: what DeepSpeed 0.19.8's ZeRO-2 Offload allocates on the host -----------------------------------------
def pinned_size(nbytes: int, pow2: bool) -> int:
    """Bytes a pinned block really takes: torch's pinned allocator rounds each block up to a power of two."""
    return 1 << (nbytes - 1).bit_length() if pow2 and nbytes > 0 else nbytes


def predict_host(group_numels: list[int], largest_param: int, config: str, pinned: bool, pow2: bool,
                 base: int = BASE_RSS) -> dict:
    """Host bytes (RSS) at DeepSpeed's engine set-up (its peak) and in steady training: per param group a master
    and a gradient partition and a bf16 staging buffer, each pinned through an unpinned copy, and a bf16 gradient
    buffer of the largest parameter (docs/notes_offload.md derives it)."""
    pow2 = pow2 and pinned   # only pinned blocks are rounded
    fp32 = sum(pinned_size(4 * k, pow2) for k in group_numels)
    bf16 = sum(pinned_size(2 * k, pow2) for k in group_numels)
    temp = pinned_size(2 * largest_param, pow2)
    transient = 4 * max(group_numels) if pinned else 0
    if config == "coat_full_bf16sr":
        setup_peak, held = base + 3 * bf16 + temp + transient // 2, 2 * bf16 + temp
    else:
        setup_peak, held = base + 2 * fp32 + bf16 + temp + transient, 2 * fp32 + bf16 + temp
    states = int(STATE_B[config] * sum(group_numels))
    steady = base + held + states
    return {"setup_peak_bytes": setup_peak, "steady_bytes": steady, "peak_bytes": max(setup_peak, steady),
            "states_bytes": states, "base_bytes_assumed": base, "pinned": pinned, "pinned_pow2": pow2}


def model_numels(model: str) -> tuple[list[int], int]:
    """(numel of each of the main job's param groups, largest parameter) from the model built on the meta device."""
    net = build_model(model, "meta", torch.bfloat16, seed=0)
    numels = [sum(p.numel() for p in g["params"]) for g in param_groups(net)]
    return numels, max(p.numel() for p in net.parameters())


# --- Worker: one (model, config) row ----------------------------------------------------------------------------------
def rss_gb(key: str = "VmRSS") -> float:
    return proc_bytes(key) / GIB


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (VmHWM); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def step_phases(w) -> dict:
    """One step's host RSS before it and the peaks of forward+backward and of the step (the CPU optimizer's)."""
    x, y = w.rung_inputs(w.args.micro_batch)
    w.sync()
    out = {"before_gb": rss_gb()}
    for phase, after, run in (("forward_backward", "after_backward",
                               lambda: w.engine.backward(w.train_lib.lm_loss(w.engine, x, y))),
                              ("optimizer_step", "after_step", w.engine.step)):
        ok = reset_peak_rss()
        run()
        w.sync()
        out[f"{phase}_peak_gb"] = rss_gb("VmHWM") if ok else None
        out[f"{after}_gb"] = rss_gb()
    return out


def _is_pinned(t) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:   # a CPU-only torch cannot ask
        return False


def host_accounting(engine, n_params: int) -> dict:
    """Every host tensor of the ZeRO and base optimizers by category, each storage in the first that names it
    (bf16_sr's staging buffer *is* the master); `other`: the rest (on CPU also the flat weights and buckets)."""
    zo, base = engine.optimizer, base_optimizer(engine)
    masters = [p for g in base.param_groups for p in g["params"]]
    cats = [("master", masters),
            ("optimizer_states", [t for st in base.state.values() for t in _tensors(st)]),
            ("master_grads", [p.grad for p in masters]),
            ("bf16_staging", list(getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", []))),
            ("grad_staging", [getattr(zo, "temp_grad_buffer_for_cpu_offload", None)]),
            ("accumulated_grads", list(_tensors(getattr(zo, "accumulated_grads_in_cpu", {})))),
            ("other", [t for v in vars(zo).values() for t in _tensors(v)])]
    counter, out = StorageCounter(), {}
    for name, tensors in cats:
        b = counter.add(t for t in tensors if t is not None and t.device.type == "cpu")
        pinned = [t.untyped_storage().nbytes() for t in counter.new if _is_pinned(t)]
        out[name] = {"bytes": b, "per_param": b / n_params, "pinned_bytes": sum(pinned),
                     "pinned_rounded_bytes": sum(pinned_size(x, True) for x in pinned)}
    total = sum(c["bytes"] for k, c in out.items() if k != "other")
    opt = out["master"]["bytes"] + out["optimizer_states"]["bytes"]
    return {"categories": out, "host_total_bytes": total, "host_total_bytes_per_param": total / n_params,
            "host_optimizer_bytes": opt, "host_optimizer_bytes_per_param": opt / n_params}


class OffloadWorker(Worker):
    """e2e's worker and configuration under ZeRO-2 with the optimizer on the host, its RSS at each stage recorded;
    BF16's "type": "AdamW" runs as DeepSpeedCPUAdam under Offload (on CPU too: no torch_adam)."""

    def setup_engine(self):
        args = self.args
        self.rss = {"start": rss_gb()}
        net = self.model()
        self.rss["model_built"] = rss_gb()
        cfg = ds_config(args.config, micro_batch=args.micro_batch, zero_stage=2)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": args.pin_memory}
        cfg.pop("_source")
        engine = self.train_lib.initialize(net, cfg)
        engine.train()
        self.rss.update(engine_built=rss_gb(), engine_built_peak=rss_gb("VmHWM"))
        self.ds_cfg = cfg
        return engine


def pinned_stats() -> dict | None:
    """torch's pinned host allocator: bytes it holds (rounded blocks, live and cached)."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.host_memory_stats()
    return {"allocated_bytes": s.get("allocated_bytes.current"), "allocated_bytes_peak": s.get("allocated_bytes.peak"),
            "active_bytes": s.get("active_bytes.current")}


def run_row(w: OffloadWorker) -> dict:
    """Warm-up steps, timed steps (cut short by the time budget), then the accounting at steady state."""
    args, b = w.args, w.args.micro_batch
    x, y = w.rung_inputs(b)
    w.one_step(x, y)
    w.rss["first_step"] = rss_gb()
    for _ in range(args.warmup - 1):
        w.one_step(x, y)
    w.sync()
    if w.on_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0, steps = time.perf_counter(), 0
    while steps < args.steps and (steps == 0 or time.time() - T0 < args.budget_s):
        loss = w.one_step(x, y)
        steps += 1
    w.sync()
    dt = time.perf_counter() - t0
    acc = host_accounting(w.engine, w.n_params)
    peak = rss_gb("VmHWM")   # before step_phases starts new peak windows
    phases = step_phases(w)
    peak = max([peak] + [v for k, v in phases.items() if k.endswith("peak_gb") and v is not None])
    return {"model": args.model, "config": args.config, "label": CONFIGS[args.config], "params": w.n_params,
            "micro_batch": b, "seq_len": args.seq_len, "timed_steps": steps, "step_time_s": dt / steps,
            "tokens_per_s": b * args.seq_len * steps / dt, "loss": float(loss.detach().float()),
            "host_optimizer_bytes_per_param": acc["host_optimizer_bytes_per_param"],
            "host_rss_gb": rss_gb(), "host_rss_peak_gb": peak, "host_rss_stages_gb": w.rss,
            "host_rss_step_phases": phases,
            "gpu_peak_gb": torch.cuda.max_memory_allocated() / GIB if w.on_cuda else None,
            "gpu_peak_reserved_gb": torch.cuda.max_memory_reserved() / GIB if w.on_cuda else None,
            "pinned_allocator": pinned_stats(), "host_accounting": acc,
            "basic_optimizer": type(w.engine.basic_optimizer).__name__, "ds_config": w.ds_cfg, "fits": True,
            "why_not": None, "coat_warnings": w.wlog.messages, "device": device_name(), "versions": versions()}


def worker(args: argparse.Namespace) -> int:
    w = OffloadWorker(args)
    try:
        row = run_row(w)
    except torch.OutOfMemoryError as e:
        row = {"model": args.model, "config": args.config, "micro_batch": args.micro_batch, "fits": False,
               "why_not": f"GPU OOM: {str(e).splitlines()[0]}", "gpu_oom": True, "host_rss_stages_gb": w.rss}
    Path(args.result).write_text(json.dumps(row))
    return 0


# --- Parent: prediction, one worker per row, merged into offload.json -------------------------------------------------
def host_plan(args: argparse.Namespace, model: str, config: str, avail: int) -> dict:
    """The row's predicted host memory and whether it fits the host (a row that does not is not run)."""
    groups, largest = model_numels(model)
    on_cuda = torch.cuda.is_available()
    p = predict_host(groups, largest, config, pinned=args.pin_memory and on_cuda,
                     pow2=os.environ.get("DS_PIN_MEMORY_BACKEND", "torch") != "native", base=BASE_RSS if on_cuda else 0)
    p["per_param"] = {k: v / sum(groups) for k, v in p.items() if k.endswith("_bytes")}
    return {"prediction": p, "host_available_bytes": avail, "params": sum(groups),
            "predicted_fits": p["peak_bytes"] <= HOST_MARGIN * avail or not on_cuda}


def not_run(model: str, config: str, plan: dict) -> dict:
    """A row predicted not to fit the host: its prediction, not run."""
    p, avail = plan["prediction"], plan["host_available_bytes"]
    return {"model": model, "config": config, "label": CONFIGS[config], "fits": False,
            "why_not": f"host OOM predicted: peak {p['peak_bytes'] / GIB:.1f} GiB (set-up "
                       f"{p['setup_peak_bytes'] / GIB:.1f}, steady {p['steady_bytes'] / GIB:.1f}) > "
                       f"{HOST_MARGIN} x {avail / GIB:.1f} GiB available; not run", **plan, "pinned": p["pinned"]}


def one_row(args: argparse.Namespace, model: str, config: str, plan: dict) -> dict:
    """The row's worker (half the micro-batch once after a GPU OOM, where the time left allows)."""
    def launch(mb: int) -> dict:
        print(f"== {model} / {config}, micro-batch {mb}", flush=True)
        row = harness.worker_row(lambda result: worker_cmd(
            "benchmarks.offload", args, ("seq_len", "steps", "warmup", "seed"), models=model, configs=config,
            micro_batch=mb, budget_s=max(args.deadline.left() - 30, 10), result=result,
            no_pin_memory=not args.pin_memory), args.deadline.left(), model=model, config=config, micro_batch=mb)
        if "returncode" in row:
            row["why_not"] = "host OOM: killed by SIGKILL" if row["returncode"] in (-9, 137) else \
                f"worker exit {row['returncode']}"
        return row

    mb = args.micro_batch or MICRO_BATCH.get(model, 1)
    row = launch(mb)
    if row.get("gpu_oom") and mb > 1 and args.deadline.fits(EST_S.get(model, 300)):
        row = launch(mb // 2)
    # pinned: as the worker's DeepSpeed config said, or as predicted where no engine was built
    return {**row, **plan, "label": CONFIGS[config],
            "pinned": args.pin_memory if "ds_config" in row else plan["prediction"]["pinned"]}


def _row_order(row: dict) -> tuple[int, int]:
    """MODELS x CONFIGS order; a model outside MODELS (the smoke's tiny) last."""
    m = row["model"]
    return MODELS.index(m) if m in MODELS else len(MODELS), list(CONFIGS).index(row["config"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "out", "seq_len", "seed", worker=True, smoke="tiny model, seq 32, CPU is fine",
               steps=(3, "timed steps per row (cut short by the time budget)"),
               warmup=(2, "untimed steps before the steady-state measurement"),
               time_budget=(560.0, "seconds for all rows together"))
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--micro-batch", type=int, help=f"default per model: {MICRO_BATCH}")
    p.add_argument("--no-pin-memory", dest="pin_memory", action="store_false",
                   help='"pin_memory": false in offload_optimizer (default true)')
    p.add_argument("--budget-s", type=float, default=1e9, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = names_of(p, "models", args.models, SHAPES)
    args.configs = names_of(p, "configs", args.configs, CONFIGS)
    check_positive(p, args, ("micro_batch", "seq_len", "steps", "warmup"))
    return args


def meta(args: argparse.Namespace, avail: int) -> dict:
    """What this call measured with, beside its call (harness.this_call)."""
    return {"what": "ZeRO-2 + offload_optimizer cpu, 1 rank: host memory per parameter, GPU peak, tokens/s",
            "host_available_gb": avail / GIB, "pin_memory": args.pin_memory,
            "pin_backend": os.environ.get("DS_PIN_MEMORY_BACKEND", "torch"), "seq_len": args.seq_len,
            "wall_s": args.deadline.seconds - args.deadline.left(), "smoke": args.smoke}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        args.model, args.config = args.models[0], args.configs[0]
        return harness.worker_exit(lambda: worker(args))
    if args.smoke:
        args.models, args.seq_len, args.steps, args.warmup = ["tiny"], 32, 2, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.deadline, avail = harness.Deadline(args.time_budget), proc_bytes("MemAvailable", "/proc/meminfo")
    call, path, rows = harness.this_call(), out / "offload.json", []
    plans = {(m, c): host_plan(args, m, c, avail) for m in args.models for c in args.configs}

    def write(*_) -> None:   # the rows so far replace the file's of the same (model, config) and sequence length
        res = harness.into_file(path, rows, lambda r: (r["model"], r["config"]), meta(args, avail), call, ("seq_len",))
        res["rows"].sort(key=_row_order)
        if rows:
            harness.write_results(res, out, "offload")

    write()   # a file of another sequence length refused before the first row
    for job, plan in plans.items():
        if not plan["predicted_fits"]:
            rows.append(not_run(*job, plan))
    harness.run_waves([[job] for job, plan in plans.items() if plan["predicted_fits"]], args.deadline,
                      lambda _, job: rows.append(one_row(args, *job, plans[job])), write, " / ".join,
                      est=lambda job: min(EST_S.get(job[0], 300), 60), log=call)
    write()
    if not rows:
        return 1
    print(render("offload", out) + f"-> {path}")
    return 0 if all(r["fits"] or "predicted" in (r.get("why_not") or "") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
