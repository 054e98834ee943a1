"""How a distributed job's process ends, so that its exit code is the job's own.

Why: a process left to Python's finalization with a live process group can abort (SIGABRT, "terminate called
without an active exception": gloo's worker threads still hold objects that reach back into the interpreter being
torn down; pytorch/pytorch#190489). A failure's exit code 1 then reads 134 (250 through a launcher), with a line
of C++ beside the job's own, at random (CI saw it on the main job's refused save).

How: a job that ends well destroys its process group (torch's documented teardown, every rank past the job's last
barrier; bounded by DESTROY_S); one that fails ends its process at once with its exit code (os._exit, after
flushing what it printed), as the watchdog does for a lost rank: destroying a group whose peers may still be inside
a collective can block. A script that is not ours (an HF Trainer user's) gets the same from at_exit, which `import
coat_ds` registers with atexit: a group still alive when the interpreter exits is destroyed first.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Iterator

DESTROY_S = 60.0   # seconds the process group's teardown may take once the job has ended


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed or broken: nothing more can be said there
            pass
    os._exit(code)


def exit_code(exc: SystemExit) -> int:
    """What Python itself would exit with: a message's 1 (printed to stderr first, as Python does), else the code."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


@contextmanager
def torn_down() -> Iterator[None]:
    """Around a job of an initialized torch.distributed process group (see the module's docstring): a block that
    returns, or exits with code 0, destroys the group; any other exit ends the process at once with its code
    (an uncaught exception: its traceback, then 1)."""
    import torch.distributed as dist

    try:
        yield
    except SystemExit as exc:
        code = exit_code(exc)
        if code != 0:
            _flush_and_exit(code)
        _destroy(dist)
        raise
    except KeyboardInterrupt:
        _flush_and_exit(130)
    except BaseException:   # noqa: BLE001 - said as Python would say it, then ended as above
        traceback.print_exc()
        _flush_and_exit(1)
    _destroy(dist)


def _destroy(dist) -> None:
    """torch's teardown, bounded: one that hangs (pytorch/pytorch#75097: NCCL's communicators abort together) ends
    the process after DESTROY_S with the job's exit code 0, everything having been written by then."""
    if not dist.is_initialized():
        return
    timer = threading.Timer(DESTROY_S, _teardown_hung)
    timer.daemon = True
    timer.start()
    dist.destroy_process_group()
    timer.cancel()


def _teardown_hung() -> None:
    print(f"\nwarning: the process group's teardown took over {DESTROY_S:.0f} s; the job had ended: exit 0",
          file=sys.stderr)
    _flush_and_exit(0)


def at_exit() -> None:
    """atexit's hook (registration.register): the process group of a script that ends with one alive is destroyed
    before Python's finalization, bounded as above; after an uncaught exception (its traceback printed, the exit
    code 1) the process ends at once with 1 instead, as torn_down does. Nothing without an initialized group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    failed = getattr(sys, "last_value", None)   # set by the interpreter for an uncaught exception (not SystemExit)
    if failed is not None and not isinstance(failed, SystemExit):
        _flush_and_exit(1)
    _destroy(dist)
