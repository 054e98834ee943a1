"""CoatAdamW under DeepSpeed: real multi-process runs (CPU accelerator, gloo), their ranks started as DeepSpeed's
launcher starts them (harness.ranks_launcher); the two-node run goes through the `deepspeed` launcher itself.

Four launched jobs (shared by all tests below, ~4 min on 2 cores after the one-off shm-op build):
  W1  world 1: stage-0 references (fp32; bf16 and fp16 as ZeRO-1/2 on one rank), 1-rank checkpoints
  W2  world 2: ZeRO-1/2/3 (fp32, bf16), fp16 ZeRO-2, Offload; same-world resume; 1 -> 2 resume;
      refusal of truncated/foreign checkpoints and of planted ones carrying code; zero_to_fp32; an fp16
      overflow step; the classes pickled in every saved file
  W1b world 1: 2 -> 1 resume (stages 1/2/3)
  MN  two "nodes" on this machine (--no_ssh --node_rank 0/1), ZeRO-2 across them
A task in a dtype DeepSpeed's accelerator does not support here (fp16 on a CPU without oneDNN fp16) is
left out of its job, and the tests that read it skip with the accelerator's answer.

Why equality is exact: FP8 groups are per parameter whatever the partition (coat_ds/deepspeed/zero/layout.py),
and both worlds see bit-identical gradients (two micro-batches of 4: accumulated on one rank or
averaged over two, g0/2 + g1/2 either way). So losses are compared with ==, not a tolerance; only
DeepSpeed's stage-0 bf16 path, which accumulates gradients in bf16, is compared to bf16 precision.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import pytest
import torch

from harness import (DS_SCRIPTS, SAVE_AT, STEPS, job_env, launch_job, require_launcher, start_two_nodes,
                     task_result, unsupported)


def start_job_on_two_nodes(out: str, ckpt: str, tasks: list[str], tmp: str) -> Callable[[], dict]:
    """job.py's `tasks` on two 'nodes' of one rank each (harness.start_two_nodes); the call returned waits for them
    and gives their results."""
    wait = start_two_nodes(tmp, 1, [str(DS_SCRIPTS / "job.py"), "--out", out, "--ckpt", ckpt, *tasks], job_env())

    def results() -> dict:
        logs = wait()
        if not os.path.isfile(out):
            pytest.fail("two-node run wrote no results:\n" + "\n".join(log[-4000:] for log in logs))
        with open(out) as f:
            return json.load(f)

    return results


W1 = ["train:0:fp32", "train:1:fp32", "train:2:fp32", "train:3:fp32", "train:1:bf16", "train:2:fp16"]
W2 = ["train:1:fp32", "train:2:fp32", "train:3:fp32", "train:1:bf16", "train:2:bf16", "train:3:bf16",
      "train:2:fp16", "train:2:fp32:offload", "resume:1:fp32:1", "resume:2:fp32:1", "resume:3:fp32:1",
      "refuse:2", "plant:2", "tofp32:2:fp32", "tofp32:3:fp32", "skip:2:fp16", "regroup:2:fp32", "universal:3:fp32:1",
      "contents:0"]
W1B = ["resume:1:fp32:2", "resume:2:fp32:2", "resume:3:fp32:2", "resume:2:bf16:2", "universal:2:fp32:2"]


def run_all(tmp: str, gpus_per_world: dict[int, int], multinode: bool = True) -> dict:
    ckpt = os.path.join(tmp, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    # the two-node run reads no checkpoint: it starts beside W1, whose one rank leaves a core free
    mn = start_job_on_two_nodes(os.path.join(tmp, "mn.json"), ckpt, ["quick:2:fp32"], tmp) if multinode else None
    res = {"w1": launch_job(os.path.join(tmp, "w1.json"), ckpt, W1 + ["train:0:bf16"], gpus_per_world[1])}
    res["w2"] = launch_job(os.path.join(tmp, "w2.json"), ckpt, W2, gpus_per_world[2])
    res["w1b"] = launch_job(os.path.join(tmp, "w1b.json"), ckpt, W1B, gpus_per_world[1])
    if mn is not None:
        res["mn"] = mn()
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_launcher()
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs; the gpu-marked test covers CUDA")
    return run_all(str(tmp_path_factory.mktemp("ds")), {1: 1, 2: 2})


def check_trajectories(res: dict) -> float:
    """ZeRO-1/2/3 on 2 ranks == stage 0 on 1 rank, bit for bit, 50 steps; returns the max |loss difference|."""
    ref = task_result(res, "w1", "train:0:fp32")["losses"]
    assert len(ref) == STEPS and all(x == x for x in ref)
    assert ref[-1] < ref[0] - 0.02, "the tiny model must actually learn"
    worst = 0.0
    for stage in (1, 2, 3):
        for job in ("w1", "w2"):
            got = task_result(res, job, f"train:{stage}:fp32")
            assert got["bound"] >= 1, "partition layouts were not bound"
            assert got["losses"] == ref, f"{job} ZeRO-{stage} fp32 diverged from stage 0"
    bf16_ref = task_result(res, "w1", "train:1:bf16")["losses"]  # one rank, nothing partitioned, fp32 grad accumulation
    for stage in (1, 2, 3):
        got = task_result(res, "w2", f"train:{stage}:bf16")["losses"]
        assert got == bf16_ref, f"ZeRO-{stage} bf16 on 2 ranks diverged from 1 rank"
    ddp_bf16 = task_result(res, "w1", "train:0:bf16")["losses"]  # DeepSpeed's stage-0 bf16: bf16 gradient accumulation
    worst = max(abs(a - b) for a, b in zip(ddp_bf16, bf16_ref))
    assert worst < 3e-2
    return worst


def check_memory(res: dict) -> dict:
    """Optimizer-state bytes per parameter per rank: ~2 + metadata at world 1, half of it at world 2."""
    out = {}
    for stage in (1, 2, 3):
        one = task_result(res, "w1", f"train:{stage}:fp32")
        two = task_result(res, "w2", f"train:{stage}:fp32")
        n = one["n_params"]
        out[stage] = (one["state_bytes"] / n, two["state_bytes"] / n)
        assert one["state_bytes"] / n < 2.6  # 2 B of codes + 16 B per group of 32 (fp32 scale+expo, m and v)
        assert two["state_bytes"] < 0.52 * one["state_bytes"]
    return out


def check_checkpoints(res: dict) -> None:
    for job in ("w1", "w2"):
        for task, out in res[job]["tasks"].items():
            if task.startswith("train:") and "resumed" in out:
                assert out["resumed"] == out["losses"][SAVE_AT:], f"{job} {task}: resume is not exact"
    full = task_result(res, "w1", "train:0:fp32")["losses"][SAVE_AT:]
    for stage in (1, 2, 3):
        assert task_result(res, "w2", f"resume:{stage}:fp32:1")["resumed"] == full, f"ZeRO-{stage}: 1 -> 2 ranks"
        assert task_result(res, "w1b", f"resume:{stage}:fp32:2")["resumed"] == full, f"ZeRO-{stage}: 2 -> 1 rank"
        assert task_result(res, "w1b", f"resume:{stage}:fp32:2")["global_steps"] == STEPS
    bf16 = task_result(res, "w1", "train:1:bf16")["losses"]
    assert task_result(res, "w1b", "resume:2:bf16:2")["resumed"] == bf16[SAVE_AT:]


def test_zero_trajectories_equal_stage0(runs):
    check_trajectories(runs)


def test_fp16_zero2_two_ranks_close_to_one(runs):
    """One rank sums the two micro-batches' gradients in fp16, two ranks reduce them in fp32: close, not equal."""
    fp16 = max(abs(a - b) for a, b in zip(task_result(runs, "w2", "train:2:fp16")["losses"],
                                          task_result(runs, "w1", "train:2:fp16")["losses"]))
    assert fp16 < 2e-2


