"""Two "nodes" of N GPUs through a hostfile, checkpointed, then the job resumed on one node of 2N (issue 44), as
docs/train.md "Two nodes, then one" tells a user to: do its losses go on where they stopped? Both "nodes" run here,
a launcher each; the two-node run is also the uninterrupted run the resumed one must follow (docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.common import GIB, ROOT, check_positive, free_port, launcher, parser, provenance, read_log, write_json
from benchmarks.render_tables import markdown

TIMINGS = ("tokens_per_s", "step_time_s", "peak_mem_gb")   # a train record's fields that no rerun repeats
SMOKE = {"model_size": "tiny", "seq_len": 64, "micro_batch": 2, "steps": 6, "save_at": 3, "gpus_per_node": 2,
         "config": "zero3_largest_model.json"}


def job(args: argparse.Namespace, run: Path) -> list[str]:
    """The main job's command after the launcher: the same on both nodes and when resumed."""
    return ["examples/train.py", "--deepspeed", f"ds_configs/{args.config}", "--model-size", args.model_size,
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--lr", str(args.lr),
            "--steps", str(args.steps), "--save-every", str(args.save_at), "--eval-every", "0",
            "--eval-batches", "2", "--save-dir", str(run), *(["--data", args.data] if args.data else [])]


def launch(cmds: list[list[str]], logs: list[Path], timeout: float) -> tuple[list[int], float]:
    """Run `cmds` side by side, each in a process group of its own with its output in its log -> (exit codes, 124
    where it was killed past `timeout`; wall seconds)."""
    t0 = time.time()
    ends = harness.side_by_side(lambda i, cmd: harness.run_process(cmd, kill_at=t0 + timeout, log=logs[i], cwd=ROOT),
                                cmds)
    return [124 if r["killed"] else r["exit_code"] for r in ends], time.time() - t0


def loss_of(record: dict) -> float:
    """A train record's loss or an eval record's validation loss."""
    return record.get("loss", record.get("val_loss"))


def compare(before: list[dict], after: list[dict]) -> dict:
    """The resumed steps against the two-node run's same steps: equal bit for bit, else the largest differences."""
    pairs = [(a, b) for a in before for b in after if a["kind"] == b["kind"] and a["step"] == b["step"]]
    diffs = [abs(loss_of(a) - loss_of(b)) / abs(loss_of(a)) for a, b in pairs]
    untimed = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]  # noqa: E731
    return {"steps": [b["step"] for _, b in pairs], "bit_equal": untimed(before) == untimed(after),
            "lr_equal": all(a.get("lr") == b.get("lr") for a, b in pairs),
            "max_rel_loss_diff": max(diffs, default=None), "pairs": len(pairs)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__, "out", seq_len=4096, steps=(8, "training steps"), smoke=f"CPU ranks: {SMOKE}")
    p.add_argument("--model-size", default="llama3.1-8b")
    p.add_argument("--config", default="zero3_largest_model.json", help="a file of ds_configs/")
    p.add_argument("--data", help="the main job's --data (default: its own, the Python standard library)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--save-at", type=int, default=4, help="checkpoint every this many steps; resumed from the first")
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--run-dir", default="runs/two_nodes", help="the job's --save-dir (emptied first)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for each of the two launches")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    check_positive(p, args, ("seq_len", "micro_batch", "steps", "save_at", "gpus_per_node", "timeout"))
    if args.save_at >= args.steps:
        p.error(f"--save-at must be below --steps ({args.steps}): the resumed job needs steps after the checkpoint")
    if not (ROOT / "ds_configs" / args.config).is_file():
        p.error(f"--config: no ds_configs/{args.config}")
    return args


