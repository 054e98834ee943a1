"""Accuracy at scale (issue 46): is coat "nearly lossless" beyond small runs? A ~350M Llama pretrained at seq 2048 on
203M tokens of the kernel corpus through the main job, ZeRO-2, with BF16 + FusedAdam and coat's presets exact,
lowest_memory and largest_model (3 seeds for BF16 and lowest_memory); then BF16's final model fine-tuned on perldoc
with each, validated before its first step and at the end. --recipe moe: a mixture of experts' pretraining (issue 60);
--recipe long: a 125M model's fine-tuning at 16K tokens with FP8 checkpoints and tiles (issue 61).

A case over benchmarks/harness.py: a run the deadline stops checkpoints and continues in a later call on the same
machine (--merge). docs/benchmarks.md, "Accuracy at scale", has the commands and what each run takes.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness, plot_utils
from benchmarks.accuracy import recipe as R, runs, verdicts
from benchmarks.common import RESULTS, ROOT, check_positive, int_list, names_of, now, read_json
from benchmarks.render_tables import render

NAME = "accuracy_scale"
PHASES = ("pretrain", "finetune", "all")
STOP_MARGIN_S = 45.0    # a run is told to stop this long before the deadline: its step, its checkpoint (~5 GB for
                        # BF16 at 350M), its summary, then this JSON and the device call's copy of it
KILL_MARGIN_S = 10.0    # and killed this long before it, whatever it is doing
MIN_PARTIAL_S = 120.0   # --partial-ok starts a run that will not end only where it gets this long before the signal
OUTLIERS_S = (90.0, 20.0)   # the outlier measure's predicted seconds (4 GPUs, smoke): load the export, 8 forwards
RECIPES = ("dense", "moe", "long")
EXPORT, MARK = "export_bf16", "coat_export.json"   # BF16's model the fine-tuning starts from, and what made it


@dataclass(frozen=True)
class Job:
    phase: str        # pretrain, outliers or finetune
    config: str
    seed: int

    @property
    def key(self) -> str:
        return "outliers" if self.phase == "outliers" else f"{self.phase}_{self.config}_s{self.seed}"


@dataclass
class Todo:
    """A job as this call will run it: from scratch or from its checkpoint, how many steps, its predicted seconds."""
    job: Job
    resume_from: int | None = None    # the checkpoint's step (None: from scratch)
    steps_left: int = 0
    why: str = ""
    est_s: float = 0.0
    beside: int = 0                   # jobs side by side with it


# --- Arguments --------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", help=f"comma-separated, from {list(R.CONFIGS)} (--recipe long: and "
                                     f"{list(R.LONG_CONFIGS)}; default: all)")
    p.add_argument("--seeds", default="0,1,2", help=f"comma-separated: each for {', '.join(R.MULTI_SEED)}, the first "
                                                    f"for the other presets (the fine-tuning and BF16's export: seed "
                                                    f"{R.EXPORT_SEED})")
    p.add_argument("--phase", default="all", choices=PHASES, help="all: BF16's export, the outliers and the "
                                                                  "fine-tuning first, then the other pretraining runs")
    p.add_argument("--num-gpus", type=int, help=f"GPUs of the main job, from {list(R.GPU_COUNTS)} (default 4; "
                                                f"--smoke 2 CPU ranks)")
    p.add_argument("--deadline", type=float, default=math.inf, help="seconds from start: a run starts where its "
                   f"predicted time fits; one still going {STOP_MARGIN_S:g} s before checkpoints, a later call goes on")
    p.add_argument("--partial-ok", action="store_true", help="start a run that will not end before the deadline too "
                                                             "(every call of a session but its last)")
    p.add_argument("--side-by-side", action="store_true", help="runs at once on disjoint GPUs of --host-gpus: "
                                                               "fine-tunings one GPU each, pretraining --num-gpus each")
    p.add_argument("--host-gpus", type=int, help="GPUs of the host that --side-by-side shares (default: --num-gpus)")
    p.add_argument("--jobs-per-gpu", type=int, default=1, help="side-by-side runs sharing each GPU (a small model "
                                                               "alone leaves the GPU idle between its kernels)")
    p.add_argument("--recipe", default="dense", choices=RECIPES, help="moe: pretraining only, the moe-90m "
                   "Qwen3-MoE of recipe.py's MOE_PRETRAIN, into accuracy_moe.json, with its router's balance; long: "
                   "BF16's 125M pretrained, then fine-tuned at 16K tokens (LONG_*), into accuracy_long.json")
    p.add_argument("--tokens-per-s", help="pretraining's assumed tokens/s on 4 GPUs, before a run has measured its "
                                          "own: one number, or config=N,... (default: benchmarks/accuracy/recipe.py)")
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE", help="earlier results files (missing ones "
                   "skipped): ended runs kept, partial ones continued from their checkpoints where they are")
    p.add_argument("--plan-only", action="store_true", help="print the schedule and its predicted minutes")
    p.add_argument("--smoke", action="store_true", help=f"tiny model, {R.SMOKE_PRETRAIN.steps} + "
                                                        f"{R.SMOKE_FINETUNE.steps} steps, the small corpora, CPU ranks")
    p.add_argument("--data-root", type=Path, default=ROOT / ".data" / "corpora",
                   help="the corpora's folders (python -m data.prepare_corpus [--from-carry] writes them)")
    p.add_argument("--run-root", type=Path, help="the runs' directories (default runs/accuracy_scale[_smoke])")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"where {NAME}.json and .png go")
    args = p.parse_args(argv)
    args.allowed = [*R.CONFIGS, *(R.LONG_CONFIGS if args.recipe == "long" else ())]
    args.configs = names_of(p, "configs", args.configs or ",".join(args.allowed), args.allowed)
    args.seeds = int_list(p, "seeds", args.seeds, low=0)
    args.num_gpus = args.num_gpus or (2 if args.smoke else 4)
    if args.num_gpus not in R.GPU_COUNTS:
        p.error(f"--num-gpus={args.num_gpus} is invalid; allowed: one of {list(R.GPU_COUNTS)} (they divide the "
                f"batches of {R.PRETRAIN.global_batch} and {R.FINETUNE.global_batch} samples)")
    check_positive(p, args, ("jobs_per_gpu",))
    args.host_gpus = args.host_gpus or args.num_gpus
    if args.host_gpus % args.num_gpus:
        p.error(f"--host-gpus={args.host_gpus} is invalid; allowed: a multiple of --num-gpus ({args.num_gpus})")
    args.rates = rates_flag(p, args.tokens_per_s)
    pick_recipe(p, args)
    return args


def pick_recipe(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--recipe's (and --smoke's) results name, run root, recipes and assumed speeds; p.error where a phase's samples
    a step do not divide over its jobs' GPUs."""
    args.name = NAME if args.recipe == "dense" else f"accuracy_{args.recipe}"
    args.run_root = args.run_root or ROOT / "runs" / (args.name + ("_smoke" if args.smoke else ""))
    args.recipes = {"pretrain": R.SMOKE_PRETRAIN if args.smoke else R.PRETRAIN,
                    "finetune": R.SMOKE_FINETUNE if args.smoke else R.FINETUNE}
    args.speeds = {"pretrain": R.SMOKE_SPEED if args.smoke else R.PRETRAIN_SPEED,
                   "finetune": R.SMOKE_SPEED if args.smoke else R.FINETUNE_SPEED}
    if args.recipe == "moe":   # pretraining alone: no export, outliers or fine-tuning
        args.phase = "pretrain"
        args.recipes["pretrain"] = R.SMOKE_MOE_PRETRAIN if args.smoke else R.MOE_PRETRAIN
        args.speeds["pretrain"] = R.SMOKE_SPEED if args.smoke else R.MOE_SPEED
    if args.recipe == "long":   # BF16's pretraining and export, then the fine-tuning at long context
        args.recipes = ({"pretrain": R.SMOKE_LONG_PRETRAIN, "finetune": R.SMOKE_LONG_FINETUNE} if args.smoke else
                        {"pretrain": R.LONG_PRETRAIN, "finetune": R.LONG_FINETUNE})
        args.speeds = args.speeds if args.smoke else R.LONG_SPEED
    for phase, r in args.recipes.items():   # the long recipe fine-tunes one sequence a step
        gpus = side_gpus(args, phase) if args.side_by_side else args.num_gpus
        if r.global_batch % gpus:
            p.error(f"--num-gpus={args.num_gpus} is invalid for --recipe {args.recipe}: its {phase} runs "
                    f"{r.global_batch} sample(s) a step on {gpus} GPUs; allowed: a count dividing {r.global_batch}"
                    + " (or --side-by-side: one GPU a fine-tuning)" * (phase == "finetune"))


