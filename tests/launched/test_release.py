"""coat.gradients "release" (issue 36): each reduced gradient stepped at once and dropped, ZeRO-1/2/3.

The config refusals run here; the rest in launched jobs (ranks started as DeepSpeed's launcher starts them:
tests/ds_scripts/ranks.py; CPU accelerator, gloo), one job per world size (tests/ds_scripts/release_job.py):
  W1  world 1: release == per_parameter, ZeRO-1/2/3
  W2  world 2: the same with cut groups swapped between ranks, all three masters, overlap_comm on, and ZeRO-2's
      reduce to each slice's owner (use_multi_rank_bucket_allreduce false); a gradient spike under
      clipping, a NaN gradient midway through backward, a resume with clipping on, the engine's refusals,
      each under ZeRO-2 and ZeRO-3; the host reads during backward, ZeRO-1/2/3
      and coat.states "host" against "device" (ZeRO-3)
  G1  one GPU (`gpu`): W1's equality with the CUDA kernels, deterministic algorithms on
"""
from __future__ import annotations

import pytest
import torch

from coat_ds.deepspeed.check import check_config
from coat_ds.deepspeed.zero.states import host_refusal
from harness import DS_SCRIPTS, SAVE_AT, STEPS, launch_job, launch_worlds, task_result

JOB = DS_SCRIPTS / "release_job.py"
EQUAL_STEPS = 100   # release_job.py's
ALLOWED = "allowed there: ['per_parameter', 'partition_buffer']"

STAGES = (2, 3)  # spike, NaN, resume and refusals: ZeRO-2 and ZeRO-3
EQUAL_W1 = ["equal:1:fp32_remainder", "equal:2:bf16_sr", "equal:3:fp32_remainder"]
EQUAL_W2 = ["equal:1:bf16_sr", "equal:2:bf16_sr", "equal:2:fp32_remainder", "equal:2:fp32", "equal:2:bf16_sr:overlap",
            "equal:2:bf16_sr:reduce", "equal:3:bf16_sr", "equal:3:fp32_remainder", "equal:3:fp32"]
HOST = ["host:3:bf16_sr", "host:3:fp32_remainder:w1"]  # coat.states "host"
W2 = EQUAL_W2 + HOST + [t for s in STAGES for t in (f"spike:{s}:bf16_sr", f"nan:{s}:bf16_sr",
                                                    f"resume:{s}:fp32_remainder", f"refuse:{s}")] + \
    [f"syncs:{s}:fp32_remainder" for s in STAGES]


def _config(**extra) -> dict:
    cfg = {"optimizer": {"type": "CoatAdamW"}, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
           "coat": {"gradients": "release"}}
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("extra,why", [
    ({"gradient_accumulation_steps": 2},
     "steps as gradients are reduced: gradient_accumulation_steps must be 1 (it is 2)"),
    ({"zero_optimization": {"stage": 0}}, "needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "runs on the device, not under Offload (zero_optimization.offload_optimizer)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "runs on the device, not under Offload (zero_optimization.offload_param)"),
    ({"bf16": {"enabled": False}}, "needs bf16 gradients (bf16.enabled true)"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "needs bf16 gradients (data_types.grad_accum_dtype is 'fp32')"),
])
def test_config_refuses_what_release_cannot_run(extra, why):
    """Before any model exists: one line naming the key, why, and the values allowed there."""
    with pytest.raises(ValueError) as exc:
        check_config(_config(**extra))
    assert str(exc.value) == f"coat.gradients='release' {why}; {ALLOWED}"


def test_config_accepts_release_and_hf_auto():
    check_config(_config())
    check_config(_config(zero_optimization={"stage": 3}))
    check_config(_config(gradient_accumulation_steps="auto", bf16={"enabled": "auto"}), hf_auto=True)


@pytest.mark.parametrize("zero,coat,why", [
    ({"stage": 2}, {"gradients": "release"}, "streams ZeRO-3 sub-groups (zero_optimization.stage is 2; allowed: 3)"),
    ({"stage": 3}, {}, "steps each sub-group as backward reduces it: needs coat.gradients 'release' "
                       "(it is 'per_parameter')"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {"gradients": "per_parameter"},
     "steps each sub-group as backward reduces it: needs coat.gradients 'release' (it is 'per_parameter')"),
])
def test_config_refuses_host_states_where_they_cannot_run(zero, coat, why):
    with pytest.raises(ValueError) as exc:
        check_config(_config(zero_optimization=zero, coat={**coat, "states": "host"}))
    assert str(exc.value) == f"coat.states='host' {why}; allowed there: ['device']"
    with pytest.raises(ValueError, match=r"coat.states='cpu' is invalid; allowed: \['device', 'host'\]"):
        check_config(_config(coat={"states": "cpu"}))


