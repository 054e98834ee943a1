"""coat_ds.op_builder.jit_lock: a JIT build stopped mid-way (its torch lock file left behind) does not block the
next load of the op, which torch alone would leave waiting forever; a process waiting for another's build says so
(only when it waits longer than a load of a built op takes) and goes on once that process is gone, killed or not;
a filesystem without flock builds under torch's lock alone, after one line. Real processes and a real SIGKILL; no
build (the lock is what is tested; tests/test_packaging.py builds an op through it)."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from coat_ds.op_builder import jit_lock
from coat_ds.op_builder.jit_lock import FLOCK, TORCH_LOCK, build_lock
from harness import child_env

# jit_lock.py loaded by its path, alone (the standard library only): through coat_ds.op_builder each process imported
# torch and DeepSpeed first, ~2.5 s of CPU, longer than most of the holds and waits tested
HOLD = textwrap.dedent("""
    import importlib.util, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("jit_lock", sys.argv[4])
    jit_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jit_lock)
    TORCH_LOCK, build_lock = jit_lock.TORCH_LOCK, jit_lock.build_lock
    d = sys.argv[1]
    jit_lock.QUIET_S = float(sys.argv[3])
    with build_lock(d, "op"):
        Path(d, TORCH_LOCK).touch()   # torch's own lock, as a build in progress holds it
        print("building", flush=True)
        time.sleep(float(sys.argv[2]))
    print("built", flush=True)
""")


def hold(directory, seconds: float, quiet_s: float = jit_lock.QUIET_S) -> subprocess.Popen:
    """A process that holds the op's locks for `seconds` once it has them (waiting for them quietly `quiet_s`)."""
    cmd = [sys.executable, "-c", HOLD, str(directory), str(seconds), str(quiet_s), jit_lock.__file__]
    return subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def building(proc: subprocess.Popen) -> None:
    """Wait until `proc` holds the locks (past whatever importing DeepSpeed prints first)."""
    for line in proc.stdout:
        if line.strip() == "building":
            return
    raise AssertionError(f"ended without building: {proc.stderr.read()[-2000:]}")


def said(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("coat_ds:")]


def test_a_lock_file_left_by_a_stopped_build_is_removed_with_one_line(tmp_path, capsys):
    (tmp_path / TORCH_LOCK).touch()
    os.utime(tmp_path / TORCH_LOCK, (time.time() - 7200, time.time() - 7200))
    with build_lock(str(tmp_path), "coat_cpu_adam"):
        assert not (tmp_path / TORCH_LOCK).exists() and (tmp_path / FLOCK).exists()
    err = said(capsys.readouterr().err)
    assert err == [f"coat_ds: removed {tmp_path / TORCH_LOCK}, left 120 min ago by a build of coat_cpu_adam that was "
                   "stopped (torch would have waited for it forever); building again"], err


def test_no_lock_file_no_line(tmp_path, capsys):
    with build_lock(str(tmp_path), "op"):
        pass
    assert capsys.readouterr().err == ""


def test_a_build_killed_mid_way_lets_the_waiting_one_go_on(tmp_path):
    """A builds (holds both locks) and is killed; B, waiting, says so, then takes over and removes A's lock file."""
    a = hold(tmp_path, 120)
    building(a)
    b = hold(tmp_path, 0, quiet_s=1.0)
    first = next(ln for ln in b.stderr if ln.startswith("coat_ds:") or b.poll() is not None)   # B waits
    assert first.strip() == f"coat_ds: waiting for another process's build of op ({tmp_path})", first
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=30)
    t0 = time.monotonic()
    out, err = b.communicate(timeout=60)
    assert b.returncode == 0 and time.monotonic() - t0 < 30 and out.split()[-2:] == ["building", "built"], (out, err)
    lines = said(err)
    assert len(lines) == 1 and lines[0].startswith(f"coat_ds: removed {tmp_path / TORCH_LOCK}, left 0 min ago by a "
                                                   "build of op"), err


def test_a_build_that_ends_hands_over_without_a_line_about_stale_locks(tmp_path):
    a = hold(tmp_path, 2)
    building(a)
    os.remove(tmp_path / TORCH_LOCK)   # as torch's builder does when it ends well
    b = hold(tmp_path, 0)
    a.communicate(timeout=60)
    out, err = b.communicate(timeout=60)
    assert b.returncode == 0 and "removed" not in err and out.split()[-1] == "built", err


def test_a_wait_as_short_as_loading_a_built_op_says_nothing(tmp_path):
    """The ranks of a job load a built op together: the one that waits the ~0.3 s another holds the lock for says
    nothing (every run printed 'waiting for another process's build' here, with nothing being built)."""
    a = hold(tmp_path, 1.0)
    building(a)
    os.remove(tmp_path / TORCH_LOCK)   # a load of a built op: torch's lock goes with it
    t0 = time.monotonic()
    b = hold(tmp_path, 0)
    out, err = b.communicate(timeout=60)
    a.communicate(timeout=60)
    assert b.returncode == 0 and out.split()[-1] == "built" and said(err) == [], err
    assert time.monotonic() - t0 < jit_lock.QUIET_S + 30


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK], ids=errno.errorcode.get)
def test_a_filesystem_without_flock_builds_under_torchs_lock_with_one_line(tmp_path, capsys, monkeypatch, code):
    """A shared filesystem without flock (Lustre's noflock: ENOSYS; others EOPNOTSUPP or ENOLCK) made every JIT load
    fail. Now the block runs, after one line, and a lock file found there is left alone: it may be another
    process's build in progress, which only the flock could have told from a stopped one."""
    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / TORCH_LOCK).touch()
    ran = False
    with build_lock(str(tmp_path), "coat_cpu_adam"):
        ran = True
    assert ran and (tmp_path / TORCH_LOCK).exists()
    err = said(capsys.readouterr().err)
    assert err == [f"coat_ds: {tmp_path} has no flock ({os.strerror(code)}): building coat_cpu_adam under torch's "
                   f"lock alone; a build stopped mid-way there leaves {tmp_path / TORCH_LOCK}, which later loads "
                   "wait on until it is removed"], err


def test_another_flock_error_is_raised(tmp_path, monkeypatch):
    def bad(fd, op):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(fcntl, "flock", bad)
    with pytest.raises(OSError, match="Bad file descriptor"):
        with build_lock(str(tmp_path), "op"):
            pass