def rates_flag(p: argparse.ArgumentParser, value: str | None) -> dict[str, float]:
    """--tokens-per-s as config -> tokens/s (one number: every config)."""
    if value is None:
        return {}
    try:
        out = ({n: float(value) for n in R.CONFIGS} if "=" not in value else
               {k.strip(): float(v) for k, v in (kv.split("=", 1) for kv in value.split(","))})
    except ValueError:
        out = {}
    if not out or any(k not in R.CONFIGS or not v > 0 for k, v in out.items()):
        p.error(f"--tokens-per-s={value!r} is invalid; allowed: a number > 0, or config=N,... with configs from "
                f"{list(R.CONFIGS)}")
    return out


# --- The results file: merged from earlier calls ----------------------------------------------------------------------
def recipe_facts(args: argparse.Namespace) -> dict:
    return {"smoke": args.smoke, **{phase: r.facts() for phase, r in args.recipes.items()}}


def merged(paths: list[str], recipe: dict) -> dict:
    """The runs, outlier measure and calls of earlier results files (harness.merged, calls_of); exits with one line
    where a file ran another recipe."""
    docs = harness.merge_files(paths, lambda doc: doc.get("recipe") or {}, recipe, "recipe",
                               "results of this recipe (benchmarks/accuracy/recipe.py; --smoke has its own)")
    key = lambda e: Job(e["phase"], e["config"], e["seed"]).key  # noqa: E731
    return {"runs": harness.merged(key, *(d.get("runs", {}).values() for d in docs)),
            "outliers": next((d["outliers"] for d in reversed(docs) if d.get("outliers")), None),
            "calls": harness.calls_of(docs)}


