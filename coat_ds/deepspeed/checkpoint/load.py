"""Checkpoints of CoatAdamW engines: exact resume, re-partitioning to another world size, refusal of bad files.

Saving is DeepSpeed's own `engine.save_checkpoint`; each rank's base-optimizer state also records its
partition layout (`coat_layouts`: which piece of which parameter each flat tensor holds). Because FP8
groups are per parameter (zero/layout.py), a checkpoint re-partitions exactly: pieces are cut out of the
parameters and re-assembled, codes, scales and exponents unchanged. Only a different `group_size`
re-groups (dequantize with the old groups, quantize with the new: one extra FP8 rounding of m and v).
Reading saved files and the per-parameter form are files.py's (universal.py shares them).

`engine.load_checkpoint` of a CoatAdamW engine runs load() (engine.py wraps DeepSpeedEngine.load_checkpoint):
  1. every file of the tag is opened and checked on every rank before anything is loaded; a missing,
     truncated or foreign file (another optimizer), or one holding objects outside DeepSpeed's checkpoint contents
     (files.torch_load: a pickle that could run code when DeepSpeed unpickles it), raises ValueError on
     all ranks, nothing half-loaded;
  2. same data-parallel world size: DeepSpeed's own load (bit-exact resume);
  3. another world size under ZeRO: DeepSpeed loads module weights, scheduler and client state, then
     masters and optimizer states are rebuilt per parameter from all saved ranks and cut to this rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from ... import kernels
from ...formats import Fp8Moment, bf16_weight
from ...optim import CoatAdamW
from ...optim.coat_adamw import FP8_STATE_KEYS, FP32_STATE_KEYS, MOMENTS, fp8_moments, fp32_zeros
from ..zero.kind import is_zero3
from ..zero.layout import meta_offsets
from ..zero.partitions import partitions, zero3_slice
from .files import (LATEST, LATEST_UNIVERSAL, LAYOUTS, ZERO3_MODEL_FILE, CheckpointError, ParamState, base_and_flats,
                    canonical, check_contents, latest_tag, model_file, read_mapped, zero_files)
from .universal import read as read_universal


# ------------------------------------------------------------------ optimizer hooks (torch's own API)
def _flat_params(opt: CoatAdamW) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _state_dict_post(opt: CoatAdamW, sd: dict) -> dict:
    """Record, per saved parameter index, the layout of the flat tensor (None: a whole parameter)."""
    flats = getattr(opt, "_coat_flat_index", {})
    rec = {}
    for i, p in enumerate(_flat_params(opt)):
        layout = opt.partition_of(p)
        rec[i] = None if layout is None else {"layout": layout.record(), "flat_index": flats.get(id(p)),
                                              "group_size": layout.group_size}
    sd[LAYOUTS] = rec
    return sd


def check_state(sd: dict, where: str) -> None:
    """Refuse a base-optimizer state that CoatAdamW did not write."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise CheckpointError(f"{where}: not an optimizer state dict (keys: {sorted(sd) if isinstance(sd, dict) else type(sd).__name__})")
    groups = {i: g for g in sd["param_groups"] for i in g["params"]}
    for i, st in sd["state"].items():
        g = groups.get(i, {})
        if "group_size" not in g or "fp8_state" not in g:
            raise CheckpointError(f"{where}: written by another optimizer (param group keys {sorted(g)}); "
                                  "CoatAdamW's groups carry group_size, v_format, expansion, fp8_state")
        want = FP8_STATE_KEYS if g["fp8_state"] else FP32_STATE_KEYS
        if sorted(st) != sorted(want):
            raise CheckpointError(f"{where}: written by another optimizer or truncated (state keys {sorted(st)}); "
                                  f"CoatAdamW with fp8_state={g['fp8_state']} expects {sorted(want)}")


def _load_pre(opt: CoatAdamW, sd: dict) -> dict:
    check_state(sd, "optimizer state")
    own = _state_dict_post(opt, {})[LAYOUTS]
    saved = sd.get(LAYOUTS)
    if any(v is not None for v in own.values()) and saved is not None:
        for i, rec in own.items():
            if rec is not None and saved.get(i, {}) and saved[i]["layout"] != rec["layout"]:
                raise CheckpointError("optimizer state was saved with another partition layout (world size or "
                                      "ZeRO stage changed); load it with engine.load_checkpoint, which re-partitions")
    opt._coat_loading = sd["state"]
    return sd