def test_state_memory_shrinks_with_world_size(runs):
    check_memory(runs)


def test_offload_runs_fp8_states_on_host(runs):
    off = task_result(runs, "w2", "train:2:fp32:offload")
    assert off["losses"] == task_result(runs, "w1", "train:0:fp32")["losses"]
    assert off["resumed"] == off["losses"][SAVE_AT:]


def test_checkpoints_resume_exactly_and_repartition(runs):
    check_checkpoints(runs)


def test_group_size_change_regroups_states(runs):
    """group_size 32 -> 64 on load: moments re-quantized once; the run goes on within FP8 rounding."""
    out = task_result(runs, "w2", "regroup:2:fp32")
    full = task_result(runs, "w1", "train:0:fp32")["losses"][SAVE_AT:]
    assert out["group_size"] == 64
    assert out["resumed"][0] == full[0]  # the loss before the first step after loading
    assert max(abs(a - b) for a, b in zip(out["resumed"], full)) < 1e-3


def test_universal_checkpoint_converter(runs):
    """coat_ds.deepspeed.checkpoint.universal: DeepSpeed's universal layout + FP8 states; loads at another world
    size."""
    full = task_result(runs, "w1", "train:0:fp32")["losses"][SAVE_AT:]
    assert task_result(runs, "w1b", "universal:2:fp32:2")["resumed"] == full  # ZeRO-2, 2 ranks -> 1
    assert task_result(runs, "w2", "universal:3:fp32:1")["resumed"] == full  # ZeRO-3, 1 rank -> 2


def test_bad_checkpoints_refused_before_loading(runs):
    out = task_result(runs, "w2", "refuse:2")
    assert "truncated or corrupt" in out["truncated"] and "weights_only" not in out["truncated"]
    assert out["truncated_untouched"]
    assert "another optimizer" in out["foreign"] and out["foreign_untouched"]


