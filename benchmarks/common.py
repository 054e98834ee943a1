"""What every benchmark shares: where and how a result was measured, worker processes, argument checks, the
output files and the profiler's read-outs. One copy here, so every results file records the same facts."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

T0 = time.time()   # this process's start (common is imported first): a worker's budget counts its imports too

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from coat_ds.report import versions as package_versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2 ** 30
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- Where and how a result was measured ------------------------------------------------------------------------------

def proc_bytes(key: str, path: str = "/proc/self/status") -> int:
    """Bytes of a /proc file's `key: N kB` line (0 if absent): VmRSS, VmHWM (peak RSS), meminfo's MemAvailable."""
    with open(path) as fh:
        return next((int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":")), 0)


def git_commit() -> str | None:
    """COAT_GIT_COMMIT where set (a GPU node's copy of the tree may carry stale git metadata), else git's."""
    if os.environ.get("COAT_GIT_COMMIT"):
        return os.environ["COAT_GIT_COMMIT"]
    try:
        out, dirty = (subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=10)
                      for a in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None


def versions(*extra: str, parent: bool = False) -> dict:
    """coat_ds.report's versions (with `extra`), this checkout's commit, the GPUs (a `parent`'s: nvidia-smi's)."""
    v = {**package_versions(*extra), "coat_ds_commit": git_commit()}
    gpus = gpu_names(parent)
    if gpus:
        v.update(gpu=gpus[0], gpu_count=len(gpus))
    return v


def gpu_names(parent: bool = False) -> list[str]:
    """Each GPU's model ([] without one); in a `parent`, as nvidia-smi names them, without initialising CUDA."""
    if not parent:
        return [torch.cuda.get_device_name(0)] * torch.cuda.device_count() if torch.cuda.is_available() else []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def cpu_info() -> dict[str, str]:
    """The first processor's /proc/cpuinfo fields (none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in text.split("\n\n")[0].splitlines()
                                               if ":" in line)}


def device_name(device: str | None = None, parent: bool = False) -> str:
    """The GPU ('2x ...' for several), or with device 'cpu' or no GPU the CPU's model and torch's threads."""
    gpus = [] if device == "cpu" else gpu_names(parent)
    if gpus:
        return f"{len(gpus)}x {gpus[0]}" if len(gpus) > 1 else gpus[0]
    model = cpu_info().get("model name") or platform.processor() or platform.machine()
    return f"cpu ({model}, {torch.get_num_threads()} threads of {os.cpu_count()} cores)"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command() -> str:
    """This process's command line as typed: `python -m benchmarks.X ...` for a benchmark run as a module."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    argv = ["-m", spec.name, *sys.argv[1:]] if spec is not None and spec.name else sys.argv
    return " ".join([Path(sys.executable).name, *argv])


def provenance(extra: tuple[str, ...] = (), parent: bool = False) -> dict:
    """Every results file's device, versions (with `extra`), command, date and commit; a `parent` (which starts
    workers) never initialises CUDA, whose context would take memory on a GPU where a worker measures."""
    return {**row_provenance(device_name(parent=parent)), "versions": versions(*extra, parent=parent)}


def row_provenance(device: str | None = None) -> dict:
    """Where, when and how one row was measured (a file's rows may come from several calls)."""
    return {"device": device or device_name(), "date": now(), "command": command(), "commit": git_commit()}


class WarningLog:
    """Collects coat_ds's warnings (a kernel that fell back to the reference path changes every figure)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._show = warnings.showwarning
        warnings.showwarning = self._record

    def _record(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "coat" in text.lower() and text not in self.messages:
            self.messages.append(text)
        self._show(message, category, filename, lineno, file, line)


# --- Arguments --------------------------------------------------------------------------------------------------------
def check_positive(p: argparse.ArgumentParser, args: argparse.Namespace, keys: tuple[str, ...]) -> None:
    """p.error for any of these options below 1 (an optional one left unset passes)."""
    for key in keys:
        v = getattr(args, key)
        if v is not None and v < 1:
            p.error(f"--{key.replace('_', '-')}={v} is invalid; allowed: an integer >= 1")


def names_of(p: argparse.ArgumentParser, option: str, value: str, allowed) -> list[str]:
    """The names of a comma-separated option, after p.error for an unknown one or for none at all."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        p.error(f"--{option}: {bad or names!r} is invalid; allowed: a comma-separated list from {list(allowed)}")
    return names


def int_list(p: argparse.ArgumentParser, option: str, text: str, low: int | None = None,
             distinct: bool = True) -> list[int]:
    """A comma-separated option's integers, after p.error (one line) for none, a bad one or (`distinct`) a repeat."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (low is not None and min(values) < low) or (distinct and len(set(values)) < len(values)):
        what = "distinct " * distinct + "comma-separated integers" + ("" if low is None else f" >= {low}")
        p.error(f"--{option}={text!r} is invalid; allowed: {what}")
    return values


def flags(args: argparse.Namespace, *names: str) -> list[str]:
    """`--name value` for each of `names` set in args (a True switch alone): what a parent hands its worker."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None and value is not False:
            out += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The hidden options of a worker process: --worker, --result and --local_rank (the deepspeed launcher's)."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)


# the options several benchmarks take: type, default, meaning (a script may give its own default, or default and help)
OPTIONS = {"out": (str, str(RESULTS), "the folder the results go to"), "seq_len": (int, 2048, "tokens a sample"),
           "steps": (int, 3, "timed steps"), "warmup": (int, 1, "untimed steps before the timed ones"),
           "seed": (int, 1234, "the weights' and the tokens' seed"), "verbose": (bool, False, "echo workers' output"),
           "time_budget": (float, None, "seconds for everything; a job that would end later is skipped"),
           "mem_fraction": (float, 0.95, "'fits': peak reserved <= this x device memory")}


def parser(doc: str, *names: str, smoke: str | None = None, worker: bool = False, **given) -> argparse.ArgumentParser:
    """A benchmark's parser, described by `doc`'s first paragraph: the OPTIONS in `names` and `given` (each a default,
    or (default, help)), --smoke (its help) where given, and a worker's hidden options with `worker`."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    for name in (*names, *given):
        kind, default, text = OPTIONS[name]
        default, text = given[name] if isinstance(given.get(name), tuple) else (given.get(name, default), text)
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            p.add_argument(flag, action="store_true", help=text)
        else:
            p.add_argument(flag, type=kind, default=default, help=text)
    if smoke:
        p.add_argument("--smoke", action="store_true", help=smoke)
    if worker:
        add_worker_args(p)
    return p


# --- Worker processes: a DeepSpeed engine never gives its memory back, so each measurement gets its own ---------------
_PORTS: set[int] = set()


def free_port() -> int:
    """A port free now, and never one this process handed out before (workers started side by side)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def worker_env(**extra: str) -> dict[str, str]:
    """A worker's environment: this checkout first on the path, no launcher's rank variables (the worker is a
    job of its own), expandable segments (the rungs of one ladder do not fragment the allocator)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def launcher() -> str:
    """DeepSpeed's launcher: on PATH, else beside this Python (a virtual environment not activated)."""
    return shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")


def worker_cmd(module: str, args: argparse.Namespace, names: tuple[str, ...], num_gpus: int = 1,
               devices: str | None = None, cores: str | None = None, **given) -> list[str]:
    """The command of a worker of `module` (the deepspeed launcher for several GPUs, on CUDA ids `devices`) with
    args' options `names` and the `given` ones; `cores` bound as DeepSpeed's `--bind_cores_to_rank` splits them."""
    run = argparse.Namespace(**{**vars(args), **given})
    opts = ["--worker", *flags(run, *names, *given)]
    if num_gpus > 1:
        where = ["--include", f"localhost:{devices}"] if devices else ["--num_gpus", str(num_gpus)]
        bind = ["--bind_cores_to_rank", "--bind_core_list", cores] if cores else []
        return ["deepspeed", *where, *bind, "--master_port", str(free_port()), "--module", module, *opts]
    return [*(["numactl", "-C", cores] if cores else []), sys.executable, "-m", module, *opts]


def parse_cores(text: str) -> list[int]:
    """A core list ("0-15,32,40-47") -> its cores; ValueError for anything else."""
    cores = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi.isdigit() or not hi) or int(hi or lo) < int(lo):
            raise ValueError(f"--bind-cores {text!r}: {part!r} is not a core or a range; allowed: 'all' or a core "
                             "list such as 0-15,32-47")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def core_list(devices: str, host_gpus: int, host_cores: int | None = None) -> str:
    """The host's cores that CUDA devices `devices` ("2,3") own when each of `host_gpus` GPUs owns an equal,
    contiguous share ("32-63" of 64 cores): side-by-side workers bound to disjoint cores."""
    cores = host_cores or os.cpu_count() or 1
    per = cores // host_gpus
    if per < 1:
        raise ValueError(f"{host_gpus} GPUs share {cores} cores: none for each")
    return ",".join(f"{per * int(d)}-{per * int(d) + per - 1}" for d in devices.split(","))


# --- Output files -----------------------------------------------------------------------------------------------------
def read_json(path: str | Path, default=None):
    """The JSON in `path`, or `default` where there is no such file (a results file not written yet)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else default


def read_log(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file ([] where there is none yet); a line cut by a kill is skipped."""
    path, out = Path(path), []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def write_json(path: str | Path, obj, indent: int = 1) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent))
    return path


