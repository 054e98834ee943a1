"""coat_ds/deepspeed/zero/leaf_hooks.py: ZeRO-3's reduce of a leaf module fired from its input, in plain torch (the
engine's side: tests/test_inject_zero3.py)."""
from functools import partial

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
from coat_ds.deepspeed.zero import leaf_hooks  # noqa: E402


def _hooked(module: nn.Module, seen: list):
    def reduce(m, grad_input, grad_output):
        seen.append((grad_input, grad_output, m.weight.grad is not None and bool(m.weight.grad.abs().sum() > 0)))
    anchor = torch.empty(0, requires_grad=True)
    return module.register_forward_pre_hook(partial(leaf_hooks._at_input, reduce, anchor), with_kwargs=True)


@pytest.mark.parametrize("input_grad", [True, False])
def test_the_reduce_fires_once_after_the_parameters_gradients(input_grad):
    """Once a backward, with the weight's gradient already accumulated, whether or not the input needs a gradient
    (torch's full backward hook fires before it where none does); the input's gradient is untouched."""
    torch.manual_seed(0)
    layer, seen = nn.Linear(8, 8), []
    _hooked(layer, seen)
    x = torch.randn(4, 8, requires_grad=input_grad)
    y = layer(x)
    (y * y).sum().backward()
    assert seen == [(None, None, True)]
    if input_grad:
        assert torch.equal(x.grad, (2 * y @ layer.weight).detach())


class _Layer(nn.Module):   # HF's decoder layers take hidden_states first, positionally or by name
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, hidden_states, mask=None):
        return hidden_states @ self.weight + (0 if mask is None else mask)


def test_the_input_by_name_no_backward_and_a_module_without_a_float_input():
    """hidden_states by name is the input (not a float mask beside it); under no_grad nothing is marked; a module
    called without a float tensor is refused in one line."""
    layer, seen = _Layer(), []
    _hooked(layer, seen)
    mask = torch.zeros(2, 8, requires_grad=True)
    layer(mask=mask, hidden_states=torch.randn(2, 8)).sum().backward()
    assert seen == [(None, None, True)] and torch.equal(mask.grad, torch.ones(2, 8))
    with torch.no_grad():
        layer(torch.randn(2, 8))
    assert len(seen) == 1
    emb, seen = nn.Embedding(4, 8), []
    _hooked(emb, seen)
    with pytest.raises(RuntimeError, match="without a floating-point tensor input"):
        emb(torch.tensor([1, 2]))