# --- The schedule -----------------------------------------------------------------------------------------------------
SOURCE = Job("pretrain", R.BASELINE, R.EXPORT_SEED)   # the run whose final model the fine-tuning starts from


def jobs(args: argparse.Namespace) -> list[Job]:
    """The selected jobs in order: with --phase all BF16's exported seed, the outliers and the fine-tuning first,
    then the other pretraining runs seed by seed (a short session covers every config). --recipe long: BF16's
    exported seed and the fine-tuning alone."""
    first, long = args.seeds[0], args.recipe == "long"
    multi = R.CONFIGS if args.recipe == "moe" else R.MULTI_SEED   # the MoE runs are small: every one over the seeds
    pre = [SOURCE] if long else [Job("pretrain", c, s) for s in args.seeds for c in args.configs
                                 if c in multi or s == first]
    after = ([] if long else [Job("outliers", R.BASELINE, R.EXPORT_SEED)]) + \
        [Job("finetune", c, R.EXPORT_SEED) for c in args.configs]
    if args.phase == "pretrain":
        return pre
    return [SOURCE, *after] + ([j for j in pre if j != SOURCE] if args.phase == "all" else [])


def export_id(args: argparse.Namespace) -> str | None:
    """What identifies BF16's exported model on this machine (when it was written), None where there is none."""
    mark = read_json(args.run_root / EXPORT / MARK)
    return mark and mark["written"]


def todo(args: argparse.Namespace, res: dict, job: Job) -> Todo | None:
    """How this call would run `job`, None: nothing to do. The fine-tunings compare runs from one export: one from
    another export runs again, and so does BF16's pretraining where they still need an export this machine lacks."""
    entry, run_dir = res["runs"].get(job.key), args.run_root / job.key
    current = export_id(args)
    if job.phase == "outliers":
        have = res.get("outliers")
        return None if have and (current is None or have.get("export_id") == current) else Todo(job, why="measure")
    stale = job.phase == "finetune" and entry and current and entry.get("export_id") != current
    status = (entry or {}).get("status")
    if status in harness.ENDED and not stale and not rerun_for_export(args, res, job):
        return None
    steps = args.recipes[job.phase].steps
    ckpt = runs.checkpoint_step(run_dir) if not stale else None
    if ckpt is not None and ckpt < steps:
        return Todo(job, ckpt, steps - ckpt, f"continue from step {ckpt}")
    why = ("again: made from another export" if stale else "again: the fine-tuning needs its export"
           if status in harness.ENDED else f"restart (its run directory is gone; {entry['steps_done']} steps logged)"
           if status == "partial" else "again (failed)" if entry else "from scratch")
    return Todo(job, None, steps, why)


