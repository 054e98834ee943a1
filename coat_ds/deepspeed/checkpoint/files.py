"""What a saved CoatAdamW checkpoint holds, read back: its files, and each parameter's state made whole.

Both loaders build on this (load.py: a regular tag, re-partitioned; universal.py: DeepSpeed's universal
layout) and the up-front check (check.py) refuses files with its CheckpointError. The names DeepSpeed gives a
tag's files are spelled here only, so a release that renames them changes this file. A rank's optimizer
state holds, per flat partition, pieces of many parameters (its recorded layout says which);
`canonical` gathers the pieces of every rank into one ParamState per parameter, and a loader cuts that
to its own partitions (the inverse, ParamState.scatter).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import mmap
import os
import pickle
import pickletools
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ...formats import Fp8Moment
from ...optim.coat_adamw import MOMENTS, fp8_moments, moment_formats
from ..zero.layout import Segment, meta_offsets

LAYOUTS = "coat_layouts"  # key of the base-optimizer state dict: per state index, its partition's layout

LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"  # beside the tags: the newest (universal) tag's name
MODEL_STATES, OPTIM_STATES = "model_states.pt", "optim_states.pt"  # how a tag's model and optimizer files end
RANKED = "zero_pp_rank_{}_"  # how a data-parallel rank's own files start (optimizer states; ZeRO-3: model states)
MODEL_FILE = "mp_rank_00_" + MODEL_STATES  # module weights and engine state
ZERO3_MODEL_FILE = RANKED.format(0) + MODEL_FILE  # ZeRO-3 writes one per rank: saved rank 0's
OPTIM_FILE = RANKED + "mp_rank_00_" + OPTIM_STATES  # .format(rank); "bf16_" before it for BF16_Optimizer's
_RANK = re.compile(r"zero_pp_rank_\d+_")


class CheckpointError(ValueError):
    """A checkpoint this engine must not load; raised before anything is loaded."""


_UNREADABLE = "checkpoint file unreadable (truncated or corrupt)"


def torch_load(path: str, mmap: bool = False) -> Any:
    """torch.load to the CPU (`mmap`: tensors mapped, not read) of a file that may come from elsewhere: unpickled with
    weights_only and only DeepSpeed's own classes allowed (ds_globals), so a file carrying code is refused, unrun.
    A missing, unreadable or refused file is a CheckpointError."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file missing: {path}")
    with torch.serialization.safe_globals(ds_globals()):  # also around _refusal, which asks torch what it allows
        try:
            return torch.load(path, map_location="cpu", mmap=mmap and zipfile.is_zipfile(path), weights_only=True)
        except pickle.UnpicklingError:  # torch's weights-only reader stopped; its text advises weights_only=False
            error = _refusal(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is refused the same way
            first = str(exc).splitlines()[0] if str(exc) else ""
            error = f"{_UNREADABLE}: {path} ({type(exc).__name__}: {first})"
    raise CheckpointError(error)


def read_mapped(path: str) -> Any:
    """torch_load of `path` with its tensors memory-mapped (nothing read until used), and where it holds a ZeRO
    optimizer state (a rank's optimizer file), that state streamed: its per-partition entries are Streamed, so a load
    that copies them one after another into place (DeepSpeed's, CoatAdamW's, canonical's) keeps one entry's pages
    resident, not the file's. An old-format (non-zip) file is read whole, as torch reads it."""
    obj = torch_load(path, mmap=True)
    ranges = mapped_ranges(path)
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if ranges and isinstance(osd, dict):
        for key in ("base_optimizer_state", "optimizer_state_dict"):
            base = osd.get(key)
            if isinstance(base, dict) and isinstance(base.get("state"), dict):
                base["state"] = Streamed({i: Streamed(st, ranges) if isinstance(st, dict) else st
                                          for i, st in base["state"].items()}, ranges)
        for key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
            if isinstance(osd.get(key), list):
                osd[key] = StreamedList(osd[key], ranges)
    return obj


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges at which this process maps the file `path` (/proc/self/maps): where release() may drop."""
    real, out = os.path.realpath(path), []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    out.append((lo, hi))
    except OSError:  # no procfs: nothing is released, the load reads as torch does
        pass
    return out


_MADV_DONTNEED = 4


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def release(value: Any, ranges: list[tuple[int, int]]) -> None:
    """Drop the resident pages of every tensor in `value` (a tensor, or a dict / list of them) that lies inside
    `ranges`, a read-only use of a private file mapping (madvise MADV_DONTNEED): a later read maps them again from
    the file, unchanged, so dropping never changes a value. A tensor elsewhere (heap memory) is left alone."""
    if isinstance(value, dict):
        for v in dict.values(value):
            release(v, ranges)
    elif isinstance(value, (list, tuple)):
        for v in list.__iter__(value) if isinstance(value, list) else value:
            release(v, ranges)
    elif isinstance(value, torch.Tensor) and value.device.type == "cpu":
        start = value.data_ptr()
        end = start + value.numel() * value.element_size()
        if any(lo <= start and end <= hi for lo, hi in ranges):
            page = mmap.PAGESIZE
            lo, hi = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
            if hi > lo:
                _madvise()(lo, hi - lo, _MADV_DONTNEED)


class Streamed(dict):
    """A dict read from a mapped file whose entries are dropped (release) as a reader moves on: the entry taken last
    (by key, get, items or values) is released when another one is taken, or when items() / values() run out. Loads
    copy each entry once, in turn; one that reads an entry again maps it again, unchanged."""

    def __init__(self, items: dict, ranges: list[tuple[int, int]]) -> None:
        super().__init__(items)
        self._ranges, self._taken = ranges, None

    def _take(self, key: Any) -> Any:
        if self._taken is not None and self._taken[0] != key:
            release(self._taken[1], self._ranges)
        value = dict.__getitem__(self, key)
        self._taken = (key, value)
        return value

    def _walk(self):
        for k in list(self.keys()):
            yield k, self._take(k)
        if self._taken is not None:  # every entry read: the last one too is done with
            release(self._taken[1], self._ranges)

    def __getitem__(self, key: Any) -> Any:
        return self._take(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._take(key) if key in self else default

    def items(self):
        return self._walk()

    def values(self):
        return (v for _, v in self._walk())


class StreamedList(list):
    """A list read from a mapped file whose entries are dropped as a reader moves on (as Streamed)."""

    def __init__(self, items: list, ranges: list[tuple[int, int]]) -> None:
        super().__init__(items)
        self._ranges, self._taken = ranges, None

    def __getitem__(self, i: Any) -> Any:
        value = list.__getitem__(self, i)
        if isinstance(i, int):
            if self._taken is not None and self._taken[0] != i:
                release(self._taken[1], self._ranges)
            self._taken = (i, value)
        return value

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
        if self._taken is not None:
            release(self._taken[1], self._ranges)


def _refusal(path: str) -> str:
    """Why torch's weights-only reader refused `path`, from the pickle's opcodes rather than torch's text (whose
    wording differs between releases, which advises the unsafe weights_only=False, and which calls a name cut off
    by truncation an unsupported global): globals outside what torch allows (its defaults and ds_globals) are what
    unpickling would import and call; a whole pickle without any still holds what that reader refuses; a pickle
    cut short or garbled is truncated or corrupt."""
    from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals

    found, broken = _pickled_globals(path)
    allowed = _get_allowed_globals().keys() | _get_user_allowed_globals().keys()
    outside = list(dict.fromkeys(g for g in found if g not in allowed))
    if not outside and broken:
        return f"{_UNREADABLE}: {path} (pickle {broken})"
    what = (f"global{'s' * (len(outside) > 1)} {', '.join(outside)}" if outside
            else "pickle instructions torch's weights-only reader refuses")
    return (f"checkpoint file refused unread: {path} holds objects outside DeepSpeed's checkpoint contents ({what}); "
            "unpickling it could run code")


_STRINGS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_PUTS, _GETS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}, {"GET", "BINGET", "LONG_BINGET"}


def _pickled_globals(path: str) -> tuple[list[str], str | None]:
    """The globals (module.name, renamed from Python 2 names as torch's reader does) imported by the pickle torch.load
    reads from `path`, in order, read as opcodes (pickletools), nothing built; and why that pickle is not whole (None
    if it is). A zip file's pickle is its data.pkl; an old-format file holds four in a row, the object's last.
    STACK_GLOBAL (protocol 4+) imports the two strings pushed last."""
    from torch._utils import IMPORT_MAPPING, NAME_MAPPING

    found: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            if zipfile.is_zipfile(path):
                zf = stack.enter_context(zipfile.ZipFile(path))
                name = next((n for n in zf.namelist() if n.rpartition("/")[2] == "data.pkl"), "data.pkl")
                stream, count = stack.enter_context(zf.open(name)), 1
            else:
                stream, count = stack.enter_context(open(path, "rb")), 4
            for _ in range(count):
                memo: dict[int, str | None] = {}
                top, last = None, ["?", "?"]  # the string on top of the stack, if one is; the last two pushed
                for op, arg, _pos in pickletools.genops(stream):
                    if op.name in _PUTS:
                        memo[len(memo) if arg is None else arg] = top
                        continue
                    top = arg if op.name in _STRINGS else memo.get(arg) if op.name in _GETS else None
                    if isinstance(top, str):
                        last = [last[1], top]
                    if op.name in ("GLOBAL", "INST", "STACK_GLOBAL"):
                        module, name = arg.split(" ", 1) if arg else last
                        module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
                        found.append(f"{module}.{name}")
    except (ValueError, KeyError, OSError, zipfile.BadZipFile) as exc:
        return found, f"{type(exc).__name__}: {exc}"
    return found, None


@functools.cache
def ds_globals() -> tuple[type, ...]:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and plain containers: the loss scaler,
    ZeRO's stage, the fragment addresses of its parameter slices (tests/test_deepspeed.py finds exactly these in the
    files of real ZeRO-0..3 runs, bf16 / fp16 / fp32, Offload)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


def check_contents(folder: str) -> None:
    """Unpickle every checkpoint file under `folder` as torch_load does (tensors mapped, not read): a CheckpointError
    names the first that is unreadable or holds objects outside DeepSpeed's checkpoint contents. Run before
    DeepSpeed's own load, which unpickles with weights_only=False."""
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.pt"), recursive=True)):
        torch_load(path, mmap=True)


def latest_tag(ckpt_dir: str, name: str = LATEST) -> str | None:
    """The tag the `latest` file of `ckpt_dir` (or `name`: LATEST_UNIVERSAL) names; None without one."""
    try:
        with open(os.path.join(ckpt_dir, name)) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def model_file(tag_dir: str) -> str | None:
    """The model-states file of a tag (under ZeRO-3 saved rank 0's), or None if it has none."""
    return next((path for path in (os.path.join(tag_dir, n) for n in (MODEL_FILE, ZERO3_MODEL_FILE))
                 if os.path.isfile(path)), None)


def per_rank(name: str) -> str:
    """A file name with its data-parallel rank as `{}` (RANKED), or the name itself if the file is not a rank's."""
    return _RANK.sub(RANKED, name)


def zero_files(ckpt_dir: str, world: int) -> list[str]:
    """The ZeRO optimizer files of data-parallel ranks 0..world-1 (bf16_ prefixed or not)."""
    for prefix in ("bf16_", ""):
        names = [os.path.join(ckpt_dir, prefix + OPTIM_FILE.format(r)) for r in range(world)]
        if os.path.isfile(names[0]):
            return names
    found = sorted(glob.glob(os.path.join(ckpt_dir, "*" + RANKED.format("*") + OPTIM_STATES)))
    raise CheckpointError(f"{ckpt_dir}: expected ZeRO optimizer files for {world} ranks "
                          f"({OPTIM_FILE.format('<r>')}), found {[os.path.basename(f) for f in found]}")


def base_and_flats(osd: dict, where: str) -> tuple[dict, list]:
    """(CoatAdamW's state dict, the flat fp32 partitions) of one rank's ZeRO optimizer state."""
    if not isinstance(osd, dict):
        raise CheckpointError(f"{where}: no optimizer state in this file")
    if "base_optimizer_state" in osd:
        return osd["base_optimizer_state"], osd["single_partition_of_fp32_groups"]
    if "fp32_flat_groups" in osd:
        return osd["optimizer_state_dict"], osd["fp32_flat_groups"]
    raise CheckpointError(f"{where}: unknown ZeRO optimizer state layout (keys {sorted(osd)})")


@dataclass
class ParamState:
    """One parameter's optimizer state, whole: fp32 master, step, and (m, v) as Fp8Moments or, for an
    fp8_state=False group, fp32 tensors (all flat)."""
    master: torch.Tensor
    step: torch.Tensor
    m: Fp8Moment | torch.Tensor
    v: Fp8Moment | torch.Tensor
    group_size: int
    v_format: str
    filled: int = 0  # values written so far (gathering checks that the saved ranks cover the parameter)

    @property
    def fp8(self) -> bool:
        return isinstance(self.m, Fp8Moment)

    @classmethod
    def empty(cls, numel: int, group: dict) -> "ParamState":
        """Zeros, for a parameter of `numel` values in param group `group`."""
        if group["fp8_state"]:
            m, v = (Fp8Moment.zeros(numel, fmt, group["group_size"]) for fmt in moment_formats(group))
        else:
            m, v = torch.zeros(numel), torch.zeros(numel)
        return cls(torch.zeros(numel), torch.zeros(()), m, v, group["group_size"], group["v_format"])

    def gather(self, seg: Segment, meta: int, flat: torch.Tensor, step: torch.Tensor, moments: tuple) -> None:
        """Take the piece `seg` from a partition: its fp32 master `flat` and its (m, v), whose metadata holds
        the piece's groups from `meta`."""
        a, n, f = seg.param_start, seg.numel, seg.flat_start
        self.master[a:a + n] = flat.reshape(-1)[f:f + n].float()
        self.step = step.clone()
        for whole, part in zip((self.m, self.v), moments):
            if self.fp8:
                whole.slice(a, a + n).copy_(seg.piece(part, meta))
            else:
                whole[a:a + n] = part.reshape(-1)[f:f + n].float()
        self.filled += n

    def scatter(self, seg: Segment, meta: int, flat: torch.Tensor, moments: tuple) -> None:
        """The inverse of gather: write the piece `seg` into a partition (to its device), the step aside."""
        a, n, f = seg.param_start, seg.numel, seg.flat_start
        flat.view(-1)[f:f + n] = self.master[a:a + n].to(flat.device)
        for whole, part in zip((self.m, self.v), moments):
            if self.fp8:
                seg.piece(part, meta).copy_(whole.slice(a, a + n))
            else:
                part.view(-1)[f:f + n] = whole[a:a + n].to(part.device)

    def to_file(self) -> dict:
        """Plain data (the moments under CoatAdamW's state keys), the master aside: universal.py's file."""
        sd = {"step": self.step, "group_size": self.group_size, "fp8": self.fp8, "v_format": self.v_format}
        if self.fp8:
            for prefix, moment in zip(MOMENTS, (self.m, self.v)):
                sd.update(moment.to_state(prefix))
        else:
            sd.update(zip(MOMENTS, (self.m, self.v)))
        return sd

    @classmethod
    def from_file(cls, sd: dict, master: torch.Tensor) -> "ParamState":
        """The inverse of to_file (also of the files coat_ds wrote with uint8 codes)."""
        if sd["fp8"]:
            m, v = fp8_moments(sd, sd)  # the file carries group_size and v_format as a param group does
        else:
            m, v = (sd[k].float() for k in MOMENTS)
        master = master.reshape(-1).float()
        return cls(master, sd["step"], m, v, sd["group_size"], sd["v_format"], master.numel())


def _gather_rank(canon: dict[str, ParamState], base: dict, flats: list, r: int) -> None:
    groups = {i: g for g in base["param_groups"] for i in g["params"]}
    for i, st in base["state"].items():
        info = base[LAYOUTS].get(i)
        if info is None:
            raise CheckpointError(f"rank {r}: state {i} has no partition layout")
        group, flat = groups[i], flats[info["flat_index"]]
        moments = fp8_moments(st, group) if group["fp8_state"] else tuple(st[k] for k in MOMENTS)
        segments = [Segment(*rec) for rec in info["layout"]]
        for seg, meta in zip(segments, meta_offsets(segments, group["group_size"])):
            if seg.name not in canon:
                canon[seg.name] = ParamState.empty(seg.param_numel, group)
            canon[seg.name].gather(seg, meta, flat, st["step"], moments)


def canonical(zsds: list[dict]) -> dict[str, ParamState]:
    """Per parameter name, its whole state, from the ZeRO optimizer states of all saved ranks."""
    canon: dict[str, ParamState] = {}
    for r, osd in enumerate(zsds):
        _gather_rank(canon, *base_and_flats(osd, f"rank {r}"), r)
    for name, c in canon.items():
        if c.filled != c.master.numel():
            raise CheckpointError(f"parameter {name}: saved ranks cover {c.filled} of {c.master.numel()} values")
    return canon
