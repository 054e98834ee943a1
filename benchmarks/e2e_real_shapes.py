"""Today's model shapes on one GPU, no offload (issue 30): the largest micro-batch and its tokens/s.

Each case merges into e2e_real_shapes.json under its name; `--configs` re-runs some of its configurations and keeps
the others' rows (docs/benchmarks.md has the commands)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks import e2e
from benchmarks.common import check_positive, parser, provenance, read_json, row_provenance
from benchmarks.configs import MODELS, check_args
from benchmarks.harness import merged, write_results
from benchmarks.render_tables import markdown, num

NAME = "e2e_real_shapes"
# target: the lowest-memory preset's largest micro-batch (issue 30: 2; issue 34, with per-parameter gradients: 6
# at 8B, and >= 1.3x torchao float8 + AdamWFp8's tokens/s at its largest)
# issue 36, gradient release: 13B at micro-batch >= 2 on one H100 (`coat`: the row the target is read from);
# issue 37: Qwen3 and Gemma 3 beside BF16 and torchao (targets: the planner's micro-batch for the preset)
PEERS_AND_COAT = "bf16,lowest_memory,torchao_fp8"
CASES = {
    "llama3.1-8b": dict(model="llama3.1-8b", seq_len=4096, configs=PEERS_AND_COAT, gpu="one 80 GB H100", target=6),
    "llama2-13b": dict(model="llama2-13b", seq_len=4096, configs="lowest_memory", gpu="one H200 (141 GB)", target=2),
    "llama2-13b-h100": dict(model="llama2-13b", seq_len=4096, configs="largest_model", gpu="one 80 GB H100",
                            target=2, coat="largest_model"),
    "qwen3-8b": dict(model="qwen3-8b", seq_len=4096, configs=PEERS_AND_COAT, gpu="one 80 GB H100", target=4),
    "gemma3-4b": dict(model="gemma3-4b", seq_len=4096, configs=PEERS_AND_COAT, gpu="one 80 GB H100", target=4),
    "tiny": dict(model="tiny", seq_len=32, configs="bf16,lowest_memory", gpu="any (smoke)", target=2),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "out", steps=(3, "timed steps per micro-batch size"),
               time_budget=(480.0, "seconds for the case's configurations"),
               smoke="the tiny case, one step per size (CPU is fine)")
    p.add_argument("--case", choices=list(CASES), default="llama3.1-8b")
    p.add_argument("--configs", help="comma-separated e2e.py configurations (default: the case's); the case's "
                   "other configurations keep their earlier rows")
    p.add_argument("--start-batch", type=int, default=1, help="the micro-batch each ladder starts at")
    p.add_argument("--max-batch", type=int, default=256, help="the largest micro-batch the ladders try")
    p.add_argument("--max-rungs", type=int, default=4, help="micro-batch sizes tried per configuration")
    args = p.parse_args(argv)
    if args.smoke:
        args.case, args.steps, args.max_rungs = "tiny", 1, 2
    check_positive(p, args, ("max_rungs", "steps", "start_batch", "max_batch"))
    return args


def worker_args(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """e2e.py's options for this case, and its configuration names (checked)."""
    case = CASES[args.case]
    argv = ["--model", case["model"], "--seq-len", str(case["seq_len"]), "--configs", args.configs or case["configs"],
            "--equal-batch", str(args.start_batch), "--max-batch", str(2 if args.smoke else args.max_batch),
            "--max-rungs", str(args.max_rungs), "--steps", str(args.steps), "--warmup", str(0 if args.smoke else 1),
            "--time-budget", str(args.time_budget), "--out", args.out]
    p, eargs = e2e.parse_args(argv)
    return eargs, check_args(p, eargs, ())


def summary(row: dict) -> dict:
    """What the case's table shows of one configuration."""
    best = row.get("max_batch") or {}
    return {**{k: row.get(k) for k in ("name", "label", "max_micro_batch")},
            **{k: best.get(k) for k in ("exact", "tokens_per_s", "peak_reserved_gb", "peak_alloc_gb")},
            **{k: row.get(k) for k in ("needed_gb_at_1", "chunked_loss")}}


def case_result(args: argparse.Namespace, eargs: argparse.Namespace, rows: list[dict], t0: float) -> dict:
    case = CASES[args.case]
    coat_row = case.get("coat", "lowest_memory")
    coat, bf16, peer = (next((r for r in rows if r["name"] == n), None) for n in (coat_row, "bf16", "torchao_fp8"))
    mb = coat and coat.get("max_micro_batch")
    bf16_mb = bf16 and bf16.get("max_micro_batch")
    best = lambda row: (row.get("max_batch") or {}).get("tokens_per_s") if row else None  # noqa: E731
    return {"case": args.case, "target_gpu": case["gpu"], **provenance(), "model": case["model"],
            "params": next((r["params"] for r in rows if r.get("params")), None), "shape": MODELS[case["model"]],
            "seq_len": case["seq_len"], "target_micro_batch": case["target"],
            "meets_target": None if mb is None else mb >= case["target"],
            "coat_row": coat_row,
            "speedup_vs_torchao_at_largest": e2e.ratio(best(coat), best(peer)),
            "speedup_vs_bf16_at_largest": e2e.ratio(best(coat), best(bf16)),
            "bf16_fits_at_1": None if bf16_mb is None else bf16_mb >= 1,
            "summary": [summary(r) for r in rows], "fit_rule": f"peak reserved <= {eargs.mem_fraction} x device memory",
            "configs": rows, "wall_s": time.time() - t0, "smoke": args.smoke}


def with_provenance(cases: dict) -> dict:
    """The file: its cases, and at the top where, when and how each was measured (cases run on different GPUs)."""
    per = lambda key: {name: c[key] for name, c in cases.items()}  # noqa: E731
    return {"what": __doc__.split("\n")[0], "device": per("device"), "date": max(c["date"] for c in cases.values()),
            "command": per("command"), "versions": per("versions"), "cases": cases}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    eargs, names = worker_args(args)
    out = Path(args.out)
    t0 = time.time()
    rows = e2e.run_configs(eargs, names, out, f"{NAME}_{args.case}")
    for r in rows:
        r["measured"] = row_provenance()
    cases = read_json(out / f"{NAME}.json", {}).get("cases", {})
    rows = list(merged(lambda r: r["name"], cases.get(args.case, {}).get("configs", []), rows).values())
    res = case_result(args, eargs, rows, t0)
    path = write_results(with_provenance({**cases, args.case: res}), out, NAME)
    print(markdown(["case", "configuration", "largest micro-batch", "tokens/s there", "needs at 1 (GiB, >=)"],
                   [[args.case, s["name"], s["max_micro_batch"], num(s["tokens_per_s"], 0), num(s["needed_gb_at_1"])]
                    for s in res["summary"]]))
    print(f"meets target ({res['coat_row']} micro-batch >= {res['target_micro_batch']}): {res['meets_target']}; "
          f"tokens/s at the largest against torchao's: {res['speedup_vs_torchao_at_largest']}  ->  {path}")
    return 0 if all(r["equal_batch"] or r.get("max_micro_batch") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
