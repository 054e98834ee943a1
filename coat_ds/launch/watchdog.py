"""A job that stops within a bounded time, in one line, when one of its ranks is lost, instead of hanging.

Why: when a rank dies mid-step, the others are inside a collective that will never complete. Under NCCL they
wait there until the process group's timeout (DeepSpeed's default: 10 minutes), then torch's NCCL watchdog aborts
them with pages of log; under gloo they fail at once with a "Connection reset by peer" traceback that names no
rank. DeepSpeed's launcher notices only the ranks of its own node, so on a job of several nodes the other nodes'
launchers keep waiting.

How: every rank runs a thread that, every INTERVAL seconds, adds one to its own counter in the job's TCPStore (the
one deepspeed.init_distributed met at MASTER_ADDR:MASTER_PORT, which rank 0's process hosts) and reads every rank's
counter and state. A heartbeat process (a child of the rank, `pulse`) adds to the same counter while the rank's
process lives and is not stopped: a rank whose main thread holds the GIL for longer than the timeout (torch.save
into a buffer: 9 s a GiB here; a tensor's tolist()) starves its own thread, never its pulse. A peer is lost when
  - it is on this node and its process has ended (seen in /proc at once; the pid and start time it published),
  - its counter has not moved for `timeout` seconds (a peer on another node, or a frozen one), or for SUSPECT_S
    once this rank's own collective has failed (`suspect`: gloo's reset names no rank, the silence does),
  - it wrote that it failed (an exception ended it: `stop(failure=...)`), or
  - (rank 0) the store it hosts stops answering for as long; on rank 0's node its process ending says so first,
    and the store is not touched again (each failed call prints a page of torch's C++ warnings).
Then the rank publishes that it stops and why, so that every rank stops with the same verdict; a silent rank on
this node (a frozen process, which DeepSpeed's launcher would SIGTERM and wait 30 s for) is ended with SIGKILL; one
rank per node (the lowest one not lost) prints one line naming the lost rank, its node, host and pid and how it was
lost, and the process ends at once with os._exit(EXIT_CODE): a thread can end a process whose main thread is blocked
in a collective that never returns (NCCL's included). Rank 0 waits for the others to have seen it (GRACE_S at most)
before it ends, as the store ends with it.

A verdict waits GRACE_S for this rank's own `stop()` first: a job that ends on every rank at once (a save refused
everywhere) must not report its peers' ordinary exits. Bound: a peer on the same node INTERVAL + GRACE_S, others
`timeout` + INTERVAL + GRACE_S (SUSPECT_S in place of `timeout` where a collective failed).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

INTERVAL = 1.0      # seconds between beats
SUSPECT_S = 3.0     # the silence that makes a peer lost once this rank's own collective has failed
GRACE_S = 2.0       # how long a verdict waits for this rank's own stop(), and rank 0 for the others to see it
START_S = 300.0     # how long start() waits for every rank to publish itself
EXIT_CODE = 1
PREFIX = "coat_ds/watchdog/"
UP, DONE, FAILED, STOPPING = b"up", b"done", b"failed:", b"stopping:"   # a rank's state key
PF_EXITING = 0x4       # /proc/PID/stat's flags: the process is exiting
STOPPED = ("T", "t")   # /proc states of a process stopped by a signal or a tracer: its pulse stays silent


def _key(kind: str, rank: int) -> str:
    return f"{PREFIX}{kind}/{rank}"


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after "pid (comm)" of a live process (state first, its process group third, flags
    seventh, start time twentieth); None where it does not exist or is ending: exiting (the kernel's PF_EXITING, set
    before its sockets close) or ended (a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") or int(fields[6]) & PF_EXITING else fields


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a live process; None where it has ended or is ending (stat_fields)."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[0], fields[19])


def start_time(pid: int) -> str | None:
    """A live process's start time, which tells it from a later one with its pid; None where it has ended."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def process_state(pid: int, start: str) -> str | None:
    """The /proc state letter of the process `pid` started at `start` (R, S, D, T...); None where it has ended."""
    stat = _stat(pid)
    return stat[0] if stat is not None and stat[1] == start else None


@dataclass(frozen=True)
class Peer:
    """What each rank publishes about itself at start."""
    rank: int
    node: str          # DeepSpeed's launcher's node rank (CROSS_RANK), torchrun's GROUP_RANK, else the host name
    host: str
    local_rank: int
    pid: int
    start: str         # start_time(pid), "" where /proc is not there

    @classmethod
    def me(cls, rank: int) -> "Peer":
        host = socket.gethostname()
        node = os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", host))
        return cls(rank, node, host, int(os.environ.get("LOCAL_RANK", "0")), os.getpid(), start_time(os.getpid()) or "")

    @property
    def node_key(self) -> tuple[str, str]:
        return self.host, self.node

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, local rank {self.local_rank}, host {self.host}, pid {self.pid})"


