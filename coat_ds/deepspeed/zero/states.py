"""`"coat": {"states": ...}`: where CoatAdamW's FP8 moments live between steps.

- "device" (default): beside the partition they belong to, on the GPU.
- "host": in pinned host memory (ZeRO-3 with `"gradients": "release"`). Each ZeRO-3 sub-group's moments (FP8 codes,
  per-group scales and exponents: 2.125 B/param at group_size 128, divided by the data-parallel world) are one
  contiguous block of one page-locked buffer per rank, pinned at its exact size (cudaHostRegister: torch's pinned
  allocator would round every block up to a power of two). Backward reaches the sub-groups in the same order every
  step, so as release steps a bucket the sub-group's block is copied to one of WINDOWS device windows (the next
  sub-group of the last step's order not yet reached in this one is prefetched), stepped there, and copied back once
  every parameter of the sub-group has been stepped, on two copy streams beside the compute stream: the step waits
  only for its own block, a copy back only for its block's step and its own copy in, and no host thread waits at
  all (the copies' events order them). engine.step() writes back what is still open. When the order changes (a
  branch or an expert unused on some steps: its parameters are stepped with zeros at engine.step()), a block
  fetched and not stepped is copied back only after it arrived. The arithmetic is the device step's on the same
  bytes, so "host" equals "device" bit for bit.
  The pinned buffers are unregistered and freed, and the windows freed, by the optimizer's destroy()
  (`engine.destroy()`: DeepSpeed 0.19.8 keeps every ZeRO-3 engine reachable after its last reference is dropped),
  or when the states are garbage-collected.
  What it buys: 70B's 150 GB of FP8 moments leave four 80 GB GPUs for the weights (ZeRO-3 bf16 partition, the
  master under bf16_sr) and the activations; the host keeps 2.125 B/param (DeepSpeed's CPU Adam: 12-16).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ... import node
from ...formats import state_keys
from ...optim.coat_adamw import MOMENTS, moment_formats
from ...keys import check_choice

STATES = ("device", "host")
DEFAULT, HOST = STATES
KEY = "coat.states"
WINDOWS = 3  # sub-groups on the device at once: the one stepped, the next (prefetched), the last (copied back)
ALIGN = 64  # elements: where every block starts in its buffers (16-byte loads stay aligned)
HEADROOM = 0.9  # of the node's available host memory, what the states may pin


def check_states(value: Any) -> str:
    """The value of coat.states, or a one-line ValueError naming the key and the allowed values."""
    return check_choice(KEY, value, STATES)


def _refused(why: str) -> str:
    return f"{KEY}={HOST!r} {why}; allowed there: {[DEFAULT]}"


def config_refusal(cfg: Mapping, hf_auto: bool = False) -> str | None:
    """Why a config's coat.states "host" cannot run, from the config alone (check.py, before any model)."""
    coat = cfg.get("coat") or {}
    if coat.get("states", DEFAULT) != HOST:
        return None
    zero = cfg.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    if zero.get("stage", 0) != 3:
        return _refused(f"streams ZeRO-3 sub-groups (zero_optimization.stage is {zero.get('stage', 0)!r}; allowed: 3)")
    if coat.get("gradients") != "release":
        return _refused(f"steps each sub-group as backward reduces it: needs coat.gradients 'release' "
                        f"(it is {coat.get('gradients', 'per_parameter')!r})")
    for k in ("offload_optimizer", "offload_param"):
        if str((zero.get(k) or {}).get("device", "none")).lower() != "none":
            return _refused(f"keeps the states on the host itself; DeepSpeed's Offload (zero_optimization.{k}) "
                            "moves the whole optimizer")
    return None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Block:
    """One sub-group's moments in three buffers (m's codes, v's codes, the fp32 metadata: one dtype each, as
    torch.save wants), at `offsets` on the host and at 0 in a window."""
    numel: int  # values of the partition
    n_meta: int  # (scale, exponent) pairs per moment
    offsets: tuple = (0, 0, 0)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.numel, self.numel, 4 * self.n_meta

    def views(self, bufs: list[torch.Tensor], at: tuple = (0, 0, 0)) -> dict[str, torch.Tensor]:
        """The state tensors as views of `bufs` (this block's start in each at `at`)."""
        (qm, sm, em), (qv, sv, ev) = (state_keys(prefix) for prefix in MOMENTS)
        m, v, meta = self.pieces(bufs, at)
        k = self.n_meta
        return {qm: m, sm: meta[:k], em: meta[k:2 * k], qv: v, sv: meta[2 * k:3 * k], ev: meta[3 * k:]}

    def pieces(self, bufs: list[torch.Tensor], at: tuple = (0, 0, 0)) -> list[torch.Tensor]:
        """This block's part of each buffer (what one copy moves)."""
        return [b.narrow(0, o, n) for b, o, n in zip(bufs, at, self.sizes)]


