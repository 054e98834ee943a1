"""Make `"optimizer": {"type": "CoatAdamW", ...}` work through DeepSpeed's own extension points.

DeepSpeed builds an optimizer it does not know by `getattr(torch.optim, name)(params, **params_cfg)`
and lets ZeRO run any class listed in `ZERO_SUPPORTED_OPTIMIZERS`. We put a validating factory named
CoatAdamW on `torch.optim` and CoatAdamW on that list, hook DeepSpeedEngine (engine.py: the "coat"
section, partition layouts) and tell the FP8 layers what ZeRO-3 does (sharding.py); that covers
deepspeed.initialize, the launcher, HF Trainer and accelerate alike.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..optim import CoatAdamW
from ..optim.coat_adamw import PARAM_RULES, check_param

NAME = "CoatAdamW"

def validate_params(params: dict | None) -> dict:
    """The optimizer "params" of a DeepSpeed config, checked by CoatAdamW's own rules; a ValueError names
    the key and what is allowed."""
    params = dict(params or {})
    for key, value in params.items():
        if key not in PARAM_RULES:
            raise ValueError(f"optimizer.params.{key}: unknown key for CoatAdamW; allowed keys: {sorted(PARAM_RULES)}")
        check_param(key, value, where="optimizer.params.")
    if "betas" in params:
        params["betas"] = tuple(float(b) for b in params["betas"])
    if "v_format" in params:
        params["v_format"] = params["v_format"].lower()
    return params


def coat_adamw_from_config(model_parameters: Iterable, **params: Any) -> CoatAdamW:
    """What DeepSpeed calls for `"type": "CoatAdamW"`: validate the params, then build the optimizer."""
    return CoatAdamW(model_parameters, **validate_params(params))


coat_adamw_from_config.__name__ = coat_adamw_from_config.__qualname__ = NAME


def register() -> None:
    """Idempotent; `import coat_ds` calls it."""
    import torch

    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero import utils as zero_utils
    except ImportError:  # DeepSpeed not installed: CoatAdamW still works as a plain torch optimizer
        return
    from .fence import warn_if_untested

    warn_if_untested()  # a release whose methods we re-state may differ from the tested ones (fence.py)
    setattr(torch.optim, NAME, coat_adamw_from_config)
    if CoatAdamW not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CoatAdamW)
    from .engine import hook
    from .sharding import register as register_sharding

    hook(DeepSpeedEngine)
    register_sharding()  # what ZeRO-3 and the engine mean to the FP8 layers and the swap
