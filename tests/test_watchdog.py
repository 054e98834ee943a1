"""coat_ds.launch.watchdog: a Watchdog for rank 0 on a real TCPStore, its peer (rank 1) played by hand through the
store (a silent counter, a failure mark, a process that ends or is frozen) or a real process whose main thread holds
the GIL, the verdict caught instead of ending the process; the heartbeat process (pulse) against a real process
that runs, stops and ends. tests/launched/test_lost_rank.py kills, freezes and starves real ranks of jobs."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from coat_ds.launch import watchdog
from coat_ds.launch.watchdog import Peer, Watchdog, start_pulse, start_time
from harness import child_env

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def _short_waits(monkeypatch):
    monkeypatch.setattr(watchdog, "GRACE_S", 0.3)
    monkeypatch.setattr(watchdog, "SUSPECT_S", 0.6)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


_STARTED: list[Watchdog] = []


@pytest.fixture(autouse=True)
def _stop_watchdogs():
    """No watchdog thread outlives its test (one left at interpreter exit aborts the process)."""
    yield
    while _STARTED:
        _STARTED.pop().stop()


def client(master) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def play_peer(master, node: str = "1", pid: int = 4242, start: str = "") -> dist.TCPStore:
    """Rank 1, published by hand: on another node unless `node` is this one's."""
    peer = client(master)
    peer.set("coat_ds/watchdog/peer/1", json.dumps(asdict(Peer(1, node, HOST, 0, pid, start))))
    peer.set("coat_ds/watchdog/beat/1", "0")
    peer.set("coat_ds/watchdog/state/1", "up")
    return peer


def rank0(master, timeout: float, **kw) -> tuple[Watchdog, list]:
    lines: list = []
    dog = Watchdog(client(master), 0, 2, timeout, hint="resume with --resume", on_verdict=lines.append,
                   interval=0.1, **kw)
    _STARTED.append(dog)
    return dog, lines


def wait_for(lines: list, seconds: float) -> float:
    t0 = time.monotonic()
    while not lines and time.monotonic() - t0 < seconds:
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_silent_peer_is_lost_after_the_timeout_and_named(store):
    play_peer(store)
    dog, lines = rank0(store, timeout=1.0)
    dog.start()
    took = wait_for(lines, 10)
    assert lines == [f"error: rank 1 (node 1, local rank 0, host {HOST}, pid 4242) was lost: no heartbeat for 1 s; "
                     "every rank stops (exit 1); resume with --resume"], lines
    assert 1.0 <= took < 3.0
    assert dog.verdict.gone == (1,)
    assert store.get("coat_ds/watchdog/state/0").startswith(b"stopping:")   # the others stop with this verdict


def test_a_beating_or_finished_peer_is_not_lost(store):
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=0.5)
    dog.start()
    for i in range(12):   # 1.2 s of beats
        peer.set("coat_ds/watchdog/beat/1", str(i + 1))
        time.sleep(0.1)
    peer.set("coat_ds/watchdog/state/1", "done")
    time.sleep(1.0)
    dog.stop()
    assert lines == [] and dog.verdict is None
    assert store.get("coat_ds/watchdog/state/0") == b"done"


class SlowRead:
    """A client whose `slow`-th multi_get waits `wait_s` first, as the watchdog thread waits there for the GIL its main
    thread holds, the peer beating once meanwhile; `returned`: when that read ended."""

    def __init__(self, master, peer: dist.TCPStore, slow: int, wait_s: float):
        self.inner, self.peer, self.slow, self.wait_s = client(master), peer, slow, wait_s
        self.calls, self.returned = 0, 0.0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls += 1
        if self.calls != self.slow:
            return self.inner.multi_get(keys)
        time.sleep(self.wait_s)
        self.peer.add("coat_ds/watchdog/beat/1", 1)
        values = self.inner.multi_get(keys)
        self.returned = time.monotonic()
        return values


