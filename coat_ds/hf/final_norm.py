"""The model's final norm over sequence tiles, where `activation.tile_tokens` tiles the decoder layers.

At long context HF's final RMSNorm is what a step's peak is made of: its autograd keeps an fp32 copy of its input
and its bf16 output (6 B a token a hidden unit) and its backward holds 18 more (measured: 97 KB a token at
Llama-3.1-8B, docs/activation.md). Over tiles (activation.tiled.TiledRowsFn) it saves its bf16 input alone and its
backward holds a tile's transients; its output and input gradient are the stock module's, bit for bit."""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from ..activation.tiled import TiledRowsFn


class TiledFinalNorm(nn.Module):
    """`stock` (the final norm) with the same parameters under the same names (state_dict unchanged); while autograd
    records a sequence longer than a tile, its forward over tiles of `tile_tokens` rows, else the stock forward."""

    def __init__(self, stock: nn.Module, tile_tokens: int) -> None:
        super().__init__()
        object.__setattr__(self, "stock", stock)   # not a submodule: its parameters are this module's own
        for name, p in stock.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.tile_tokens = tile_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or hidden.numel() // hidden.shape[-1] <= self.tile_tokens:
            return self.stock(hidden)   # its parameters are these
        params = dict(self.named_parameters(recurse=False))
        return TiledRowsFn.apply(hidden, self.tile_tokens,
                                 lambda x, *ps: functional_call(self.stock, dict(zip(params, ps)), (x,)),
                                 *params.values())

    def extra_repr(self) -> str:
        return f"{type(self.stock).__name__}, tile_tokens={self.tile_tokens}"


def _decoder(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_decoder", None)
    return get() if callable(get) else None


def tile(model: nn.Module, tile_tokens: int) -> bool:
    """Put the decoder's final norm (`norm`, as the Llama-family models name it) over tiles; False where it has
    none. Tiled already: its tile size updated."""
    decoder = _decoder(model)
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, TiledFinalNorm):
        norm.tile_tokens = tile_tokens
        return True
    if not isinstance(norm, nn.Module):
        return False
    decoder.norm = TiledFinalNorm(norm, tile_tokens)
    return True


def untile(model: nn.Module) -> None:
    """The stock final norm back (the same module and parameters)."""
    decoder = _decoder(model)
    if isinstance(getattr(decoder, "norm", None), TiledFinalNorm):
        decoder.norm = decoder.norm.stock