def test_host_states_refused_before_allocation_when_the_node_is_short():
    """The planner's host column per rank times the node's ranks, against 90% of MemAvailable; one line."""
    gib = 2**30
    assert host_refusal(35 * gib, 4, 512 * gib) is None
    assert host_refusal(35 * gib, 4, None) is None  # unknown (not Linux): DeepSpeed's own allocation decides
    assert host_refusal(35 * gib, 4, 150 * gib) == (
        "coat.states='host' needs 35.0 GiB of pinned host memory per rank (4 ranks on this node: 140.0 GiB, the "
        "planner's host column); this host has 150.0 GiB available (90% usable); allowed there: ['device'], or more "
        "ranks (ZeRO-3 divides the states)")


@pytest.mark.parametrize("task", HOST)
def test_host_states_step_as_device_states_bit_for_bit(runs, task):
    """coat.states "host" (ZeRO-3 release, 3 sub-groups a rank): clipping on, a NaN step, saved and resumed: losses,
    every rank's masters and FP8 states equal the device run's, every state tensor in the host blocks between steps;
    with one window (w1) every sub-group is copied back and fetched again within a step."""
    check_host(task_result(runs, "w2", task))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_worlds(tmp_path_factory, "release", JOB, w1=(EQUAL_W1, 1), w2=(W2, 2))


@pytest.mark.parametrize("job,task", [("w1", t) for t in EQUAL_W1] + [("w2", t) for t in EQUAL_W2])
def test_release_steps_as_per_parameter_bit_for_bit(runs, job, task):
    """Clipping off: 100 steps of losses, every rank's final masters and FP8 states equal per_parameter's, and
    when the step begins no gradient is held (per_parameter holds the whole partition's). `reduce`: DeepSpeed
    reduces each slice to its owner alone (the other ranks' copies of it are left partial sums)."""
    out = task_result(runs, job, task)
    check_equal(out)
    if task.endswith(":reduce"):
        assert out["release"]["multi_rank_allreduce"] is False and out["per_parameter"]["multi_rank_allreduce"] is False


@pytest.mark.gpu
def test_release_steps_as_per_parameter_on_one_gpu(tmp_path):
    """The same on one GPU, ZeRO-1/2/3: the CUDA step kernels run per bucket on DeepSpeed's reduction stream
    during backward (release_job.py turns deterministic algorithms on where CUDA is)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    res = {"g1": launch_job(tmp_path / "g1.json", ckpt, EQUAL_W1, 1, job=JOB)}
    for task in EQUAL_W1:
        check_equal(task_result(res, "g1", task))


@pytest.mark.gpu
def test_host_states_step_as_device_states_on_two_gpus(tmp_path):
    """coat.states "host" on CUDA: pinned host blocks, copy streams and events, the CUDA kernels, NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    res = {"g2": launch_job(tmp_path / "g2.json", ckpt, HOST, 2, job=JOB)}
    for task in HOST:
        check_host(task_result(res, "g2", task))


def check_host(out: dict) -> None:
    host, dev = out["host"], out["device"]
    assert host["losses"] == dev["losses"]
    assert host["resumed"] == dev["resumed"] == host["losses"][-len(host["resumed"]):]
    assert out["masters_equal"] and out["states_equal"] and out["resumed_equal"]
    assert host["subgroups"] >= 3 and host["in_host_blocks"] and not dev["in_host_blocks"] and host["on_device"] == 0


def check_equal(out: dict) -> None:
    lean, ref = out["release"], out["per_parameter"]
    assert len(lean["losses"]) == EQUAL_STEPS and lean["losses"] == ref["losses"]
    assert out["masters_equal"] and out["states_equal"]
    assert lean["grads_at_step"] == 0 and ref["grads_at_step"] >= out["partition"] // 2


