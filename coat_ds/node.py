"""The node a rank runs on: how many ranks share it and how much host memory it can still give them, for what must
hold for the whole node (coat.states "host" pins every rank's FP8 moments: deepspeed/zero/states.py; the planner's
node of `examples/train.py --plan`).

The ranks are counted by the ranks themselves once a process group exists (each rank's host identity gathered:
no launcher to trust), else from the launcher's environment, whichever launcher it is. The available memory is the
smaller of the kernel's MemAvailable and what the rank's memory cgroup still allows (a container's limit, v1 or v2,
at every level from the rank's own cgroup up): MemAvailable alone is the whole machine's.

`COAT_DS_HOST_ROOT` (a directory; unset: `/`) is where `proc/meminfo`, `proc/self/cgroup`, `proc/self/mountinfo`
and the cgroup files are read from: the seam through which a test gives a host less memory than it has.
"""
from __future__ import annotations

import hashlib
import os
import re
import socket
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

ROOT_VARIABLE = "COAT_DS_HOST_ROOT"
LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",            # torchrun, accelerate
    "LOCAL_SIZE",                  # deepspeed's launcher (launch.py)
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI's mpirun
    "MPI_LOCALNRANKS",             # MPICH / Intel MPI
    "SLURM_NTASKS_PER_NODE",       # srun --ntasks-per-node
)
UNLIMITED = 2**60  # a cgroup limit at least this large is no limit (v1 writes 2^63 rounded down to a page)
# per cgroup version: (limit file, usage file, memory.stat key of the file cache the kernel can drop)
CGROUP_FILES = {"cgroup2": ("memory.max", "memory.current", "inactive_file"),
                "cgroup": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def launcher_local_ranks(env: Mapping[str, str] = os.environ) -> int:
    """This node's ranks as its launcher says (the first of LOCAL_SIZE_VARIABLES set; SLURM's per-node list
    SLURM_TASKS_PER_NODE, e.g. `4(x2),2`, at SLURM_NODEID), 1 where none is set."""
    for key in LOCAL_SIZE_VARIABLES:
        if env.get(key, "").isdigit():
            return int(env[key])
    if "SLURM_TASKS_PER_NODE" in env:
        counts = [int(n) for n, rep in re.findall(r"(\d+)(?:\(x(\d+)\))?", env["SLURM_TASKS_PER_NODE"])
                  for _ in range(int(rep or 1))]
        node = int(env.get("SLURM_NODEID", "0"))
        if node < len(counts):
            return counts[node]
    return 1


def _read(path: str) -> str | None:
    try:
        with open(os.path.join(os.environ.get(ROOT_VARIABLE) or "/", path.lstrip("/"))) as f:
            return f.read()
    except OSError:
        return None


def host_identity() -> str:
    """The hostname and the kernel's boot id: ranks sharing both share this node's memory."""
    return f"{socket.gethostname()}/{(_read('/proc/sys/kernel/random/boot_id') or '').strip()}"


def node_key() -> int:
    return int.from_bytes(hashlib.sha256(host_identity().encode()).digest()[:7], "little")


def gather_by_node(values: Sequence[int], group=None, device=None) -> dict[int, list[tuple[int, ...]]]:
    """Every rank's `values` (ints, the same count on every rank), grouped by node (key: node_key()). A collective:
    every rank of `group` calls it; on a device tensor where the backend needs one (NCCL)."""
    mine = torch.tensor([node_key(), *values], dtype=torch.int64, device=device)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        rows = [mine]
    else:
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
    nodes: dict[int, list[tuple[int, ...]]] = {}
    for row in rows:
        key, *rest = row.tolist()
        nodes.setdefault(key, []).append(tuple(rest))
    return nodes


def local_ranks(group=None, device=None) -> int:
    """This node's ranks: counted over `group` where a process group exists (a collective), else the launcher's."""
    if not dist.is_initialized():
        return launcher_local_ranks()
    return len(gather_by_node((), group, device)[node_key()])


def meminfo_available() -> int | None:
    """MemAvailable of this host (Linux), or None where it cannot be read."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", _read("/proc/meminfo") or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def _cgroup_dirs() -> list[tuple[str, str]]:
    """(fs type, directory) of this process's memory cgroup at each level up to its mount, from
    /proc/self/cgroup and /proc/self/mountinfo."""
    paths = {}  # "cgroup2" or "cgroup" (v1, memory controller) -> this process's path in the hierarchy
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["cgroup2"] = path
        elif "memory" in controllers.split(","):
            paths["cgroup"] = path
    dirs = []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        fields, _, fs = line.partition(" - ")
        fs_type, _, options = (fs.split() + ["", "", ""])[:3]
        if fs_type not in paths or (fs_type == "cgroup" and "memory" not in options.split(",")):
            continue
        mount_root, mount_point = fields.split()[3:5]
        path = paths[fs_type]
        inside = path == mount_root or path.startswith(mount_root.rstrip("/") + "/")
        rel = os.path.relpath(path, mount_root) if inside else "."  # else: a namespaced view, rooted here
        level = os.path.normpath(os.path.join(mount_point, rel))
        while True:
            dirs.append((fs_type, level))
            if level == mount_point or len(level) <= len(mount_point):
                break
            level = os.path.dirname(level)
    return dirs


def cgroup_available() -> int | None:
    """What this process's memory cgroups still allow: the least, over the levels that set a limit, of the limit
    less the usage (plus the file cache the kernel drops before it fails an allocation); None where none is set."""
    best = None
    for fs_type, d in _cgroup_dirs():
        limit_file, usage_file, cache_key = CGROUP_FILES[fs_type]
        limit, usage = (_read(os.path.join(d, f)) for f in (limit_file, usage_file))
        if limit is None or usage is None or not limit.strip().isdigit() or int(limit) >= UNLIMITED:
            continue
        stat = re.search(rf"^{cache_key} (\d+)", _read(os.path.join(d, "memory.stat")) or "", re.M)
        left = int(limit) - int(usage) + (int(stat.group(1)) if stat else 0)
        best = left if best is None else min(best, left)
    return None if best is None else max(0, best)


def available_bytes() -> int | None:
    """The host memory this node can still give its ranks: the smaller of MemAvailable and the cgroup's room,
    None where neither can be read."""
    known = [n for n in (meminfo_available(), cgroup_available()) if n is not None]
    return min(known) if known else None