def _gib(n: float) -> str:
    """A size in GiB, or in MiB / KiB below one GiB (a tiny job's line still says its numbers)."""
    unit = next((u for u in (3, 2, 1) if n >= 2 ** (10 * u)), 1)
    return f"{n / 2 ** (10 * unit):.1f} {'KMG'[unit - 1]}iB"


def host_refusal(need: int, local_ranks: int, available: int | None) -> str | None:
    """The one line that refuses the host states before anything is allocated, or None: every rank of this node
    pins `need` bytes (ZeRO-3 pads every rank's partitions to one size), and the node keeps a tenth of its
    available memory (node.available_bytes: MemAvailable and its cgroup's room) for everything else."""
    if available is None or need * local_ranks <= HEADROOM * available:
        return None
    return (f"{KEY}={HOST!r} needs {_gib(need)} of pinned host memory per rank ({local_ranks} ranks on this node: "
            f"{_gib(need * local_ranks)}, the planner's host column); this host has {_gib(available)} available "
            f"(90% usable); allowed there: {[DEFAULT]}, or more ranks (ZeRO-3 divides the states)")


class HostStates:
    """The FP8 moments of a ZeRO-3 optimizer's sub-groups in pinned host memory, stepped through device windows
    (module docstring). Release3Step calls acquire(i) before stepping sub-group i, done(params) after each bucket
    and flush() at the end of the step; sync() before anything reads the host copies (checkpoints)."""

    def __init__(self, opt, masters: list[torch.Tensor], groups: list[dict], param_ids: list[set], device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        layouts = [opt.partition_of(m) for m in masters]
        self.blocks = [Block(m.numel(), lay.n_meta) for m, lay in zip(masters, layouts)]
        ends = [0, 0, 0]
        for b in self.blocks:
            b.offsets = tuple(ends)
            ends = [_aligned(e + n) for e, n in zip(ends, b.sizes)]
        self.dtypes = [f.dtype for f in moment_formats(groups[0])] + [torch.float32] if groups else []
        if any(f.dtype != d for g in groups for f, d in zip(moment_formats(g), self.dtypes)):
            raise ValueError(f"{KEY}={HOST!r} needs one v_format in every CoatAdamW param group")
        need = sum(n * torch.tensor([], dtype=d).element_size() for n, d in zip(ends, self.dtypes))
        _refuse_short_host(need, self.device)
        self.host = self._pin(ends, need)
        self._unpin = weakref.finalize(self, _unregister, self.host if self.cuda else [])  # if it is collected
        self._unpin.atexit = False  # at exit the process goes with its registrations
        biggest = [max((b.sizes[k] for b in self.blocks), default=0) for k in range(3)]
        self.windows = [[torch.empty(n, dtype=d, device=self.device) for n, d in zip(biggest, self.dtypes)]
                        for _ in range(WINDOWS)]
        self.holder: list[int | None] = [None] * WINDOWS  # sub-group whose block a window holds
        self.free: list[Any] = [None] * WINDOWS  # event: the window's last copy back is done
        self.released = list(range(-WINDOWS, 0))  # when each window's last copy back was issued (a counter)
        self.open: dict[int, int] = {}  # sub-group -> window, in order of use (oldest first)
        self.ready: dict[int, Any] = {}  # sub-group -> event: its block is in its window
        self.written: dict[int, Any] = {}  # sub-group -> event: its block is back on the host
        self.param_ids = param_ids  # sub-group -> ids of its parameters
        self.left = [set(s) for s in param_ids]  # ... not yet stepped this step
        self.where = {pid: i for i, s in enumerate(param_ids) for pid in s}
        self.order: list[int] = []  # sub-groups in the order this step first reached them
        self.last_order: list[int] = []  # ... the last step's (what prefetching follows)
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        for i, (m, lay, g) in enumerate(zip(masters, layouts, groups)):
            lay.home = (self, i)
            opt.state[m] = self.fresh(i)

    def _pin(self, sizes: list[int], need: int) -> list[torch.Tensor]:
        """The host buffers, page-locked at their exact sizes on CUDA (async copies, no power-of-two rounding)."""
        host = [torch.empty(n, dtype=d) for n, d in zip(sizes, self.dtypes)]
        for k, t in enumerate(host if self.cuda else []):
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(rc) != 0:
                _unregister(host[:k])
                raise RuntimeError(f"{KEY}={HOST!r}: cudaHostRegister of {_gib(need)} failed ({rc}); "
                                   "check `ulimit -l` (locked memory)")
        return host

    def close(self) -> None:
        """The host buffers unregistered and freed, the windows freed (the optimizer's destroy(): its states are
        gone after it)."""
        self.sync()
        self._unpin()
        for t in self.host + [t for w in self.windows for t in w]:
            t.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ the host copies (what opt.state holds)
    def host_views(self, i: int) -> dict[str, torch.Tensor]:
        return self.blocks[i].views(self.host, self.blocks[i].offsets)

    def fresh(self, i: int) -> dict:
        """Zero moments (scale 0, exponent 1: exact zeros) at step 0 in sub-group i's host block."""
        self.sync()  # nothing in flight into or out of the block (no window is open between steps)
        st = self.host_views(i)
        for key, t in st.items():
            if key.endswith("_expo"):
                t.fill_(1.0)
            else:
                t.view(torch.uint8).fill_(0)
        return {"step": torch.zeros((), dtype=torch.float32), **st}

    def adopt(self, i: int, saved: dict) -> dict:
        """A loaded state of sub-group i copied into its host block (codes bit for bit)."""
        self.sync()
        st = self.host_views(i)
        for key, t in st.items():
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and saved[key].element_size() == 1:
                t.view(torch.uint8).copy_(saved[key].reshape(-1).view(torch.uint8))
            else:
                t.copy_(saved[key].reshape(-1))
        return {"step": saved["step"].clone(), **st}

    # ------------------------------------------------------------------ the windows
    def window(self, i: int) -> dict[str, torch.Tensor]:
        """Sub-group i's state in its window (acquire(i) first)."""
        w = self.open.get(i)
        if w is None:
            raise RuntimeError(f"{KEY}={HOST!r}: sub-group {i} is stepped without its states on the device")
        return self.blocks[i].views(self.windows[w])

    def acquire(self, i: int) -> None:
        """Sub-group i's block in a window, the compute stream waiting for it; the next one of the last step's
        order prefetched into a spare window."""
        if i not in self.order:
            self.order.append(i)
        if i not in self.open:
            self._fetch(i, evict=True)
        self.open[i] = self.open.pop(i)  # most recently used last
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[i])
        k = self.last_order.index(i) if i in self.last_order else len(self.last_order)
        nxt = next((j for j in self.last_order[k + 1:] if j not in self.order), None)  # not stepped this step
        if nxt is not None and nxt not in self.open and len(self.open) < WINDOWS - 1:
            self._fetch(nxt, evict=False)

    def _fetch(self, i: int, evict: bool) -> None:
        if len(self.open) >= WINDOWS:
            if not evict:
                return
            self._write_back(next(iter(self.open)))  # the least recently used
        w = self._free_window()
        self.holder[w], self.open[i] = i, w
        b = self.blocks[i]
        pairs = list(zip(b.pieces(self.host, b.offsets), b.pieces(self.windows[w])))
        if not self.cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return
        with torch.cuda.stream(self.h2d):
            for ev in (self.free[w], self.written.get(i)):  # the window emptied, the host block written
                if ev is not None:
                    self.h2d.wait_event(ev)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            self.ready[i] = torch.cuda.Event()
            self.ready[i].record(self.h2d)

    def _free_window(self) -> int:
        """The free window whose copy back was issued first: a copy in waits for the window's copy back, and the
        one issued last is likely still running (taking it put every copy in behind a copy back: measured on
        Qwen3-30B-A3B, the two directions overlapped 0.01 s of 3.9 s of copies)."""
        return min((w for w, h in enumerate(self.holder) if h is None), key=self.released.__getitem__)

    def _write_back(self, i: int) -> None:
        w = self.open.pop(i)
        self.released[w] = max(self.released) + 1
        b = self.blocks[i]
        pairs = list(zip(b.pieces(self.windows[w]), b.pieces(self.host, b.offsets)))
        self.holder[w] = None
        if not self.cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # after the step that wrote the window
        self.d2h.wait_event(self.ready[i])  # and after the block arrived: a prefetched one may never have been stepped
        with torch.cuda.stream(self.d2h):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        self.free[w] = self.written[i] = ev

    def done(self, params) -> None:
        """These parameters were stepped (or skipped) this step: copy back every sub-group now complete."""
        for p in params:
            i = self.where.get(id(p))
            if i is None:
                continue
            self.left[i].discard(id(p))
            if not self.left[i] and i in self.open:
                self._write_back(i)

    def flush(self) -> None:
        """The end of a step: every open block copied back, the order kept for the next step's prefetching."""
        for i in list(self.open):
            self._write_back(i)
        self.left = [set(s) for s in self.param_ids]
        self.last_order, self.order = self.order, []

    def sync(self) -> None:
        """Wait until every host block holds its latest values (before a checkpoint reads them)."""
        for i in list(self.open):
            self._write_back(i)
        for ev in self.written.values():
            ev.synchronize()
        self.written.clear()
        self.free = [None] * WINDOWS


