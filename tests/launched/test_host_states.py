"""coat.states "host" at node scale (issue 57), in launched jobs (tests/ds_scripts/host_states_job.py).

  CPU   2 ranks under the real `deepspeed` launcher (which sets LOCAL_SIZE, not LOCAL_WORLD_SIZE): the node's ranks
        counted by the ranks; an engine refused on both ranks, before either allocates its host buffers, where the
        node's available memory (MemAvailable, then a cgroup's room, read from a host root the test points at)
        holds one rank's states but not two; "host" == "device" bit for bit when the sub-groups' order changes
        between steps (a branch unused on some steps; mixture-of-experts with experts that get no tokens)
  G1    one GPU (`gpu`): the same order changes with the copy-in stream slowed (a block fetched and not stepped is
        copied back only after it arrived); three engines built, trained, destroyed and dropped: the pinned memory
        does not grow
"""
from __future__ import annotations

import os

import pytest

from coat_ds.deepspeed.zero.states import host_refusal
from harness import (DS_SCRIPTS, free_port, job_env, launch_json, launcher, ranks_launcher, require_launcher,
                     task_result)

pytestmark = pytest.mark.slow

JOB = DS_SCRIPTS / "host_states_job.py"
ORDER = ["order:3", "order:3:moe"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One launch of 2 CPU ranks through `deepspeed --num_gpus 2`: the order tasks, then node and refuse."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs")
    require_launcher()
    tmp = tmp_path_factory.mktemp("host_states")
    (tmp / "host").mkdir()
    out = tmp / "r.json"
    env = dict(job_env(), COAT_DS_HOST_ROOT=str(tmp / "host"),   # 4 tasks, 12 engines on 2 CPU ranks
               COAT_JOB_TIMEOUT=os.environ.get("COAT_JOB_TIMEOUT", "540"))
    env.pop("LOCAL_WORLD_SIZE", None)
    cmd = [launcher(), "--num_gpus", "2", "--master_port", str(free_port()), str(JOB), "--out", str(out),
           "--ckpt", str(tmp), *ORDER, "node:3", "refuse:3"]
    return {"w2": launch_json(cmd, out, env)}


def test_the_ranks_count_their_node_under_the_deepspeed_launcher(cpu_run):
    """DeepSpeed's launcher says LOCAL_SIZE=2 (no LOCAL_WORLD_SIZE, which the check read before: 1 rank a node);
    the ranks count 2 with every launcher variable removed, and read LOCAL_SIZE where no process group exists."""
    out = task_result(cpu_run, "w2", "node:3")
    assert out["env"].get("LOCAL_SIZE") == "2" and "LOCAL_WORLD_SIZE" not in out["env"]
    assert out["gathered"] == [2, 2] and out["without_env"] == 1 and out["launcher"] == 2


def test_host_states_refused_on_every_rank_when_the_node_holds_one_rank_not_two(cpu_run):
    """Available memory for 2.3 ranks' states: built. For 1.5 ranks' (MemAvailable, then a cgroup's room under a
    plentiful MemAvailable): refused on both ranks with the node's need and what it has, in one line, before
    either rank allocated its host buffers. No memory file at all: not refused (unknown)."""
    out = task_result(cpu_run, "w2", "refuse:3")
    need = out["need"]
    assert need > 0
    for rank in out["ranks"]:
        assert rank["unknown"]["result"] == rank["fits"]["result"] == "built"
        assert rank["unknown"]["allocated"] == rank["fits"]["allocated"] == 1
        line = host_refusal(need, 2, rank["available"]["short"])
        assert line and host_refusal(need, 1, rank["available"]["short"]) is None  # one rank's states fit
        for case in ("short", "cgroup"):
            assert rank[case] == {"result": line, "allocated": 0, "need": None}, case
    assert "2 ranks on this node" in line and "KiB available" in line


@pytest.mark.parametrize("task", ORDER)
def test_host_states_equal_device_states_when_the_order_changes(cpu_run, task):
    check_order(task_result(cpu_run, "w2", task))


@pytest.mark.gpu
@pytest.mark.parametrize("task", ORDER)
def test_host_states_equal_device_states_when_the_order_changes_on_one_gpu(tmp_path, task):
    """On CUDA with the copy-in stream slowed by a spin kernel before each fetch: a prefetched block copied back
    without waiting for its own arrival (before the fix) writes the window's previous occupant into its host block."""
    check_order(task_result(_gpu(tmp_path, [task]), "g1", task))


@pytest.mark.gpu
def test_three_engines_built_and_dropped_do_not_grow_pinned_memory(tmp_path):
    """Each engine pins ~1.1 GiB of host states; after engine.destroy() its buffers are no longer registered with
    CUDA and the process's resident memory does not grow from the first engine to the third."""
    out = task_result(_gpu(tmp_path, ["drop:3"]), "g1", "drop:3")
    assert min(out["host_bytes"]) > 2**30
    assert out["still_registered"] == [[False] * 3] * 3
    assert out["rss"][2] - out["rss"][0] < out["host_bytes"][0] // 2, out


def _gpu(tmp_path, tasks: list[str]) -> dict:
    out = tmp_path / "g1.json"
    cmd = [*ranks_launcher(1), str(JOB), "--out", str(out), "--ckpt", str(tmp_path), *tasks]
    return {"g1": launch_json(cmd, out, job_env())}


def check_order(out: dict) -> None:
    """Losses, every rank's final masters and FP8 states equal; the host run's sub-group order did change."""
    assert out["host"]["losses"] == out["device"]["losses"]
    assert out["masters_equal"] and out["states_equal"]
    orders = {tuple(o) for o in out["host"]["orders"]}
    assert len(orders) >= 2 and out["host"]["subgroups"] >= 4, out["host"]["orders"]