def _load_post(opt: CoatAdamW) -> None:
    """torch casts every floating state tensor to its param's dtype: give codes and metadata theirs back."""
    saved = getattr(opt, "_coat_loading", None)
    opt._coat_loading = None
    if saved is None:
        return
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p)
            if st and g["fp8_state"]:
                for prefix, moment in zip(MOMENTS, fp8_moments(st, g)):
                    st.update(moment.to_state(prefix))


def install(engine) -> None:
    """State-dict hooks on the CoatAdamW of `engine` (layouts in, canonical FP8 moments out)."""
    opt = engine.basic_optimizer
    opt._coat_flat_index = {id(flat): k for k, (flat, _, _) in enumerate(partitions(engine))}
    if not getattr(opt, "_coat_hooks", False):
        opt.register_state_dict_post_hook(_state_dict_post)
        opt.register_load_state_dict_pre_hook(_load_pre)
        opt.register_load_state_dict_post_hook(_load_post)
        opt._coat_hooks = True


# ------------------------------------------------------------------ files
def _tag(load_dir: str, tag: str | None, latest_name: str = LATEST) -> str | None:
    return str(tag) if tag is not None else latest_tag(load_dir, latest_name)


def _agree(err: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank found a problem."""
    errs = [err]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
    bad = [e for e in errs if e]
    if bad:
        raise CheckpointError(bad[0])


def _read(engine, load_dir: str, tag: str) -> tuple[int, list[dict] | None, dict[str, dict]]:
    """(saved dp world size, ZeRO optimizer dicts or None without ZeRO, what was read: absolute path -> the file's
    contents), checked; every file memory-mapped, its optimizer state streamed (files.read_mapped).

    At the saved world size each rank checks its own file (the others check theirs; _agree shares the
    verdict); at another world size every rank needs, and checks, all of them."""
    ckpt_dir = os.path.join(load_dir, tag)
    path = model_file(ckpt_dir) or os.path.join(ckpt_dir, ZERO3_MODEL_FILE)  # neither: torch_load says it is missing
    sd = read_mapped(path)
    files = {os.path.abspath(path): sd}
    world = int(sd.get("dp_world_size", 1))
    if not engine.zero_optimization():
        opt_sd = sd.get("optimizer")
        if opt_sd is None:
            raise CheckpointError(f"{path}: holds no optimizer state")
        check_state(opt_sd.get("optimizer_state_dict", opt_sd) if isinstance(opt_sd, dict) else opt_sd, path)
        return world, None, files
    paths = zero_files(ckpt_dir, world)
    if world == engine.seq_dp_world_size:
        own = paths[dist.get_rank(group=engine.optimizer.dp_process_group) if dist.is_initialized() else 0]
        files[os.path.abspath(own)] = read_mapped(own)
        zsds = [_checked(files[os.path.abspath(own)], own)]
        if _group_sizes(zsds) == _current_sizes(engine):
            return world, zsds, files
    for p in paths:
        files.setdefault(os.path.abspath(p), read_mapped(p))
    return world, [_checked(files[os.path.abspath(p)], p) for p in paths], files


def _checked(z: dict, path: str) -> dict:
    """The ZeRO optimizer dict of the file `path` (its contents `z`), refused if CoatAdamW did not write it."""
    base, _ = base_and_flats(z.get("optimizer_state_dict") if isinstance(z, dict) else None, path)
    check_state(base, path)
    if LAYOUTS not in base:
        raise CheckpointError(f"{path}: no partition layouts; it was not saved by a coat_ds CoatAdamW engine")
    return z["optimizer_state_dict"]


class _HandedOver:
    """engine.checkpoint_engine while DeepSpeed loads a tag coat_ds has read: a file coat_ds read is handed over as it
    is (DeepSpeed's own load reads each rank's optimizer file whole, a second time), any other file is read as coat_ds
    reads (files.read_mapped: weights_only, mapped, its optimizer state streamed) instead of DeepSpeed's
    torch.load(weights_only=False). Everything else is DeepSpeed's own checkpoint engine."""

    def __init__(self, inner, files: dict[str, dict]) -> None:
        self._inner, self._files = inner, files

    def load(self, path: str, map_location=None):
        got = self._files.pop(os.path.abspath(path), None)  # handed over once: DeepSpeed holds it from here
        return got if got is not None else read_mapped(path)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@contextlib.contextmanager
def _handed_over(engine, files: dict[str, dict]):
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _HandedOver(inner, files)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


# ------------------------------------------------------------------ load
def load(engine, original, load_dir: str, tag: str | None = None, **kw):
    """engine.load_checkpoint for CoatAdamW engines (see the module docstring)."""
    load_opt = kw.get("load_optimizer_states", True) and not kw.get("load_module_only", False)
    if engine.load_universal_checkpoint():
        return _load_universal(engine, original, load_dir, _tag(load_dir, tag, LATEST_UNIVERSAL), load_opt, kw)
    tag = _tag(load_dir, tag)
    if tag is None:
        return original(load_dir, None, **kw)
    err, world, zsds, files = None, None, None, {}
    try:
        check_contents(os.path.join(load_dir, tag))  # every file DeepSpeed may unpickle, before it does
        world, zsds, files = _read(engine, load_dir, tag)
    except CheckpointError as exc:
        err = str(exc)
    _agree(err)
    if not load_opt or not engine.zero_optimization() or (world == engine.seq_dp_world_size
                                                          and _group_sizes(zsds) == _current_sizes(engine)):
        with _handed_over(engine, files):  # DeepSpeed's own load, on what coat_ds read: no file read twice
            return original(load_dir, tag, **kw)
    if is_zero3(engine.optimizer):  # ZeRO-3: model files are per saved rank
        path, client = _engine_state(engine, load_dir, tag, kw.get("load_lr_scheduler_states", True), files)
    else:  # module weights, scheduler, counters and client state by DeepSpeed; the optimizer below
        with _handed_over(engine, files):
            path, client = original(load_dir, tag, **dict(kw, load_optimizer_states=False))
    try:
        canon = canonical(zsds)
        restore(engine, canon, zsds[0])
        err = None
    except CheckpointError as exc:
        err = str(exc)
    _agree(err)
    return path, client


def _load_universal(engine, original, load_dir: str, tag: str | None, load_opt: bool, kw: dict):
    """DeepSpeed loads fp32 masters and steps from the universal folder; the FP8 states come from
    the coat_states.bin files that universal.py wrote beside them."""
    canon, err = None, None
    if tag is not None:
        try:
            check_contents(os.path.join(load_dir, tag))  # every file DeepSpeed may unpickle, before it does
            canon = read_universal(os.path.join(load_dir, tag)) if load_opt else None
        except CheckpointError as exc:
            err = str(exc)
        _agree(err)
    if canon is not None and is_zero3(engine.optimizer):
        # DeepSpeed's ZeRO-3 universal loader reads exp_avg.pt/exp_avg_sq.pt per parameter: do it all here
        path, client = _engine_state(engine, load_dir, tag, kw.get("load_lr_scheduler_states", True))
    else:
        path, client = original(load_dir, tag, **kw)
    if canon is not None and path is not None:
        try:
            restore(engine, canon, None)
        except CheckpointError as exc:
            err = str(exc)
        _agree(err)
    return path, client


_DS_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd",
            "lr_scheduler", "optimizer", "global_samples")


