"""The one job runner of the benchmarks: a case names its jobs (identity, GPUs, predicted seconds, command); the
harness packs them on disjoint GPU slots under a deadline (a job told to stop saves what a later call resumes from),
merges rows into the case's file by identity (refusing a file of another setting) and records each call once.
docs/benchmarks.md, "A new benchmark", says how a case uses it."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch

from benchmarks import plot_utils
from benchmarks.common import (RESULTS, ROOT, add_worker_args, check_positive, int_list, provenance, read_json,
                               worker_env, write_json)
from coat_ds.launch.teardown import torn_down
from coat_ds.launch.watchdog import stat_fields

J = TypeVar("J")
ENDED = ("done", "ok", "diverged")   # a job that ended: kept, not run again (a diverged run is a result too)
CALL_FIELDS = ("device", "versions", "command", "date", "commit")
POLL_S = 0.2
GROUP_GRACE_S = 60.0   # a job's processes outliving its first: DeepSpeed's launch.py kills its ranks 30 s after SIGTERM


# --- The deadline -----------------------------------------------------------------------------------------------------
@dataclass
class Deadline:
    """A call's end, `seconds` from `start`: a job is told to stop `stop_s` before it (it saves what it has) and
    killed `kill_s` before it (negative: after)."""
    seconds: float = math.inf
    stop_s: float = 0.0
    kill_s: float = 0.0
    start: float = field(default_factory=time.time)

    @property
    def stop_at(self) -> float:
        return self.start + self.seconds - self.stop_s

    @property
    def kill_at(self) -> float:
        return self.start + self.seconds - self.kill_s

    def left(self) -> float:
        """Seconds to the deadline itself."""
        return self.start + self.seconds - time.time()

    def fits(self, est_s: float) -> bool:
        """A job predicted to take `est_s` ends before it is told to stop."""
        return est_s <= self.stop_at - time.time()

    def why_not(self, est_s: float) -> str | None:
        """Why a job predicted to take `est_s` does not start (None: it fits)."""
        return None if self.fits(est_s) else f"predicted {est_s:.0f} s, {self.left():.0f} s left"


# --- Slots: jobs side by side on disjoint GPUs ------------------------------------------------------------------------
def pack(jobs: list[J], gpus: int, size: Callable[[J], int], joins: Callable[[list[J], J], bool],
         in_order: bool = False) -> list[list[J]]:
    """Waves of jobs side by side on `gpus` GPUs: a wave starts with the first job left and takes each later one
    that fits its free GPUs and `joins` it; with `in_order` the first that does not ends it (a fine-tuning must
    follow the pretraining it starts from)."""
    left, out = list(jobs), []
    while left:
        wave = [left.pop(0)]
        for job in list(left):
            if size(job) <= gpus - sum(map(size, wave)) and joins(wave, job):
                wave.append(job)
                left.remove(job)
            elif in_order:
                break
        out.append(wave)
    return out


def devices(sizes: Iterable[int], share: int = 1) -> list[str]:
    """Each job's CUDA ids, disjoint and from GPU 0, `share` jobs on the same ones: sizes 1, 1, 2 -> "0", "1", "2,3"."""
    out, first = [], 0
    for i, n in enumerate(sizes, 1):
        out.append(",".join(map(str, range(first, first + n))))
        first += n if i % share == 0 else 0
    return out


def side_by_side(run: Callable[[int, J], object], jobs: list[J]) -> list:
    """run(i, job) for each job, all at once, a thread each -> the results in order."""
    if len(jobs) == 1:
        return [run(0, jobs[0])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, range(len(jobs)), jobs))


def plan_text(waves: list[list[J]], line: Callable[[J], str], where: str, est=lambda job: job.est_s) -> str:
    """What --plan-only prints: each wave's predicted seconds and end, a job a line (`line(job)`), the total."""
    out, total = [], 0.0
    for i, wave in enumerate(waves, 1):
        total += max(map(est, wave))
        out.append(f"wave {i}: ~{max(map(est, wave)):.0f} s (ends ~{total:.0f} s)")
        out += [f"    {line(job)}: ~{est(job):.0f} s" for job in wave]
    n = sum(map(len, waves))
    return "\n".join(out + [f"predicted: ~{total:.0f} s ({total / 60:.1f} min) for {n} jobs on {where} in "
                            f"{len(waves)} waves"])


