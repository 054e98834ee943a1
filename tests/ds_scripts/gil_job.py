"""Two gloo ranks under coat_ds.launch.watchdog.watching: rank 1 saves a state of --gib GiB with torch.save into a
buffer, which keeps its GIL for the whole copy of the storage (torch 2.13 releases it while it writes to a file, not
into a buffer), while rank 0 waits in a barrier. Prints `RESULT {"held": S}`: the longest stretch, in seconds, in
which rank 1's other threads could not run (a thread that ticks every 50 ms).
Used by tests/launched/test_lost_rank.py."""
from __future__ import annotations

import argparse
import io
import json
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from coat_ds.launch.teardown import torn_down
from coat_ds.launch.watchdog import watching


def gil_held(work: Callable[[], object]) -> float:
    """The longest gap between ticks of a thread that ticks every 50 ms while `work` runs."""
    ticks = [time.monotonic()]
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.05):
            ticks.append(time.monotonic())

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    time.sleep(0.2)
    work()
    time.sleep(0.2)
    done.set()
    thread.join()
    return max(b - a for a, b in zip(ticks, ticks[1:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-timeout", type=float, required=True)
    ap.add_argument("--interval", type=float, required=True)
    ap.add_argument("--gib", type=float, required=True)
    args, _ = ap.parse_known_args()   # and the launcher's --local_rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with torn_down(), watching(args.peer_timeout, interval=args.interval):
        state = torch.ones(int(args.gib * 2**28)) if rank == 1 else None
        dist.barrier()
        held = gil_held(lambda: torch.save({"state": state}, io.BytesIO())) if rank == 1 else 0.0
        dist.barrier()
    if rank == 1:
        print("RESULT " + json.dumps({"held": held}), flush=True)


if __name__ == "__main__":
    main()