def test_a_beat_read_after_a_long_wait_counts_from_its_reading(store):
    """The look that waited 1.5 s inside the store's read saw the peer's beat: the peer, silent after it, is lost a
    whole timeout (1 s) later, not at the next look (which dated that beat from before the wait: a CI run's rank 1,
    holding its GIL, named a beating rank 0 lost)."""
    peer = play_peer(store)
    seen: list = []
    slow = SlowRead(store, peer, slow=2, wait_s=1.5)
    dog = Watchdog(slow, 0, 2, 1.0, on_verdict=lambda line: seen.append((time.monotonic(), line)), interval=0.1)
    _STARTED.append(dog)
    dog.start()
    wait_for(seen, 20)
    assert seen and "rank 1 (" in seen[0][1] and "was lost: no heartbeat for " in seen[0][1], seen
    assert slow.returned and seen[0][0] - slow.returned >= 1.0, (seen[0][0] - slow.returned, seen)


def test_a_failed_peer_is_reported_with_its_error(store):
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=60)
    dog.start()
    peer.set("coat_ds/watchdog/state/1", "failed:OutOfMemoryError: CUDA out of memory")
    wait_for(lines, 5)
    assert lines and lines[0].startswith("error: rank 1 (node 1, local rank 0, host ") and \
        " failed: OutOfMemoryError: CUDA out of memory; every rank stops (exit 1)" in lines[0], lines


def test_a_failure_on_every_rank_at_once_is_not_reported(store):
    """A job that ends on every rank together (a save refused everywhere): this rank's own stop() comes within
    GRACE_S of seeing the peer's failure, and nothing is reported."""
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=60)
    dog.start()
    peer.set("coat_ds/watchdog/state/1", "failed:exit 1")
    time.sleep(0.2)
    dog.stop(failure="exit 1")
    time.sleep(0.5)
    assert lines == []
    assert store.get("coat_ds/watchdog/state/0") == b"failed:exit 1"


def test_a_peer_process_that_ends_on_this_node_is_lost_at_once(store):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        play_peer(store, node=HOST, pid=proc.pid, start=start_time(proc.pid))
        dog, lines = rank0(store, timeout=60)
        dog.start()
        time.sleep(0.3)
        assert lines == []
        proc.kill()   # a zombie until reaped: ended all the same
        took = wait_for(lines, 5)
    finally:
        proc.kill()
        proc.wait()
    assert lines and lines[0].startswith(f"error: rank 1 (node {HOST}, local rank 0, host {HOST}, pid {proc.pid}) "
                                         "was lost: its process ended;"), lines
    assert took < 2.0


def test_suspect_shortens_the_wait_after_a_failed_collective(store):
    play_peer(store)
    dog, lines = rank0(store, timeout=60)
    dog.start()
    time.sleep(0.8)
    assert lines == []
    t0 = time.monotonic()
    assert dog.suspect()
    assert time.monotonic() - t0 < 2.0 and "was lost: no heartbeat for 1 s" in lines[0], lines


def test_suspect_returns_false_when_every_peer_beats(store):
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=60)
    dog.start()
    beating = threading.Event()

    def beat():
        i = 0
        while not beating.is_set():
            i += 1
            peer.set("coat_ds/watchdog/beat/1", str(i))
            time.sleep(0.1)

    t = threading.Thread(target=beat)
    t.start()
    try:
        assert not dog.suspect()
    finally:
        beating.set()
        t.join()
        dog.stop()
    assert lines == []


def test_a_verdict_published_by_another_rank_is_adopted_and_its_node_prints_once(store):
    """Rank 1 (another node) stopped for rank 2's loss: rank 0 stops with the same line and prints it, as the
    lowest rank of its node; a second rank on rank 0's node would stay quiet."""
    peer = play_peer(store)
    line = "error: rank 2 (node 1, ...) was lost: its process ended; every rank stops (exit 1)"
    dog, lines = rank0(store, timeout=60)
    dog.start()
    peer.set("coat_ds/watchdog/state/1", "stopping:" + json.dumps({"line": line, "gone": [2]}))
    wait_for(lines, 5)
    assert lines == [line]


def store_host() -> tuple[subprocess.Popen, int, dist.TCPStore]:
    """(process, port, a client) of rank 0's store hosted in a process of its own, as rank 0 would host it."""
    host = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                             "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
                             "print(s.port, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    port = int(host.stdout.readline())
    return host, port, dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                     timeout=timedelta(seconds=5))


