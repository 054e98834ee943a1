"""coat_ds.deepspeed.watchdog in one process: a Watchdog for rank 0 on a real TCPStore, its peer (rank 1) played by
hand through the store (a silent counter, a failure mark, a process that ends), the verdict caught instead of
ending the process. tests/launched/test_lost_rank.py kills real ranks of the main job."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import pytest
import torch.distributed as dist

from coat_ds.deepspeed import watchdog
from coat_ds.deepspeed.watchdog import Peer, Watchdog, start_time

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
    assert store.get("coat_ds/watchdog/beat/0").startswith(b"stopping:")   # the others stop with this verdict


def test_a_beating_or_finished_peer_is_not_lost(store):
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=0.5)
    dog.start()
    for i in range(12):   # 1.2 s of beats
        peer.set("coat_ds/watchdog/beat/1", str(i + 1))
        time.sleep(0.1)
    peer.set("coat_ds/watchdog/beat/1", "done")
    time.sleep(1.0)
    dog.stop()
    assert lines == [] and dog.verdict is None
    assert store.get("coat_ds/watchdog/beat/0") == b"done"


def test_a_failed_peer_is_reported_with_its_error(store):
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=60)
    dog.start()
    peer.set("coat_ds/watchdog/beat/1", "failed:OutOfMemoryError: CUDA out of memory")
    wait_for(lines, 5)
    assert lines and lines[0].startswith("error: rank 1 (node 1, local rank 0, host ") and \
        " failed: OutOfMemoryError: CUDA out of memory; every rank stops (exit 1)" in lines[0], lines


def test_a_failure_on_every_rank_at_once_is_not_reported(store):
    """A job that ends on every rank together (a save refused everywhere): this rank's own stop() comes within
    GRACE_S of seeing the peer's failure, and nothing is reported."""
    peer = play_peer(store)
    dog, lines = rank0(store, timeout=60)
    dog.start()
    peer.set("coat_ds/watchdog/beat/1", "failed:exit 1")
    time.sleep(0.2)
    dog.stop(failure="exit 1")
    time.sleep(0.5)
    assert lines == []
    assert store.get("coat_ds/watchdog/beat/0") == b"failed:exit 1"


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
    peer.set("coat_ds/watchdog/beat/1", "stopping:" + json.dumps({"line": line, "gone": [2]}))
    wait_for(lines, 5)
    assert lines == [line]


def test_rank_0s_store_gone_is_reported_as_rank_0_lost():
    """Rank 1's view when rank 0 (on another node) and the store it hosts are gone."""
    host = subprocess.Popen([sys.executable, "-c", "import sys, time, json, torch.distributed as d; "
                             "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
                             "print(s.port, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        master = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=5))
        master.set("coat_ds/watchdog/peer/0", json.dumps(asdict(Peer(0, "0", "elsewhere", 0, 4242, ""))))
        master.set("coat_ds/watchdog/beat/0", "0")
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
