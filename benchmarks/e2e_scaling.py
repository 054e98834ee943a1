"""Scaling over the GPUs of one host (issues 44, 47): per-GPU tokens/s and peak of coat's presets against BF16 +
FusedAdam, Llama-3.1-8B and Llama-2-13B at seq 4096 on 1, 2, 4 (8) GPUs, ZeRO-2 and ZeRO-3.

Each (model, GPUs, ZeRO stage, preset) is an e2e.py worker, side by side in waves by importance (docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import e2e, harness
from benchmarks.common import (GIB, RESULTS, T0, check_positive, core_list, device_name, gpu_names, names_of,
                               parser, row_provenance)
from benchmarks.configs import LABELS, MODELS as SHAPES, PEERS, check_bind_cores, ds_config, parse_zero_set
from benchmarks.render_tables import render
from coat_ds import plan

NAME = "e2e_scaling"
MODELS, BIG = ("llama3.1-8b", "llama2-13b"), "llama3.1-70b"   # BIG: issue 47, 8 GPUs, ZeRO-3, built under zero.Init
SMOKE_MODELS, SMOKE_BIG = ("tiny",), "tiny-gqa"
ORDER = [*MODELS, BIG, *SMOKE_MODELS, SMOKE_BIG]
PRESETS = {"largest_model": {2: "largest_model", 3: "largest_model_z3"},
           "lowest_memory": {2: "lowest_memory", 3: "lowest_memory_z3"}, "bf16": {2: "bf16", 3: "bf16"}}
# issue 44: per-GPU tokens/s at N GPUs over 1 at the same micro-batch (issue 47: ZeRO-3 at 8 >= 0.90); coat's
# tokens/s over BF16's, each at its largest micro-batch, where BF16 fits
TARGETS = {"efficiency_zero2": 0.95, "efficiency_zero3": 0.90, "coat_over_bf16": 1.5}
START_S = (10.0, 30.0)   # a worker's start and exit outside its own clock: python -m (1 GPU), the launcher
PROFILE_STEPS, PROFILE_TRACE_S = 4, 30.0   # --profile: one step alone, two probed, one untimed; the trace read


@dataclass
class Run:
    """One row of the matrix: what the planner says of it and what its worker will try."""
    model: str
    world: int
    stage: int
    preset: str
    order: tuple = ()         # priority; its first three: the tier (preset, model, BF16 or not)
    planned: int = 0          # the planner's largest micro-batch (0: not even 1 fits)
    common: int = 0           # the micro-batch every GPU count of the model is compared at
    rungs: tuple = ()
    est_s: float = 0.0

    @property
    def key(self) -> tuple:
        return self.model, self.world, self.stage, self.preset

    @property
    def config(self) -> str:
        return PRESETS[self.preset][self.stage]


# --- The matrix, the planner's verdicts and the schedule --------------------------------------------------------------
def job(args: argparse.Namespace, model: str, config: str, stage: int, world: int) -> plan.Job:
    """The planner's job for configuration `config` of e2e.py, as its worker will run it (--zero-set applied)."""
    cfg = ds_config(config, micro_batch=1, zero_stage=stage, zero_set=args.zero_set)
    cfg.pop("_source")
    return plan.job_from_config(cfg, plan.shape_from_hf(SHAPES[model], model), args.seq, world)


def matrix(args: argparse.Namespace) -> list[Run]:
    """The selected rows by priority (issue 44): coat's largest-model preset on the first model, BF16, the next
    model, the lowest-memory preset; the big model (on the most GPUs only) first of all."""
    runs = []
    for model in args.models:
        big = model == args.big
        for world in args.gpus:
            for stage in args.stages:
                for preset in args.configs:
                    if big and (stage != 3 or preset == "lowest_memory" or world < max(args.gpus)):
                        continue
                    rank = -1 if big else args.all_models.index(model)
                    order = (preset == "lowest_memory", rank, preset == "bf16", -world, stage)
                    runs.append(Run(model, world, stage, preset, order))
    return sorted(runs, key=lambda r: r.order)


