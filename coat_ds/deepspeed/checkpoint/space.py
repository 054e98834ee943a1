"""A checkpoint save refused up front, in one line, when its filesystem cannot hold it.

A 70B CoatAdamW checkpoint is ~290 GB, more than a 235 GB node disk: DeepSpeed would write for minutes, then fail
on the last files with a full disk. So before anything is written, every rank estimates the bytes of the files
that it will write and reads the free space of its target filesystem, the ranks gather both, and each filesystem
must hold the sum over the ranks that write to it, with a margin; otherwise every rank raises the same
CheckpointSaveError, which says what is needed and what is free, and nothing is written (`latest` and the earlier
tags stay as they were).

The estimate is measured on the state dicts the save will write, each storage once, as torch.save writes it
(no tensor is copied to measure, except what a state_dict() call itself makes, which the save makes again):
  - this rank's optimizer file (ZeRO's, BF16_Optimizer's): `engine.optimizer.state_dict()`, i.e. this rank's
    master partition (fp32, or bf16 with coat's bf16 masters) and its base optimizer's state (CoatAdamW's FP8
    moments, scales, remainders);
  - the model states file, on the ranks DeepSpeed has write one (`save_non_zero_checkpoint`: data-parallel rank
    0; under ZeRO-3 every rank, whose module holds only empty partitioned parameters): `module_state_dict()`,
    plus the optimizer's state dict without ZeRO and the frozen parameters' fragments under ZeRO-2/3;
  - plus MARGIN of that and SLACK per rank for what is not a tensor (pickled metadata, zip records, DeepSpeed's
    zero_to_fp32.py and zero_to_torch.py copies), fitted to what was measured: the tensors alone come within 0.3-1.5%
    of the bytes on disk (tests/launched/test_checkpoint_space.py: ZeRO-1/2/3, bf16 and fp32 masters, Offload; the
    main job's tiny model: 9,387,632 tensor bytes in 9,414,523 on disk, +0.29%), and what is not a tensor is ~8-10
    KB a file plus 41 KB of scripts. A wider margin refuses saves that fit: 5% + 1 MiB a rank refused the main job's
    8.98 MiB checkpoint with 11.0 MiB free, and would refuse a 290 GB 70B checkpoint with 300 GB free.
The ranks that share a filesystem: every rank of the job (DeepSpeed assumes one shared filesystem), or, with
`"checkpoint": {"use_node_local_storage": true}`, the ranks of one node whose save directory is on the same device.
"""
from __future__ import annotations

import os
import shutil
import socket
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch

MARGIN = 0.015          # of the tensor bytes: the most that the files were measured to exceed them by
SLACK = 64 * 2 ** 10     # bytes per writing rank: its files' metadata (~8-10 KB each), rank 0's two scripts (41 KB)

_CHECKED: ContextVar[bool] = ContextVar("coat_ds_space_checked", default=False)


class CheckpointSaveError(RuntimeError):
    """A save that failed, or was refused, on some rank: one line, the same on every rank (save.py re-exports it)."""


@dataclass(frozen=True)
class RankSpace:
    """What one rank reports: its files' estimated bytes, its filesystem (key, mount) and the free space there."""
    need: int
    free: int
    filesystem: tuple
    mount: str