def _unregister(host: list[torch.Tensor]) -> None:
    for t in host:
        if t.untyped_storage().nbytes():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _refuse_short_host(need: int, device) -> None:
    """Refuse on every rank together, before any rank pins, when a node cannot pin all its ranks' states: each
    rank's need and its node's available memory gathered over the world (node.py: the ranks of a node counted by
    the ranks themselves, whatever the launcher), one line naming what the node needs and what it has."""
    available = node.available_bytes()
    nodes = node.gather_by_node((need, -1 if available is None else available), device=device)
    verdicts = {key: host_refusal(max(n for n, _ in rows), len(rows),
                                  None if min(a for _, a in rows) < 0 else min(a for _, a in rows))
                for key, rows in nodes.items()}
    why = verdicts[node.node_key()]
    if why is None and any(verdicts.values()):
        why = f"{KEY}={HOST!r}: another node has too little host memory for its ranks' states (see its ranks' line)"
    if why is not None:
        raise ValueError(why)


def install(zo) -> HostStates:
    """Move the FP8 moments of ZeRO-3 optimizer `zo` (release installed, layouts bound) to pinned host memory, to
    be released by zo.destroy() (engine.destroy() calls it)."""
    opt = zo.optimizer
    masters = list(zo.fp32_partitioned_groups_flat)
    groups = [opt.param_groups[zo.sub_group_to_group_id[i]] for i in range(len(masters))]
    ids = [{id(p) for p in group} for group in zo.fp16_groups]
    home = zo._coat_home = HostStates(opt, masters, groups, ids, zo.device)
    destroy = zo.destroy  # DeepSpeed's, bound: called, not re-stated

    def destroy_and_release() -> None:
        destroy()
        home.close()

    zo.destroy = destroy_and_release
    return home


def engine_refusal(zo, gradients: str) -> str | None:
    """Why the ZeRO optimizer `zo` cannot keep its states on the host (the engine-side check), or None."""
    from .kind import is_zero3

    if not is_zero3(zo):
        return _refused(f"streams ZeRO-3 sub-groups; this engine runs {type(zo).__name__}")
    if gradients != "release":
        return _refused("steps each sub-group as backward reduces it: needs coat.gradients 'release' "
                        f"(it is {gradients!r})")
    return None
