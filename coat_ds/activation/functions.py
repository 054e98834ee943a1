"""FP8 autograd Functions of a decoder layer. Everything they save is FP8 plus small scale tensors.

Each Function covers a stretch of the layer whose backward can rebuild its GEMM inputs from what the
stretch saves anyway (COAT's "save the minimum"):
  NormLinearFn    RMSNorm -> fused q/k/v (or any) linear: saves the norm's FP8 input; the linear's FP8
                  input is rebuilt from it in backward.
  MlpFn           RMSNorm -> gate/up -> act(gate)*up -> down (-> + residual): saves the norm's FP8 input and
                  the FP8 gate/up outputs; the down_proj input is rebuilt from the latter. act: SiLU (SwiGLU)
                  or tanh-GELU (GeGLU); the residual add is left out where a post-norm comes first (Gemma).
  RmsNormFn       an RMSNorm whose output is no GEMM operand (per-head q/k norms, Gemma's post-norms): its
                  output is stock's, it saves only its FP8 input and rstd.
  LinearFn        one FP8 linear (+ residual). It saves either the FP8 transposed input (mode "linear") or
                  a reference to a bf16 input that another op already saves (attention's output for o_proj).
Forward operands are E4M3 per tensor, output gradients E5M2 per tensor; every GEMM is torch._scaled_mm;
the transposed operands of the weight-gradient GEMMs come from the quantizing kernels."""
from __future__ import annotations

import torch
from torch.autograd import Function

from ..formats import FP8Format
from ..kernels import quant
from .config import ActivationConfig
from .gemm import fp8_mm
from .weight_cache import WeightGroup


def residual_add(out: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """out + res: in place in eager mode; out of place where a graph is traced. torch < 2.13's compiled
    autograd.Function drops the gradient of an output that its forward mutated in place (all-zero
    gradients for everything before it; seen with torch 2.11, CPU and CUDA alike)."""
    return out + res if quant.tracing(out) else out.add_(res)


def quant_operand(x: torch.Tensor, fmt: FP8Format, rowmajor: bool = True, transposed: bool = False):
    """(codes, transposed codes, scale) of a per-tensor FP8 GEMM operand: row maxima, then one scale."""
    scale = quant.tensor_scale(quant.row_amax(x), fmt)
    q, qt = quant.quant_tensor(x, scale, fmt, rowmajor, transposed)
    return q, qt, scale


def release(t: torch.Tensor) -> None:
    """Free `t`'s memory now, where its last reader is done but a caller holds it: autograd's engine keeps the
    gradient it hands a Function's backward alive until that backward returns. Eager tensors only (a traced graph
    plans its own buffers)."""
    if not quant.tracing(t):
        t.untyped_storage().resize_(0)


def linear_backward(dout: torch.Tensor, group: WeightGroup, xt: torch.Tensor, xs: torch.Tensor,
                    bwd: FP8Format, need_dx: bool = True, free_dout: bool = False):
    """(dx, per-param grads) of out = x W^T (+ b), given the FP8 transposed input xt [K, M] and its scale.
    free_dout: dout is the caller's own (no other reader): freed once quantized, before the GEMMs' outputs."""
    db = dout.sum(dim=0).to(group.weights[0].dtype) if group.has_bias else None
    dq, dqt, ds = quant_operand(dout, bwd, rowmajor=need_dx, transposed=True)
    if free_dout:
        release(dout)
    dx = None
    if need_dx:
        wt, ws = group.operand(transposed=True)
        dx = fp8_mm(dq, ds, wt, ws, dout.dtype)
    dw = fp8_mm(dqt, ds, xt, xs, group.weights[0].dtype)
    return dx, group.split_grad(dw, db)


def _norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, cfg: ActivationConfig, group: WeightGroup):
    """RMSNorm then an FP8 GEMM: (output, (xq, xs, rstd, ys)), the norm's FP8 input and the scale of its
    FP8 output being what backward rebuilds the GEMM input from."""
    fwd, g = cfg.fwd, cfg.group_size
    xq, xs, rstd, ymax = quant.rmsnorm_quant(x, norm_w, eps, fwd, g)
    ys = quant.tensor_scale(ymax, fwd)
    y, _ = quant.rmsnorm_rebuild(xq, xs, rstd, norm_w, ys, fwd, g)
    wq, ws = group.operand(transposed=False)
    return fp8_mm(y, ys, wq, ws, x.dtype, group.bias_cat()), (xq, xs, rstd, ys)


