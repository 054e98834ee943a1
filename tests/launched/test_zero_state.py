"""ZeRO's training state for CoatAdamW (issue 16), in launched jobs (CPU accelerator, gloo).

Two launched jobs (tests/ds_scripts/zero_state_job.py):
  W1  world 1: bf16_sr master, ZeRO-2 (the world-size reference; its checkpoint re-partitions to 2 ranks)
  W2  world 2: coat_ds's ZeRO step against DeepSpeed's own (ZeRO-1/2/3; bf16 gradients, fp32-accumulated
      bf16, fp16 where the accelerator has it), bf16_sr / bf16_rn masters on the device and under Offload,
      cross-setting and re-partitioning loads, universal conversion, refusals; the fp32_remainder master against
      the fp32 one (last section: issue 31)

Part 1 is exact by construction (the kernel widens the same gradient and multiplies by the same fp32
scalar DeepSpeed would), so losses are compared with ==. bf16_sr is exact across world sizes because its
random bits are keyed by positions in parameters, not in partitions.
"""
from __future__ import annotations

import os

import pytest

from coat_ds.deepspeed.zero.master import MASTER_WEIGHTS
from harness import DS_SCRIPTS, SAVE_AT, STEPS, launch_job, launch_worlds, task_result as _task

JOB = DS_SCRIPTS / "zero_state_job.py"

pytestmark = pytest.mark.slow

EXACT = [f"exact:{s}:{d}" for s in (1, 2, 3) for d in ("bf16", "fp16")] + ["exact:2:bf16acc"]
GRADS = ["grads:1:bf16_sr", "grads:2:bf16_sr", "grads:2:fp32_remainder", "grads:3:bf16_sr", "grads:3:fp32_remainder"]
W1 = ["master:2:bf16_sr", "master:3:bf16_sr", "grads:2:bf16_sr", "grads:3:bf16_sr"]
W2 = EXACT + GRADS + ["master:2:bf16_sr", "master:1:bf16_sr:bf16grads", "master:3:bf16_sr", "master:2:bf16_rn",
              "master:2:bf16_sr:offload", "resume:2:bf16_sr:1", "resume:3:bf16_sr:1", "universal:2:bf16_sr:1",
              "cross:2:fp32:bf16_sr", "cross:2:bf16_sr:fp32", "cross:3:bf16_sr:fp32", "refuse:2",
              "master:2:fp32", "master:2:fp32_remainder"]
REMAINDER = [f"remainder:{s}:bf16" for s in (1, 2, 3)]
W2 += REMAINDER + ["refuse_remainder:2"]   # in the same launch: one import of torch and DeepSpeed per rank, not two


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_worlds(tmp_path_factory, "zs", JOB, w1=(W1, 1), w2=(W2, 2))


@pytest.mark.parametrize("task", EXACT)
def test_zero_step_is_deepspeeds_bit_for_bit(runs, task):
    """50 steps with gradient clipping (and fp16's loss scale): coat_ds's step == DeepSpeed's, resume exact,
    and no fp32 tensor of partition size is made in the step (DeepSpeed's makes one from bit16 gradients)."""
    out = _task(runs, "w2", task)
    assert len(out["coat"]) == STEPS and out["coat"] == out["deepspeed"]
    assert out["coat_resumed"] == out["coat"][SAVE_AT:]
    assert out["coat_skipped"] == out["deepspeed_skipped"]
    assert out["partition"] > out["coat_alloc"]
    if not task.endswith("acc"):  # with fp32 accumulation DeepSpeed steps on its fp32 buffer in place too
        assert out["deepspeed_alloc"] >= out["partition"]


