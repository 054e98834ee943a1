"""One JIT build of an op at a time, and a build that was stopped never blocks the next.

Why: torch's JIT builds (torch.utils.cpp_extension, under DeepSpeed's OpBuilder.jit_load) take turns through a
lock *file* in the build directory that only its builder removes. A build stopped mid-way (Ctrl-C on a first run,
a job ended by its launcher or a timeout) leaves the file, and every later load of the op waits for it forever,
saying nothing: the main job sat at step 0 of 200 that way here.

How: coat_ds's builders first take an flock on a file beside it (FLOCK). The kernel drops an flock with the
process that held it, and every coat_ds load of the op takes this one before torch's, so a lock file found while
holding it was left by a build that was stopped: it is removed, with one line that says so. A process that waits
for another's build says so once. Both lines start a line of their own (a progress bar may hold the current one).
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator

TORCH_LOCK = "lock"              # torch.utils.cpp_extension's FileBaton in the build directory
FLOCK = "coat_build.flock"


@contextmanager
def build_lock(directory: str, name: str) -> Iterator[None]:
    """Hold the op `name`'s build lock in its JIT `directory` (see the module's docstring) for the block."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, FLOCK), "a") as fh:   # closing it (or the process ending) drops the flock
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"\ncoat_ds: waiting for another process's build of {name} ({directory})", file=sys.stderr,
                  flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        _remove_stale(os.path.join(directory, TORCH_LOCK), name)
        yield


def _remove_stale(path: str, name: str) -> None:
    try:
        age_min = (time.time() - os.path.getmtime(path)) / 60
        os.remove(path)
    except FileNotFoundError:
        return
    print(f"\ncoat_ds: removed {path}, left {age_min:.0f} min ago by a build of {name} that was stopped (torch would "
          "have waited for it forever); building again", file=sys.stderr, flush=True)