def test_rank_0s_store_gone_is_reported_as_rank_0_lost():
    """Rank 1's view when rank 0 (on another node) and the store it hosts are gone."""
    host, port, master = store_host()
    try:
        master.set("coat_ds/watchdog/peer/0", json.dumps(asdict(Peer(0, "0", "elsewhere", 0, 4242, ""))))
        master.set("coat_ds/watchdog/beat/0", "0")
        master.set("coat_ds/watchdog/state/0", "up")
        lines: list = []
        dog = Watchdog(client(master), 1, 2, 1.0, on_verdict=lines.append, interval=0.1,
                       store_address=f"127.0.0.1:{port}")
        _STARTED.append(dog.start())
        host.kill()
        wait_for(lines, 10)
    finally:
        host.kill()
        host.wait()
    assert lines and lines[0].startswith("error: rank 0 (node 0, local rank 0, host elsewhere, pid 4242) was lost: "
                                         f"the job's store it hosts (127.0.0.1:{port}) stopped answering for "), lines
    assert dog.verdict.gone == (0,)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_frozen_peer_on_this_node_is_ended_with_the_verdict(store):
    """A stopped rank on this node (SIGSTOP) is lost after the timeout, as before, and is now ended (SIGKILL): a
    stopped process ignores the SIGTERM of DeepSpeed's launcher, which then waits 30 s before its SIGKILL."""
    proc = sleeper()
    try:
        play_peer(store, node=HOST, pid=proc.pid, start=start_time(proc.pid))
        proc.send_signal(signal.SIGSTOP)
        dog, lines = rank0(store, timeout=0.5)
        dog.start()
        wait_for(lines, 10)
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()
    assert lines and "was lost: no heartbeat for 1 s; every rank stops (exit 1)" in lines[0], lines
    assert dog.verdict.silent == (1,) and proc.returncode == -signal.SIGKILL


def test_a_silent_peer_on_another_node_is_not_signalled(store):
    """Only a rank of this node is ended: the pid a rank on another node published is not this node's."""
    proc = sleeper()
    try:
        play_peer(store, node="1", pid=proc.pid, start=start_time(proc.pid))
        dog, lines = rank0(store, timeout=0.5)
        dog.start()
        wait_for(lines, 10)
        time.sleep(0.3)
        assert lines and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_rank_0_ended_on_this_node_is_named_without_a_call_to_its_store(capfd):
    """Rank 1's view when rank 0, on this node, is killed: the store went with it, and every call to it printed a
    page of torch's C++ warnings (TCPStore.cpp, a stack of 20 frames) before the line; /proc says it first now."""
    host, port, master = store_host()
    try:
        master.set("coat_ds/watchdog/peer/0",
                   json.dumps(asdict(Peer(0, HOST, HOST, 0, host.pid, start_time(host.pid)))))
        master.set("coat_ds/watchdog/beat/0", "0")
        master.set("coat_ds/watchdog/state/0", "up")
        lines: list = []
        dog = Watchdog(client(master), 1, 2, 60, on_verdict=lines.append, interval=0.1)
        _STARTED.append(dog.start())
        time.sleep(0.3)
        host.kill()
        wait_for(lines, 10)
        dog.stop()
    finally:
        host.kill()
        host.wait()
    assert lines and lines[0].startswith(f"error: rank 0 (node {HOST}, local rank 0, host {HOST}, pid {host.pid}) "
                                         "was lost: its process ended;"), lines
    err = capfd.readouterr().err
    assert "TCPStore" not in err and "Exception raised from" not in err, err[-3000:]


def beats(store, rank: int) -> int:
    return int(store.get(f"coat_ds/watchdog/beat/{rank}"))


def wait_connected(pid: int, port: int, seconds: float = 120) -> None:
    """Until process `pid` holds a TCP connection to `port` (a pulse, once it has imported torch)."""
    t0 = time.monotonic()
    proc = psutil.Process(pid)
    while not any(c.raddr and c.raddr.port == port for c in proc.net_connections("tcp")):
        assert proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() - t0 < seconds, "the pulse never connected"
        time.sleep(0.1)