# --- Timing and profiler read-outs ---------------------------------------------------------------------------------
def call_ms(fn, device: str) -> float:
    """One call's milliseconds; on the GPU between two CUDA events (the kernels' time, not the launch's)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def top_events(prof, on_cuda: bool, top: int) -> dict:
    """A profiled step's kernels by device time (on the CPU: calls by CPU time) and host calls by self CPU time,
    the `top` of each with the total over all of them (ms); older torch names the device time self_cuda_time_total."""
    events = prof.key_averages()
    dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    on_device = lambda e: getattr(e, "device_type", None) is None or "CUDA" in str(e.device_type)  # noqa: E731

    def rows(attr: str, keep) -> tuple[list[dict], float]:
        kept = sorted((e for e in events if getattr(e, attr, 0) > 0 and keep(e)), key=lambda e: -getattr(e, attr))
        total = sum(getattr(e, attr) for e in kept) or 1.0
        return [{"name": e.key[:120], "calls": e.count, "ms": getattr(e, attr) / 1e3,
                 "share": getattr(e, attr) / total} for e in kept[:top]], total / 1e3

    kernels, device_ms = rows(dev, on_device) if on_cuda else rows("self_cpu_time_total", lambda e: True)
    host, host_ms = rows("self_cpu_time_total", lambda e: True)
    return {"time_source": dev if on_cuda else "self_cpu_time_total", "kernels": kernels, "device_ms": device_ms,
            "host": host, "host_ms": host_ms}


@contextlib.contextmanager
def sync_sites(on_cuda: bool):
    """The device syncs made inside the block by Python line, most first (filled as it ends; a sync drains the
    launch queue: the GPU then waits on Python)."""
    sites: dict[str, int] = {}
    if not on_cuda:
        yield sites
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    sites.update(sorted(((k, where.count(k)) for k in set(where)), key=lambda kv: -kv[1]))


class StepProbe:
    """Two consecutive steps: the device syncs of the first by Python line, the second under torch.profiler.
    `mark()` before the first step and after each; `result` holds the read-outs after the third."""

    def __init__(self, on_cuda: bool, top: int = 15) -> None:
        self.on_cuda, self.top, self.marks, self.result = on_cuda, top, 0, {}

    def mark(self) -> None:
        if self.marks == 0:
            self._window = sync_sites(self.on_cuda)
            self.result["syncs"] = self._window.__enter__()
        elif self.marks == 1:
            self._window.__exit__(None, None, None)
            on_device = [ProfilerActivity.CUDA] if self.on_cuda else []
            self._window, self._t0 = profile(activities=[ProfilerActivity.CPU, *on_device]), time.perf_counter()
            self._prof = self._window.__enter__()
        elif self.marks == 2:
            if self.on_cuda:
                torch.cuda.synchronize()
            self._window.__exit__(None, None, None)
            trace = chrome_trace(self._prof)
            self.result.update(profiled_step_ms=(time.perf_counter() - self._t0) * 1e3,
                               **top_events(self._prof, self.on_cuda, self.top),
                               gpu_gaps=gpu_gaps(trace).splitlines(), streams=stream_gaps(trace).splitlines())
        self.marks += 1


def chrome_trace(prof) -> dict:
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        return json.loads(Path(f"{d}/trace.json").read_text())


def _device_events(trace: dict) -> list[tuple[float, float, str, object]]:
    """(start, end, name, stream) of a chrome trace's kernels, copies and memsets, by start."""
    return sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"], (e.get("args") or {}).get("stream", e.get("tid")))
                   for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda t: t[0])