def common_batch(args: argparse.Namespace, model: str) -> int:
    """The planner's micro-batch that every coat preset of `model` fitting one GPU takes there (1 if none): where
    the efficiency compares N GPUs with one, the same in every call."""
    if args.common_batch:
        return args.common_batch
    fits = [plan.max_micro_batch(job(args, model, PRESETS[p][s], s, 1), args.memory)
            for p in ("largest_model", "lowest_memory") for s in (2, 3)]
    return min([min(f, args.max_batch) for f in fits if f] or [1])


def planned(args: argparse.Namespace, runs: list[Run], hist: dict) -> None:
    """Each run's planner verdict, its two rungs (common and largest, or largest and one above where those meet)
    and its predicted seconds."""
    common = {m: common_batch(args, m) for m in {r.model for r in runs}}
    for r in runs:
        r.planned = min(plan.max_micro_batch(job(args, r.model, r.config, r.stage, r.world), args.memory),
                        args.max_batch)
        r.common = c = common[r.model]
        r.rungs = () if not r.planned else (c, r.planned) if c < r.planned else (r.planned, r.planned + 1)
        r.est_s = estimate(r, hist, args)


def history(results: Path = RESULTS) -> dict:
    """From the committed e2e rows of 3B+ parameters: set-up seconds against parameters per GPU (least squares),
    tokens/s per GPU x parameters by kind (median)."""
    pts, speed = [], {"bf16": [], "coat": []}
    for path in sorted(results.glob("e2e*.json")):
        doc = json.loads(path.read_text())
        for run in (doc.get("cases") or {"": doc}).values():
            for c in run.get("configs", []):
                if (c.get("params") or 0) < 3e9 or not c.get("rungs") or c["name"] in PEERS:
                    continue
                world = run.get("world_size") or 1
                pts.append((c["params"] / world / 1e9, c["setup_s"]))
                tps = max(r["tokens_per_s"] for r in c["rungs"]) / world
                speed["bf16" if c["name"] == "bf16" else "coat"].append(tps * c["params"] / 1e9)
    slope, intercept = statistics.linear_regression(*zip(*pts))
    return {"setup": (intercept, slope), "speed": {k: statistics.median(v) for k, v in speed.items()}}


def estimate(r: Run, hist: dict, args: argparse.Namespace) -> float:
    """Predicted wall seconds of run `r`: start, set-up, its rungs' steps (the first: 4 warm-ups, a breakdown more)."""
    if not r.rungs:
        return 0.0
    params = plan.shape_from_hf(SHAPES[r.model], r.model).params / 1e9
    a, b = hist["setup"]
    step = params / hist["speed"]["bf16" if r.preset == "bf16" else "coat"] * args.seq   # s per sample
    steps = [args.warmup + args.steps + 5] + [args.warmup + args.steps] * (len(r.rungs) - 1)
    steps[0] += PROFILE_STEPS if args.profile else 0
    return START_S[r.world > 1] + a + b * params / r.world + step * sum(
        n * mb for n, mb in zip(steps, r.rungs)) + (PROFILE_TRACE_S if args.profile else 0)


def waves(runs: list[Run], gpus: int) -> list[list[Run]]:
    """Runs side by side by priority (harness.pack); one of a later tier joins a wave where it lengthens it by under
    a quarter of its own time."""
    joins = lambda wave, r: (r.order[:3] == wave[0].order[:3]  # noqa: E731
                             or r.est_s - max(w.est_s for w in wave) <= r.est_s / 4)
    return harness.pack([r for r in runs if r.rungs], gpus, lambda r: r.world, joins)


def describe(r: Run) -> str:
    """A row in --plan-only's schedule and the call's log."""
    return f"{r.model} x{r.world} ZeRO-{r.stage} {r.preset}"