def test_the_pulse_beats_while_its_process_runs_not_while_stopped_and_ends_with_it(store):
    proc = sleeper()
    pulse = start_pulse("127.0.0.1", store.port, 1, proc.pid, start_time(proc.pid), 0.1)
    try:
        wait_connected(pulse.pid, store.port)
        time.sleep(0.5)
        first = beats(store, 1)
        time.sleep(0.5)
        assert beats(store, 1) >= first + 3                 # it runs: beats
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        stopped = beats(store, 1)
        time.sleep(0.6)
        assert beats(store, 1) == stopped                   # frozen: silent
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        assert beats(store, 1) >= stopped + 2
        proc.kill()
        proc.wait()
        pulse.wait(timeout=5)                               # it ended: the pulse goes
    finally:
        proc.kill()
        proc.wait()
        pulse.kill()
        pulse.wait()
    assert pulse.returncode == 0


# rank 1 of the job, on its own: a Watchdog (with its pulse, or without: the watchdog before the pulse), then its
# main thread in a C call that keeps the GIL for HOLD_S (ctypes.PyDLL: the call is made with the GIL held), timed by a
# thread that ticks every 50 ms. What holds the GIL in a real job: torch 2.13 releases it while torch.save writes a
# storage to a file (2 GiB: the ticks never stopped for more than 0.07 s), not while it copies one into a buffer
# (1 GiB: 1.5 s on a quiet 2-core machine, 9 s on a busy one; tests/launched/test_lost_rank.py saves 2 GiB so)
HOLD_S = 2.0
RANK1 = textwrap.dedent("""
    import ctypes, sys, threading, time
    from datetime import timedelta
    import torch.distributed as dist
    from coat_ds.launch.watchdog import Watchdog
    port, hold_s, with_pulse = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    dog = Watchdog(store, 1, 2, 60, on_verdict=print, interval=0.1,
                   address=("127.0.0.1", port) if with_pulse else None).start()
    print("ready", dog.pulse.pid if dog.pulse else 0, flush=True)
    sys.stdin.readline()
    ticks = [time.monotonic()]
    done = threading.Event()
    def tick():
        while not done.wait(0.05):
            ticks.append(time.monotonic())
    threading.Thread(target=tick, daemon=True).start()
    time.sleep(0.2)
    ctypes.PyDLL(None).usleep(int(hold_s * 1e6))
    time.sleep(0.2)
    done.set()
    print("held", max(b - a for a, b in zip(ticks, ticks[1:])), flush=True)
    sys.stdin.readline()
    dog.stop()
""")


@pytest.mark.parametrize("with_pulse", [True, False], ids=["pulse", "thread_only"])
def test_a_rank_holding_the_gil_past_the_timeout_is_not_lost(store, with_pulse):
    """Rank 1's main thread holds the GIL for 2 s, rank 0's timeout is 0.5 s: rank 1's watchdog thread cannot beat,
    its pulse does, and rank 0 sees it there. Without the pulse (the watchdog before it) the same hold is taken for
    a frozen rank: named lost, and ended."""
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(store.port), str(HOLD_S), "1" if with_pulse else "0"],
                             env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dog, lines = rank0(store, timeout=0.5)
        dog.start()
        ready = next(ln for ln in rank1.stdout if ln.startswith("ready")).split()
        if with_pulse:
            wait_connected(int(ready[1]), store.port)
        rank1.stdin.write("\n")
        rank1.stdin.flush()
        held = next((float(ln.split()[1]) for ln in rank1.stdout if ln.startswith("held")), None)   # None: ended
        found = list(lines)
        if held is not None:
            rank1.stdin.write("\n")
            rank1.stdin.flush()
        rank1.wait(timeout=60)
        dog.stop()
    finally:
        rank1.kill()
        rank1.wait()
    if with_pulse:
        assert found == [] and held is not None and held > HOLD_S - 0.1 and rank1.returncode == 0, (found, held)
    else:
        assert found and "rank 1 (" in found[0] and "was lost: no heartbeat for " in found[0], found
        assert rank1.returncode == -signal.SIGKILL
