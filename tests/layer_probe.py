"""What a recomputed decoder layer looks like from outside, shared by tests/test_activation_checkpoint.py and the
2-rank job tests/ds_scripts/checkpoint_job.py: how often the FP8 layers' forward runs, and what each decoder layer
saves for backward."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from coat_ds.hf import CoatDecoderLayer


@contextlib.contextmanager
def counting_forwards() -> Iterator[list[int]]:
    """[n]: how often a CoatDecoderLayer's forward ran (transformers checkpoints `forward`, so module hooks run once
    per step either way: the count comes from inside it)."""
    calls, forward = [0], CoatDecoderLayer._attention

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)
    CoatDecoderLayer._attention = counted
    try:
        yield calls
    finally:
        CoatDecoderLayer._attention = forward


def saved_per_layer(model: torch.nn.Module, run: Callable[[], None], tokens: int) -> list[float]:
    """Bytes each decoder layer of `model` saves for backward while `run()` does a forward (distinct storages, as
    saved-tensor hooks see them), per token per hidden unit."""
    layers = list(model.model.layers)
    inside, seen = [None], {}
    handles = [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda m, a, i=i: inside.__setitem__(0, i)),
        layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, None)))]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] is not None:
            seen.setdefault(inside[0], {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return [sum(seen.get(i, {}).values()) / (tokens * model.config.hidden_size) for i in range(len(layers))]
