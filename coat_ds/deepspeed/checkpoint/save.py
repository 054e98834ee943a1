"""Saving a DeepSpeed checkpoint tag atomically, and a failed save said in one line, the same on every rank.

torch.save reports a full disk as `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`
or `basic_ios::clear: iostream error`: its C++ writer drops the errno. `write_failure` asks the OS itself (a
small probe write next to the failed file) and says why, with the free space; `save_atomically` first refuses a
save that the filesystem cannot hold (space.py), then writes a tag as `<tag>.tmp`, renames it and points `latest` at
it only once every rank has written, and on a failure removes the partial tag and raises CheckpointSaveError on
every rank with one message.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Any

from .files import LATEST, latest_tag  # the file DeepSpeed's load_checkpoint(tag=None) reads, and its reader
from .space import CheckpointSaveError, checked, existing_dir, mount_of, ranks_text, refuse_if_short

__all__ = ["CheckpointSaveError", "save_atomically", "write_failure", "writer"]
PROBE_BYTES = 1 << 20


def writer(engine: Any) -> bool:
    """Whether this rank owns the renames: rank 0, or each node's local rank 0 with node-local storage."""
    return engine.local_rank == 0 if engine.use_node_local_storage() else engine.global_rank == 0


def _probe(directory: str) -> OSError | None:
    """Write PROBE_BYTES (flushed to the filesystem) in `directory`: the OS's own error, if it refuses."""
    probe = os.path.join(directory, f".coat_write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * PROBE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
        return None
    except OSError as exc:
        return exc
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def write_failure(path: str, exc: BaseException) -> str:
    """Why writing under `path` raised `exc`, in a few words: the errno's text where one is known (in the
    exception chain, else from a probe write), else the exception's first line; then the free space."""
    where = existing_dir(path)
    os_err = next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno), None)
    if os_err is None:
        os_err = _probe(where)
    if os_err is not None:
        reason = os.strerror(os_err.errno).lower()
        if os_err.errno == errno.EFBIG:
            reason += " (the file size limit, `ulimit -f`)"
        elif os_err.errno == errno.ENOSPC and os.statvfs(where).f_favail == 0:
            reason += " (no inodes left: the filesystem's limit on files)"
    else:
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    usage = shutil.disk_usage(where)
    return f"{reason} ({usage.free / 2**20:,.1f} MiB free of {usage.total / 2**20:,.1f} MiB on {mount_of(where)})"


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _write(engine: Any, save_dir: str, tmp: str, client_state: dict) -> str | None:
    """engine.save_checkpoint to `tmp`; None, or why it failed. DeepSpeed's save runs its collectives (a barrier,
    the tag check) before writing and ends with one barrier; a rank whose write failed joins that barrier, so
    the ranks stay in step whichever of them failed."""
    import deepspeed.comm as dist

    try:
        engine.save_checkpoint(save_dir, tag=tmp, client_state=client_state, save_latest=False)
        return None
    except (OSError, RuntimeError) as exc:   # torch.save's writer raises RuntimeError for I/O errors
        reason = write_failure(os.path.join(save_dir, tmp), exc)
        dist.barrier()
        return reason


def _commit(save_dir: str, tmp: str, tag: str) -> str | None:
    """The writer's renames: `tmp` -> `tag`, then `latest` (through latest.tmp, atomic); None, or why not."""
    try:
        final = os.path.join(save_dir, tag)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(os.path.join(save_dir, tmp), final)
        with open(os.path.join(save_dir, f"{LATEST}.tmp"), "w") as fh:
            fh.write(tag)
        os.replace(os.path.join(save_dir, f"{LATEST}.tmp"), os.path.join(save_dir, LATEST))
        return None
    except OSError as exc:
        return write_failure(save_dir, exc)


def save_atomically(engine: Any, save_dir: str, tag: str, client_state: dict | None = None) -> str:
    """Every rank writes `tag.tmp`; then the writer (see `writer`) renames it to `tag` and points `latest` at
    it, so a kill or a failure at any point leaves `latest` on the last complete tag. Returns the tag's path.
    On a failed write anywhere, the partial tag is removed and every rank raises the same
    CheckpointSaveError: which save, why (e.g. no space left on device), the free space, what `latest` names.
    A save the filesystem cannot hold raises it before anything is written (space.py)."""
    import deepspeed.comm as dist

    refuse_if_short(engine, save_dir, tag, latest_tag(save_dir))
    tmp = f"{tag}.tmp"
    with checked():
        mine = _write(engine, save_dir, tmp, client_state or {})
    if mine is None and writer(engine):
        mine = _commit(save_dir, tmp, tag)
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, mine)
    if not any(reasons):
        return os.path.join(save_dir, tag)
    if writer(engine):
        shutil.rmtree(os.path.join(save_dir, tmp), ignore_errors=True)
        if os.path.exists(os.path.join(save_dir, f"{LATEST}.tmp")):
            os.unlink(os.path.join(save_dir, f"{LATEST}.tmp"))
    dist.barrier()
    raise CheckpointSaveError(_message(save_dir, tag, reasons))


def _message(save_dir: str, tag: str, reasons: list) -> str:
    by_reason: dict[str, list[int]] = {}
    for rank, reason in enumerate(reasons):
        if reason:
            by_reason.setdefault(reason, []).append(rank)
    why = "; ".join(f"{r} [{ranks_text(ranks)}]" for r, ranks in by_reason.items())
    latest = latest_tag(save_dir)
    kept = f"`latest` still names {latest}" if latest else "no earlier checkpoint (`latest` does not exist)"
    return f"checkpoint {tag} not saved to {save_dir}: {why}; removed the partial {tag}.tmp; {kept}"
