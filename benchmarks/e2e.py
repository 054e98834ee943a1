"""End-to-end memory and speed: BF16 + FusedAdam vs coat_ds optimizer-only vs coat_ds full, one worker process each
(benchmarks/worker.py: a DeepSpeed engine never gives its memory back); e2e_real_shapes and e2e_scaling run their
rows through it. docs/benchmarks.md has the commands, the search, the memory breakdown and e2e.json's fields."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.common import GIB, parse_cores, parser, provenance, read_log, worker_cmd
from benchmarks.configs import LABELS, MODELS, ZERO_SET_KEYS, check_args, check_bind_cores, parse_zero_set, shape_of
from benchmarks.harness import run_worker, worker_exit, write_results

E2E_CONFIGS = "bf16,coat_opt,coat_full,coat_full_bf16sr"   # the default (round to nearest is for convergence)
TARGETS = {"memory_reduction": 1.54, "speedup_at_max_batch": 1.43}   # COAT's paper, Llama-2-7B


def launch(args: argparse.Namespace, name: str, result: Path, start: int, known_fail: int | None,
           budget: float) -> tuple[int, str]:
    """One worker (the launcher's when N > 1) -> its exit code and output's tail; it stops climbing at `budget - 20`
    s and is killed at `budget + 30`."""
    devices = getattr(args, "devices", None)   # CUDA ids ("2,3"): workers side by side (e2e_scaling); several go to
    # the launcher's --include alone (beside CUDA_VISIBLE_DEVICES it would count only those GPUs)
    cores = f"0-{(os.cpu_count() or 1) - 1}" if args.bind_cores == "all" else args.bind_cores   # None: unbound
    cmd = worker_cmd("benchmarks.e2e", args, ("model", "seq_len", "max_batch", "steps", "warmup", "mem_fraction",
                     "seed", "max_rungs", "zero_stage", "profile_batch", "profile", "then_batch", "layers",
                     "memory_trace", "zero_set"),
                     args.num_gpus, devices, cores, config=name, start_batch=start, known_fail=known_fail,
                     budget_s=max(budget - 20, 10), result=result)
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    env = {"CUDA_VISIBLE_DEVICES": devices} if devices and args.num_gpus == 1 else {}
    if cores and args.num_gpus == 1:   # as DeepSpeed's launcher sets it for a bound rank
        env["OMP_NUM_THREADS"] = str(len(parse_cores(cores)))
    return run_worker(cmd, budget + 30, echo=lambda line: args.verbose or line.startswith("[") or "rror" in line,
                      env=env or None)


# what a row keeps of the rung at the equal micro-batch and of the largest that fit
RUNG_FIELDS = ("micro_batch", "peak_alloc_gb", "peak_reserved_gb", "tokens_per_s", "step_time_s")


def summarize_config(name: str, records: list[dict], equal_batch: int, errors: list[str]) -> dict:
    setup = next((r for r in records if r["kind"] == "setup"), {})
    rungs = [r for r in records if r["kind"] == "rung"]
    ooms = [r["micro_batch"] for r in records if r["kind"] == "oom"]
    warns = sorted({w for r in records if r["kind"] == "done" for w in r.get("coat_warnings", [])})
    eq = next((r for r in rungs if r["micro_batch"] == equal_batch), None)
    best = max((r for r in rungs if r["fits"]), key=lambda r: r["micro_batch"], default=None)
    failing = sorted([r["micro_batch"] for r in rungs if not r["fits"]] + ooms)
    row = {"name": name, "label": LABELS[name],
           **{k: setup.get(k) for k in ("config_source", "ds_config", "params", "setup_s", "chunked_loss",
                                        "built_partitioned", "cores", "omp_threads")},
           "equal_batch": None if eq is None else {k: eq[k] for k in RUNG_FIELDS},
           "breakdown": None, "max_batch": None,
           "smallest_failing_batch": failing[0] if failing else None,
           "rungs": [{k: v for k, v in r.items() if k not in ("kind", "breakdown")} for r in rungs],
           "profile": next((r for r in records if r["kind"] == "profile"), None),
           "coat_warnings": warns, "errors": errors}
    first = next((r for r in rungs if "breakdown" in r), None)
    if first is not None:
        bd = dict(first["breakdown"])
        if "weights_gb" in bd:   # a peer's breakdown has the allocator's view only
            known = bd["weights_gb"] + bd["optimizer_state_gb"] + bd["grads_gb"] + bd["activations_gb"]
            bd["other_gb"] = first["peak_alloc_gb"] - known   # transients at the peak: logits, temporaries
        bd["at_micro_batch"] = first["micro_batch"]
        row["breakdown"] = bd
    if best is not None:
        row["max_batch"] = {k: best[k] for k in RUNG_FIELDS}
        row["max_batch"]["exact"] = bool(failing and failing[0] == best["micro_batch"] + 1)
    row.update(max_micro_batch(records, best))
    return row


def max_micro_batch(records: list[dict], best: dict | None) -> dict:
    """max_micro_batch (0: not even 1 fits) and then what 1 needed: the OOM message's, or a step's peak reserved."""
    if best is not None:
        return {"max_micro_batch": best["micro_batch"]}
    one = [r for r in records if r.get("micro_batch") == 1 and r["kind"] in ("oom", "rung")]
    if not one:   # nothing was tried at 1 (the worker failed otherwise): unknown, not 0
        return {"max_micro_batch": None}
    r = one[-1]
    if r["kind"] == "rung":
        return {"max_micro_batch": 0, "needed_gb_at_1": r["peak_reserved_gb"], "needed_from": "peak reserved"}
    return {"max_micro_batch": 0, "needed_gb_at_1": r.get("needed_gb"), "oom_phase": r.get("phase"),
            "needed_from": "OOM message: allocated by PyTorch + tried to allocate", "oom_error": r["error"]}


def ratio(a, b):
    return a / b if a and b else None


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = parser(__doc__, "out", "seq_len", "seed", "mem_fraction", "verbose", worker=True,
               steps=(3, "timed steps per micro-batch size"),
               warmup=(1, "untimed steps per micro-batch size (the first size: 4 more)"),
               time_budget=(420.0, "seconds for all configurations together"),
               smoke="tiny model, few steps (CPU is fine)")
    p.add_argument("--model", default="llama-1b", choices=list(MODELS))
    p.add_argument("--configs", default=E2E_CONFIGS, help=f"comma-separated, from {list(LABELS)}")
    p.add_argument("--num-gpus", type=int, default=1, help="world size (deepspeed launcher when > 1)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override the configs' ZeRO stage")
    p.add_argument("--zero-set", help="KEY=VALUE,... of zero_optimization for every config (buckets, overlap: "
                                      f"{', '.join(ZERO_SET_KEYS)}), e.g. reduce_bucket_size=2e8")
    p.add_argument("--bind-cores", help="bind each rank to cores of its own, as `deepspeed --bind_cores_to_rank "
                                        "--bind_core_list LIST` does (numactl): 'all' (the host's cores) or a "
                                        "core list, e.g. 0-31")
    p.add_argument("--equal-batch", type=int, default=1, help="micro-batch at which peak memory is compared")
    p.add_argument("--max-batch", type=int, default=256, help="largest micro-batch the search tries")
    p.add_argument("--max-rungs", type=int, default=7, help="micro-batch sizes tried per configuration")
    p.add_argument("--profile", action="store_true",
                   help="record one step's top kernels, top host-side calls and device syncs (at the largest batch)")
    p.add_argument("--profile-batch", type=int, help="profile at this micro-batch instead of the largest that fits")
    p.add_argument("--layers", type=int, help="the model's decoder layers instead of its shape's (a stand-in)")
    p.add_argument("--memory-trace", action="store_true",
                   help="rank 0's allocator trace over the first micro-batch's instrumented step: the blocks alive "
                        "at its peak by allocating line (benchmarks/memory_trace.py)")
    for hidden, kind, default in (("config", str, None), ("start_batch", int, 1), ("known_fail", int, None),
                                  ("then_batch", int, None), ("budget_s", float, 1e9)):
        p.add_argument(f"--{hidden.replace('_', '-')}", type=kind, default=default, help=argparse.SUPPRESS)
    return p, p.parse_args(argv)


def run_config(args: argparse.Namespace, name: str, result: Path, share: float, remaining) -> dict:
    """One configuration's worker (restarted once below the failing size after an OOM, in `remaining()` s) -> its
    summary row."""
    result.unlink(missing_ok=True)
    errors: list[str] = []
    rc, tail = launch(args, name, result, args.equal_batch, None, share)
    recs = read_log(result)
    if rc != 0:
        ooms = [r["micro_batch"] for r in recs if r["kind"] == "oom"]
        fit = [r["micro_batch"] for r in recs if r["kind"] == "rung" and r["fits"]]
        errors.append(f"worker exit {rc}" + (f" (OOM at micro-batch {ooms[-1]})" if ooms else f": {tail[-1500:]}"))
        left = remaining()
        if ooms and left > 90:        # restart once, below the failing size
            start = (max(fit) + ooms[-1]) // 2 if fit else ooms[-1] // 2
            if start >= 1 and start not in fit:
                rc2, tail2 = launch(args, name, result, start, ooms[-1], left)
                recs = read_log(result)
                if rc2 != 0:
                    errors.append(f"restart exit {rc2}: {tail2[-1500:]}")
    return summarize_config(name, recs, args.equal_batch, errors)


def run_configs(args: argparse.Namespace, names: list[str], out: Path, prefix: str) -> list[dict]:
    """One worker per configuration in turn, sharing args.time_budget -> their summary rows (records in `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    for i, name in enumerate(names):
        share = (args.time_budget - (time.time() - t0)) / (len(names) - i)
        remaining = lambda: args.time_budget - (time.time() - t0) - (len(names) - i - 1) * 60  # noqa: E731
        rows.append(run_config(args, name, out / f"{prefix}_{name}.jsonl", share, remaining))
    return rows


def headline(args: argparse.Namespace, rows: list[dict], t0: float) -> dict:
    """e2e.json: every configuration's ratios to BF16 (coat full's at the top), the rows, how they were measured."""
    by = {r["name"]: r for r in rows}
    at = lambda n, which, key: ((by.get(n) or {}).get(which) or {}).get(key)  # noqa: E731
    peak, tps, tps_eq = ("equal_batch", "peak_alloc_gb"), ("max_batch", "tokens_per_s"), ("equal_batch", "tokens_per_s")
    vs_bf16 = {n: {"memory_reduction": ratio(at("bf16", *peak), at(n, *peak)),
                   "speedup_at_max_batch": ratio(at(n, *tps), at("bf16", *tps)),
                   "speedup_at_equal_batch": ratio(at(n, *tps_eq), at("bf16", *tps_eq))} for n in by if n != "bf16"}
    full = {r["micro_batch"]: r["peak_alloc_gb"] for r in by.get("coat_full", {}).get("rungs", [])}
    common = {str(r["micro_batch"]): r["peak_alloc_gb"] / full[r["micro_batch"]]
              for r in by.get("bf16", {}).get("rungs", []) if r["micro_batch"] in full}
    setup, shape = rows[0], shape_of(args.model, args.layers)
    return {
        **provenance(), "model": args.model, "params": setup.get("params"), "shape": shape,
        "world_size": args.num_gpus, "zero_stage": args.zero_stage if args.zero_stage is not None else
        ((setup.get("ds_config") or {}).get("zero_optimization") or {}).get("stage"),
        "seq_len": args.seq_len, "equal_micro_batch": args.equal_batch,
        **{k: vs_bf16.get("coat_full", {}).get(k) for k in ("memory_reduction", "speedup_at_max_batch",
                                                             "speedup_at_equal_batch")},
        "vs_bf16": vs_bf16, "memory_reduction_by_batch": common,
        "max_micro_batch": {r["name"]: r.get("max_micro_batch") for r in rows},
        # a whole model's forward, through the engine: all it keeps for backward per token, hidden unit and layer
        "forward_kept_b_per_token_hidden_layer": {
            r["name"]: r["breakdown"]["alloc_forward_delta_gb"] * GIB / (
                r["breakdown"]["at_micro_batch"] * args.seq_len * shape["hidden_size"] * shape["num_hidden_layers"])
            for r in rows if r["breakdown"] and r["breakdown"].get("alloc_forward_delta_gb") is not None},
        "targets": TARGETS, "fit_rule": f"peak reserved <= {args.mem_fraction} x device memory",
        "configs": rows, "wall_s": time.time() - t0, "smoke": args.smoke,
    }


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.worker:
        from benchmarks.worker import worker   # DeepSpeed and the engine: the worker's alone
        return worker_exit(lambda: worker(args))
    if args.smoke:
        args.model, args.seq_len, args.steps, args.warmup = "tiny", 32, 1, 0
        args.max_batch, args.equal_batch, args.max_rungs = min(args.max_batch, 2), 1, 2
    names = check_args(p, args, ("seq_len", "equal_batch", "max_batch", "steps", "num_gpus", "max_rungs",
                                 "profile_batch"))
    if not 0 < args.mem_fraction <= 1:
        p.error(f"--mem-fraction={args.mem_fraction} is invalid; allowed: a float in (0, 1]")
    try:
        parse_zero_set(args.zero_set)
        check_bind_cores(args.bind_cores)
    except ValueError as e:
        p.error(str(e))

    out = Path(args.out)
    t0 = time.time()
    rows = run_configs(args, names, out, "e2e")
    res = headline(args, rows, t0)
    path = write_results(res, out, "e2e")
    f = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    print(f"memory reduction at micro-batch {args.equal_batch}: {f(res['memory_reduction'])} (target "
          f"{TARGETS['memory_reduction']}x); speedup at max batch: {f(res['speedup_at_max_batch'])} (target "
          f"{TARGETS['speedup_at_max_batch']}x)  ->  {path}")
    return 0 if all(r["equal_batch"] or r.get("max_micro_batch") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