def two_nodes(args: argparse.Namespace, run: Path) -> dict:
    """The job on two nodes: their commands, exit codes, records and the checkpoint it is resumed from."""
    n = args.gpus_per_node
    hostfile = run / "hostfile"
    hostfile.write_text(f"node0 slots={n}\nnode1 slots={2 * n}\n")   # node 1's slots n..2n-1: this machine's GPUs
    include = f"node0@node1:{','.join(map(str, range(n, 2 * n)))}"
    port = free_port()
    nodes = [[launcher(), "--hostfile", str(hostfile), "--include", include, "--no_ssh", f"--node_rank={r}",
              "--master_addr=127.0.0.1", f"--master_port={port}", *job(args, run)] for r in (1, 0)]
    logs = [run / f"node{r}.log" for r in (1, 0)]
    print(f"two nodes of {n}: {args.model_size}, seq {args.seq_len}, micro-batch {args.micro_batch}, "
          f"{args.steps} steps, a checkpoint every {args.save_at}", flush=True)
    codes, wall = launch(nodes, logs, args.timeout)
    ckpt = run / "checkpoints" / f"step{args.save_at:07d}"
    out = {"hostfile": hostfile.read_text(), "commands": {"node1": " ".join(nodes[0]), "node0": " ".join(nodes[1])},
           "exit_codes": dict(zip(("node1", "node0"), codes)), "wall_s": wall, "records": read_log(run / "log.jsonl"),
           "nnodes_2_seen": all(f"nnodes=2, num_local_procs={n}" in log.read_text() for log in logs),
           "checkpoint_files": sorted(f.name for f in ckpt.glob("*")) if ckpt.is_dir() else [],
           "checkpoint_gb": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / GIB}
    if any(codes):
        out["error"] = "two-node run: " + "".join(log.read_text()[-3000:] for log in logs)
    return out


def resumed(args: argparse.Namespace, run: Path, two: list[dict]) -> dict:
    """The same job on one node of 2N from the checkpoint: its command, exit code and the records after it."""
    n = 2 * args.gpus_per_node
    cmd = [launcher(), "--num_gpus", str(n), f"--master_port={free_port()}", *job(args, run),
           "--resume-from", f"step{args.save_at:07d}"]
    (code,), wall = launch([cmd], [run / "resume.log"], args.timeout)
    log = read_log(run / "log.jsonl")   # the resumed job keeps the lines up to its checkpoint and appends its own
    after = [r for r in log if r["step"] > args.save_at]
    text = (run / "resume.log").read_text()
    out = {"command": " ".join(cmd), "exit_code": code, "wall_s": wall, "records": after,
           "kept_the_steps_before": log[:len(log) - len(after)] == [r for r in two if r["step"] <= args.save_at],
           "one_node_seen": f"nnodes=1, num_local_procs={n}" in text, "warned_data_order": "warning: resuming" in text}
    if code:
        out["error"] = "resumed run: " + text[-3000:]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = ROOT / args.run_dir
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    res = {**provenance(), **{k: vars(args)[k] for k in ("model_size", "config", "seq_len", "micro_batch", "data",
                                                         "steps", "save_at", "gpus_per_node", "smoke")}}
    two = res["two_nodes"] = two_nodes(args, run)
    if "error" not in two:
        res["resumed"] = resumed(args, run, two["records"])
        res["comparison"] = compare([r for r in two["records"] if r["step"] > args.save_at],
                                    res["resumed"]["records"])
    error = two.get("error") or res.get("resumed", {}).get("error")
    if error:
        res["error"] = error
    path = write_json(Path(args.out) / f"two_nodes{'_smoke' if args.smoke else ''}.json", res)
    print_table(res)
    print(f"-> {path}")
    return 1 if error else 0


def print_table(res: dict) -> None:
    after, rows = {(r["kind"], r["step"]): r for r in res.get("resumed", {}).get("records", [])}, []
    for r in res["two_nodes"]["records"]:
        v, w = loss_of(r), after.get((r["kind"], r["step"]))
        w = None if w is None else loss_of(w)
        rows.append([f"{r['step']}" + (" (val)" if r["kind"] == "eval" else ""), f"{v:.6f}",
                     *(["-", "-"] if w is None else [f"{w:.6f}", w == v])])
    print(markdown(["step", "two nodes: loss", "resumed on one node: loss", "equal"], rows), end="")
    c = res.get("comparison")
    if c and c["pairs"]:
        print(f"resumed steps {c['steps']}: bit-equal {c['bit_equal']}, largest relative loss difference "
              f"{c['max_rel_loss_diff']:.2e}, same learning rates {c['lr_equal']}")


if __name__ == "__main__":
    sys.exit(main())
