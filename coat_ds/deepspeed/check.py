"""Up-front checks of a training job's inputs: one line, before any model, data or device memory.

The engine applies the same rules much later (CoatAdamW's params when DeepSpeed builds the optimizer, the
"coat" section when it wraps the model, ZeRO's section when it builds ZeRO), on every rank, as a traceback.
check_config runs them first, each rule from its owner: optimizer_type.validate_params, config.coat_section and
DeepSpeed's own parser for every DeepSpeed key (deepspeed_keys.py: unknown keys, bad values); plus the combinations
DeepSpeed or coat_ds refuse only once running.
check_tag tells whether a saved checkpoint tag is complete without reading its tensors.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any, Mapping

from . import deepspeed_keys
from .checkpoint.files import MODEL_FILE, CheckpointError, model_file, per_rank, torch_load
from .config import SECTION, CoatSection, coat_section
from .optimizer_type import NAME, validate_params
from .zero.gradients import config_refusal as gradients_refusal
from .zero.states import config_refusal as states_refusal
from .zero.master import config_refusal

AUTO = deepspeed_keys.AUTO


def check_config(cfg: Any, *, hf_auto: bool = False, world_size: int | None = None) -> None:
    """Raise ValueError, one line naming the key and what is allowed, if DeepSpeed + coat_ds would refuse `cfg` or
    DeepSpeed would ignore one of its keys. With `hf_auto`, "auto" values are left to HF Trainer / accelerate,
    which fill them; `world_size`: the job's, for DeepSpeed's batch rule (default: the launcher's WORLD_SIZE)."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"the DeepSpeed config is a {type(cfg).__name__}; allowed: a JSON object")
    coat_opt = _check_optimizer(cfg.get("optimizer"), hf_auto)
    _check_coat(cfg, hf_auto)
    _check_precision(cfg)
    deepspeed_keys.check(cfg, hf_auto=hf_auto, world_size=world_size, ours=(SECTION,))
    _check_zero(cfg.get("zero_optimization"), coat_opt)


def _check_optimizer(opt: Any, hf_auto: bool) -> bool:
    """Whether the config names CoatAdamW, whose params are then checked by its own rules."""
    if opt is None:
        return False
    if not isinstance(opt, Mapping):
        raise ValueError(f"optimizer={opt!r} is invalid; allowed: an object with \"type\" and \"params\"")
    kind = opt.get("type")
    if isinstance(kind, str) and kind != NAME and kind.lower() == NAME.lower():
        raise ValueError(f"optimizer.type={kind!r} is invalid; allowed: {NAME!r} (DeepSpeed looks up names it "
                         "does not know on torch.optim, where case matters)")
    if kind != NAME:
        return False
    params = opt.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"optimizer.params={params!r} is invalid for {NAME}; allowed: an object of its keys")
    validate_params({k: v for k, v in params.items() if not (hf_auto and v == AUTO)})
    return True


def _check_coat(cfg: Mapping, hf_auto: bool) -> None:
    if SECTION not in cfg:
        return
    if not isinstance(cfg[SECTION], Mapping):
        keys = [f.name for f in dataclasses.fields(CoatSection)]
        raise ValueError(f"{SECTION}={cfg[SECTION]!r} is invalid; allowed: an object with keys {keys}")
    coat_section(cfg)
    for refusal in (config_refusal, gradients_refusal, states_refusal):
        reason = refusal(cfg, hf_auto)
        if reason is not None:
            raise ValueError(reason)


def _check_zero(zero: Any, coat_opt: bool) -> None:
    """What CoatAdamW cannot run of a ZeRO section DeepSpeed's own model accepted (deepspeed_keys.check)."""
    if not isinstance(zero, Mapping):   # absent, or a bool: DeepSpeed's deprecated form, read by DeepSpeed itself
        return
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig(**zero)
    device = getattr(z.offload_optimizer, "device", None)
    if coat_opt and int(z.stage) == 3 and str(getattr(device, "value", device)) == "nvme":
        raise ValueError(f"zero_optimization.offload_optimizer.device='nvme' is invalid with ZeRO-3 and {NAME}; "
                         "allowed: 'cpu' or 'none' (DeepSpeed's NVMe swapper keeps every optimizer state as fp32 "
                         "of its parameter's size; FP8 codes and per-group scales are not)")


def _check_precision(cfg: Mapping) -> None:
    """fp16 and bf16 together, or one the accelerator lacks: DeepSpeed refuses both inside initialize."""
    on = [k for k in ("fp16", "bf16") if isinstance(cfg.get(k), Mapping) and cfg[k].get("enabled") is True]
    if len(on) == 2:
        raise ValueError("fp16.enabled and bf16.enabled are both true; allowed: at most one of them")
    if not on:
        return
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    ok = getattr(acc, f"is_{on[0]}_supported")()
    if not ok:
        raise ValueError(f"{on[0]}.enabled=true is invalid on this machine: DeepSpeed's {acc.device_name()} "
                         f"accelerator says is_{on[0]}_supported() -> {ok!r}; allowed: "
                         f"{'bf16' if on[0] == 'fp16' else 'fp16'} or fp32 (no {on[0]} section)")


# ------------------------------------------------------------------ checkpoints
def check_tag(tag_dir: str) -> None:
    """Raise CheckpointError naming the first missing or unreadable file of a DeepSpeed checkpoint tag.

    Every `*.pt` file is unpickled with its tensors memory-mapped, not read (cheap at any size), and with
    DeepSpeed's classes only (checkpoint/files.py's torch_load), which catches truncated and missing files and
    files carrying code; the engine's load still checks contents (checkpoint/load.py)."""
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint missing: {tag_dir}")
    model = model_file(tag_dir)
    if model is None:
        raise CheckpointError(f"checkpoint file missing: {tag_dir}/{MODEL_FILE}")
    states = torch_load(model, mmap=True)
    world = int(states.get("dp_world_size", 1)) if isinstance(states, dict) else 1
    files = sorted(glob.glob(os.path.join(tag_dir, "*.pt")))
    for family in sorted({per_rank(os.path.basename(f)) for f in files}):
        for rank in range(world if "{}" in family else 0):  # one file per data-parallel rank
            path = os.path.join(tag_dir, family.format(rank))
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file missing: {path}")
    for path in files:
        if path != model:
            torch_load(path, mmap=True)


def intact_tags(ckpt_dir: str, exclude: str | None = None) -> list[str]:
    """Tags in `ckpt_dir` whose files check_tag accepts, newest (highest step number) first."""
    tags = sorted((d for d in os.listdir(ckpt_dir) if os.path.isdir(os.path.join(ckpt_dir, d))
                   and not d.endswith(".tmp") and d != exclude), key=_natural, reverse=True)
    good = []
    for tag in tags:
        try:
            check_tag(os.path.join(ckpt_dir, tag))
        except CheckpointError:
            continue
        good.append(tag)
    return good


def _natural(name: str) -> list:
    """Sort key in which global_step20 comes before global_step100."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", name)]
