"""The FP8 MLP over row tiles of the sequence: one layer's MLP memory bounded by a tile, not the sequence.

MlpFn saves, per token, the FP8 input and the FP8 gate/up outputs (H + 2I bytes and their scales) and holds
bf16 [tokens, 2I] transients in both passes: at a million tokens at Llama-8B width (H 4096, I 14336) that is
tens of GB for one layer. `TiledMlpFn` runs MlpFn over tiles of `tile_tokens` rows (DeepSpeed's TiledMLP idea
on the FP8 flow): its forward runs without autograd and saves only its bf16 input h (2H bytes a token); its
backward recomputes each tile's MlpFn forward under autograd and takes the tile's vector-Jacobian product,
writing dh into one preallocated tensor and summing the weight gradients in fp32. Those are returned once,
as this Function's own: the weights are its inputs, so a gradient hook (DeepSpeed ZeRO's reduction) fires
once per parameter per backward, not once per tile. The price is one more MLP forward per backward.

Each tile quantizes its GEMM operands with its own per-tensor scale, as MlpFn would on that tile alone.
Scales are powers of two and a tile's is at most the whole tensor's, so the FP8 values of a tile are those of
the untiled flow except where the whole tensor's scale would make them subnormal (they come out finer): the
outputs and gradients equal MlpFn's up to that, the order in which a GEMM sums, and each tile's weight
gradient rounded to the weights' dtype before the fp32 sum (CPU, 3-6 tiles: within one bf16 ulp of each
tensor's largest value). One tile is MlpFn exactly."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.autograd import Function

from .config import ActivationConfig, check_tile_tokens
from .functions import MlpFn
from .weight_cache import WeightGroup

def tiles(rows: int, tile_tokens: int) -> list[slice]:
    """The row slices of [rows, ...] in tiles of tile_tokens (the last one shorter where it does not divide)."""
    return [slice(r, min(r + tile_tokens, rows)) for r in range(0, rows, tile_tokens)]


@contextlib.contextmanager
def held_operands(*groups: WeightGroup) -> Iterator[None]:
    """Each group's FP8 weight operands made once for every tile of a pass, not once a tile; where the
    cache is off, freed after it (ZeRO-3's partitioned weights are never held: weight_cache)."""
    caching = [g.cache for g in groups]
    for g in groups:
        g.cache = True
    try:
        yield
    finally:
        for g, was in zip(groups, caching):
            g.cache = was
            if not was:
                g.clear()


class TiledMlpFn(Function):
    """MlpFn(h, ...) computed tile by tile of `tile_tokens` rows of h [tokens, H], saving only h."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, norm_w: torch.Tensor, eps: float, cfg: ActivationConfig, gu: WeightGroup,
                down: WeightGroup, act: str, add_residual: bool, tile_tokens: int, discard: bool,
                *params: torch.Tensor) -> torch.Tensor:
        width = sum(down.out_features)
        if discard:   # nobody reads the output (a checkpoint's recompute): only the saves below matter
            out = h.new_empty(1, 1).expand(h.shape[0], width)
        else:
            out = h.new_empty(h.shape[0], width)
            with held_operands(gu, down):
                for rows in tiles(h.shape[0], tile_tokens):  # autograd is off in a Function's forward: nothing saved
                    out[rows] = MlpFn.apply(h[rows], norm_w, eps, cfg, gu, down, act, add_residual, *params)
        ctx.save_for_backward(h, norm_w)  # the weights are read from their groups in backward, as MlpFn does
        ctx.args = (eps, cfg, gu, down, act, add_residual)
        ctx.tile_tokens = tile_tokens
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        h, norm_w = ctx.saved_tensors
        _, _, gu, down, *_ = ctx.args
        weights = [norm_w, *gu.params(), *down.params()]
        dout = dout.contiguous()
        # detached leaves: each tile's gradients come back from autograd.grad, never into a parameter's .grad
        leaves = [w.detach().requires_grad_() for w in weights]
        dh = torch.empty_like(h)
        sums: list[torch.Tensor] = []
        with held_operands(gu, down):
            for rows in tiles(h.shape[0], ctx.tile_tokens):
                x = h[rows].detach().requires_grad_()
                with torch.enable_grad():
                    out = MlpFn.apply(x, leaves[0], *ctx.args, *leaves[1:])
                dx, *grads = torch.autograd.grad(out, [x, *leaves], dout[rows])
                dh[rows] = dx
                del out, dx
                sums = [g.float() for g in grads] if not sums else [s.add_(g) for s, g in zip(sums, grads)]
        dnw, *dparams = (s.to(w.dtype) for s, w in zip(sums, weights))
        return dh, dnw, None, None, None, None, None, None, None, None, *dparams


def mlp(h: torch.Tensor, norm_w: torch.Tensor, eps: float, cfg: ActivationConfig, gu: WeightGroup,
        down: WeightGroup, act: str, add_residual: bool, tile_tokens: int | None,
        discard: bool = False) -> torch.Tensor:
    """The FP8 MLP of a decoder layer on [tokens, H]: MlpFn, or TiledMlpFn where tile_tokens is set. `discard`:
    the output will not be read (a checkpoint's recompute, the MLP's output the layer's): TiledMlpFn, which saves
    only h, then computes nothing, sparing a recomputed layer an MLP forward and its output's 2 B/token/hidden."""
    params = (*gu.params(), *down.params())
    if tile_tokens is None:
        return MlpFn.apply(h, norm_w, eps, cfg, gu, down, act, add_residual, *params)
    check_tile_tokens(tile_tokens)
    return TiledMlpFn.apply(h, norm_w, eps, cfg, gu, down, act, add_residual, tile_tokens, discard, *params)


class TiledRowsFn(Function):
    """fn(x, *params) over tiles of `tile_tokens` rows of x [..., n], saving only x: for a row-wise function with
    small parameters (a norm), whose autograd would otherwise keep fp32 copies of x and hold several more in its
    backward (HF's RMSNorm: 18 B a token a hidden unit beyond its 6 of saves). Forward runs fn tile by tile without
    autograd, so its output is fn's own; backward recomputes each tile under autograd, writes the tile's input
    gradient into one tensor and sums the parameters' in fp32, returned once (a ZeRO gradient hook fires once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tile_tokens: int, fn, *params: torch.Tensor) -> torch.Tensor:
        rows, out = x.reshape(-1, x.shape[-1]), None
        for t in tiles(rows.shape[0], tile_tokens):
            y = fn(rows[t], *params)
            if out is None:
                out = y.new_empty(rows.shape[0], y.shape[-1])
            out[t] = y
        ctx.save_for_backward(x, *params)
        ctx.fn, ctx.tile_tokens = fn, tile_tokens
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        rows, drows = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        dx = torch.empty_like(rows) if need_x else None
        dps = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) if need else None
               for p, need in zip(params, need_p)]
        for t in tiles(rows.shape[0], ctx.tile_tokens):
            with torch.enable_grad():
                xt = rows[t].detach().requires_grad_(need_x)
                pt = [p.detach().requires_grad_(need) for p, need in zip(params, need_p)]
                wanted = [v for v in (xt, *pt) if v.requires_grad]
                grads = iter(torch.autograd.grad(ctx.fn(xt, *pt), wanted, drows[t]))
            if need_x:
                dx[t] = next(grads)
            for acc, need in zip(dps, need_p):
                if need:
                    acc += next(grads)
        return (dx.view_as(x) if need_x else None, None, None,
                *[acc.to(p.dtype) if acc is not None else None for acc, p in zip(dps, params)])