@pytest.mark.parametrize("stage", STAGES)
def test_release_clips_a_gradient_spike_at_once(runs, stage):
    """Every gradient x1e4 for one step, clipping 1.0: the second moment stays where exact clipping keeps it
    (each clipped gradient value <= 1, so v <= beta2 v_max + (1 - beta2)), while unclipped it explodes."""
    out = task_result(runs, "w2", f"spike:{stage}:bf16_sr")
    rel, exact, raw = out["release"], out["exact"], out["unclipped"]
    # before the spike the norm stays under the clip, lagged or not: the runs are equal up to it
    spike = out["spike_at"]
    assert rel["losses"][:spike + 1] == exact["losses"][:spike + 1] and rel["v_before"] == exact["v_before"]
    b2, clip = out["beta2"], out["clip"]
    bound = b2 * rel["v_before"] + (1 - b2) * clip ** 2  # each clipped gradient value is at most the clip
    assert rel["v_after"] <= bound * 1.07, (rel, bound)  # 7%: the FP8 v's rounding
    assert exact["v_after"] <= bound * 1.07
    assert raw["v_after"] > 1e4 * bound
    assert rel["norm"] == pytest.approx(exact["norm"], rel=0.05) and rel["norm"] > 1e3  # logged: unclipped
    assert all(x == x and x < 3 for x in rel["losses"])  # trains on, finite


@pytest.mark.parametrize("stage", STAGES)
def test_release_nan_midway_skips_the_rest_of_the_step(runs, stage):
    """A NaN in rank 0's gradient of the first layer's weight (reduced last): the buckets reduced before it
    were stepped, the first layer's weight not; nothing non-finite anywhere; the step counts as skipped once
    (DeepSpeed and CoatAdamW), and training goes on."""
    out = task_result(runs, "w2", f"nan:{stage}:bf16_sr")
    assert out["finite"]
    assert out["changed"]["0.weight"] is False
    assert out["changed"]["4.weight"] and out["changed"]["4.bias"]
    assert out["skipped"] == 1 and out["coat_skipped"] == 1 and out["skipped_after"] == 1
    assert out["norm"] == float("inf")
    assert all(x == x and x < 3 for x in out["losses_after"])


@pytest.mark.parametrize("stage", STAGES)
def test_release_resumes_exactly_with_clipping(runs, stage):
    """Clipping on (the previous step's norm is part of the saved state): the resumed tail == the run's."""
    out = task_result(runs, "w2", f"resume:{stage}:fp32_remainder")
    assert len(out["losses"]) == STEPS and out["resumed"] == out["losses"][SAVE_AT:]


@pytest.mark.parametrize("stage", STAGES)
def test_engine_refuses_what_release_cannot_run(runs, stage):
    out = task_result(runs, "w2", f"refuse:{stage}")
    assert out["accumulation"] == ("coat.gradients='release' steps as gradients are reduced: "
                                   f"gradient_accumulation_steps must be 1 (it is 2); {ALLOWED}")
    assert out["fp32_accumulation"] == ("coat.gradients='release' needs bf16 gradients "
                                        f"(data_types.grad_accum_dtype is fp32); {ALLOWED}")
    assert out["stage0"].startswith("coat.gradients='release' needs DeepSpeed's ZeRO-1/2/3 optimizer (this engine "
                                    "has ") and out["stage0"].endswith(ALLOWED)
    assert out["offload"] == ("coat.gradients='release' runs on the device, not under Offload "
                              f"(zero_optimization.offload_optimizer); {ALLOWED}")


@pytest.mark.parametrize("stage", STAGES)   # ZeRO-1 steps buckets through ZeRO-2's code (ReleaseStep)
def test_release_reads_nothing_on_the_host_during_backward(runs, stage):
    """No tensor is read on the host (item, tolist, float, bool, int) from coat_ds during backward, so the host
    queues backward ahead of the device: per bucket the norm, clipping scale and skip stay on the device, the
    NaN step's included. engine.step() reads the step's squared norm once, and after an overflow the flags
    of the partitions whose step counts it rolls back. The NaN is in the first bucket reduced: every rank's
    masters, FP8 states, step counts (advanced during backward, rolled back) and weights stay as they were."""
    out = task_result(runs, "w2", f"syncs:{stage}:fp32_remainder")
    assert out["backward"] == [[], [], []]
    assert [len(reads) for reads in out["step"]] == [1, 2, 1], out["step"]
    assert out["unchanged"] and out["skipped"] == 1 and all(x == x and x < 3 for x in out["losses"])
