"""`import coat_ds` makes DeepSpeed run CoatAdamW and the "coat" section, through DeepSpeed's own extension points.

DeepSpeed builds an optimizer it does not know by `getattr(torch.optim, name)(params, **params_cfg)` and lets
ZeRO run any class listed in `ZERO_SUPPORTED_OPTIMIZERS`. We put a validating factory named CoatAdamW on
`torch.optim` and CoatAdamW on that list, hook DeepSpeedEngine (engine.py: the "coat" section, partition
layouts) and tell the FP8 layers what ZeRO-3 does (sharding.py); that covers deepspeed.initialize, the
launcher, HF Trainer and accelerate alike. DeepSpeed is optional here: without it CoatAdamW is a plain torch
optimizer. So register() is the one gate to it: it imports DeepSpeed, then the modules that import DeepSpeed at
their top (engine.py, sharding.py; through engine.py, zero/'s step and checkpoint/load.py). The modules `import
coat_ds` loads before that import DeepSpeed only inside the functions that need it.
"""
from __future__ import annotations

import atexit
from typing import Any

import torch

from ..optim import CoatAdamW
from .fence import warn_if_untested
from .optimizer_type import NAME, coat_adamw_from_config
from ..launch.teardown import at_exit


def register() -> None:
    """Idempotent; `import coat_ds` calls it."""
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero import utils as zero_utils
    except ImportError:  # DeepSpeed not installed: CoatAdamW still works as a plain torch optimizer
        return
    from .engine import hook  # imports DeepSpeed
    from .sharding import register as register_sharding  # imports DeepSpeed

    warn_if_untested()  # a release whose methods we re-state may differ from the tested ones (fence.py)
    atexit.unregister(at_exit)   # once: a live process group is destroyed before finalization, where it can abort
    atexit.register(at_exit)     # a script that is not ours (teardown.py)
    setattr(torch.optim, NAME, coat_adamw_from_config)
    if CoatAdamW not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(CoatAdamW)
    hook(DeepSpeedEngine)
    register_sharding()  # what ZeRO-3 and the engine mean to the FP8 layers and the swap


def initialize(model: torch.nn.Module, config: Any = None, optimizer: Any = None, **kw: Any):
    """deepspeed.initialize with the model first (kept for scripts written against it): the engine itself
    applies the "coat" section, so plain `deepspeed.initialize` after `import coat_ds` gives the same engine."""
    import deepspeed

    return deepspeed.initialize(model=model, config=config, optimizer=optimizer, **kw)
