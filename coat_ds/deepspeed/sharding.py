"""DeepSpeed's answers to coat_ds.activation.sharding: what an engine and ZeRO-3 do to a model.

ZeRO-3 decides which parameters to gather per module when deepspeed.initialize installs its hooks (a leaf
module's children get none), so swapping layers afterwards would run them on unfetched parameters. Its
registration marks every module (`ds_recompute_parameters`; `ds_grads_remaining` from the first forward on);
a model built under zero.Init has partitioned parameters (`ds_id`) but no such marks yet, and can still be
swapped. `_z3_leaf` (set through DeepSpeed's own `set_z3_leaf_module`) makes ZeRO-3 gather a module's
parameters together when it is entered."""
from __future__ import annotations

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import set_z3_leaf_module
from torch import nn

from ..activation.sharding import ShardingHooks, register_sharding
from .zero import leaf_hooks

_ZERO3_MODULE_MARKS = ("ds_recompute_parameters", "ds_grads_remaining")


class ZeroHooks(ShardingHooks):
    def wrapper_refusal(self, model: nn.Module, what: str) -> str | None:
        if not isinstance(model, DeepSpeedEngine):
            return None
        return (f"coat_ds.{what} got a DeepSpeedEngine; the FP8 layers go into the model before "
                "deepspeed.initialize (a \"coat\": {\"activation\": ...} config section does it there)")

    def hooked_refusal(self, model: nn.Module, what: str) -> str | None:
        if not any(hasattr(m, mark) for m in model.modules() for mark in _ZERO3_MODULE_MARKS):
            return None
        return (f"coat_ds.{what}: this model already carries DeepSpeed ZeRO-3 hooks (an engine wrapped it); "
                "the FP8 layers go in before deepspeed.initialize (to save, use the engine: state_dict keys "
                "are the stock ones)")

    def is_partitioned(self, param: torch.Tensor) -> bool:
        return hasattr(param, "ds_id")

    def mark_leaf(self, module: nn.Module) -> None:
        set_z3_leaf_module(module, True)
        leaf_hooks.mark(module)   # its gradients reduced from its input (zero/leaf_hooks.py)


def register() -> None:
    register_sharding(ZeroHooks())
