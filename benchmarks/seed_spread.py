"""Seed spread: is coat's validation loss inside BF16's band (benchmarks/accuracy/verdicts.py)? One convergence
worker per (configuration, seed), up to --max-parallel at once on one device; calls merge into one seed_spread.json
(docs/benchmarks.md: the commands, the sections, the statistics).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks import convergence, harness
from benchmarks.accuracy import verdicts
from benchmarks.common import int_list, parser, read_json
from benchmarks.configs import CONFIGS, check_args
from benchmarks.convergence import SMOKE_CONFIGS, fmt, last_common_step
from benchmarks.render_tables import markdown

DEFAULT_CONFIGS = "bf16,coat_opt,coat_full,coat_full_bf16sr"
LONG_CONFIGS = "bf16,coat_full"
LONG_DATA_BYTES = 40_000_000        # ~10M tokens of transformers' source: the BPE builds in well under a minute
STOP_MARGIN_S, KILL_MARGIN_S = 30.0, 8.0   # before the budget ends: workers stop themselves, then are killed


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace, list[str], list[int]]:
    """This script's options, the worker recipe (convergence.py's defaults, adjusted), the configs, the seeds."""
    p = parser(__doc__, "out", time_budget=(3600.0, "seconds for the whole command"),
               steps=(None, "default: convergence.py's 2000 (the smoke's 4)"),
               smoke="tiny model, few steps, 2 configs x 2 seeds (CPU is fine)")
    p.add_argument("--configs", help=f"comma-separated, from {list(CONFIGS)} (default {DEFAULT_CONFIGS}; "
                                     f"with --long {LONG_CONFIGS})")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated integers")
    p.add_argument("--max-parallel", type=int, default=4, help="workers at once on the one device")
    p.add_argument("--long", action="store_true", help="seq 1024 x micro-batch 8 on --data: the long_data section")
    p.add_argument("--family", default="llama", choices=convergence.FAMILIES,
                   help="the 125M model's family; another than llama runs in its own section, named after it")
    p.add_argument("--data", help="with --long (default: the transformers package's source folder)")
    p.add_argument("--data-bytes", type=int, help=f"a --data folder's files up to this many bytes "
                                                  f"(--long default {LONG_DATA_BYTES:,})")
    args = p.parse_args(argv)
    args.configs = args.configs or (LONG_CONFIGS if args.long else SMOKE_CONFIGS if args.smoke else DEFAULT_CONFIGS)
    names = check_args(p, args, ("max_parallel", "steps"))
    seeds = int_list(p, "seeds", args.seeds)
    if args.long and args.family != "llama":
        p.error(f"--family={args.family!r} runs the default recipe; allowed with --long: 'llama'")
    if args.data and not (args.long or args.smoke):
        p.error("--data applies to --long only (the default section is convergence.py's own corpus)")
    return args, recipe_args(args), names, seeds[:2] if args.smoke else seeds


def recipe_args(args: argparse.Namespace) -> argparse.Namespace:
    """convergence.py's worker arguments: its defaults, the --long or --smoke changes, no Adam-state dump."""
    _, rec = convergence.parse_args([])
    rec.data, rec.data_bytes = args.data, args.data_bytes
    if args.smoke:
        convergence.smoke_recipe(rec)
        rec.steps, rec.eval_every = 4, 2
        if args.long:
            rec.seq_len, rec.micro_batch = 128, 2
    elif args.long:
        rec.seq_len, rec.micro_batch = 1024, 8          # 8192 tokens per step, as the default recipe
        if rec.data is None:
            import transformers
            rec.data = os.path.dirname(transformers.__file__)
        if rec.data_bytes is None and Path(rec.data).is_dir():
            rec.data_bytes = LONG_DATA_BYTES
    rec.steps, rec.family, rec.state_sample = args.steps or rec.steps, args.family, 0
    return rec


def entry(run: dict, call: int) -> dict:
    """What seed_spread.json keeps of one worker's result."""
    status = run.get("status", "")
    kind = "ok" if status == "ok" else "partial" if run.get("val") else "failed"
    keep = ("steps_done", "final_val_loss", "val", "tokens_per_s", "peak_mem_gb", "params", "coat_warnings",
            "exit_code")
    e = {"status": kind, "detail": status, "call": call, **{k: run.get(k) for k in keep}}
    if kind != "ok":
        e["log_tail"] = run.get("log_tail", "")
    return e


# --- Statistics -------------------------------------------------------------------------------------------------------
def config_stats(runs: dict[str, dict], step: int | None) -> dict:
    """One configuration's seeds at `step`: each one's final and best (lowest so far) loss, mean, std, min, max."""
    seeds = sorted((s for s, e in runs.items() if dict(e["val"] or []).get(step) is not None), key=int)
    final = [dict(runs[s]["val"])[step] for s in seeds]
    best = [min(v for st, v in runs[s]["val"] if st <= step) for s in seeds]
    (fm, fs), (bm, bs) = verdicts.mean_std(final), verdicts.mean_std(best)
    return {"seeds": [int(s) for s in seeds], "final": final, "best": best, "final_mean": fm, "final_std": fs,
            "best_mean": bm, "best_std": bs, "final_min": min(final, default=None),
            "final_max": max(final, default=None), "statuses": [runs[s]["status"] for s in seeds]}