def rerun_for_export(args: argparse.Namespace, res: dict, job: Job) -> bool:
    """BF16's exported pretraining must run again: the fine-tuning has runs to do and this machine has no export."""
    if job != SOURCE or args.phase == "pretrain" or export_id(args):
        return False
    return any((res["runs"].get(f.key) or {}).get("status") not in harness.ENDED
               for f in jobs(args) if f.phase == "finetune")


def measured_rate(res: dict, phase: str, config: str, gpus: int) -> float | None:
    """The median tokens/s of this phase and config's runs of 10+ steps; pretraining's on `gpus` GPUs, else per GPU
    times `gpus` (a guess: the micro-batch changes with the count)."""
    seen = [(e.get("gpus", 4), e["tokens_per_s"]) for e in res["runs"].values()   # no key: the first runs, 4 GPUs
            if e.get("phase") == phase and e.get("config") == config and e.get("tokens_per_s")
            and e.get("steps_done", 0) >= 10]
    rates = [r for _, r in seen]
    if phase == "pretrain":
        rates = [r for n, r in seen if n == gpus] or [r * gpus / n for n, r in seen]
    return statistics.median(rates) if rates else None


def measured_start(res: dict, phase: str) -> float | None:
    seen = [s["startup_s"] for e in res["runs"].values() if e.get("phase") == phase
            for s in e.get("segments", []) if s.get("startup_s")]
    return statistics.median(seen) if seen else None


def rate(args: argparse.Namespace, res: dict, phase: str, config: str) -> tuple[float, str]:
    """tokens/s over all ranks for a run of this phase and config, and where the figure comes from."""
    got = measured_rate(res, phase, config, args.num_gpus)
    if got:
        return got, "measured"
    given = args.rates.get(config) if phase == "pretrain" else None
    base = given or args.speeds[phase].tokens_per_s[config]
    return base * (1 if args.smoke else args.num_gpus / 4), "given" if given else "assumed"