class NormLinearFn(Function):
    """owns_grad: the output's only readers make tensors of their own (the layer's q/k/v heads: RoPE's outputs, or
    a split whose backward concatenates), so the output's gradient is a fresh tensor no one else reads: backward
    frees it once quantized (3 B/token/hidden at Llama-8B's q/k/v, at a long sequence's peak)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, norm_w: torch.Tensor, eps: float, cfg: ActivationConfig,
                group: WeightGroup, owns_grad: bool, *params: torch.Tensor) -> torch.Tensor:
        out, (xq, xs, rstd, ys) = _norm_linear(x, norm_w, eps, cfg, group)
        ctx.save_for_backward(xq, xs, rstd, ys, norm_w)
        ctx.cfg, ctx.group, ctx.owns_grad = cfg, group, owns_grad
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        xq, xs, rstd, ys, norm_w = ctx.saved_tensors
        cfg, group = ctx.cfg, ctx.group
        _, yt = quant.rmsnorm_rebuild(xq, xs, rstd, norm_w, ys, cfg.fwd, cfg.group_size, rowmajor=False,
                                    transposed=True)
        dy, pgrads = linear_backward(dout.contiguous(), group, yt, ys, cfg.bwd, free_dout=ctx.owns_grad)
        del yt
        dx, dnw = quant.rmsnorm_backward(dy, xq, xs, rstd, norm_w, cfg.group_size)
        return dx, dnw.to(norm_w.dtype), None, None, None, None, *pgrads


class MlpFn(Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, norm_w: torch.Tensor, eps: float, cfg: ActivationConfig,
                gu: WeightGroup, down: WeightGroup, act: str, add_residual: bool, *params: torch.Tensor) -> torch.Tensor:
        fwd, g = cfg.fwd, cfg.group_size
        gate_up, (xq, xs, rstd, ys) = _norm_linear(h, norm_w, eps, cfg, gu)
        q, s, amax = quant.silu_mul_quant(gate_up, fwd, g, act)
        del gate_up
        a_s = quant.tensor_scale(amax, fwd)
        a, _ = quant.silu_mul_rebuild(q, s, a_s, fwd, g, act=act)
        wq, ws = down.operand(transposed=False)
        out = fp8_mm(a, a_s, wq, ws, h.dtype, down.bias_cat())
        if add_residual:
            out = residual_add(out, h)
        ctx.save_for_backward(xq, xs, rstd, ys, q, s, a_s, norm_w)
        ctx.cfg, ctx.gu, ctx.down, ctx.act, ctx.add_residual = cfg, gu, down, act, add_residual
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        xq, xs, rstd, ys, q, s, a_s, norm_w = ctx.saved_tensors
        cfg, g = ctx.cfg, ctx.cfg.group_size
        dout = dout.contiguous()
        _, at = quant.silu_mul_rebuild(q, s, a_s, cfg.fwd, g, rowmajor=False, transposed=True, act=ctx.act)
        da, down_grads = linear_backward(dout, ctx.down, at, a_s, cfg.bwd)
        del at
        dgu, amax = quant.silu_mul_backward(da, q, s, g, ctx.act)
        del da
        dgs = quant.tensor_scale(amax, cfg.bwd)
        dq, dqt = quant.quant_tensor(dgu, dgs, cfg.bwd, rowmajor=True, transposed=True)
        wt, ws = ctx.gu.operand(transposed=True)
        dy = fp8_mm(dq, dgs, wt, ws, dout.dtype)
        del dq
        _, yt = quant.rmsnorm_rebuild(xq, xs, rstd, norm_w, ys, cfg.fwd, g, rowmajor=False, transposed=True)
        w = ctx.gu.weights[0]
        dw = fp8_mm(dqt, dgs, yt, ys, w.dtype)
        db = dgu.sum(dim=0).to(w.dtype) if ctx.gu.has_bias else None
        gu_grads = ctx.gu.split_grad(dw, db)
        dh, dnw = quant.rmsnorm_backward(dy, xq, xs, rstd, norm_w, g, dres=dout if ctx.add_residual else None)
        return dh, dnw.to(norm_w.dtype), None, None, None, None, None, None, *gu_grads, *down_grads


class RmsNormFn(Function):
    """y = RMSNorm(x) * w, [rows, n], in x's dtype: stock's output; saved are x in FP8 per 1 x G group and rstd
    (1 + 1/G + 4/n bytes a value where stock keeps fp32 and bf16 copies of x). The RMSNorm kernels serve any
    rows, so a per-head norm is this over rows = tokens x heads, n = head_dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, cfg: ActivationConfig) -> torch.Tensor:
        y, xq, xs, rstd = quant.rmsnorm_save(x, w, eps, cfg.fwd, cfg.group_size)
        ctx.save_for_backward(xq, xs, rstd, w)
        ctx.group_size = cfg.group_size
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xq, xs, rstd, w = ctx.saved_tensors
        dx, dw = quant.rmsnorm_backward(dy.contiguous(), xq, xs, rstd, w, ctx.group_size)
        return dx, dw.to(w.dtype), None, None


class RopeFn(Function):
    """HF's rotary embedding on the fused q/k/v output, as one kernel each way (CUDA only)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int, nh: int, nkv: int,
                hd: int):
        q, k, v = quant.rope_qkv(qkv, cos, sin, batch, nh, nkv, hd)
        ctx.save_for_backward(cos, sin)  # the model's shared cos/sin: no per-layer memory
        ctx.dims, ctx.shapes = (nh, nkv, hd), (q.shape, k.shape, v.shape)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        dq, dk, dv = (cos.new_zeros(shape) if g is None else g for g, shape in zip((dq, dk, dv), ctx.shapes))
        return quant.rope_qkv_backward(dq, dk, dv, cos, sin, *ctx.dims), None, None, None, None, None, None


class LinearFn(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor | None, cfg: ActivationConfig, group: WeightGroup,
                save_fp8: bool, *params: torch.Tensor) -> torch.Tensor:
        q, qt, xs = quant_operand(x, cfg.fwd, rowmajor=True, transposed=save_fp8)
        wq, ws = group.operand(transposed=False)
        out = fp8_mm(q, xs, wq, ws, x.dtype, group.bias_cat())
        if residual is not None:
            out = residual_add(out, residual)
        ctx.save_for_backward(qt if save_fp8 else x, xs)
        ctx.cfg, ctx.group, ctx.save_fp8, ctx.has_res = cfg, group, save_fp8, residual is not None
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        saved, xs = ctx.saved_tensors
        cfg = ctx.cfg
        xt = saved if ctx.save_fp8 else quant.quant_tensor(saved, xs, cfg.fwd, rowmajor=False, transposed=True)[1]
        dout = dout.contiguous()
        dx, pgrads = linear_backward(dout, ctx.group, xt, xs, cfg.bwd)
        return dx, (dout if ctx.has_res else None), None, None, None, *pgrads
