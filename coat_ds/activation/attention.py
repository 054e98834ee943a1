"""Attention + o_proj whose only saved activations are FP8 q, k, v (`activation.attention_fp8`).

The stock backends save bf16 q, k, v and the output (SDPA) or even the [b, h, s, s] probabilities (eager)
for their backward: 8 B/token/hidden at 7B with MHA. `Fp8AttentionFn` covers attention, o_proj and the
residual add. Its forward runs the stock attention call on the bf16 inputs (the output is bit-identical to
the stock one) and o_proj's FP8 GEMM, and keeps only q, k, v in E4M3. Its backward dequantizes them to
bf16 and runs the same call again under autograd (under `torch.func.vjp` in a traced graph, which Dynamo
traces where it cannot trace `torch.autograd.grad`: the same Function compiles): the recomputed output o'
is o_proj's weight-gradient operand, then its vector-Jacobian product gives attention's gradients. So
neither attention nor o_proj keeps the output (1 B/token/hidden at 7B as o_proj's FP8 copy); the
backward is the stock one at FP8-rounded q, k, v (o' differs from o by what that rounding moves, of the
order of o's own E4M3 rounding for the GEMM); any mask, window or backend the call uses is recomputed
exactly. It costs one more attention forward per backward (FlashAttention's own backward recomputes the
probabilities too; the forward is ~1/3 of attention's fwd+bwd FLOPs).

Scales: one power-of-two scale per 1 x group_size group (16 by default) of each head's head_dim values,
stored as one uint8 exponent (1/16 B per value), as the fused quantizer (`kernels.quant.group_quant`)
makes them; per-token-per-head scales (1/128 B) would save 0.16 B/token/hidden at 7B but need a kernel
of their own. A group never spans two tokens or heads, so one outlier token (attention-sink keys,
large-norm queries) costs the others nothing."""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.autograd import Function

from ..formats import FP8Format
from ..kernels import quant
from ..kernels import quant_reference as R
from .config import ActivationConfig
from .functions import linear_backward, quant_operand, residual_add
from .gemm import fp8_mm
from .weight_cache import WeightGroup

AttentionCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
_ROW = 8192  # row width of the quantizer's 2-D view: each of the kernel's 256 threads a row takes two groups


def quant_heads(t: torch.Tensor, fmt: FP8Format, group_size: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(FP8 codes, uint8 group exponents, layout for `dequant_heads`) of a [..., head_dim] tensor, quantized
    in its own memory order (HF's and the RoPE kernel's q, k, v are [b, h, s, d] views of [b, s, h, d]
    or [b, h, s, d] memory: no copy), head_dim a multiple of group_size."""
    R.check_groups(t.shape[-1], group_size)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    dense = t.permute(order).contiguous()  # a view, unless t is not dense
    rows = math.gcd(dense.numel(), _ROW)  # a power of two, a multiple of group_size: groups never span rows
    codes, sexp = quant.group_quant(dense.view(-1, rows), fmt, group_size)
    return codes, sexp, (dense.shape, order, t.dtype)


def dequant_heads(codes: torch.Tensor, sexp: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The tensor `quant_heads` saw, FP8-rounded, with its shape and strides (one kernel for bf16)."""
    shape, order, dtype = layout
    out = quant.group_dequant(codes, sexp, codes.shape[1] // sexp.shape[1], dtype)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return out.view(shape).permute(inverse)


def _drop(_: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("attention_fp8: the forward's stock graph is never differentiated")


def _stock_forward(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """call(q, k, v, mask) as the stock flow runs it: autograd on, inputs requiring grad (SDPA picks its
    backend and kernel by both; autograd is off in a Function's forward). Its graph is never differentiated,
    so its saved-tensor hook packs nothing: outer hooks (offloading, checkpointing) never see the bf16 q, k,
    v, output and logsumexp, and nothing keeps them. (Identity hooks kept them: SDPA saves its own output, and
    a saved output packed as a Python object makes a cycle with its grad_fn that the garbage collector does
    not see; the H100 run measured 19.6 B/token/hidden instead of 11.5.)"""
    if quant.tracing(q):  # a traced forward keeps no autograd graph, and the tracers do not take hooks
        return call(q, k, v, mask)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never):
        return call(*[t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)], mask).detach()


def _recompute(call: AttentionCall, inputs: list[torch.Tensor], mask: torch.Tensor | None):
    """(call(*inputs, mask), its vector-Jacobian product): under `torch.func.vjp` where a graph is traced
    (Dynamo cannot trace `torch.autograd.grad`), under autograd elsewhere (`torch.func` refuses to run while
    saved-tensor hooks are active, as activation offloading and checkpointing keep them)."""
    if quant.tracing(inputs[0]):
        return torch.func.vjp(lambda q, k, v: call(q, k, v, mask), *inputs)
    inputs = [t.requires_grad_() for t in inputs]
    with torch.enable_grad():
        out = call(*inputs, mask)
    return out.detach(), lambda do: torch.autograd.grad(out, inputs, do)


class Fp8AttentionFn(Function):
    """h = o_proj(call(q, k, v, mask)) + residual (None: no add, where a post-norm comes first), saving q, k, v as FP8 codes + group exponents (and the
    mask, the model's shared tensor, by reference). Backward recomputes the call from the dequantized
    inputs, for o_proj's weight gradient and for attention's gradients."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                residual: torch.Tensor | None, call: AttentionCall, cfg: ActivationConfig, group: WeightGroup,
                *params: torch.Tensor) -> torch.Tensor:
        out = _stock_forward(call, q, k, v, mask)
        o = out.reshape(-1, out.shape[-2] * out.shape[-1])
        oq, _, o_s = quant_operand(o, cfg.fwd)
        dtype = o.dtype
        del out, o
        wq, ws = group.operand(transposed=False)
        h = fp8_mm(oq, o_s, wq, ws, dtype, group.bias_cat())
        if residual is not None:
            h = residual_add(h, residual)
        del oq
        saved = [quant_heads(t, cfg.fwd, cfg.group_size) for t in (q, k, v)]
        ctx.save_for_backward(*[c for codes, sexp, _ in saved for c in (codes, sexp)], mask)
        ctx.call, ctx.cfg, ctx.group, ctx.layouts = call, cfg, group, [layout for *_, layout in saved]
        ctx.has_res = residual is not None
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        tiled = getattr(ctx.call, "backward", None)   # activation.tile_tokens: a TiledCall's backward over query tiles
        if tiled is not None and not quant.tracing(dh):
            return tiled(ctx, dh)
        qc, qe, kc, ke, vc, ve, mask = ctx.saved_tensors
        cfg = ctx.cfg
        inputs = [dequant_heads(c, e, layout) for c, e, layout in zip((qc, kc, vc), (qe, ke, ve), ctx.layouts)]
        del qc, qe, kc, ke, vc, ve
        out, attention_vjp = _recompute(ctx.call, inputs, mask)
        _, ot, o_s = quant_operand(out.reshape(-1, out.shape[-2] * out.shape[-1]), cfg.fwd,
                                   rowmajor=False, transposed=True)
        dh = dh.contiguous()
        do, pgrads = linear_backward(dh, ctx.group, ot, o_s, cfg.bwd)
        del ot
        dq, dk, dv = attention_vjp(do.view(out.shape))
        return dq, dk, dv, None, (dh if ctx.has_res else None), None, None, None, *pgrads
