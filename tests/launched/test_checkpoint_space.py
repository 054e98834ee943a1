"""A checkpoint save the filesystem cannot hold is refused before anything is written (coat_ds.deepspeed.checkpoint.
space), in one line that says what it needs and what is free, on every rank; `latest` and the earlier tags stay.
  - the estimate against the bytes real saves put on disk, and the refusal when one rank sees too little free space
    (engine.save_checkpoint of CoatAdamW engines on 2 ranks: tests/ds_scripts/space_job.py);
  - the main job on a 10 MiB tmpfs, which holds its first checkpoint and not its second (a real filesystem's free
    space, in a private mount namespace: `unshare -rm`, skipped where the machine allows none)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from coat_ds.deepspeed.checkpoint.space import MARGIN, SLACK
from harness import DS_SCRIPTS, ROOT, TRAIN_SMALL, child_env, finish, launch_results, ranks_launcher, tmpfs_ok

_RESULTS: dict = {}


@pytest.fixture
def saves(tmp_path):
    """space_job.py's results on 2 ranks, launched once for the module."""
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs")
    if not _RESULTS:
        out = tmp_path / "r.json"
        _RESULTS.update(launch_results([*ranks_launcher(2), str(DS_SCRIPTS / "space_job.py"), "--out", str(out),
                                        "--ckpt", str(tmp_path)], out))
    return _RESULTS


@pytest.mark.parametrize("config", ["z1_fp32", "z2_bf16", "z3_bf16", "z2_bf16_sr", "z2_offload"])
def test_the_estimate_covers_what_a_save_writes_and_little_more(saves, config):
    """The ranks' estimates, summed, are at least the tag's bytes on disk (with DeepSpeed's two scripts, 41 KB), and
    without the margin and the slack within 1.6% of them: the tensors the save will hold, measured as torch.save
    writes them; so a save that fits is not refused (measured 2026-12-02: z3_bf16's tensors 1.53% above its files,
    the other configurations within 1.5%)."""
    r = saves[config]
    assert "error" not in r, r.get("trace")
    need, on_disk = sum(r["estimates"]), r["on_disk"]
    tensors = (need - SLACK * len(r["estimates"])) / (1 + MARGIN)
    assert on_disk + 41_070 <= need and abs(tensors - on_disk) <= 0.016 * on_disk, (config, r)


def test_a_save_one_rank_cannot_hold_is_refused_on_every_rank_and_writes_nothing(saves):
    """Rank 1 sees 1 MiB free (space.disk patched there only): both ranks raise the same one-line error from
    engine.save_checkpoint, and the save directory, `latest` included, is as it was."""
    r = saves["z2_bf16"]["refused"]
    first, second = r["errors"]
    assert first == second and "\n" not in first, r
    assert first.startswith("checkpoint t2 not saved to ") and " free there (estimated from the tensors to save, " \
        "+1.5%); nothing written; `latest` still names t" in first and ", 1.0 MiB free there" in first, first
    assert r["after"] == r["before"] and r["latest"] == r["latest_before"] == "t", r


@pytest.mark.skipif(not tmpfs_ok(), reason="needs `unshare -rm` and a tmpfs mount in a user namespace")
def test_main_job_refuses_a_checkpoint_the_disk_cannot_hold(tmp_path):
    """The issue's case, small: 2 CPU ranks save into a 10 MiB tmpfs; step 2's checkpoint (8.98 MiB) fits (the margin
    of 5% + 1 MiB a rank refused it: issue 58), step 4's does not. The save is refused before writing: one line of
    its own (mid-run: not on the progress bar's line), exit 1, no step0000004*, `latest` on step0000002 and its files
    intact (checked in the namespace, where the tmpfs still is)."""
    run = tmp_path / "run"
    run.mkdir()
    job = [*ranks_launcher(2), "examples/train.py", "--deepspeed", "ds_configs/zero2_coat.json", "--save-dir", str(run),
           *TRAIN_SMALL, "--steps", "6", "--save-every", "2", "--eval-every", "0"]
    tag = run / "checkpoints" / "step0000002"
    check = f"from coat_ds.deepspeed.check import check_tag; check_tag('{tag}'); print('INTACT')"
    script = (f'mount -t tmpfs -o size=10m tmpfs "{run}" && "$@"; rc=$?; echo "LS:" $(ls -a "{run}/checkpoints"); '
              f'echo "LATEST:" $(cat "{run}/checkpoints/latest"); python -c "{check}"; exit $rc')
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", script, "sh", *job], cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = finish(proc)
    assert proc.returncode == 1, out[-3000:]
    errors = [ln for ln in out.split("\n") if "error: " in ln]   # a line of its own: not after the bar's \r
    assert len(errors) == 1 and errors[0].startswith("error: "), out[-3000:]
    assert errors[0].startswith(f"error: checkpoint step0000004 not saved to {run}/checkpoints: needs ") and \
        f" MiB on {run} (ranks 0, 1), " in errors[0] and errors[0].endswith(
            " MiB free there (estimated from the tensors to save, +1.5%); nothing written; `latest` still names "
            "step0000002"), errors
    listing = next(ln for ln in out.splitlines() if ln.startswith("LS:")).split()[1:]
    assert sorted(listing) == [".", "..", "latest", "step0000002", "zero_to_fp32.py", "zero_to_torch.py"], listing
    assert "LATEST: step0000002" in out.splitlines() and "INTACT" in out.splitlines(), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
