"""Attention whose saved q, k, v are FP8 (`activation.attention_fp8`).

The stock backends save bf16 q, k, v and the output (SDPA) or even the [b, h, s, s] probabilities (eager)
for their backward: 8 B/token/hidden at 7B with MHA. `Fp8AttentionFn` runs the stock attention call in
its forward on the bf16 inputs (the forward output is bit-identical to the stock one), keeps only q, k, v in
E4M3, and in backward dequantizes them to bf16, runs the same call again under autograd and takes its
gradients (`torch.autograd.grad`). So the backward is the stock one, at FP8-rounded q, k, v; the output is
not saved (o_proj then keeps its own FP8 copy of it), and any mask, window or backend the call uses is
recomputed exactly. It costs one more attention forward per backward (FlashAttention's own backward
recomputes the probabilities too; the forward is ~1/3 of attention's fwd+bwd FLOPs).

Scales: one power-of-two scale per token per head (a 1 x head_dim group, `quant_reference.group_quant`),
stored as one uint8 exponent: 1/head_dim B per value (0.008 at head_dim 128). Per-(batch, head) scales
would cost nothing, but one outlier token (attention-sink keys, large-norm queries) would then push every
other token of its head down by its binades into E4M3's subnormals; a per-token group keeps each token's
3 mantissa bits, for the price of one byte per 128 values."""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import Function

from ..formats import FP8Format
from ..kernels import quant_reference as R

AttentionCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def quant_heads(t: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes [N, head_dim], uint8 exponents [N, 1]) of a [..., head_dim] tensor: one scale per row."""
    d = t.shape[-1]
    return R.group_quant(t.reshape(-1, d), fmt, d)


def dequant_heads(codes: torch.Tensor, sexp: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return R.group_dequant(codes, sexp, codes.shape[-1]).to(dtype).view(shape)


class Fp8AttentionFn(Function):
    """out = call(q, k, v, mask), saving q, k, v as FP8 codes + per-token-per-head exponents (and the mask,
    the model's shared tensor, by reference). Backward recomputes the call from the dequantized inputs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                call: AttentionCall, fmt: FP8Format) -> torch.Tensor:
        out = call(q, k, v, mask)
        saved = [c for t in (q, k, v) for c in quant_heads(t, fmt)]
        ctx.save_for_backward(*saved, mask)
        ctx.call, ctx.meta = call, [(t.shape, t.dtype) for t in (q, k, v)]
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        *saved, mask = ctx.saved_tensors
        inputs = [dequant_heads(saved[2 * i], saved[2 * i + 1], *ctx.meta[i]).requires_grad_() for i in range(3)]
        with torch.enable_grad():
            out = ctx.call(*inputs, mask)
            dq, dk, dv = torch.autograd.grad(out, inputs, dout)
        return dq, dk, dv, None, None, None