def _engine_state(engine, load_dir: str, tag: str, load_lr: bool, files: dict | None = None) -> tuple[str, dict]:
    """What DeepSpeed's _load_checkpoint restores besides weights and optimizer, from saved rank 0's model file (in
    `files` where read already)."""
    ckpt_dir = os.path.join(load_dir, tag)
    path = os.path.join(ckpt_dir, ZERO3_MODEL_FILE)
    sd = (files or {}).get(os.path.abspath(path))
    sd = read_mapped(path) if sd is None else sd
    if load_lr and engine.lr_scheduler is not None and sd.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(sd["lr_scheduler"])
    engine.global_steps = sd["global_steps"]
    engine.global_samples = sd.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = sd["skipped_steps"]
    module = sd.get("module") or {}
    with torch.no_grad():
        for name, buf in engine.module.named_buffers():
            if name in module and module[name].shape == buf.shape:
                buf.copy_(module[name])
    return ckpt_dir, {k: v for k, v in sd.items() if k not in _DS_KEYS}


def _group_sizes(zsds: list[dict]) -> list[int]:
    base, _ = base_and_flats(zsds[0], "rank 0")
    return [g["group_size"] for g in base["param_groups"]]


def _current_sizes(engine) -> list[int]:
    return [g["group_size"] for g in engine.basic_optimizer.param_groups]