def predict(args: argparse.Namespace, res: dict, t: Todo) -> float:
    """Predicted wall seconds: the start, the steps left, their evaluations and checkpoints (module recipe.py)."""
    job = t.job
    if job.phase == "outliers":
        return OUTLIERS_S[args.smoke]
    r, speed = args.recipes[job.phase], args.speeds[job.phase]
    tps, _ = rate(args, res, job.phase, job.config)
    evals = t.steps_left // r.eval_every + 1 + (job.phase == "finetune" and t.resume_from is None)
    saves = (t.steps_left // r.save_every if r.save_every else 0) + 1
    return ((measured_start(res, job.phase) or speed.start_s) + t.steps_left * r.tokens_per_step / tps
            + evals * r.eval_windows * r.seq_len / (R.EVAL_SPEEDUP * tps) + saves * speed.save_s)


def planned(args: argparse.Namespace, res: dict, these: list[Job]) -> list[Todo]:
    """`these` jobs as this call would run them now (todo's), each with its predicted seconds."""
    out = [t for t in (todo(args, res, job) for job in these) if t]
    for t in out:
        t.est_s = predict(args, res, t)
    return out


def schedule(args: argparse.Namespace, res: dict) -> list[Todo]:
    """What to run, in jobs()'s order but runs that continue from a checkpoint first: it lives on this machine only."""
    return sorted(planned(args, res, jobs(args)), key=lambda t: t.resume_from is None)


def side_gpus(args: argparse.Namespace, phase: str) -> int:
    """The GPUs of one side-by-side job of `phase`: one a fine-tuning, --num-gpus a pretraining run."""
    return 1 if phase == "finetune" else args.num_gpus


def shares_gpus(args: argparse.Namespace, phase: str) -> bool:
    """Whether jobs of `phase` share the host's GPUs (--side-by-side; the outlier measure always alone)."""
    return args.side_by_side and phase != "outliers"


def groups(args: argparse.Namespace, plan: list[Todo]) -> list[list[Todo]]:
    """The plan in groups (harness.pack): one job at a time, or consecutive jobs of one phase side by side."""
    joins = lambda group, t: shares_gpus(args, t.job.phase) and t.job.phase == group[0].job.phase  # noqa: E731
    return harness.pack(plan, args.host_gpus * args.jobs_per_gpu, lambda t: side_gpus(args, t.job.phase), joins,
                        in_order=True)


def plan_line(args: argparse.Namespace, res: dict, t: Todo) -> str:
    """A job in --plan-only's schedule: why it runs, its steps and tokens/s, its GPUs where side by side."""
    phase, per = t.job.phase, side_gpus(args, t.job.phase)
    tps, source = rate(args, res, phase, t.job.config) if phase != "outliers" else (0, "")
    return (f"{t.job.key}: {t.why}" + f", {t.steps_left:,} steps at {tps:,.0f} tokens/s ({source})" *
            (phase != "outliers") + f", {'one GPU' if per == 1 else f'{per} GPUs'}" * shares_gpus(args, phase))


# --- Running ----------------------------------------------------------------------------------------------------------
def check_data(args: argparse.Namespace) -> dict[str, int]:
    """Each corpus's train tokens (the phases this call runs); exits with one line where a corpus folder is missing."""
    out = {}
    for r in [args.recipes["pretrain"]] if args.phase == "pretrain" else args.recipes.values():
        meta = read_json(args.data_root / r.corpus / "meta.json")
        if meta is None:
            sys.exit(f"error: --data-root {args.data_root}: no {r.corpus}/meta.json; allowed: a folder that "
                     f"python -m data.prepare_corpus wrote (on the device: --from-carry, first)")
        out[r.corpus] = meta["train_tokens"]
    return out


def run_job(args: argparse.Namespace, res: dict, t: Todo, stop: harness.Deadline, call: dict, tokens: dict,
            where: str | None = None) -> None:
    """One job to its end or the deadline, on the first GPUs or the CUDA ids `where`; its entry (or the outlier
    measure) written into `res`."""
    job, run_dir, export_dir = t.job, args.run_root / t.job.key, args.run_root / EXPORT
    if job.phase == "outliers":
        return measure_outliers(args, res, stop, call)
    r = args.recipes[job.phase]
    if t.resume_from is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    source = job == SOURCE
    if source and t.resume_from is None:
        shutil.rmtree(export_dir, ignore_errors=True)
    gpus = args.num_gpus if where is None else len(where.split(","))
    cmd = runs.command(r, config_file(args, job.config, r), job.seed, gpus, run_dir, args.data_root,
                       model=export_dir if job.phase == "finetune" else None, export=export_dir if source else None,
                       resume=t.resume_from is not None,
                       devices=None if args.smoke else where)   # CPU ranks: no ids
    print(f"== {job.key}: {t.why} (~{t.est_s / 60:.1f} min)\n   {' '.join(cmd)}", flush=True)
    seg = runs.launch(cmd, run_dir, t.resume_from or 0, stop, job.key, r.steps)
    state = runs.read_run(run_dir, r, tokens.get(r.corpus))
    old = res["runs"].get(job.key) if t.resume_from is not None else None
    segments = (old or {}).get("segments", []) + [{"date": call["date"], "device": call["device"],
                                                   "command": " ".join(cmd), "from_step": t.resume_from or 0,
                                                   "to_step": state["steps_done"], "where": where,
                                                   "beside": t.beside, **seg}]
    entry = {"phase": job.phase, "config": job.config, "seed": job.seed, "label": R.LABELS[job.config],
             "gpus": gpus, "run_dir": str(run_dir), **state, "segments": segments,
             "wall_s": sum(s["wall_s"] for s in segments)}
    entry["status"] = status(entry, seg, run_dir, export_dir if source else None)
    if entry["status"] not in ("done", "partial"):
        entry["error"] = runs.failure(run_dir)
    if job.phase == "finetune":
        entry["export_id"] = export_id(args)
    if source and entry["status"] == "done":
        (export_dir / MARK).write_text(json.dumps({"source": job.key, "written": now()}))
    if entry["status"] in harness.ENDED:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)   # the curves are in log.jsonl; the disk is not
    res["runs"][job.key] = entry
    print(f"   {job.key}: {entry['status']} at step {entry['steps_done']}/{r.steps} in {seg['wall_s']:.0f} s"
          + (f": {entry['error'][-300:]}" if entry.get("error") else ""), flush=True)