def run_waves(waves: list[list[J]], deadline: Deadline, run: Callable[[str, J], object],
              after: Callable[[list[J], list], None], name: Callable[[J], str], size=lambda job: 1, share: int = 1,
              est=lambda job: job.est_s, why_not: Callable[[list[J], float], str | None] | None = None,
              again=lambda wave: wave, log: dict | None = None) -> dict:
    """Each wave side by side, run(its CUDA ids, job) (`devices` of their `size`s), where `why_not(wave, predicted
    seconds)` lets it (default: the deadline's), then `after(wave, results)` (the file rewritten: a call cut off keeps
    what ran); `again(wave)`: the wave predicted anew from what ran before it. -> `log` with the jobs that ran, those
    skipped and why, each wave's predicted and measured seconds, the call's."""
    log = {} if log is None else log
    for key in ("ran", "skipped", "waves"):
        log.setdefault(key, [])
    for wave in waves:
        wave = again(wave)
        names, length = [name(job) for job in wave], max(map(est, wave), default=0.0)
        why = (why_not or (lambda _, s: deadline.why_not(s)))(wave, length) if wave else "done already"
        if why:
            log["skipped"] += [{"job": n, "why": why} for n in names]
            print(*(f"== {n}: skipped ({why})" for n in names), sep="\n", flush=True)
            continue
        t0, ids = time.time(), devices(map(size, wave), share)
        done = side_by_side(lambda i, job: run(ids[i], job), wave)
        log["ran"] += names
        log["waves"].append({"jobs": names, "predicted_s": length, "wall_s": time.time() - t0})
        log["wall_s"] = time.time() - deadline.start
        after(wave, done)
    return log


# --- A job's process --------------------------------------------------------------------------------------------------
def run_process(cmd: list[str], *, stop_at: float = math.inf, kill_at: float = math.inf, log: Path | None = None,
                echo: Callable[[str], bool] = lambda line: False, env: dict | None = None, cwd: Path | None = None,
                watch: Callable[[], None] = lambda: None, ready: Callable[[], bool] = lambda: True) -> dict:
    """Run a job in a process group of its own -> {exit_code, signalled, killed, start, wall_s, tail}, its output
    appended to `log` or read by line (printed where `echo` says; the last 40 kept). `watch()` runs every POLL_S. At
    `stop_at` the group gets SIGTERM once `ready()` (nothing to save yet: it waits), at `kill_at` SIGKILL."""
    out = open(log, "a") if log else subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=cwd, env=worker_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    sel = None if log else selectors.DefaultSelector()
    if sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
    t0, tail, signalled, killed = time.time(), [], False, False
    try:
        while True:
            if sel is None or not sel.select(timeout=POLL_S):
                if proc.poll() is not None:
                    break
                if sel is None:
                    time.sleep(POLL_S)
            else:
                line = proc.stdout.readline()
                if not line:   # its output closed: it ended
                    break
                if echo(line):
                    print(line, end="", flush=True)
                tail = (tail + [line])[-40:]
            watch()
            now = time.time()
            if not signalled and now >= stop_at and (ready() or now >= kill_at):
                signalled = _signal(proc, signal.SIGTERM)
            if not killed and now >= kill_at and proc.poll() is None:
                killed = _signal(proc, signal.SIGKILL)
                tail.append(f"killed after {now - t0:.0f} s (deadline)\n")
        proc.wait()
        killed = _wait_group(proc.pid, kill_at) or killed
    finally:
        if log:
            out.close()
    return {"exit_code": proc.returncode, "signalled": signalled, "killed": killed, "start": t0,
            "wall_s": time.time() - t0, "tail": "".join(tail)}


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (a zombie is not: no subreaper may reap it here)."""
    return any((fields := stat_fields(int(p.name))) is not None and int(fields[2]) == pgid
               for p in Path("/proc").glob("[0-9]*"))


def _wait_group(pgid: int, kill_at: float) -> bool:
    """Wait for the rest of the job's group, up to GROUP_GRACE_S and `kill_at`, then SIGKILL it; whether it killed.
    DeepSpeed's runner dies at SIGTERM (no handler for a local launch) while its ranks finish the step and checkpoint:
    reading their files then raced them (a checkpoint at step 2 beside a log at step 1)."""
    give_up = min(kill_at, time.time() + GROUP_GRACE_S)
    while _group_alive(pgid):
        if time.time() >= give_up:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return True
        time.sleep(POLL_S)
    return False


def _signal(proc: subprocess.Popen, sig: int) -> bool:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    return True


def worker_exit(run: Callable[[], int]) -> int:
    """A worker process's exit code: run()'s, not an abort of Python's finalization (its process group torn down)."""
    with torn_down():
        return run()


