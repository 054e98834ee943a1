"""coat_ds/node.py (issue 57): a node's ranks from every launcher's environment, and its available host memory:
MemAvailable and the memory cgroup's room (v1 and v2, every level up), read from a host root a test writes
(COAT_DS_HOST_ROOT), and from a real cgroup where this machine lets a test make one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coat_ds import node
from harness import ROOT, child_env

GIB = 2**30


@pytest.mark.parametrize("env,ranks", [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),                               # torchrun
    ({"LOCAL_SIZE": "2", "WORLD_SIZE": "8"}, 2),                  # deepspeed's launcher: no LOCAL_WORLD_SIZE
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 8),                     # Open MPI
    ({"MPI_LOCALNRANKS": "3"}, 3),                                # MPICH, Intel MPI
    ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "2"}, 2),  # srun's per-node list: nodes 0, 1 run 4
    ({"SLURM_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "1"}, 4),
    ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "1"}, 4),  # torchrun under srun: torchrun's ranks
])
def test_launcher_local_ranks_of_every_launcher(env, ranks):
    assert node.launcher_local_ranks(env) == ranks


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _meminfo(available: int) -> dict[str, str]:
    return {"proc/meminfo": f"MemTotal:       999999999 kB\nMemAvailable:   {available // 1024} kB\n"}


V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = ("31 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
            "32 25 0:28 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu\n")


def _v2(limits: dict[str, tuple[str, int, int]]) -> dict[str, str]:
    """cgroup v2 files: {cgroup dir: (memory.max, memory.current, inactive_file)}."""
    out = {}
    for d, (limit, usage, cache) in limits.items():
        out.update({f"sys/fs/cgroup{d}/memory.max": f"{limit}\n", f"sys/fs/cgroup{d}/memory.current": f"{usage}\n",
                    f"sys/fs/cgroup{d}/memory.stat": f"anon 1\ninactive_file {cache}\nactive_file 5\n"})
    return out


@pytest.fixture
def host_root(tmp_path, monkeypatch):
    monkeypatch.setenv(node.ROOT_VARIABLE, str(tmp_path))
    return tmp_path


def test_available_is_meminfo_without_a_cgroup_limit(host_root):
    _write(host_root, {**_meminfo(100 * GIB), "proc/self/cgroup": "0::/job\n", "proc/self/mountinfo": V2_MOUNT,
                       **_v2({"/job": ("max", 3 * GIB, 0)})})
    assert node.cgroup_available() is None
    assert node.available_bytes() == 100 * GIB


def test_cgroup_v2_limit_caps_meminfo_at_every_level(host_root):
    """The job's own cgroup allows 40 - 10 + 2 GiB; its parent 30 - 12: the least is what the node can give."""
    _write(host_root, {**_meminfo(100 * GIB), "proc/self/cgroup": "0::/a/job\n", "proc/self/mountinfo": V2_MOUNT,
                       **_v2({"/a/job": (40 * GIB, 10 * GIB, 2 * GIB), "/a": (30 * GIB, 12 * GIB, 0)})})
    assert node.cgroup_available() == 18 * GIB
    assert node.available_bytes() == 18 * GIB
    _write(host_root, _meminfo(5 * GIB))  # MemAvailable the smaller
    assert node.available_bytes() == 5 * GIB


def test_cgroup_v2_in_a_namespace(host_root):
    """A container's cgroup namespace: /proc/self/cgroup says `/`, its files are at the mount's root."""
    _write(host_root, {**_meminfo(100 * GIB), "proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT,
                       **_v2({"": (8 * GIB, 3 * GIB, GIB)})})
    assert node.available_bytes() == 6 * GIB


def test_cgroup_v1_memory_controller(host_root):
    """v1 (memory.limit_in_bytes, usage_in_bytes, total_inactive_file); a mount of a sub-tree (its root field)
    and v1's 'unlimited' (2^63 rounded to a page) at the top."""
    d = "sys/fs/cgroup/memory"
    _write(host_root, {**_meminfo(100 * GIB), "proc/self/cgroup": "5:cpu:/x\n4:memory:/docker/abc\n0::/\n",
                       "proc/self/mountinfo": V1_MOUNT,
                       f"{d}/docker/abc/memory.limit_in_bytes": f"{16 * GIB}\n",
                       f"{d}/docker/abc/memory.usage_in_bytes": f"{6 * GIB}\n",
                       f"{d}/docker/abc/memory.stat": f"cache 9\ntotal_inactive_file {GIB}\n",
                       f"{d}/memory.limit_in_bytes": "9223372036854771712\n", f"{d}/memory.usage_in_bytes": "1\n"})
    assert node.available_bytes() == 11 * GIB


def test_nothing_readable_is_unknown(host_root):
    assert node.meminfo_available() is None and node.cgroup_available() is None and node.available_bytes() is None


def test_a_real_cgroup_limit_is_read(tmp_path):
    """A child memory cgroup of this process's own (v1 or v2) with a 768 MiB limit, where this machine lets a test
    make one: a process inside it reads at most the limit less what it uses, far below MemAvailable."""
    own = next((line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":", 2)[1] in ("memory", "")), None)
    dirs = [Path(f"/sys/fs/cgroup/memory{own[2]}"), Path(f"/sys/fs/cgroup{own[2]}")] if own else []
    parent = next((d for d in dirs if (d / "memory.limit_in_bytes").exists() or (d / "memory.max").exists()), None)
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable memory cgroup here")
    child, limit = parent / f"coat_test_{os.getpid()}", 768 * 2**20
    try:
        child.mkdir()
        (child / ("memory.limit_in_bytes" if (parent / "memory.limit_in_bytes").exists() else "memory.max")
         ).write_text(str(limit))
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        code = "from coat_ds import node; print(node.cgroup_available(), node.meminfo_available())"
        env = child_env()
        env.pop(node.ROOT_VARIABLE, None)
        out = subprocess.run(["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
                              code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        room, meminfo = (int(x) for x in out.stdout.split()[-2:])
    finally:
        child.rmdir()
    assert 0 < room < limit - 20 * 2**20, out.stdout  # python and torch use more than 20 MiB of it
    assert meminfo > limit


def test_train_plan_reads_the_deepspeed_launchers_node_size():
    """`examples/train.py --plan` as a rank of `deepspeed` sees it (LOCAL_SIZE, no LOCAL_WORLD_SIZE): 8 ranks are
    2 nodes of 4, not 8 nodes of 1."""
    env = child_env(WORLD_SIZE="8", LOCAL_SIZE="4", RANK="0")
    env.pop("LOCAL_WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "examples/train.py", "--plan", "--model-size", "1b", "--seq-len", "2048",
                          "--micro-batch", "8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ZeRO-2 on 8 GPU(s) (2 node(s) x 4)" in out.stdout, out.stdout