@dataclass(frozen=True)
class Verdict:
    """Why the job stops: the line, the ranks it names as gone (lost or failed), and those of them lost by silence
    (frozen, or unreachable), whose process the ranks of its node end."""
    line: str
    gone: tuple[int, ...]
    silent: tuple[int, ...] = ()

    @classmethod
    def loads(cls, text: bytes) -> "Verdict":
        saved = json.loads(text)
        return cls(saved["line"], tuple(saved["gone"]), tuple(saved.get("silent", ())))


def _exit(line: str | None) -> None:
    if line:   # on a line of its own, whatever a progress bar left on the current one
        print(f"\n{line}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


class Watchdog:
    """The thread described above, for one rank. `store`: a client of the job's TCPStore; `on_verdict(line)`:
    what happens on a verdict (default: print the line where it is given, then os._exit), line None on the ranks
    that stay quiet; `address`: the store's (host, port), for the heartbeat process (without it this rank beats
    from its thread alone)."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float, hint: str = "",
                 on_verdict: Callable[[str | None], None] = _exit, interval: float = INTERVAL,
                 store_address: str = "the store", address: tuple[str, int] | None = None):
        self.store, self.rank, self.world, self.timeout = store, rank, world, float(timeout)
        self.hint, self.on_verdict, self.interval, self.store_address = hint, on_verdict, interval, store_address
        self.address = address
        self.peers: list[Peer] = []
        self.verdict: Verdict | None = None
        self.pulse: subprocess.Popen | None = None        # the heartbeat process
        self._threshold = self.timeout
        self._seen: dict[int, tuple[bytes, float]] = {}   # rank -> (its counter, when it last changed)
        self._store_down: float | None = None
        self._store_gone = False                          # its host ended: never called again
        self._same_node: set[int] = set()                 # peers whose process this rank can see end
        self._stop = threading.Event()
        self._acted = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle (main thread)
    def start(self) -> "Watchdog":
        """Publish this rank, start its heartbeat process, wait (START_S) until every rank has published itself,
        then watch them in a daemon thread."""
        me = Peer.me(self.rank)
        self.store.set(_key("peer", self.rank), json.dumps(asdict(me)))
        self.store.set(_key("state", self.rank), UP)
        self.store.add(_key("beat", self.rank), 0)
        if self.address is not None and me.start:
            self.pulse = start_pulse(*self.address, self.rank, me.pid, me.start, self.interval)
        self.store.wait([_key("peer", r) for r in range(self.world)], timedelta(seconds=START_S))
        self.peers = [Peer(**json.loads(v)) for v in self.store.multi_get([_key("peer", r) for r in range(self.world)])]
        self._same_node = {p.rank for p in self.peers if p.rank != self.rank and p.node_key == me.node_key
                           and p.start and start_time(p.pid) == p.start}
        now = time.monotonic()
        self._seen = {r: (b"", now) for r in range(self.world)}
        self._thread = threading.Thread(target=self._run, name="coat_ds-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, failure: str | None = None) -> None:
        """This rank is done (or, `failure`: ended by an error, which the others then report): no more watching."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 10)
        self._end_pulse()
        if self._store_gone:
            return
        try:
            self.store.set(_key("state", self.rank), DONE if failure is None else FAILED + failure.encode())
        except Exception:   # noqa: BLE001 - the store went with rank 0: nobody is left to tell
            pass

    def suspect(self) -> bool:
        """This rank's collective failed: peers silent for SUSPECT_S count as lost. Waits for the verdict (which ends
        the process by default); False where none came, i.e. the failure was not a lost peer."""
        self._threshold = min(self.timeout, SUSPECT_S)
        return self._acted.wait(SUSPECT_S + 2 * self.interval + 2 * GRACE_S)

    def _end_pulse(self) -> None:
        if self.pulse is not None and self.pulse.poll() is None:
            self.pulse.kill()
            self.pulse.wait()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self._check_pulse()
                verdict = self.check()
                if verdict is not None:
                    self._act(verdict)
                    return
        except Exception as exc:   # noqa: BLE001 - say so rather than stop watching in silence
            print(f"\nwarning: coat_ds watchdog of rank {self.rank} stopped: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)

    def _check_pulse(self) -> None:
        """The heartbeat process ended while this rank runs (killed by hand, or by the OOM killer): say so once."""
        if self.pulse is not None and self.pulse.poll() is not None and not self._stop.is_set():
            print(f"\nwarning: coat_ds watchdog: the heartbeat process of rank {self.rank} ended (exit "
                  f"{self.pulse.returncode}); this rank now beats from its own thread, which a stretch holding the "
                  "GIL for longer than the peer timeout starves", file=sys.stderr, flush=True)
            self.pulse = None

    def check(self) -> Verdict | None:
        """One beat and one look at every rank: the verdict, or None while every rank is there."""
        asked = time.monotonic()
        ended = {r for r in self._same_node if start_time(self.peers[r].pid) != self.peers[r].start}
        if 0 in ended:   # the store's host: no call to it (each would fail with a page of C++ warnings)
            self._store_gone = True
            return self._verdict([(1, 0.0, r, "was lost: its process ended") for r in sorted(ended)])
        try:
            self.store.add(_key("beat", self.rank), 1)
            values = self.store.multi_get([_key(kind, r) for kind in ("beat", "state") for r in range(self.world)])
        except Exception as exc:   # noqa: BLE001 - any store failure: rank 0 (its host) or the network is gone
            return self._store_failed(asked, exc)
        # the counters' age counts from their reading: this thread may have waited seconds inside the calls for the
        # GIL its main thread held, and a change seen then dated from before the wait made the next look call a
        # beating peer silent (a CI run: rank 1, holding its GIL, named rank 0 lost)
        now = time.monotonic()
        self._store_down = None
        beats, states = values[:self.world], values[self.world:]
        gone: list[tuple[int, float, int, str]] = []   # (0 failed, 1 ended, 2 silent; seconds silent; rank; how)
        for r in range(self.world):
            state = states[r]
            if r == self.rank or state == DONE:
                continue
            if state.startswith(STOPPING):
                return Verdict.loads(state[len(STOPPING):])
            if state.startswith(FAILED):
                gone.append((0, 0.0, r, f"failed: {state[len(FAILED):].decode(errors='replace')}"))
                continue
            last, since = self._seen[r]
            if beats[r] != last:
                self._seen[r] = (beats[r], now)
                since = now
            if r in ended:
                gone.append((1, now - since, r, "was lost: its process ended"))
            elif now - since > self._threshold:
                gone.append((2, now - since, r, f"was lost: no heartbeat for {now - since:.0f} s"))
        return self._verdict(gone) if gone else None

    def _store_failed(self, now: float, exc: BaseException) -> Verdict | None:
        if self._store_down is None:
            self._store_down = now
        if now - self._store_down <= self._threshold:
            return None
        self._store_gone = True
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        silent = now - self._store_down
        how = f"the job's store it hosts ({self.store_address}) stopped answering for {silent:.0f} s: {first}"
        return self._verdict([(1, 0.0, 0, f"was lost: {how}")])

    def _verdict(self, gone: list[tuple[int, float, int, str]]) -> Verdict:
        """The line names the rank most surely gone first (failed, ended, then the longest silent)."""
        gone.sort(key=lambda g: (g[0], -g[1], g[2]))
        first, how = gone[0][2], gone[0][3]
        others = [str(g[2]) for g in gone[1:]]
        also = f"; also gone: rank{'s' if len(others) > 1 else ''} {', '.join(others)}" if others else ""
        line = f"error: {self.peers[first].describe()} {how}{also}; every rank stops (exit {EXIT_CODE})"
        return Verdict(line + (f"; {self.hint}" if self.hint else ""), tuple(sorted(g[2] for g in gone)),
                       tuple(sorted(g[2] for g in gone if g[0] == 2)))

    def _act(self, verdict: Verdict) -> None:
        self.verdict = verdict
        if not self._store_gone:
            try:   # first, so that the others stop with the same verdict
                self.store.set(_key("state", self.rank), STOPPING + json.dumps(asdict(verdict)).encode())
            except Exception:   # noqa: BLE001 - the store is gone: the others find out by themselves
                pass
        if self._stop.wait(GRACE_S):   # this rank is ending by itself (a job ending on every rank at once)
            return
        if self.rank == 0:
            self._await_others(verdict)
        self._end_silent(verdict)
        mine = self.peers[self.rank].node_key
        printer = min((p.rank for p in self.peers if p.node_key == mine and p.rank not in verdict.gone), default=None)
        self._acted.set()
        self.on_verdict(verdict.line if self.rank == printer else None)

    def _end_silent(self, verdict: Verdict) -> None:
        """SIGKILL the ranks of this node the verdict names silent (frozen: a stopped process would keep DeepSpeed's
        launcher waiting 30 s after its SIGTERM), where their process is still the one they published."""
        for r in verdict.silent:
            peer = self.peers[r]
            if r in self._same_node and start_time(peer.pid) == peer.start:
                try:
                    os.kill(peer.pid, signal.SIGKILL)
                except OSError:   # it ended meanwhile
                    pass

    def _await_others(self, verdict: Verdict) -> None:
        """Rank 0 keeps the store (and itself) up until every other rank has seen the verdict, GRACE_S at most."""
        others = [_key("state", r) for r in range(self.world) if r != self.rank and r not in verdict.gone]
        deadline = time.monotonic() + GRACE_S
        while others and time.monotonic() < deadline:
            try:
                if all(v == DONE or v.startswith((STOPPING, FAILED)) for v in self.store.multi_get(others)):
                    return
            except Exception:   # noqa: BLE001
                return
            time.sleep(0.1)


def start_pulse(host: str, port: int, rank: int, pid: int, start: str, interval: float) -> subprocess.Popen | None:
    """Start the heartbeat process of rank `rank` (process `pid` started at `start`): this file run by a fresh
    Python (no coat_ds import), silent (a store that went away would print pages of torch's C++ warnings), out of
    reach of Ctrl-C (SIGINT is ignored there; the rank's own stop or end ends it). None where it cannot start."""
    try:
        return subprocess.Popen([sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], run_name="
                                 "'__main__')", os.path.abspath(__file__), host, str(port), str(rank), str(pid), start,
                                 str(interval)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as exc:
        print(f"\nwarning: coat_ds watchdog: no heartbeat process for rank {rank} ({exc}); it beats from its own "
              "thread, which a stretch holding the GIL for longer than the peer timeout starves", file=sys.stderr,
              flush=True)
        return None


def pulse(host: str, port: int, rank: int, pid: int, start: str, interval: float) -> None:
    """The heartbeat process's loop: add one to rank `rank`'s counter every `interval` seconds while its process
    lives and is not stopped (a frozen rank goes silent, as it should); return once that process has ended. A store
    that does not answer is tried again at the next beat (the rank's own watchdog judges the store)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from torch.distributed import TCPStore

    store = None
    while (state := process_state(pid, start)) is not None:
        if state not in STOPPED:
            try:
                if store is None:
                    store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                                     timeout=timedelta(seconds=max(5.0, 2 * interval)))
                store.add(_key("beat", rank), 1)
            except Exception:   # noqa: BLE001 - gone or unreachable: a new client next time
                store = None
        time.sleep(interval)


def from_env(timeout: float, hint: str = "", interval: float = INTERVAL) -> Watchdog | None:
    """A started Watchdog for this rank of the initialized torch.distributed job, on a client of its TCPStore
    (MASTER_ADDR:MASTER_PORT, as DeepSpeed's and torch's launchers set them); None in a world of one, where
    `timeout` is 0 (off), or without those variables."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world == 1 or timeout <= 0 or not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=max(5.0, 2 * INTERVAL)),
                          wait_for_workers=False)
    return Watchdog(store, dist.get_rank(), world, timeout, hint, interval=interval, store_address=f"{addr}:{port}",
                    address=(addr, int(port))).start()


def _failure(exc: BaseException) -> str | None:
    """What the other ranks are told ended this one: None for a clean SystemExit."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return None if code in (None, 0) else f"exit {code}" if isinstance(code, int) else f"exit 1: {code}"
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


@contextmanager
def watching(timeout: float, hint: str = "", interval: float = INTERVAL) -> Iterator[Watchdog | None]:
    """Watch the other ranks while the block runs (from_env). An exception in it is first checked against a lost
    peer (`suspect`: a collective that failed because a rank is gone ends the process with the one line; not for
    SystemExit or KeyboardInterrupt, which are the job's own), then recorded for the other ranks, which stop with
    a line naming this rank. The job's last collective may stay inside: ranks that leave the block together do
    not report each other, as a verdict waits GRACE_S for this rank's own exit from it."""
    dog = from_env(timeout, hint, interval)
    if dog is None:
        yield None
        return
    try:
        yield dog
    except BaseException as exc:
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            dog.suspect()
        dog.stop(failure=_failure(exc))
        raise
    dog.stop()


if __name__ == "__main__":   # the heartbeat process (start_pulse)
    _host, _port, _rank, _pid, _start, _interval = sys.argv[2:8]
    pulse(_host, int(_port), int(_rank), int(_pid), _start, float(_interval))