def regroup(c: ParamState, size: int, expansion: bool) -> ParamState:
    """The state of one parameter re-quantized with groups of `size` (adds one FP8 rounding of m and v)."""
    if not c.fp8 or c.group_size == size:
        return c
    m, v = (Fp8Moment(*kernels.quantize(kernels.dequantize(*x.tensors, x.group_size), x.fmt, size, expansion),
                      size, x.fmt) for x in (c.m, c.v))
    return dataclasses.replace(c, m=m, v=v, group_size=size)


def _restore_partition(flat: torch.Tensor, layout, group: dict, canon: dict[str, ParamState]) -> dict:
    """The optimizer state of one flat partition from the per-parameter form (its masters written in place)."""
    if group["fp8_state"]:
        st = layout.init_state(flat, group)
        moments = fp8_moments(st, group)
    else:
        st = fp32_zeros(flat)
        moments = tuple(st[k] for k in MOMENTS)
    for seg, meta in zip(layout.segments, meta_offsets(layout.segments, layout.group_size)):
        if seg.name not in canon:
            raise CheckpointError(f"parameter {seg.name} is not in the checkpoint")
        c = regroup(canon[seg.name], group["group_size"], group["expansion"])
        if c.master.numel() != seg.param_numel:
            raise CheckpointError(f"parameter {seg.name}: {c.master.numel()} values in the checkpoint, "
                                  f"{seg.param_numel} in the model")
        c.scatter(seg, meta, flat, moments)
        if layout.remainder is not None:  # the master as high halves + remainders, exactly
            layout.write_master(flat, seg.flat_start, c.master[seg.param_start:seg.param_start + seg.numel])
        st["step"] = c.step.clone()
    return st


@torch.no_grad()
def restore(engine, canon: dict[str, ParamState], zsd0: dict | None) -> None:
    """Write masters, model weights and optimizer states of this rank from the per-parameter form."""
    opt = engine.basic_optimizer
    for k, (flat, _, _) in enumerate(partitions(engine)):
        opt.state[flat] = _restore_partition(flat, opt.partition_of(flat), _group_for(opt, engine, k), canon)
    _restore_lp(engine, canon)
    if zsd0 is None:  # universal load: DeepSpeed restored loss scale and hyperparameters
        return
    base0, _ = base_and_flats(zsd0, "rank 0")
    if len(base0["param_groups"]) == len(opt.param_groups):  # hyperparameters, as DeepSpeed's own load does
        for cur, saved in zip(opt.param_groups, base0["param_groups"]):
            cur.update({k: v for k, v in saved.items() if k not in ("params", "group_size")})
    scaler = zsd0.get("loss_scaler")
    zo = engine.optimizer
    if scaler is not None and hasattr(zo, "loss_scaler"):
        zo.loss_scaler = scaler
        zo.dynamic_loss_scale = zsd0.get("dynamic_loss_scale", getattr(zo, "dynamic_loss_scale", False))


def _group_for(opt: CoatAdamW, engine, k: int) -> dict:
    sub = getattr(engine.optimizer, "sub_group_to_group_id", None)
    gi = sub[k] if sub is not None else k
    return opt.param_groups[gi]


def _restore_lp(engine, canon: dict[str, ParamState]) -> None:
    """Model (low-precision) weights from the restored fp32 masters: bf16 ones as the step writes them (the
    split's high half, an fp32 master's or a remainder master's alike)."""
    zo = engine.optimizer
    names = {p: n for n, p in engine.module.named_parameters()}

    def lp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return bf16_weight(x.float()) if dtype == torch.bfloat16 else x.to(dtype)

    if is_zero3(zo):  # ZeRO-3: each rank holds its slice of every parameter
        rank = dist.get_rank(group=zo.dp_process_group)
        for group in zo.fp16_groups:
            for p in group:
                start, n, _ = zero3_slice(p, rank)
                if n:
                    p.ds_tensor.data.view(-1)[:n] = lp(canon[names[p]].master[start:start + n], p.ds_tensor.dtype)
        return
    for p, name in names.items():
        if name in canon and p.numel() == canon[name].master.numel():
            p.data.copy_(lp(canon[name].master, p.dtype).view_as(p))

