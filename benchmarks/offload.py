"""ZeRO-2 + ZeRO-Offload (optimizer on the host): host memory per parameter, GPU peak, tokens/s; one process per row.

    python -m benchmarks.offload --models llama-1b --out $OUT/offload              # 1 GPU; rows merge into offload.json
    python -m benchmarks.offload --smoke --out /tmp/offload_smoke                  # CPU, tiny model, < 60 s

A row predicted not to fit the host (`predict_host`) is skipped instead of taking the node down; rows are
written as they finish. docs/benchmarks.md says what a row reports, docs/notes_offload.md where every host
byte goes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import e2e
from benchmarks.common import (GIB, RESULTS, add_worker_args, check_positive, command, device_name, names_of, now,
                               read_json, replace_rows, run_worker, versions, worker_cmd,
                               write_results)
from benchmarks.render_tables import markdown, num
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


def offload_config(name: str, micro_batch: int, pin_memory: bool) -> dict:
    """e2e.py's configuration `name` under ZeRO-2 with the optimizer offloaded to the host. The BF16 row keeps
    "type": "AdamW", which DeepSpeed runs as DeepSpeedCPUAdam under Offload (on CPU too: no torch_adam)."""
    cfg = e2e.ds_config(name, micro_batch=micro_batch, zero_stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    return cfg


# --- Prediction: what DeepSpeed 0.19.8's ZeRO-2 Offload allocates on the host -----------------------------------------
def pinned_size(nbytes: int, pow2: bool) -> int:
    """Bytes a pinned block really takes: torch's pinned allocator rounds each block up to a power of two."""
    return 1 << (nbytes - 1).bit_length() if pow2 and nbytes > 0 else nbytes


def predict_host(group_numels: list[int], largest_param: int, config: str, pinned: bool, pow2: bool,
                 base: int = BASE_RSS) -> dict:
    """Host bytes (RSS) at DeepSpeed's engine set-up (its peak) and in steady training, per config.

    Set-up: per param group a master partition, a bf16 staging buffer and a gradient partition, each pinned
    through an unpinned copy of the same size (the transient), and a bf16 gradient buffer of the largest
    parameter. Master and gradient are fp32, except with bf16_sr: ZeRO builds them in bf16 from the start
    (DeepSpeed's bf16_master_weights_and_grads, set by coat_ds's engine hook), and the master then also
    serves as the staging buffer, whose own block is freed (master.py)."""
    pin = (lambda b: pinned_size(b, pow2)) if pinned else (lambda b: b)
    n = sum(group_numels)
    fp32 = sum(pin(4 * k) for k in group_numels)
    bf16 = sum(pin(2 * k) for k in group_numels)
    temp = pin(2 * largest_param)
    transient = 4 * max(group_numels) if pinned else 0
    setup_peak = base + fp32 + bf16 + temp + transient + fp32
    if config == "coat_full_bf16sr":
        setup_peak = base + 3 * bf16 + temp + transient // 2
    states = int(STATE_B[config] * n)
    held = (bf16 + bf16 + temp) if config == "coat_full_bf16sr" else (fp32 + bf16 + fp32 + temp)
    steady = base + held + states
    return {"setup_peak_bytes": setup_peak, "steady_bytes": steady, "peak_bytes": max(setup_peak, steady),
            "states_bytes": states, "base_bytes_assumed": base, "pinned": pinned, "pinned_pow2": pow2 and pinned}


def model_numels(model: str) -> tuple[list[int], int]:
    """(numel of each of the main job's param groups, largest parameter) from the model built on the meta device."""
    net = e2e.build_model(model, "meta", torch.bfloat16, seed=0)
    numels = [sum(p.numel() for p in g["params"]) for g in param_groups(net)]
    return numels, max(p.numel() for p in net.parameters())