# --- Running a wave ---------------------------------------------------------------------------------------------------
def worker_args(args: argparse.Namespace, r: Run, devs: str | None) -> argparse.Namespace:
    """e2e.py's options for run `r`: its two rungs, the timing, the GPUs it runs on."""
    _, eargs = e2e.parse_args(["--model", r.model, "--seq-len", str(args.seq), "--num-gpus", str(r.world),
                               "--zero-stage", str(r.stage), "--equal-batch", str(r.rungs[0]),
                               "--max-batch", str(max(r.rungs)), "--max-rungs", str(len(r.rungs)),
                               "--steps", str(args.steps), "--warmup", str(args.warmup)]
                              + (["--profile", "--profile-batch", str(r.rungs[0])] if args.profile else [])
                              + (["--zero-set", args.zero_set_text] if args.zero_set else []))
    eargs.then_batch, eargs.devices = r.rungs[-1], devs
    if args.bind_cores:   # the cores of its GPUs' share of the host: rows side by side never share a core
        eargs.bind_cores = core_list(devs, args.num_gpus) if devs else "all"
    return eargs


def run_one(args: argparse.Namespace, r: Run, devs: str | None, stop_at: float) -> dict:
    """One worker (no restart after an OOM: the wave's time is fixed), killed at `stop_at` or well past its predicted
    time -> its row."""
    tag = f"{r.model}_x{r.world}_z{r.stage}_{r.preset}"
    budget = min(900 if args.smoke else 2 * r.est_s + 60, stop_at - time.time()) - 30
    row = e2e.run_config(worker_args(args, r, devs), r.config, args.out / f"{NAME}_{tag}.jsonl", budget, lambda: 0)
    return measured(args, r, row)


def at(args: argparse.Namespace, r: Run, rung: dict | None) -> dict | None:
    """A rung per GPU, beside the planner's peak for it."""
    if rung is None:
        return None
    p = plan.plan(job(args, r.model, r.config, r.stage, r.world), rung["micro_batch"]).peak / GIB
    return {**{k: rung[k] for k in e2e.RUNG_FIELDS}, "tokens_per_s_per_gpu": rung["tokens_per_s"] / r.world,
            "planner_peak_gb": p, "planner_error": p / rung["peak_alloc_gb"] - 1}


def measured(args: argparse.Namespace, r: Run, row: dict) -> dict:
    """e2e's row of run `r` with what the tables read: its largest and common sizes per GPU, where it ran."""
    fits = [g for g in row["rungs"] if g["fits"]]
    best = max(fits, key=lambda g: g["micro_batch"], default=None)
    largest = at(args, r, best)
    if largest:
        largest["exact"] = bool((row.get("max_batch") or {}).get("exact"))
    return {**row, **identity(r), "rungs_planned": list(r.rungs), "common_micro_batch": r.common,
            "largest": largest, "common": at(args, r, next((g for g in fits if g["micro_batch"] == r.common), None)),
            "measured": row_provenance(args.device)}


def identity(r: Run) -> dict:
    return {"model": r.model, "world_size": r.world, "zero_stage": r.stage, "preset": r.preset,
            "planner_max_micro_batch": r.planned}


def verdict(args: argparse.Namespace, r: Run) -> dict:
    """A row the planner says does not fit at micro-batch 1: not run, its plan recorded."""
    p = plan.plan(job(args, r.model, r.config, r.stage, r.world), 1)
    return {"name": r.config, "label": LABELS[r.config], **identity(r), "max_micro_batch": None,
            "verdict": f"does not fit (planner: {p.peak / GIB:.1f} GiB + {p.reserve / GIB:.1f} reserve at micro-batch "
                       f"1 > {plan.USABLE:.0%} of {args.memory / GIB:.1f} GiB)", "planner_peak_gb_at_1": p.peak / GIB}


# --- The results file -------------------------------------------------------------------------------------------------
def key_of(row: dict) -> tuple:
    return row["model"], row["world_size"], row["zero_stage"], row["preset"]


def setting(src: dict) -> dict:
    """What makes rows of one key another configuration's (a file's or `vars(args)`): --zero-set, --bind-cores."""
    return {"zero_set": src.get("zero_set") or {}, "bind_cores": bool(src.get("bind_cores"))}


def merged_rows(paths: list[str], options: dict | None = None) -> tuple[dict, list[dict]]:
    """The rows (by key) and calls of earlier results files; one of another `setting` is refused."""
    docs = harness.merge_files(paths, setting, setting(options or {}))
    rows = harness.merged(key_of, *([c for case in d.get("cases", {}).values() for c in case["configs"]] for d in docs))
    return rows, harness.calls_of(docs)