def config_file(args: argparse.Namespace, name: str, r: R.Recipe) -> str:
    """The DeepSpeed config a run of `name` reads: a shipped file as it is, or a LONG_CONFIGS one written under
    --run-root (its preset's file with its activation keys; recipe.long_config)."""
    if name in R.CONFIGS:
        return R.CONFIGS[name]
    path = args.run_root / "configs" / f"{name}_seq{r.seq_len}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(R.long_config(name, r.seq_len), indent=2))
    return str(path)


def status(entry: dict, seg: dict, run_dir: Path, export: Path | None) -> str:
    """done (and exported, where it exports), partial (stopped by the deadline), diverged (the main job's
    non-finite-loss stop: a result), failed (run again)."""
    if entry.pop("finished") and (export is None or (export / "config.json").is_file()):
        return "done"
    if seg["signalled"] or seg["killed"]:
        return "partial"
    return "diverged" if "the loss became" in runs.failure(run_dir) else "failed"


def measure_outliers(args: argparse.Namespace, res: dict, stop: harness.Deadline, call: dict) -> None:
    """max |x| / RMS at BF16's exported model's decoder-layer inputs (accuracy/outliers.py, a process of its own)."""
    if export_id(args) is None:
        print("== outliers: no export of BF16's model on this machine yet; skipped", flush=True)
        return
    r = args.recipes["pretrain"]
    print(f"== outliers of {args.run_root / EXPORT}", flush=True)
    got = harness.worker_row(lambda out: [
        sys.executable, "-m", "benchmarks.accuracy.outliers", "--model", str(args.run_root / EXPORT), "--data",
        str(args.data_root / r.corpus), "--batches", str(R.OUTLIER_BATCHES), "--micro-batch",
        str(R.OUTLIER_MICRO_BATCH), "--seq-len", str(r.seq_len), "--out", str(out)],
        max(1.0, stop.kill_at - time.time()), env={"CUDA_VISIBLE_DEVICES": "0"})
    if "returncode" in got:
        print(f"   outliers failed (exit {got['returncode']}): {got['error']}", flush=True)
        return
    res["outliers"] = {**got, "export_id": export_id(args), "date": call["date"], "device": call["device"]}
    print(f"   max |x| / RMS up to {got['max_ratio']:.1f} (layer {got['max_ratio_layer']}), median "
          f"{got['median_ratio']:.1f}", flush=True)


# --- Verdicts and the file --------------------------------------------------------------------------------------------
def final_val(entry: dict, steps: int) -> float | None:
    return next((v for s, _, v in entry.get("val", []) if s == steps), None)


def judge(args: argparse.Namespace, res: dict) -> dict:
    """The targets' verdicts from the runs that ended (accuracy/verdicts.py); each pretraining run gets its spike."""
    done = [e for e in res["runs"].values() if e["status"] == "done"]
    finals: dict[str, dict[int, float]] = {n: {} for n in args.allowed}   # the recipe's order; none yet: skipped
    spikes: dict[str, dict[int, float]] = {n: {} for n in args.allowed}
    for e in (e for e in done if e["phase"] == "pretrain"):
        e["spike"] = verdicts.val_rise(e["val"])   # the largest rise of its validation loss (issue 57)
        finals[e["config"]][e["seed"]] = final_val(e, args.recipes["pretrain"].steps)
        spikes[e["config"]][e["seed"]] = e["spike"]["rise"]
    ft_runs = {e["config"]: e for e in done if e["phase"] == "finetune"}
    same = (ft_runs.get(R.BASELINE) or {}).get("export_id")   # fine-tunings of BF16's export only
    ft_runs = {n: e for n, e in ft_runs.items() if e.get("export_id") == same}
    routers = {n: {e["seed"]: e["router"] for e in done if e["config"] == n and "router" in e} for n in R.CONFIGS}
    ft = verdicts.finetune(*({n: final_val(e, step) for n, e in ft_runs.items()}
                             for step in (0, args.recipes["finetune"].steps)))
    router = verdicts.router(routers)   # a mixture of experts' (--recipe moe)
    return {"pretrain": verdicts.pretrain(finals, spikes), **({"router": router} if router else {}), "finetune": ft}