@pytest.mark.parametrize("job,task", [("w1", "grads:2:bf16_sr"), ("w1", "grads:3:bf16_sr")] + [("w2", t) for t in GRADS])
def test_per_parameter_gradients_train_as_the_partition_buffer(runs, job, task):
    """coat.gradients "per_parameter" (the default) == DeepSpeed's partition buffer, loss for loss and in every
    rank's final masters (world 1 accumulates two micro-batches, world 2 partitions), with each gradient piece
    the step reads in a storage of its own (allocated as backward reached its parameter), where DeepSpeed's
    pieces share one partition-sized buffer."""
    out = _task(runs, job, task)
    lean, buffer = out["per_parameter"], out["partition_buffer"]
    assert len(lean["losses"]) == STEPS and lean["losses"] == buffer["losses"]
    assert out["masters_equal"]
    assert all(n >= 3 and storages == n for n, storages in lean["pieces_storages"]), lean["pieces_storages"]
    assert all(n >= 3 and storages == 1 for n, storages in buffer["pieces_storages"]), buffer["pieces_storages"]
    if task.startswith("grads:3"):  # ZeRO-3's buffer lives from set-up on; per-parameter gradients die with the step
        assert lean["kept_between_steps"] == 0 and buffer["kept_between_steps"] >= out["partition"]


def _falls(losses: list[float]) -> bool:
    return sum(losses[-5:]) < sum(losses[:5]) - 0.1


def test_bf16_sr_trains_resumes_and_keeps_no_fp32_partition(runs):
    for task in ("master:2:bf16_sr", "master:1:bf16_sr:bf16grads", "master:3:bf16_sr", "master:2:bf16_sr:offload"):
        out = _task(runs, "w2", task)
        assert _falls(out["losses"]), task
        assert out["resumed"] == out["losses"][SAVE_AT:], f"{task}: resume is not exact"
        assert out["master_dtypes"] == ["torch.bfloat16"]
        assert out["fp32_partition_sized"] == [], f"{task}: the optimizer keeps {out['fp32_partition_sized']}"


def test_a_bf16_master_never_builds_an_fp32_partition(runs):
    """ZeRO-1/2 builds a master that is not fp32 in bf16 from the start (DeepSpeed's
    bf16_master_weights_and_grads), under Offload its host gradient too: deepspeed.initialize allocates no
    fp32 tensor at all (a 13B model's 48 GiB fp32 partition kept it off one 80 GB GPU). "fp32" still builds
    its fp32 master: the probe sees it there."""
    for task in ("master:2:bf16_sr:offload", "master:2:bf16_sr", "master:1:bf16_sr:bf16grads",
                 "master:2:fp32_remainder"):
        assert _task(runs, "w2", task)["setup_fp32_alloc"] == 0, task
    fp32 = _task(runs, "w2", "master:2:fp32")
    assert fp32["setup_fp32_alloc"] >= fp32["partition"]


def test_bf16_sr_is_world_size_invariant(runs):
    """The random bits are keyed by position in the parameter: 1 and 2 ranks give identical losses, and a
    1-rank checkpoint re-partitioned to 2 ranks (or converted to the universal form) continues exactly."""
    one = _task(runs, "w1", "master:2:bf16_sr")["losses"]
    assert _task(runs, "w2", "master:2:bf16_sr")["losses"] == one
    assert _task(runs, "w2", "resume:2:bf16_sr:1")["resumed"] == one[SAVE_AT:]
    assert _task(runs, "w2", "universal:2:bf16_sr:1")["resumed"] == one[SAVE_AT:]
    assert _task(runs, "w1", "master:3:bf16_sr")["losses"] == one  # ZeRO-3: same groups, same bits
    assert _task(runs, "w2", "master:3:bf16_sr")["losses"] == one
    assert _task(runs, "w2", "resume:3:bf16_sr:1")["resumed"] == one[SAVE_AT:]


def test_stochastic_rounding_differs_from_round_to_nearest(runs):
    sr, rn = _task(runs, "w2", "master:2:bf16_sr")["losses"], _task(runs, "w2", "master:2:bf16_rn")["losses"]
    assert sr[0] == rn[0] and sr != rn
    assert _task(runs, "w2", "master:2:bf16_rn")["resumed"] == rn[SAVE_AT:]


def test_checkpoints_load_across_master_settings(runs):
    """fp32 -> bf16_sr rounds the master once (to nearest); bf16_sr -> fp32 widens it exactly."""
    for task, dtype in (("cross:2:fp32:bf16_sr", "torch.bfloat16"), ("cross:2:bf16_sr:fp32", "torch.float32"),
                        ("cross:3:bf16_sr:fp32", "torch.float32")):
        out = _task(runs, "w2", task)
        assert out["master_exact"] and out["master_dtype"] == dtype, task
        assert all(x == x and x < 3 for x in out["resumed"]), task