def summary(rows: dict) -> list[dict]:
    """Per row: per-GPU tokens/s at its largest and common micro-batch over 1 GPU's (efficiency) and BF16's."""
    per_gpu = lambda row, which: ((row or {}).get(which) or {}).get("tokens_per_s_per_gpu")  # noqa: E731
    out = []
    for k, r in rows.items():
        one, bf16 = rows.get((k[0], 1, k[2], k[3])), rows.get((k[0], k[1], k[2], "bf16"))
        eff = e2e.ratio(per_gpu(r, "common"), per_gpu(one, "common"))
        out.append({**{f: r.get(f) for f in ("model", "world_size", "zero_stage", "preset", "label", "verdict",
                                             "planner_max_micro_batch", "max_micro_batch", "largest", "common")},
                    "efficiency_common": eff, "efficiency_largest": e2e.ratio(per_gpu(r, "largest"),
                                                                              per_gpu(one, "largest")),
                    "coat_over_bf16": None if k[3] == "bf16" else e2e.ratio(per_gpu(r, "largest"),
                                                                          per_gpu(bf16, "largest")),
                    "meets_efficiency": None if eff is None or k[1] == 1 or k[3] == "bf16" else
                    eff >= TARGETS[f"efficiency_zero{k[2]}"]})
    return sorted(out, key=lambda s: (ORDER.index(s["model"]), s["zero_stage"], [*PRESETS].index(s["preset"]),
                                      s["world_size"]))


def result(args: argparse.Namespace, rows: dict, calls: list[dict], log: dict) -> dict:
    """The file: rows grouped by (model, GPUs, stage) as e2e's runs (tests/test_plan.py reads them), the summary,
    the calls."""
    cases: dict[str, dict] = {}
    for k, r in sorted(rows.items()):
        case = cases.setdefault(f"{k[0]} x{k[1]} ZeRO-{k[2]}", {
            "model": k[0], "shape": SHAPES[k[0]], "seq_len": args.seq, "world_size": k[1], "zero_stage": k[2],
            "smoke": args.smoke, "device": None, "date": "", "configs": []})
        case["configs"].append(r)
        if r.get("measured") and r["measured"]["date"] > case["date"]:
            case.update(device=r["measured"]["device"], date=r["measured"]["date"])
    return {"what": " ".join(__doc__.split("\n\n")[0].split()), **harness.head(calls),
            "seq_len": args.seq, "gpu_memory_gb": args.memory / GIB, "zero_set": args.zero_set,
            "bind_cores": args.bind_cores,
            "timing": {"warmup": args.warmup, "timed_steps": args.steps, "first_rung_extra_warmup": 4},
            "fit_rule": "peak reserved <= 0.95 x device memory", "targets": TARGETS, "summary": summary(rows),
            **log, "cases": cases}


