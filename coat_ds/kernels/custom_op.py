"""How coat_ds's FP8 kernels meet torch's tracers: each is a `torch.library` custom op (namespace `coat_act`).

A kernel that writes into `torch.empty` outputs through raw pointers cannot be traced: the graph would hold
just the empty outputs (or the call fails on a fake tensor's data pointer). So wherever a graph is traced
(`tracing()`: Dynamo, AOTAutograd, make_fx) the compiler sees opaque ops with known output shapes (their
fakes) and no graph break, while eager calls on real tensors skip the dispatcher and call the
implementation directly (no per-call overhead)."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..formats import FP8Format

LIBRARY = "coat_act"
_REAL = (torch.Tensor, torch.nn.Parameter)


def tracing(x: torch.Tensor | None = None) -> bool:
    """Whether a graph is being traced rather than run, so the FP8 ops must be the custom ops.

    True under Dynamo (torch.compile, export) and wherever a python dispatch mode is active (AOTAutograd,
    make_fx: they run the code on fake/functional tensors, and `torch.compiler.is_compiling()` is False
    there when Dynamo is not involved, e.g. aot_function / make_fx, or on torch < 2.13 outside Dynamo's
    own trace). `x`, an input, is checked for a tensor subclass (a fake/functional tensor outside its mode;
    any other subclass takes the custom op too, which is always correct). Dynamo folds is_compiling() to
    True, so it never traces the dispatch-stack check (a graph break). ~0.1 us per eager call."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or (x is not None and type(x) not in _REAL))


class KernelOp:
    """`fn` as the custom op `coat_act::<fn name>` (schema from its type hints, no input mutated), called
    as the op where a graph is traced (`tracing(first argument)`, FP8Format arguments then passed by name:
    the schema's `str`) and as `impl` (fn itself, as given) on real tensors. `register_fake` gives the op
    its output shapes."""

    def __init__(self, fn: Callable):
        self.impl = fn
        self.op = torch.library.custom_op(f"{LIBRARY}::{fn.__name__}", fn, mutates_args=())
        self.register_fake = self.op.register_fake
        functools.update_wrapper(self, fn)
        KERNEL_OPS[fn.__name__] = self

    def __call__(self, *args, **kwargs):
        if tracing(args[0]):
            return self.op(*[_by_name(a) for a in args], **{k: _by_name(v) for k, v in kwargs.items()})
        return self.impl(*args, **kwargs)


def _by_name(arg):
    return arg.name if isinstance(arg, FP8Format) else arg


KERNEL_OPS: dict[str, KernelOp] = {}