def test_bf16_master_refused_where_it_cannot_run(runs):
    out = _task(runs, "w2", "refuse:2")
    assert "coat.master_weights='bf16_sr' under ZeRO-3 needs parameters and optimizer on the device" in out["zero3_offload"]
    assert "coat.master_weights='bf16_sr' needs DeepSpeed's ZeRO-1/2/3 optimizer" in out["bf16_optimizer"]
    assert "BF16_Optimizer (ZeRO stage 1)" in out["bf16_optimizer"]
    assert "needs a bf16 model" in out["fp32_model"]
    assert out["ds_bf16_master"] == ("bf16.bf16_master_weights_and_grads=true with CoatAdamW needs coat.master_weights "
                                     "'bf16_sr' or 'bf16_rn' (CoatAdamW's step writes the bf16 master); this config "
                                     "has 'fp32'")
    assert f"coat.master_weights='bf16' is invalid; allowed: {list(MASTER_WEIGHTS)}" == out["bad_value"]


# ------------------------------------------------------------------ the fp32_remainder master (issue 31)
# `"coat": {"master_weights": "fp32_remainder"}` (task `remainder`): ZeRO-1/2/3 against the fp32 master, 100 steps
# with gradient clipping, checkpoints both ways; the same on one GPU (`gpu`).
#
# The remainder master is exact, and an fp32 master's bf16 weights are written as the split's high half too
# (nearest, ties away from zero: formats.remainder says why no 16-bit split can round ties to even), so the two
# runs are bit-identical at every step: losses, masters and weights `==`. The job counts, per step, the fp32
# run's masters on an exact tie with an even high half (about 2^-17 of the values a step writes), where a
# nearest-even weight copy would have made the runs part: the runs must cross at least one.


def check_bit_identical(out: dict) -> None:
    """100 steps: losses, then masters and weights at the end, `==`; an even tie crossed on the way."""
    assert len(out["fp32"]) == len(out["fp32_ties"]) == 100
    assert out["fp32_remainder"] == out["fp32"]
    assert out["masters_equal"] and out["weights_equal"]
    assert sum(out["fp32_ties"]) > 0, out["fp32_ties"]
    assert out["remainder_dtypes"] == ["torch.bfloat16"]  # DeepSpeed's fp32 partition is gone


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_remainder_master_trains_bit_identically_to_the_fp32_master(runs, stage):
    check_bit_identical(_task(runs, "w2", f"remainder:{stage}:bf16"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_remainder_checkpoints_are_fp32_masters(runs, stage):
    """Saved as fp32 masters (bit-identical to the live ones); resume exact; the file loads into an fp32 engine
    exactly and into bf16_sr rounded once; an fp32-master checkpoint loads into remainders exactly."""
    out = _task(runs, "w2", f"remainder:{stage}:bf16")
    assert out["saved_dtypes"] == "torch.float32" and out["saved_exact"]
    assert out["resumed"] == out["fp32_remainder"][60:]
    assert out["into_fp32_exact"] and out["into_bf16_sr_exact"] and out["from_fp32_exact"]


def test_remainder_refused_under_offload(runs):
    out = _task(runs, "w2", "refuse_remainder:2")
    for case in ("offload_z2", "offload_z3"):
        assert out[case] == ("coat.master_weights='fp32_remainder' keeps bf16 weights + int16 remainders on the "
                             "device; under Offload the host master would cost what DeepSpeed's fp32 one does (4 "
                             "B/param); allowed there: 'fp32' (exact) or 'bf16_sr'"), case
    assert "needs a bf16 model" in out["fp32_model"]


@pytest.mark.gpu
def test_remainder_master_is_the_fp32_master_on_one_gpu(tmp_path):
    """The same job on one GPU (the CUDA kernel, bf16): bit-identical to the fp32 master over 100 steps,
    ZeRO-1/2/3, and its checkpoints as on the CPU."""
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    res = {"g1": launch_job(str(tmp_path / "g1.json"), ckpt, REMAINDER, 1, job=JOB)}
    for task in REMAINDER:
        out = _task(res, "g1", task)
        check_bit_identical(out)
        assert out["saved_exact"] and out["resumed"] == out["fp32_remainder"][60:], task
        assert out["into_fp32_exact"] and out["into_bf16_sr_exact"] and out["from_fp32_exact"], task
