"""`import coat_ds` makes DeepSpeed run CoatAdamW and the "coat" section, through DeepSpeed's own extension points.

DeepSpeed builds an optimizer it does not know by `getattr(torch.optim, name)(params, **params_cfg)` and lets
ZeRO run any class listed in `ZERO_SUPPORTED_OPTIMIZERS`. We put a validating factory named CoatAdamW on
`torch.optim` and CoatAdamW on that list, hook DeepSpeedEngine (engine.py: the "coat" section, partition
layouts) and tell the FP8 layers what ZeRO-3 does (sharding.py); that covers deepspeed.initialize, the
launcher, HF Trainer and accelerate alike. DeepSpeed is optional here: without it CoatAdamW is a plain torch
optimizer, so what needs it is imported inside register().
"""
from __future__ import annotations

import torch

from ..optim import CoatAdamW
from .engine import hook
from .fence import warn_if_untested
from .optimizer_type import NAME, coat_adamw_from_config


def register() -> None:
    """Idempotent; `import coat_ds` calls it."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero import utils as zero_utils
    except ImportError:  # DeepSpeed not installed: CoatAdamW still works as a plain torch optimizer
        return
    from .sharding import register as register_sharding  # imports DeepSpeed

    warn_if_untested()  # a release whose methods we re-state may differ from the tested ones (fence.py)
    setattr(torch.optim, NAME, coat_adamw_from_config)
    if CoatAdamW not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CoatAdamW)
    hook(DeepSpeedEngine)
    register_sharding()  # what ZeRO-3 and the engine mean to the FP8 layers and the swap