def summarize(section: dict) -> None:
    """steps_compared, BF16's band (verdicts.band) and every configuration's statistics and gap, into `section`."""
    step = last_common_step(e["val"] for r in section["runs"].values() for e in r.values() if e["val"])
    stats = {n: config_stats(r, step) for n, r in section["runs"].items()}
    base = stats.get("bf16") or config_stats({}, step)   # no BF16 seeds: every figure None
    band = verdicts.band(base["final"]) if base["final"] else None
    for st in stats.values():
        mean = st["final_mean"]
        st["gap_rel_mean"] = verdicts.gap(mean, base["final_mean"])
        st["gap_rel_mean_best"] = verdicts.gap(st["best_mean"], base["best_mean"])
        within = st["within_bf16_spread"] = verdicts.inside(band, mean)
        st["outside_bf16_spread_rel"] = None if within is None else 0.0 if within else \
            min(abs(mean - band[k]) for k in ("low", "high")) / base["final_mean"]
    section.update(steps_compared=step, bf16_band=band, summary=stats)


# --- The JSON: merged with what --out already holds -------------------------------------------------------------------
def load_existing(path: Path, key: str, recipe: dict) -> dict:
    """The JSON in --out (or a fresh one); exits with one line when its `key` section ran another recipe."""
    res = read_json(path, {"calls": []})
    if res.get(key):
        harness.same_setting(f"{path}: its '{key}' section", res[key]["recipe"], recipe, "recipe",
                             "another --out, or the file moved away")
    res.setdefault(key, {"recipe": recipe, "runs": {}})
    return res


def merge(section: dict, done: dict[tuple[str, int], dict], call: int) -> None:
    """Each new result replaces its pair's old one where harness.further says so (no curve never replaces one)."""
    for (name, seed), run in done.items():
        new, runs = entry(run, call), section["runs"].setdefault(name, {})
        old = runs.get(str(seed))
        if old and not harness.further(new, old):
            print(f"{name} seed {seed}: this run ended {new['detail']}; keeping call {old['call']}'s result")
            continue
        runs[str(seed)] = new


# --- Table ------------------------------------------------------------------------------------------------------------
def table(res: dict, keys: list[str]) -> str:
    """Every section's statistics, a configuration a row."""
    rows = [[key, res[key]["steps_compared"], name, len(st["seeds"]), f"{fmt(st['final_mean'])} +- "
             f"{fmt(st['final_std'])}", f"{fmt(st['best_mean'])} +- {fmt(st['best_std'])}",
             fmt(st["gap_rel_mean"], "+.2%"), f"{st['within_bf16_spread']} ({', '.join(st['statuses'])})"]
            for key in keys for name, st in res[key]["summary"].items()]
    return markdown(["section", "compared at step", "config", "seeds", "final mean +- std", "best mean +- std", "gap",
                     "within BF16 spread"], rows)


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    args, rec, names, seeds = parse_args(argv)
    key = "long_data" if args.long else "default" if args.family == "llama" else args.family
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = convergence.load_tokens(rec, t0)
    recipe = {**convergence.recipe_facts(rec, tokens), "steps": rec.steps, "eval_every": rec.eval_every,
              "eval_batches": rec.eval_batches, "smoke": args.smoke}
    res = load_existing(out / "seed_spread.json", key, recipe)
    at_once = min(args.max_parallel, len(names) * len(seeds))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // at_once)))   # the cores shared
    pairs = [(n, s) for s in seeds for n in names]          # seed-major: a short budget still covers every config
    deadline = harness.Deadline(args.time_budget, STOP_MARGIN_S, KILL_MARGIN_S, start=t0)
    call = harness.this_call(section=key, configs=names, seeds=seeds, max_parallel=args.max_parallel,
                             omp_num_threads=os.environ["OMP_NUM_THREADS"], time_budget_s=args.time_budget)
    done = convergence.run_workers(rec, pairs, out, args.max_parallel, deadline, lambda n, s: f"{n}_seed{s}", call)
    res["calls"].append(call)
    merge(res[key], done, len(res["calls"]) - 1)
    keys = [k for k in ("default", "long_data", *convergence.FAMILIES) if k in res]
    for k in keys:
        summarize(res[k])
    res.update(harness.head(res["calls"]))
    res["note"] = ("per section: each (config, seed) run's validation curve; summary compares them all at "
                   "steps_compared; std is the sample std (n - 1); within_bf16_spread: the config's final mean "
                   f"lies in BF16's band ({verdicts.TARGETS['band']}); long_data keeps the "
                   "default recipe's tokens per step (seq 1024 x micro-batch 8 = 512 x 16)")
    path = harness.write_results(res, out, "seed_spread")
    print(table(res, keys) + f"\n-> {path}", flush=True)
    return 0 if done and all(r.get("status") == "ok" for r in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