def kib_field(path: str, key: str) -> int:
    """Bytes of a `key: N kB` line of a /proc file (0 if absent)."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_available() -> int:
    """MemAvailable of this host (what a worker may take before the kernel's OOM killer steps in)."""
    return kib_field("/proc/meminfo", "MemAvailable")


# --- Worker: one (model, config) row ----------------------------------------------------------------------------------
def rss_bytes() -> int:
    return kib_field("/proc/self/status", "VmRSS")


def peak_rss_bytes() -> int:
    """VmHWM: the peak RSS since the last reset_peak_rss (or since start)."""
    return kib_field("/proc/self/status", "VmHWM")


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def step_phases(w) -> dict:
    """One step's host RSS: before it, and the peaks of forward+backward and of the optimizer step (where the
    host-side transients of the CPU optimizer would show)."""
    x, y = w.rung_inputs(w.args.micro_batch)
    w.sync()
    out = {"before_gb": rss_bytes() / GIB}
    ok = reset_peak_rss()
    loss = w.train_lib.lm_loss(w.engine, x, y)
    w.engine.backward(loss)
    w.sync()
    out["forward_backward_peak_gb"] = peak_rss_bytes() / GIB if ok else None
    out["after_backward_gb"] = rss_bytes() / GIB
    ok = reset_peak_rss()
    w.engine.step()
    w.sync()
    out["optimizer_step_peak_gb"] = peak_rss_bytes() / GIB if ok else None
    out["after_step_gb"] = rss_bytes() / GIB
    return out


def _is_pinned(t) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:   # a CPU-only torch cannot ask
        return False


def host_accounting(engine, n_params: int) -> dict:
    """Every host tensor the ZeRO optimizer and its base optimizer hold, by category; each storage counted once,
    in the first category that names it (bf16_sr: the staging buffer *is* the master, so it counts as master).
    `other` is whatever else the ZeRO optimizer keeps on the host (with DeepSpeed's CPU accelerator the device
    is the host: then it also holds the model's flat weights and the reduction buckets)."""
    zo, base = engine.optimizer, e2e.base_optimizer(engine)
    masters = [p for g in base.param_groups for p in g["params"]]
    cats = [("master", masters),
            ("optimizer_states", [t for st in base.state.values() for t in e2e._tensors(st)]),
            ("master_grads", [p.grad for p in masters]),
            ("bf16_staging", list(getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", []))),
            ("grad_staging", [getattr(zo, "temp_grad_buffer_for_cpu_offload", None)]),
            ("accumulated_grads", list(e2e._tensors(getattr(zo, "accumulated_grads_in_cpu", {})))),
            ("other", [t for v in vars(zo).values() for t in e2e._tensors(v)])]
    counter, out = e2e.StorageCounter(), {}
    for name, tensors in cats:
        b = counter.add(t for t in tensors if t is not None and t.device.type == "cpu")
        pinned = [t.untyped_storage().nbytes() for t in counter.new if _is_pinned(t)]
        out[name] = {"bytes": b, "per_param": b / n_params, "pinned_bytes": sum(pinned),
                     "pinned_rounded_bytes": sum(pinned_size(x, True) for x in pinned)}
    named = [k for k in out if k != "other"]
    total = sum(out[k]["bytes"] for k in named)
    return {"categories": out, "host_total_bytes": total, "host_total_bytes_per_param": total / n_params,
            "host_optimizer_bytes": out["master"]["bytes"] + out["optimizer_states"]["bytes"],
            "host_optimizer_bytes_per_param": (out["master"]["bytes"] + out["optimizer_states"]["bytes"]) / n_params}


class OffloadWorker(e2e.Worker):
    """e2e's worker with the offload config; records RSS at each stage of its life."""

    def setup_engine(self):
        args = self.args
        self.rss = {"start": rss_bytes()}
        net = self.model()
        self.rss["model_built"] = rss_bytes()
        cfg = offload_config(args.config, args.micro_batch, args.pin_memory)
        cfg.pop("_source")
        engine = self.train_lib.initialize(net, cfg)
        engine.train()
        self.rss["engine_built"] = rss_bytes()
        self.rss["engine_built_peak"] = peak_rss_bytes()
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
    w.rss["first_step"] = rss_bytes()
    for _ in range(args.warmup - 1):
        w.one_step(x, y)
    w.sync()
    if w.on_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0, steps = time.perf_counter(), 0
    while steps < args.steps and (steps == 0 or time.time() - e2e._T0 < args.budget_s):
        loss = w.one_step(x, y)
        steps += 1
    w.sync()
    dt = time.perf_counter() - t0
    acc = host_accounting(w.engine, w.n_params)
    peak = peak_rss_bytes()   # before step_phases starts new peak windows
    phases = step_phases(w)
    peak = max([peak] + [v * GIB for k, v in phases.items() if k.endswith("peak_gb") and v is not None])
    return {"model": args.model, "config": args.config, "label": CONFIGS[args.config], "params": w.n_params,
            "micro_batch": b, "seq_len": args.seq_len, "timed_steps": steps, "step_time_s": dt / steps,
            "tokens_per_s": b * args.seq_len * steps / dt, "loss": float(loss.detach().float()),
            "host_optimizer_bytes_per_param": acc["host_optimizer_bytes_per_param"],
            "host_rss_gb": rss_bytes() / GIB, "host_rss_peak_gb": peak / GIB,
            "host_rss_stages_gb": {k: v / GIB for k, v in w.rss.items()}, "host_rss_step_phases": phases,
            "gpu_peak_gb": torch.cuda.max_memory_allocated() / GIB if w.on_cuda else None,
            "gpu_peak_reserved_gb": torch.cuda.max_memory_reserved() / GIB if w.on_cuda else None,
            "pinned_allocator": pinned_stats(), "host_accounting": acc, "basic_optimizer":
            type(w.engine.basic_optimizer).__name__, "ds_config": w.ds_cfg, "fits": True, "why_not": None,
            "coat_warnings": w.wlog.messages, "device": device_name(), "versions": versions()}


def worker(args: argparse.Namespace) -> int:
    args.start_batch, args.zero_stage, args.grad_accum_dtype, args.mem_fraction = args.micro_batch, 2, None, 1.0
    w = OffloadWorker(args)
    try:
        row = run_row(w)
    except torch.OutOfMemoryError as e:
        row = {"model": args.model, "config": args.config, "micro_batch": args.micro_batch, "fits": False,
               "why_not": f"GPU OOM: {str(e).splitlines()[0]}", "gpu_oom": True,
               "host_rss_stages_gb": {k: v / GIB for k, v in w.rss.items()}}
    Path(args.result).write_text(json.dumps(row))
    return 0


# --- Parent: prediction, one worker per row, merge into offload.json --------------------------------------------------
def launch(args: argparse.Namespace, model: str, config: str, micro_batch: int, budget: float) -> dict:
    """One row's worker process -> its row (or why it has none)."""
    result = Path(args.out) / f"offload_{model}_{config}.row.json"
    result.unlink(missing_ok=True)
    cmd = worker_cmd("benchmarks.offload", args, ("seq_len", "steps", "warmup", "seed"), models=model,
                     configs=config, micro_batch=micro_batch, budget_s=max(budget - 30, 10), result=result)
    cmd += [] if args.pin_memory else ["--no-pin-memory"]
    print(f"== {model} / {config}, micro-batch {micro_batch}: {' '.join(cmd)}", flush=True)
    rc, tail = run_worker(cmd, budget)
    why = "host OOM: killed by SIGKILL" if rc in (-9, 137) else f"worker exit {rc}"
    return read_json(result) or {"model": model, "config": config, "micro_batch": micro_batch, "fits": False,
                                 "why_not": why, "error_tail": tail[-1500:]}


def plan_row(args: argparse.Namespace, model: str, config: str, avail: int) -> dict:
    """The predicted host memory of a row, and whether it is worth trying on this host."""
    groups, largest = model_numels(model)
    on_cuda = torch.cuda.is_available()
    pred = predict_host(groups, largest, config, pinned=args.pin_memory and on_cuda,
                        pow2=os.environ.get("DS_PIN_MEMORY_BACKEND", "torch") != "native",
                        base=BASE_RSS if on_cuda else 0)
    pred["per_param"] = {k: v / sum(groups) for k, v in pred.items() if k.endswith("_bytes")}
    fits = pred["peak_bytes"] <= HOST_MARGIN * avail or not on_cuda
    return {"prediction": pred, "host_available_bytes": avail, "params": sum(groups), "predicted_fits": fits}


def one_row(args: argparse.Namespace, model: str, config: str, avail: int, left: float) -> dict | None:
    """Prediction, then the worker (halving the micro-batch once after a GPU OOM); None: no time left."""
    plan = plan_row(args, model, config, avail)
    if not plan["predicted_fits"]:
        p = plan["prediction"]
        return {"model": model, "config": config, "label": CONFIGS[config], "params": plan["params"], "fits": False,
                "why_not": f"host OOM predicted: peak {p['peak_bytes'] / GIB:.1f} GiB (set-up "
                           f"{p['setup_peak_bytes'] / GIB:.1f}, steady {p['steady_bytes'] / GIB:.1f}) > "
                           f"{HOST_MARGIN} x {avail / GIB:.1f} GiB available; not run", **plan}
    est = EST_S.get(model, 300)
    if left < min(est, 60):
        return None
    mb = args.micro_batch or MICRO_BATCH.get(model, 1)
    row = launch(args, model, config, mb, left)
    left = args.time_budget - (time.time() - args.t0)
    if row.get("gpu_oom") and mb > 1 and left > est:
        row = launch(args, model, config, mb // 2, left)
    return {**row, **plan}


def _row_order(row: dict) -> tuple[int, int]:
    """MODELS x CONFIGS order; a model outside MODELS (the smoke's tiny) last."""
    models, configs = list(MODELS), list(CONFIGS)
    return (models.index(row["model"]) if row["model"] in models else len(models), configs.index(row["config"]))


def merge(old: dict, rows: list[dict], meta: dict) -> dict:
    """An offload.json (`old`) with these rows replacing its rows of the same (model, config), in MODELS x
    CONFIGS order, each saying whether it was pinned (rows of several invocations mix both)."""
    merged = sorted(replace_rows(old.get("rows", []), rows, lambda r: (r["model"], r["config"])), key=_row_order)
    for r in merged:
        r["pinned"] = pinned(r)
    return {**meta, "rows": merged, "invocations": old.get("invocations", []) + [meta]}


def merge_files(paths: list[Path], out: Path) -> int:
    """offload.json files of separate invocations (one GPU command each) -> one, later rows winning."""
    res = read_json(out / "offload.json", {})
    for path in paths:
        part = read_json(path, {})
        invocations = part.pop("invocations", [])
        res = merge(res, part.pop("rows"), part)
        res["invocations"] = res["invocations"][:-1] + invocations
    write_results(res, out, "offload")
    print(table(res["rows"]))
    return 0


def pinned(row: dict) -> bool | None:
    """Whether a row's host buffers were (or were predicted) pinned."""
    offload = ((row.get("ds_config") or {}).get("zero_optimization") or {}).get("offload_optimizer")
    return offload["pin_memory"] if offload else (row.get("prediction") or {}).get("pinned")


def table(rows: list[dict]) -> str:
    return markdown(["model", "config", "pinned", "fits", "micro-batch", "optimizer B/param", "host B/param",
                     "RSS GiB", "peak RSS GiB", "GPU GiB", "tokens/s", "why not"],
                    [[r["model"], r["config"], r["pinned"], r["fits"], r.get("micro_batch") or "-",
                      num(r.get("host_optimizer_bytes_per_param"), 2),
                      num((r.get("host_accounting") or {}).get("host_total_bytes_per_param"), 2),
                      num(r.get("host_rss_gb"), 2), num(r.get("host_rss_peak_gb"), 2), num(r.get("gpu_peak_gb"), 2),
                      num(r.get("tokens_per_s"), 0), r.get("why_not") or ""] for r in rows])


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(e2e.MODELS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--micro-batch", type=int, help=f"default per model: {MICRO_BATCH}")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (cut short by the time budget)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the steady-state measurement")
    p.add_argument("--no-pin-memory", dest="pin_memory", action="store_false",
                   help='"pin_memory": false in offload_optimizer (default true)')
    p.add_argument("--time-budget", type=float, default=560.0, help="seconds for all rows together")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true", help="tiny model, seq 32, CPU is fine")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--merge", nargs="+", metavar="JSON", help="no runs: merge these offload.json files into --out")
    add_worker_args(p)
    p.add_argument("--budget-s", type=float, default=1e9, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = names_of(p, "models", args.models, e2e.MODELS)
    args.configs = names_of(p, "configs", args.configs, CONFIGS)
    check_positive(p, args, ("micro_batch", "seq_len", "steps", "warmup"))
    return p, args


def main(argv: list[str] | None = None) -> int:
    _, args = parse_args(argv)
    if args.worker:
        args.model, args.config = args.models[0], args.configs[0]
        return worker(args)
    if args.smoke:
        args.models, args.seq_len, args.steps, args.warmup = ["tiny"], 32, 2, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge_files([Path(m) for m in args.merge], out)
    args.t0, avail, rows, before = time.time(), host_available(), [], read_json(out / "offload.json", {})
    for model in args.models:
        for config in args.configs:
            row = one_row(args, model, config, avail, args.time_budget - (time.time() - args.t0))
            if row is None:
                print(f"== {model} / {config}: skipped, time budget spent", flush=True)
                continue
            rows.append(row)
            res = merge(before, rows, meta(args, rows, avail))
            write_results(res, out, "offload")
    if not rows:
        return 1
    print(table(res["rows"]))
    print(f"-> {out / 'offload.json'}")
    return 0 if all(r["fits"] or "predicted" in (r.get("why_not") or "") for r in rows) else 1


def meta(args: argparse.Namespace, rows: list[dict], avail: int) -> dict:
    """How the rows were measured. Device and versions come from a worker (asking CUDA here would put a context
    on the GPU beside the workers)."""
    ran = next((r for r in reversed(rows) if r.get("device")), None)
    return {"what": "ZeRO-2 + offload_optimizer cpu, 1 rank: host memory per parameter, GPU peak, tokens/s",
            "device": ran["device"] if ran else device_name(), "versions": ran["versions"] if ran else
            versions(), "host_available_gb": avail / GIB, "pin_memory": args.pin_memory,
            "pin_backend": os.environ.get("DS_PIN_MEMORY_BACKEND", "torch"), "seq_len": args.seq_len,
            "command": command(), "date": now(), "wall_s": time.time() - args.t0, "smoke": args.smoke}


if __name__ == "__main__":
    sys.exit(main())