def _gaps(events: list) -> list[tuple[float, float, float, str, str]]:
    """Where device events sorted by start leave the device idle (overlaps count once): (length, from, to, the
    event before, the event after), in microseconds."""
    out, end = [], events[0][1]
    for (_, _, before, _), (s, e, after, _) in zip(events, events[1:]):
        if s > end:
            out.append((s - end, end, s, before, after))
        end = max(end, e)
    return out


def stream_gaps(trace: dict, top: int = 6) -> str:
    """Each stream's busy time, then the busiest (backward's) stream's longest gaps with what the other streams ran
    inside each (a collective or a step it waits for), which an all-streams view (gpu_gaps) hides."""
    dev = _device_events(trace)
    if not dev:
        return "no device events\n"
    by_stream: dict = {}
    for ev in dev:
        by_stream.setdefault(ev[3], []).append(ev)
    gaps = {k: _gaps(v) for k, v in by_stream.items()}
    busy = {k: max(e for _, e, *_ in v) - v[0][0] - sum(g[0] for g in gaps[k]) for k, v in by_stream.items()}
    span = max(e for _, e, *_ in dev) - dev[0][0]
    lines = [f"stream {k}: busy {b / 1e3:.2f} ms of {span / 1e3:.2f} ({len(by_stream[k])} events)"
             for k, b in sorted(busy.items(), key=lambda kv: -kv[1])]
    main = max(busy, key=busy.get)
    lines.append(f"stream {main} idle {sum(g[0] for g in gaps[main]) / 1e3:.2f} ms in {len(gaps[main])} gaps; the "
                 "longest:")
    for g, a, b, n0, n1 in sorted(gaps[main], reverse=True)[:top]:
        inside: dict[str, float] = {}
        for s, e, n, k in dev:
            if k != main and s < b and e > a:
                inside[n[:40]] = inside.get(n[:40], 0.0) + min(e, b) - max(s, a)
        meanwhile = ", ".join(f"{n} {t:.0f} us" for n, t in sorted(inside.items(), key=lambda kv: -kv[1])[:2])
        lines.append(f"  {g:8.1f} us  after {n0[:40]}  before {n1[:40]}  meanwhile: {meanwhile or 'nothing'}")
    return "\n".join(lines) + "\n"


def gpu_gaps(trace: dict, top: int = 8) -> str:
    """Where the GPU idles in a profiled step: span, busy and idle time, the longest gaps with the kernels either
    side (a gap is a launch the host had not made yet, or a synchronisation)."""
    dev = _device_events(trace)
    if not dev:
        return "no device events\n"
    gaps = _gaps(dev)
    span, idle = dev[-1][1] - dev[0][0], sum(g[0] for g in gaps)
    lines = [f"GPU span {span / 1e3:.2f} ms, busy {(span - idle) / 1e3:.2f}, idle {idle / 1e3:.2f} in {len(gaps)} gaps"]
    lines += [f"  {g:8.1f} us  after {a[:50]}  before {b[:50]}" for g, _, _, a, b in sorted(gaps, reverse=True)[:top]]
    return "\n".join(lines) + "\n"