def saved_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages in `obj` (nested dicts, lists, tuples), each counted once: what torch.save
    writes for them (a view's whole storage included)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        storage = obj.untyped_storage()
        if obj.device.type == "meta" or not storage.nbytes() or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        obj = obj.values()
    if isinstance(obj, (list, tuple, type({}.values()))):
        return sum(saved_bytes(v, seen) for v in obj)
    return 0


def _frozen_bytes(engine: Any) -> int:
    """What the model states file holds of parameters the optimizer does not (ZeRO-2/3: their fragments)."""
    return sum(getattr(p, "ds_tensor", p).nbytes for p in engine.module.parameters() if not p.requires_grad)


def rank_bytes(engine: Any) -> int:
    """Estimated bytes of the files this rank writes in engine.save_checkpoint, margin included: the state dicts
    DeepSpeed will save (module docstring), measured as torch.save writes them."""
    optim = saved_bytes(engine.optimizer.state_dict()) if engine.optimizer is not None else 0
    total = optim if engine.save_zero_checkpoint else 0      # its own optimizer file (ZeRO, BF16_Optimizer)
    if engine.save_non_zero_checkpoint:                      # the model states file
        total += saved_bytes(engine.module_state_dict())
        if not engine.zero_optimization():                   # ... which holds the optimizer without ZeRO
            total += optim
        if engine.zero_optimization_partition_gradients():
            total += _frozen_bytes(engine)
    return with_margin(total)


def with_margin(tensor_bytes: int) -> int:
    """A rank's estimate from the tensor bytes of its files: MARGIN and SLACK for what is not a tensor."""
    return int(tensor_bytes * (1 + MARGIN)) + SLACK


def existing_dir(path: str) -> str:
    """The nearest existing directory at or above `path` (a save creates the rest)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def mount_of(path: str) -> str:
    """The mount point of the filesystem that `path` (an existing one) is on."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def disk(path: str) -> tuple[int, str]:
    """(free bytes for this user, mount point) of the filesystem `path` is on: the one place that asks the OS."""
    where = existing_dir(path)
    return shutil.disk_usage(where).free, mount_of(where)


def report(engine: Any, save_dir: str) -> RankSpace:
    """This rank's RankSpace for a save into `save_dir`."""
    free, mount = disk(save_dir)
    shared = ()                                         # DeepSpeed's assumption: one filesystem for the whole job
    if engine.use_node_local_storage():
        shared = (socket.gethostname(), os.stat(existing_dir(save_dir)).st_dev)
    return RankSpace(rank_bytes(engine), free, shared, mount)


def size(n: float) -> str:
    """Bytes as GiB where at least one, else MiB."""
    return f"{n / 2 ** 30:,.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:,.1f} MiB"


def ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def shortfalls(spaces: list[RankSpace]) -> list[str]:
    """One clause per filesystem that cannot hold what its ranks will write there, e.g. "needs 290.1 GiB on /data
    (ranks 0, 1, 2, 3), 212.4 GiB free there"; empty when every one can."""
    groups: dict[tuple, list[int]] = {}
    for rank, s in enumerate(spaces):
        groups.setdefault(s.filesystem, []).append(rank)
    out = []
    for ranks in groups.values():
        need = sum(spaces[r].need for r in ranks)
        free = min(spaces[r].free for r in ranks)   # the same filesystem: the lowest reading is the latest
        if need > free:
            out.append(f"needs {size(need)} on {spaces[ranks[0]].mount} ({ranks_text(ranks)}), {size(free)} free there")
    return out


def refuse_if_short(engine: Any, save_dir: str, tag: str, latest: str | None) -> None:
    """Collective: raise the same CheckpointSaveError on every rank if a filesystem cannot hold this save of `tag`
    (`latest`: the tag `latest` names now, for the message). Nothing is written either way."""
    import deepspeed.comm as dist

    mine = report(engine, save_dir)
    spaces = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        spaces = [None] * dist.get_world_size()
        dist.all_gather_object(spaces, mine)
    short = shortfalls(spaces)
    if short:
        kept = f"`latest` still names {latest}" if latest else "`latest` does not exist"
        raise CheckpointSaveError(f"checkpoint {tag} not saved to {save_dir}: {'; '.join(short)} (estimated from "
                                  f"the tensors to save, +{MARGIN:.1%}); nothing written; {kept}")


@contextmanager
def checked() -> Iterator[None]:
    """Within it, engine.save_checkpoint skips the check: the caller (save_atomically) ran it for the real tag."""
    token = _CHECKED.set(True)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def already_checked() -> bool:
    return _CHECKED.get()
