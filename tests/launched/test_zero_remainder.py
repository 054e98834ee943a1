"""`"coat": {"master_weights": "fp32_remainder"}` (issue 31) on 2 CPU ranks, one launched job
(tests/ds_scripts/zero_state_job.py, task `remainder`): ZeRO-1/2/3 against the fp32 master, 100 steps with
gradient clipping, checkpoints both ways; the same on one GPU (`gpu`).

The remainder master is exact, and an fp32 master's bf16 weights are written as the split's high half too
(nearest, ties away from zero: formats.remainder says why no 16-bit split can round ties to even), so the two
runs are bit-identical at every step: losses, masters and weights `==`. The job counts, per step, the fp32
run's masters on an exact tie with an even high half (about 2^-17 of the values a step writes), where a
nearest-even weight copy would have made the runs part: the runs must cross at least one.
"""
from __future__ import annotations

import os

import pytest

from harness import DS_SCRIPTS, launch_job, launch_worlds, require_launcher, task_result

JOB = DS_SCRIPTS / "zero_state_job.py"
REMAINDER = [f"remainder:{s}:bf16" for s in (1, 2, 3)]
TASKS = REMAINDER + ["refuse_remainder:2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_worlds(tmp_path_factory, "rem", JOB, w2=(TASKS, 2))


def check_bit_identical(out: dict) -> None:
    """100 steps: losses, then masters and weights at the end, `==`; an even tie crossed on the way."""
    assert len(out["fp32"]) == len(out["fp32_ties"]) == 100
    assert out["fp32_remainder"] == out["fp32"]
    assert out["masters_equal"] and out["weights_equal"]
    assert sum(out["fp32_ties"]) > 0, out["fp32_ties"]
    assert out["remainder_dtypes"] == ["torch.bfloat16"]  # DeepSpeed's fp32 partition is gone


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_remainder_master_trains_bit_identically_to_the_fp32_master(runs, stage):
    check_bit_identical(task_result(runs, "w2", f"remainder:{stage}:bf16"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_remainder_checkpoints_are_fp32_masters(runs, stage):
    """Saved as fp32 masters (bit-identical to the live ones); resume exact; the file loads into an fp32 engine
    exactly and into bf16_sr rounded once; an fp32-master checkpoint loads into remainders exactly."""
    out = task_result(runs, "w2", f"remainder:{stage}:bf16")
    assert out["saved_dtypes"] == "torch.float32" and out["saved_exact"]
    assert out["resumed"] == out["fp32_remainder"][60:]
    assert out["into_fp32_exact"] and out["into_bf16_sr_exact"] and out["from_fp32_exact"]


def test_remainder_refused_under_offload(runs):
    out = task_result(runs, "w2", "refuse_remainder:2")
    for case in ("offload_z2", "offload_z3"):
        assert out[case] == ("coat.master_weights='fp32_remainder' keeps bf16 weights + int16 remainders on the "
                             "device; under Offload the host master would cost what DeepSpeed's fp32 one does (4 "
                             "B/param); allowed there: 'fp32' (exact) or 'bf16_sr'"), case
    assert "needs a bf16 model" in out["fp32_model"]


@pytest.mark.gpu
def test_remainder_master_is_the_fp32_master_on_one_gpu(tmp_path):
    """The same job on one GPU (the CUDA kernel, bf16): bit-identical to the fp32 master over 100 steps,
    ZeRO-1/2/3, and its checkpoints as on the CPU."""
    require_launcher()
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    res = {"g1": launch_job(str(tmp_path / "g1.json"), ckpt, REMAINDER, 1, job=JOB)}
    for task in REMAINDER:
        out = task_result(res, "g1", task)
        check_bit_identical(out)
        assert out["saved_exact"] and out["resumed"] == out["fp32_remainder"][60:], task
        assert out["into_fp32_exact"] and out["into_bf16_sr_exact"] and out["from_fp32_exact"], task