# --- The command ------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "out", steps=(3, "timed steps per micro-batch"),
               warmup=(1, "untimed steps per micro-batch (the first: 4 more)"),
               smoke="tiny models, seq 32, one step (CPU is fine)")
    p.add_argument("--num-gpus", type=int, default=4, help="GPUs of the host that the waves share")
    p.add_argument("--gpus", help="comma-separated GPU counts per run (default: 1, 2, 4 ... up to --num-gpus)")
    p.add_argument("--models", help=f"comma-separated, from {[*MODELS, BIG]} (default: the first two, {BIG} at 8)")
    p.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages, from 2, 3")
    p.add_argument("--configs", default="largest_model,bf16,lowest_memory", help=f"comma-separated, from {[*PRESETS]}")
    p.add_argument("--common-batch", type=int, help="the micro-batch all GPU counts are compared at (default: the "
                   "planner's largest that every coat preset of the model takes on the fewest GPUs)")
    p.add_argument("--max-batch", type=int, default=256, help="cap on the planner's largest micro-batch")
    p.add_argument("--deadline", type=float, default=float("inf"),
                   help="seconds from start: a wave predicted to end later is skipped, a worker killed at it")
    p.add_argument("--merge", nargs="+", default=[], help="earlier results files: their measured rows are kept and "
                   "not run again")
    p.add_argument("--rerun", action="store_true", help="run selected rows that --merge files have measured too")
    p.add_argument("--gpu-memory", help="GiB or a GPU name for the planner (default: GPU 0's name, else h100)")
    p.add_argument("--profile", action="store_true",
                   help="also profile each run at its first micro-batch (e2e.py --profile: the row's 'profile', "
                        "with each stream's busy time and backward's idle gaps)")
    p.add_argument("--zero-set", help="KEY=VALUE,... of zero_optimization for every row, planner included (e2e.py's "
                   "--zero-set; e.g. reduce_bucket_size=5e8): write it to a file of its own, --merge only its like")
    p.add_argument("--bind-cores", action="store_true", help="bind each row's ranks to its GPUs' share of the host's "
                   "cores (e2e.py --bind-cores: DeepSpeed's --bind_cores_to_rank)")
    p.add_argument("--plan-only", action="store_true", help="print the schedule and its predicted wall time")
    args = p.parse_args(argv)
    check_positive(p, args, ("num_gpus", "common_batch", "max_batch", "steps"))
    allowed = [str(1 << i) for i in range(args.num_gpus.bit_length())]   # the powers of two up to --num-gpus
    args.gpus = [int(g) for g in names_of(p, "gpus", args.gpus or ",".join(allowed), allowed)]
    args.stages = [int(s) for s in names_of(p, "stages", args.stages, ("2", "3"))]
    args.configs = names_of(p, "configs", args.configs, PRESETS)
    try:
        args.zero_set_text, args.zero_set = args.zero_set, parse_zero_set(args.zero_set)
        check_bind_cores("all" if args.bind_cores else None)
    except ValueError as e:
        p.error(str(e))
    args.all_models, args.big = (SMOKE_MODELS, SMOKE_BIG) if args.smoke else (MODELS, BIG)
    default = [*args.all_models, *([args.big] if max(args.gpus) >= 8 else [])]
    args.models = names_of(p, "models", args.models or ",".join(default), [*args.all_models, args.big])
    if args.smoke:
        args.seq, args.steps, args.warmup, args.max_batch = 32, 1, 0, 1
    else:
        args.seq = 4096
    args.gpu = next(iter(gpu_names(parent=True)), None) if torch.cuda.is_available() else None
    args.device = args.gpu or device_name("cpu")
    named = next((k for k in plan.GPUS if k.upper() in (args.gpu or "").upper()), "h100")
    args.memory, args.out = plan.gpu_memory(args.gpu_memory or named), Path(args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = matrix(args)
    planned(args, runs, history())
    rows, calls = merged_rows(args.merge, vars(args))
    todo = [r for r in runs if r.rungs and (args.rerun or not (rows.get(r.key) or {}).get("largest"))]
    sched = waves(todo, args.num_gpus)
    print(harness.plan_text(sched, lambda r: f"{describe(r)}: micro-batch {' then '.join(map(str, r.rungs))} "
                                             f"(planner's largest {r.planned})", f"{args.num_gpus} GPUs"),
          *(f"not run: {describe(r)}: the planner says micro-batch 1 does not fit" for r in runs if not r.rungs),
          sep="\n", flush=True)
    if args.plan_only:
        return 0
    if torch.cuda.is_available() and torch.cuda.device_count() < args.num_gpus:
        sys.exit(f"--num-gpus {args.num_gpus}: this host has {torch.cuda.device_count()} GPUs")
    rows.update({r.key: verdict(args, r) for r in runs if not r.rungs})
    args.out.mkdir(parents=True, exist_ok=True)
    call, deadline, log = harness.this_call(gpus=args.num_gpus), harness.Deadline(args.deadline, start=T0), {}
    write = lambda: harness.write_results(result(args, rows, [*calls, call] if log["ran"] else calls, log),  # noqa: E731
                                          args.out, NAME)
    on_gpu = torch.cuda.is_available()
    harness.run_waves(sched, deadline, lambda ids, r: run_one(args, r, ids if on_gpu else None, deadline.stop_at),
                      lambda wave, done: (rows.update({key_of(row): row for row in done}), write()), describe,
                      size=lambda r: r.world, log=log)
    print(render(NAME, args.out), f"-> {write()}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