def run_worker(cmd: list[str], timeout: float, echo: Callable[[str], bool] = lambda line: False,
               env: dict | None = None) -> tuple[int, str]:
    """A worker killed after `timeout` s -> (exit code, 124 where it was killed; the end of its output)."""
    r = run_process(cmd, kill_at=time.time() + timeout, echo=echo, env=env)
    return (124 if r["killed"] else r["exit_code"]), r["tail"]


# --- One GPU, one job after another: a value rising until the first job that does not fit -----------------------------
def worker_row(cmd_of: Callable[[Path], list[str]], timeout: float, echo: Callable[[str], bool] = lambda line: False,
               env: dict | None = None, **identity) -> dict:
    """The row the worker `cmd_of(path)` writes to path; where none, `identity` with how it failed (fits false,
    `oom`, its exit code, its output's last lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        code, tail = run_worker(cmd_of(Path(tmp) / "row.json"), timeout, echo, env)
        row = read_json(Path(tmp) / "row.json")
    lines = [line for line in tail.splitlines() if line.strip()][-3:]
    return row or {**identity, "fits": False, "oom": "out of memory" in tail.lower() or "OutOfMemoryError" in tail,
                   "returncode": code, "error": " | ".join(lines)[-800:]}


def one_gpu_options(p: argparse.ArgumentParser, name: str, rising: str, help_rising: str, depth: int) -> None:
    """A one-GPU case's options: `rising` (each configuration's jobs up to the first that does not fit), the
    allocator's cap, a stand-in's depth, a worker's seconds, --smoke, --out, a worker's hidden ones."""
    p.add_argument(f"--{rising}", help=f"rising; a configuration stops at its first that fails ({help_rising})")
    p.add_argument("--cap-gib", type=float, default=79.0,
                   help="torch.cuda.set_per_process_memory_fraction's cap: an 80 GB card's usable memory")
    p.add_argument("--layers", type=int, help=f"a shallower stand-in of the model's width (default: all {depth})")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per worker")
    p.add_argument("--smoke", action="store_true", help="CPU, the family's tiny model (benchmarks/configs.py)")
    p.add_argument("--out", type=Path, help=f"where {name}.json goes (default benchmarks/results; --smoke "
                                            f"runs/{name}_smoke)")
    add_worker_args(p)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)


def one_gpu_checked(p: argparse.ArgumentParser, args: argparse.Namespace, name: str, rising: str, default: str,
                    models: tuple[str, str]) -> list[int]:
    """one_gpu_options' values checked, the model (`models`: the real one, the smoke's) and --out set -> `rising`'s
    values, sorted (`default` where not given)."""
    values = sorted(set(int_list(p, rising, getattr(args, rising.replace("-", "_")) or default, 1, distinct=False)))
    check_positive(p, args, ("layers",))
    if args.cap_gib <= 0:
        p.error(f"--cap-gib={args.cap_gib} is invalid; allowed: a number > 0")
    args.model = args.model or models[args.smoke]
    args.out = args.out or (ROOT / "runs" / f"{name}_smoke" if args.smoke else RESULTS)
    return values


def one_gpu_case(args, name: str, worker: Callable[[object], int], run: Callable[[str, int], dict],
                 names: list[str], values: list[int], results: Callable[[list[dict], dict], dict]) -> int:
    """A one-GPU case's main: its `worker` in a worker process, else the ladder of its jobs and its file
    (`results(rows, call)`) -> the exit code (1: the first job did not fit)."""
    if args.worker:
        return worker_exit(lambda: worker(args))
    if not args.smoke and not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU; allowed here: --smoke (CPU)", file=sys.stderr)
        return 2
    call = this_call()
    rows = ladder(run, names, values)
    print(f"-> {write_results(results(rows, call), args.out, name)}", flush=True)
    return 0 if rows[0]["fits"] else 1


def ladder(run: Callable[[str, int], dict], names: list[str], values: list[int]) -> list[dict]:
    """run(name, value) for each name over the rising `values`, up to its first row that does not fit -> the rows."""
    rows: list[dict] = []
    for name in names:
        for value in values:
            rows.append(run(name, value))
            print(json.dumps(rows[-1]), flush=True)
            if not rows[-1]["fits"]:
                break
    return rows


# --- The results file -------------------------------------------------------------------------------------------------
def further(new: dict, old: dict) -> bool:
    """Whether `new` replaces `old` of one job: one that ended beats one that did not, a partial one a failed one,
    then the one further on; a tie goes to `new`."""
    rank = lambda r: (r.get("status") in ENDED, r.get("status") != "failed", r.get("steps_done") or 0)  # noqa: E731
    return rank(new) >= rank(old)


def merged(key: Callable[[dict], object], *groups: Iterable[dict]) -> dict:
    """Rows by identity, in the groups' order (earlier files' first); of two of one identity `further` decides."""
    out: dict = {}
    for row in (r for group in groups for r in group):
        k = key(row)
        if k not in out or further(row, out[k]):
            out[k] = row
    return out


def same_setting(where: str, theirs: dict, ours: dict, what: str = "setting",
                 allowed: str = "files measured with the same") -> None:
    """Exit in one line where `where`'s rows were measured with another setting (they are another configuration's)."""
    diff = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))
    if diff:
        sys.exit(f"error: {where}: its rows followed another {what} ({', '.join(diff)} differ: "
                 f"{ {k: theirs.get(k) for k in diff} } there, { {k: ours.get(k) for k in diff} } in this call); "
                 f"allowed: {allowed}")


def merge_files(paths: list[str], setting: Callable[[dict], dict], ours: dict, what: str = "setting",
                allowed: str = "files measured with the same") -> list[dict]:
    """Earlier calls' results files (a missing one skipped), each checked to share this call's `setting`."""
    docs = []
    for path in paths:
        doc = read_json(path)
        if doc is None:
            print(f"--merge {path}: no such file; skipped", flush=True)
            continue
        same_setting(f"--merge {path}", setting(doc), ours, what, allowed)
        docs.append(doc)
    return docs


def calls_of(docs: list[dict]) -> list[dict]:
    """The calls of these files, each once (a file and a machine's copy share calls); a pre-harness file's head."""
    out: list[dict] = []
    for doc in docs:
        own = doc.get("calls") or ([{k: doc.get(k) for k in CALL_FIELDS}] if doc.get("date") else [])
        out += [c for c in own if c not in out]
    return out


def into_file(path: Path | None, rows: list[dict], key: Callable[[dict], object], ours: dict, call: dict,
              setting: Iterable[str], field: str = "rows") -> dict:
    """The file at `path` (None: a new one) with `rows` merged into its `field` by `key`, `call` counted once and `ours`
    on top; exits in one line where the file's `setting` keys differ from ours."""
    old = (read_json(path) if path else None) or {}
    if old:
        same_setting(str(path), {k: old.get(k) for k in setting}, {k: ours.get(k) for k in setting})
    rows = list(merged(key, old.get(field, []), rows).values())
    return {**old, **head(calls_of([old, {"calls": [call]}])), **ours, field: rows}


def this_call(**extra) -> dict:
    """Where, when and how this call measures (common.provenance, as a parent: no CUDA context), and `extra`."""
    return {**provenance(parent=True), **extra}


def head(calls: list[dict]) -> dict:
    """A file's top: the last call's device, versions, command, date and commit, and every call."""
    last = calls[-1] if calls else {}
    return {**{k: last.get(k) for k in CALL_FIELDS}, "calls": calls}


def write_results(res: dict, out: Path, name: str, plot=None) -> Path:
    """`name`.json and its PNG by `plot` (default plot_utils.plot_`name`); without matplotlib the JSON alone."""
    path = write_json(out / f"{name}.json", res)
    plot = plot or getattr(plot_utils, f"plot_{name}", None)
    if plot is None:
        return path
    try:
        plot(res, out / f"{name}.png")
        res["png"] = str(out / f"{name}.png")
    except ImportError as e:
        print(f"warning: no plot ({e}); draw it later with python -m benchmarks.plot_utils {path}", file=sys.stderr)
    return write_json(path, res)
