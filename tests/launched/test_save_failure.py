"""A checkpoint save that fails says why in one line (coat_ds.deepspeed.checkpoint.save): torch.save's own error on a
full disk names no cause, so the reason comes from the OS. Real failures only: a file size limit (RLIMIT_FSIZE, no
root needed) and a tmpfs out of inodes (a private mount namespace, where the machine allows one), which the
free-space check before a save (test_checkpoint_space.py) cannot see coming."""
import errno
import subprocess
import sys
import textwrap

import pytest

from coat_ds.deepspeed.checkpoint.save import write_failure
from harness import ROOT, TRAIN_SMALL, child_env, finish, ranks_launcher, tmpfs_ok


def test_a_file_size_limit_is_named_not_torchs_enforce_fail(tmp_path):
    """torch.save past RLIMIT_FSIZE raises `[enforce fail at inline_container.cc] . unexpected pos`; the line says
    the file is too large and how much space is free."""
    code = textwrap.dedent(f"""
        import resource, torch
        from coat_ds.deepspeed.checkpoint.save import write_failure
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
        try:
            torch.save(torch.zeros(1 << 20), {str(tmp_path / 'x.pt')!r})
        except RuntimeError as exc:
            print("TORCH:", str(exc).splitlines()[0])
            print("LINE:", write_failure({str(tmp_path / 'x.pt')!r}, exc))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                         timeout=300).stdout
    assert "TORCH: [enforce fail" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("LINE:"))
    assert line.startswith("LINE: file too large (the file size limit, `ulimit -f`) (") and "MiB free of" in line


def test_an_errno_in_the_chain_is_used():
    try:
        try:
            raise OSError(errno.ENOSPC, "disk full")
        except OSError as inner:
            raise RuntimeError("basic_ios::clear: iostream error") from inner
    except RuntimeError as exc:
        assert write_failure("/no/such/dir/file.pt", exc).startswith("no space left on device (")


@pytest.mark.skipif(not tmpfs_ok(), reason="needs `unshare -rm` and a tmpfs mount in a user namespace")
def test_main_job_on_a_full_disk_says_why_and_keeps_latest(tmp_path):
    """The main job (2 CPU ranks) saves into a tmpfs with room for the bytes of two checkpoints (~9 MiB each for the
    tiny model) but files for one: 12 inodes, 10 in use after step 2's. The free-space check passes and step 4's
    write fails, mid-run: one line of its own (before issue 58, on the progress bar's line), the partial tag removed,
    `latest` on step 2, exit code 1."""
    run = tmp_path / "run"
    run.mkdir()
    job = [*ranks_launcher(2), "examples/train.py", "--deepspeed", "ds_configs/zero2_coat.json", "--save-dir", str(run),
           *TRAIN_SMALL, "--steps", "6", "--save-every", "2", "--eval-every", "0"]
    # the listing is taken inside the namespace: the tmpfs is gone once it exits
    script = (f'mount -t tmpfs -o size=64m,nr_inodes=12 tmpfs "{run}" && "$@"; rc=$?; '
              f'echo "LS:" $(ls "{run}/checkpoints"); echo "LATEST:" $(cat "{run}/checkpoints/latest"); exit $rc')
    inner = ["unshare", "-rm", "sh", "-c", script, "sh", *job]
    proc = subprocess.Popen(inner, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True,
                            start_new_session=True)
    out = finish(proc)
    assert proc.returncode == 1, out[-3000:]
    errors = [ln for ln in out.split("\n") if "error: " in ln]   # a line of its own: not after the bar's \r
    assert len(errors) == 1 and errors[0].startswith("error: "), out[-3000:]
    assert errors[0].startswith(f"error: checkpoint step0000004 not saved to {run}/checkpoints: no space left on "
                                f"device (no inodes left: the filesystem's limit on files) (") and \
        f"MiB free of 64.0 MiB on {run})" in errors[0], errors
    assert errors[0].endswith("removed the partial step0000004.tmp; `latest` still names step0000002"), errors
    listing = next(ln for ln in out.splitlines() if ln.startswith("LS:")).split()[1:]
    assert "step0000002" in listing and not any(n.endswith(".tmp") for n in listing), listing
    assert next(ln for ln in out.splitlines() if ln.startswith("LATEST:")) == "LATEST: step0000002"
    assert "Traceback" not in out, out[-3000:]