def result(args: argparse.Namespace, res: dict, calls: list[dict], tokens: dict) -> dict:
    """The file: its runs in the order of --phase all over every configuration, their verdicts."""
    every = jobs(argparse.Namespace(**{**vars(args), "configs": args.allowed, "phase": "all"}))
    order = {j.key: i for i, j in enumerate(every)}
    runs_sorted = dict(sorted(res["runs"].items(), key=lambda kv: order.get(kv[0], len(order))))
    return {"what": " ".join(__doc__.split("\n\n")[0].split()), **harness.head(calls),
            "recipe": recipe_facts(args), "train_tokens": tokens, "targets": verdicts.TARGETS,
            "verdicts": judge(args, res), "outliers": res.get("outliers"), "runs": runs_sorted}


def why_not(args: argparse.Namespace, group: list[Todo], est: float, stop: harness.Deadline) -> str | None:
    """Why this call does not start a group (None: it does): no export to fine-tune, or too little time (--partial-ok:
    less than MIN_PARTIAL_S before the signal)."""
    phase = group[0].job.phase
    if phase == "finetune" and export_id(args) is None:
        return "no export of BF16's model on this machine yet"
    partial = args.partial_ok and phase != "outliers" and stop.stop_at - time.time() >= MIN_PARTIAL_S
    return None if partial else stop.why_not(est)


def again(args: argparse.Namespace, res: dict, group: list[Todo]) -> list[Todo]:
    """A group as the runs before it left it (harness.run_waves): what is left of each job, its predicted time."""
    group = planned(args, res, [t.job for t in group])
    for t in group:
        t.beside = len(group) - 1
    return group


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    args = parse_args(argv)
    res = merged(args.merge, recipe_facts(args))
    plan = schedule(args, res)
    gpus = args.host_gpus if args.side_by_side else args.num_gpus
    print(harness.plan_text(groups(args, plan), lambda t: plan_line(args, res, t),
                            f"{gpus} {'CPU ranks' if args.smoke else 'GPUs'}"), flush=True)
    if args.plan_only:
        return 0
    tokens = check_data(args)
    args.out.mkdir(parents=True, exist_ok=True)
    args.run_root.mkdir(parents=True, exist_ok=True)
    call = harness.this_call(phase=args.phase, configs=args.configs, seeds=args.seeds, num_gpus=args.num_gpus,
                             deadline_s=args.deadline, partial_ok=args.partial_ok)
    calls, stop = [*res["calls"], call], harness.Deadline(args.deadline, STOP_MARGIN_S, KILL_MARGIN_S, start=t0)
    plot = plot_utils.plot_accuracy_scale if args.recipe == "long" else None   # the dense recipe's by its name
    write = lambda *_: harness.write_results(result(args, res, calls, tokens), args.out, args.name, plot)  # noqa: E731
    run = lambda ids, t: run_job(args, res, t, stop, call, tokens, ids if shares_gpus(args, t.job.phase) else None)  # noqa: E731
    harness.run_waves(groups(args, plan), stop, run, write, lambda t: t.job.key, lambda t: side_gpus(args, t.job.phase),
                      args.jobs_per_gpu, why_not=lambda g, est: why_not(args, g, est, stop),
                      again=lambda g: again(args, res, g), log=call)
    call["wall_s"] = time.time() - t0
    path = write()
    tables = [NAME, f"{NAME}_finetune"] if args.recipe == "dense" else [args.name]
    print(*(render(t, args.out) for t in tables), f"-> {path}", sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