def test_planted_code_refused_before_deepspeed_unpickles_it(runs):
    """A function torch's weights-only reader does not allow, a module it blocks, a class outside DeepSpeed's
    checkpoint contents: each named in one line, never run, though DeepSpeed's own load would run it."""
    out = task_result(runs, "w2", "plant:2")
    planted = {"function": "io.open", "blocked module": f"{os.system.__module__}.system", "class": "__main__.Planted"}
    for kind, name in planted.items():
        got = out[kind]
        assert got["refused"] == (f"checkpoint file refused unread: {out['victim']} holds objects outside DeepSpeed's "
                                  f"checkpoint contents (global {name}); unpickling it could run code"), got
        assert got["untouched"], f"{kind}: the model changed"
        assert not got["ran"] and got["live"], f"{kind}: the code ran under coat_ds's check, or the plant runs none"


def test_checkpoint_reader_allows_exactly_what_deepspeed_saves(runs):
    """Every class pickled in the files of the ZeRO-0..3 fp32 / bf16 / fp16 / Offload checkpoints and universal
    folders these jobs saved is allowed, and every class allowed was found (fp16's scaler only where fp16 ran)."""
    out = task_result(runs, "w2", "contents:0")
    found, allowed = set(out["found"]), set(out["allowed"])
    assert found <= allowed, {g: out["found"][g] for g in found - allowed}
    missing = allowed - found
    fp16_only = {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"} if unsupported("fp16") else set()
    assert missing <= fp16_only, missing


def test_zero_to_fp32_recovers_masters(runs):
    for stage in (2, 3):
        out = task_result(runs, "w2", f"tofp32:{stage}:fp32")
        assert out["n"] == 6 and out["max_diff_fp32_model"] == 0.0


def test_fp16_overflow_step_leaves_fp8_states(runs):
    out = task_result(runs, "w2", "skip:2:fp16")
    assert out["unchanged"] and out["skipped_steps"] >= 1
    assert out["scale_after"] < out["scale_before"]
    assert all(x == x and x < 10 for x in out["losses"])


def test_two_nodes_zero2(runs):
    out = task_result(runs, "mn", "quick:2:fp32")
    assert out["world"] == 2
    assert out["losses"] == task_result(runs, "w1", "train:0:fp32")["losses"][:12]


W1_GPU = ["train:0:fp32", "train:2:fp32", "train:1:bf16"]
W2_GPU = ["train:1:fp32", "train:2:fp32", "train:3:fp32", "train:2:bf16", "train:3:bf16", "resume:2:fp32:1"]


def _diff(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


@pytest.mark.gpu
def test_gpu_two_ranks(tmp_path):
    """The launched jobs on 2 GPUs (NCCL), a smaller set than on CPU; the summary goes to
    $COAT_ZERO_GPU_SUMMARY when set (benchmarks/results/zero_multi_gpu.json is made from it)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    res = {"w1": launch_job(str(tmp_path / "w1.json"), ckpt, W1_GPU, 1),
           "w2": launch_job(str(tmp_path / "w2.json"), ckpt, W2_GPU, 2)}
    ref = task_result(res, "w1", "train:0:fp32")["losses"]
    bf16 = task_result(res, "w1", "train:1:bf16")["losses"]
    summary = {"world_size": 2, "device": torch.cuda.get_device_name(), "steps": STEPS, "fp32": {}, "bf16": {}}
    for stage in (1, 2, 3):
        summary["fp32"][stage] = _diff(task_result(res, "w2", f"train:{stage}:fp32")["losses"], ref)
    for stage in (2, 3):
        summary["bf16"][stage] = _diff(task_result(res, "w2", f"train:{stage}:bf16")["losses"], bf16)
    summary["resume_same_world_max_diff"] = max(_diff(o["resumed"], o["losses"][SAVE_AT:])
                                                for job in ("w1", "w2") for t, o in res[job]["tasks"].items()
                                                if t.startswith("train:") and "resumed" in o)
    summary["resume_1_to_2_ranks_zero2"] = _diff(task_result(res, "w2", "resume:2:fp32:1")["resumed"], ref[SAVE_AT:])
    summary["state_bytes_per_param_per_rank"] = {
        stage: out["state_bytes"] / out["n_params"]
        for stage, out in ((st, task_result(res, "w2", f"train:{st}:fp32")) for st in (1, 2, 3))}
    summary["stages_passed"] = [st for st in (1, 2, 3) if summary["fp32"][st] == 0.0
                                and summary["bf16"].get(st, 0.0) == 0.0]
    path = os.environ.get("COAT_ZERO_GPU_SUMMARY")
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    assert summary["stages_passed"] == [1, 2, 3], summary
    assert summary["resume_same_world_max_diff"] == 0.0 and summary["resume_1_to_2_ranks_zero2"] == 0.0, summary
