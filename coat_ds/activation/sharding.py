"""What the FP8 layers and the swap ask of a framework that owns the model's parameters (ZeRO-3, an engine).

Their behaviour changes once such a framework holds the model (weights gathered per use, per-module hooks
installed, a wrapper around the model), but only that framework's glue may know it: coat_ds.deepspeed
registers its answers at `import coat_ds` (`register_sharding`). The defaults are plain PyTorch: nothing
wrapped, hooked or partitioned. It lives here, below coat_ds.hf, because the weight cache asks it too."""
from __future__ import annotations

import torch
from torch import nn


class ShardingHooks:
    """Plain PyTorch. A framework's glue subclasses it and overrides what applies to it."""

    def wrapper_refusal(self, model: nn.Module, what: str) -> str | None:
        """Why coat_ds.`what` (inject, revert) cannot take `model`: it is the framework's wrapper, not the model."""
        return None

    def hooked_refusal(self, model: nn.Module, what: str) -> str | None:
        """Why coat_ds.`what` can no longer swap `model`'s layers: the framework has already hooked its modules."""
        return None

    def is_partitioned(self, param: torch.Tensor) -> bool:
        """Whether `param` is gathered for each use and freed after: no copy of it may outlive the use."""
        return False

    def mark_leaf(self, module: nn.Module) -> None:
        """Have the framework gather all of `module`'s parameters when `module` is entered (an FP8 layer reads
        its children's weights without calling the children)."""


_active = ShardingHooks()


def register_sharding(hooks: ShardingHooks) -> None:
    """Make `hooks` the answers coat_ds's model code gets (one framework per process; the last one wins)."""
    global _active
    if not isinstance(hooks, ShardingHooks):
        raise TypeError(f"hooks must be a ShardingHooks, got {type(hooks).__name__}")
    _active = hooks


def sharding() -> ShardingHooks:
    return _active
