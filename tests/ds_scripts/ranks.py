"""Start a job script as N ranks on this machine, each with the environment and `--local_rank` that DeepSpeed's
launcher gives it (deepspeed/launcher/launch.py), standard library only:

    python tests/ds_scripts/ranks.py --num_gpus N --master_port PORT SCRIPT [ARG ...]

`deepspeed --num_gpus N` reaches the ranks through two Python processes that each import torch and DeepSpeed
(runner.py, then launch.py): seconds per launch on 2 cores, paid by every launched test. The tests of the launcher
itself (tests/launched/test_train.py's main command, test_fail_fast_examples.py's exit status through it, the
two-node run of test_deepspeed.py) keep it.
A rank that fails ends the others, as launch.py does; the exit status is the first failing rank's."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_gpus", type=int, required=True)
    ap.add_argument("--master_port", required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    world = a.num_gpus
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=a.master_port, WORLD_SIZE=str(world),
                CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, "-u", a.script, f"--local_rank={rank}", *a.args],
                              env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in range(world)]

    def end_all(*_):
        for p in procs:
            if p.poll() is None:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (end_all(), sys.exit(143)))
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            end_all()
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
