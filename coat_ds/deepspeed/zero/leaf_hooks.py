"""ZeRO-3's reduce of a leaf module's gradients, fired from the module's input instead of torch's full backward hook.

DeepSpeed reduces a leaf module's gradients (set_z3_leaf_module) once its backward ends, from
`register_full_backward_hook`. torch's BackwardHook keeps the module's output gradient from its arrival until the
input's gradient exists: through a whole FP8 decoder layer's backward, 2 B a token per hidden unit on top of its
peak (docs/plan.md, "Long context"). DeepSpeed's callback ignores its gradient arguments, so for the leaves coat_ds
marks the same callback fires from an identity on the module's input, which keeps nothing: its backward runs once
every gradient the module's backward makes exists (its parameters' too: autograd runs AccumulateGrad first of what
is ready). An anchor that requires grad makes it fire where the input needs none (the first layer of a model with
frozen embeddings), where torch's hook fires before the parameters' gradients are accumulated.
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

_marked: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark(module: nn.Module) -> None:
    """`module` is a leaf coat_ds made: its reduce fires from its input (replace)."""
    _marked.add(module)


class _InputGradReady(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, done: Callable[[], None]) -> torch.Tensor:
        ctx.done = done
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.done()
        return (grad if ctx.needs_input_grad[0] else None), None, None


def _input(args: tuple, kwargs: dict) -> tuple[str, Any]:
    """Where the module's input is: `hidden_states` (HF's name) or its first floating-point positional tensor."""
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return ("kw", "hidden_states")
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    raise RuntimeError("coat_ds: a ZeRO-3 leaf module was called without a floating-point tensor input "
                       "(hidden_states or a positional one), from which its gradient reduce fires")


def _at_input(reduce: Callable, anchor: torch.Tensor, module: nn.Module, args: tuple, kwargs: dict):
    if not torch.is_grad_enabled():   # no backward follows (generate, eval; reentrant checkpoint's first forward)
        return None
    done = partial(reduce, module, None, None)
    kind, key = _input(args, kwargs)
    if kind == "arg":
        args = args[:key] + (_InputGradReady.apply(args[key], anchor, done),) + args[key + 1:]
    else:
        kwargs = {**kwargs, key: _InputGradReady.apply(kwargs[key], anchor, done)}
    return args, kwargs


def replace(zo: Any, *_: Any) -> None:
    """After DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks: each leaf coat_ds marked gets its
    reduce from its input; its handle takes the backward hook's place (destroy() removes it)."""
    handles = zo._leaf_module_hooks
    for i, (module, handle) in enumerate(zip(list(zo.leaf_parameters), list(handles))):
        if module not in _marked or handle.id not in module._backward_hooks:
            continue
        reduce = module._backward_hooks[handle.id]
        handle.remove()
        anchor = torch.empty(0, requires_grad=True)
        handles[i] = module.register_forward_pre_hook(partial(_at_input, reduce, anchor), with_kwargs=True)
