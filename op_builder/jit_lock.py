"""One JIT build of an op at a time, and a build that was stopped never blocks the next.

Why: torch's JIT builds (torch.utils.cpp_extension, under DeepSpeed's OpBuilder.jit_load) take turns through a
lock *file* in the build directory that only its builder removes. A build stopped mid-way (Ctrl-C on a first run,
a job ended by its launcher or a timeout) leaves the file, and every later load of the op waits for it forever,
saying nothing: the main job sat at step 0 of 200 that way here.

How: coat_ds's builders first take an flock on a file beside it (FLOCK). The kernel drops an flock with the
process that held it, and every coat_ds load of the op takes this one before torch's, so a lock file found while
holding it was left by a build that was stopped: it is removed, with one line that says so. A process that waits
for another's build says so once, after QUIET_S: the ranks of a job load a built op together, each holding the
lock for a fraction of a second, and that is no wait worth a line. On a filesystem without flock (some shared
ones: ENOSYS, EOPNOTSUPP, ENOLCK) the build goes on under torch's lock alone, after one line that says so; a lock
file found there may be another process's build in progress, so it is left alone. Every line starts a line of its
own (a progress bar may hold the current one).
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator

TORCH_LOCK = "lock"              # torch.utils.cpp_extension's FileBaton in the build directory
FLOCK = "coat_build.flock"
QUIET_S = 5.0                    # a wait shorter than this says nothing (loading a built op: 0.3 s on 2 cores)
NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}   # what a filesystem without flock says


@contextmanager
def build_lock(directory: str, name: str) -> Iterator[None]:
    """Hold the op `name`'s build lock in its JIT `directory` (see the module's docstring) for the block."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, FLOCK), "a") as fh:   # closing it (or the process ending) drops the flock
        if _lock(fh, directory, name):
            _remove_stale(os.path.join(directory, TORCH_LOCK), name)
        yield


def _say(line: str) -> None:
    print(f"\ncoat_ds: {line}", file=sys.stderr, flush=True)


def _lock(fh: IO, directory: str, name: str) -> bool:
    """Take the flock, waiting as long as another process holds it; False where the filesystem has none."""
    quiet_until = time.monotonic() + QUIET_S
    try:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= quiet_until:
                    break
                time.sleep(0.1)
        _say(f"waiting for another process's build of {name} ({directory})")
        fcntl.flock(fh, fcntl.LOCK_EX)
        return True
    except OSError as exc:
        if exc.errno not in NO_FLOCK:
            raise
        _say(f"{directory} has no flock ({os.strerror(exc.errno)}): building {name} under torch's lock alone; a "
             f"build stopped mid-way there leaves {os.path.join(directory, TORCH_LOCK)}, which later loads wait on "
             "until it is removed")
        return False


def _remove_stale(path: str, name: str) -> None:
    try:
        age_min = (time.time() - os.path.getmtime(path)) / 60
        os.remove(path)
    except FileNotFoundError:
        return
    _say(f"removed {path}, left {age_min:.0f} min ago by a build of {name} that was stopped (torch would have waited "
         "for it forever); building again")
