"""The FP8 activation kernels: CUDA kernels (CoatQuantBuilder) where they apply, else `quant_reference`.

Same signatures and results as the reference. The kernels take bf16 inputs on CUDA and 1 x 16 groups;
anything else (CPU, fp32 models, other group sizes, a failed build) runs the plain-PyTorch reference.
Each op is one function (a `custom_op.KernelOp`: the custom op `coat_act::<name>` where a graph is traced,
the function itself on real tensors) and its fake. `fmt` is an FP8Format or its name (the custom op's schema
takes the name). A layout that a quantizer is not asked for (`rowmajor` / `transposed`) comes back as an
empty tensor."""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ..formats import FP8Format, get_format
from . import quant_reference as R
from .custom_op import KernelOp, tracing
from .loader import load_op

KERNEL_GROUP = 16
_KERNEL_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_F32 = torch.float32


def _kernels(*tensors: Tensor, group_size: int = KERNEL_GROUP, rows: int | None = None,
             dtypes: tuple = _KERNEL_DTYPES):
    """The compiled module if the kernels apply to these tensors (bf16/FP8 on CUDA, or `dtypes`; 1 x 16
    groups, 16-byte aligned; `rows`, where given, a multiple of 16 for the tile kernels), else None."""
    t = tensors[0]
    if not t.is_cuda or group_size != KERNEL_GROUP or os.environ.get("COAT_ACT_REFERENCE", "0") == "1":
        return None
    if t.dtype not in dtypes:
        return None
    if rows is not None and rows % 16:
        return None
    if any(x.data_ptr() % 16 for x in tensors):
        return None
    return load_op("CoatQuantBuilder")


def _u8(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


def _dtype(fmt: str) -> torch.dtype:
    return get_format(fmt).dtype


def _act_index(act: str) -> int:
    """The kernels' name for a gated activation: its index in R.GATED_ACTS (coat_quant.h's GatedAct)."""
    if act not in R.GATED_ACTS:
        raise ValueError(f"gated activation {act!r} is not one of {R.GATED_ACTS}")
    return R.GATED_ACTS.index(act)


def _pair(m: int, n: int, dtype, rowmajor: bool, transposed: bool, device) -> tuple[Tensor, Tensor]:
    """Outputs of a quantizer: [m, n] and [n, m], each an empty [0] tensor when not asked for."""
    q = torch.empty((m, n) if rowmajor else (0,), dtype=dtype, device=device)
    qt = torch.empty((n, m) if transposed else (0,), dtype=dtype, device=device)
    return q, qt


# ---------------------------------------------------------------- per-tensor (GEMM operands)

@KernelOp
def row_amax(x: Tensor) -> Tensor:
    op = _kernels(x)
    if op is None or x.dtype != torch.bfloat16 or x.shape[1] % 8:
        return R.row_amax(x)
    out = torch.empty(x.shape[0], dtype=_F32, device=x.device)
    op.row_amax(x.contiguous(), out)
    return out


@row_amax.register_fake
def _(x):
    return x.new_empty(x.shape[0], dtype=_F32)


@KernelOp
def tensor_scale(amax: Tensor, fmt: str) -> Tensor:
    """One launch where the reference takes ~13 (amax, frexp, compares, where, ldexp...): 12 calls a
    decoder layer make it the largest share of the FP8 flow's host time at small batches."""
    f, amax = get_format(fmt), amax.contiguous()
    op = _kernels(amax, dtypes=(_F32,))
    if op is None or amax.numel() == 0:
        return R.tensor_scale(amax, f)
    out = torch.empty((), dtype=_F32, device=amax.device)
    op.tensor_scale(amax, out, f.name == "e5m2")
    return out


@tensor_scale.register_fake
def _(amax, fmt):
    return amax.new_empty((), dtype=_F32)


@KernelOp
def quant_tensor(x: Tensor, scale: Tensor, fmt: str, rowmajor: bool = True,
                 transposed: bool = False) -> tuple[Tensor, Tensor]:
    f = get_format(fmt)
    op = _kernels(x, rows=x.shape[0])
    if op is None or x.dtype != torch.bfloat16 or x.shape[1] % 16:
        return R.quant_tensor(x, scale, f, rowmajor, transposed)
    q, qt = _pair(*x.shape, f.dtype, rowmajor, transposed, x.device)
    op.quant_tensor(x.contiguous(), scale, _u8(q), _u8(qt), f.name == "e5m2", x.shape[0])
    return q, qt


@quant_tensor.register_fake
def _(x, scale, fmt, rowmajor=True, transposed=False):
    return _pair(*x.shape, _dtype(fmt), rowmajor, transposed, x.device)


def quant_weights(ws: list[Tensor], scale: Tensor, fmt: FP8Format, transposed: bool) -> Tensor | None:
    """FP8 of the row-wise concatenation of `ws` ([N, K], or its transpose [K, N]) written slice by slice,
    with no bf16 concatenation; None where the kernel does not apply (eager CUDA bf16 only)."""
    if tracing(ws[0]):
        return None
    k = ws[0].shape[1]
    op = _kernels(*ws)
    if op is None or any(w.dtype != torch.bfloat16 or w.shape[0] % 16 or w.shape[1] != k for w in ws) or k % 16:
        return None
    n = sum(w.shape[0] for w in ws)
    out = torch.empty((k, n) if transposed else (n, k), dtype=fmt.dtype, device=ws[0].device)
    none = torch.empty(0, dtype=torch.uint8, device=out.device)
    n0 = 0
    for w in ws:
        rows = w.shape[0]
        if transposed:
            op.quant_tensor(w.contiguous(), scale, none, _u8(out[:, n0:n0 + rows]), fmt.name == "e5m2", n)
        else:
            op.quant_tensor(w.contiguous(), scale, _u8(out[n0:n0 + rows]), none, fmt.name == "e5m2", rows)
        n0 += rows
    return out


# ---------------------------------------------------------------- RMSNorm

@KernelOp
def rmsnorm_quant(x: Tensor, w: Tensor, eps: float, fmt: str,
                  group_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    f = get_format(fmt)
    op = _kernels(x, w, group_size=group_size)
    if op is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return R.rmsnorm_quant(x, w, eps, f, group_size)
    ymax = torch.empty(x.shape[0], dtype=_F32, device=x.device)
    return *_norm_kernel(op, x, w, eps, f, group_size, ymax=ymax, y=x.new_empty(0)), ymax


def _saved_norm(x: Tensor, fmt: str, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    m, n = x.shape
    return (x.new_empty(m, n, dtype=_dtype(fmt)), x.new_empty(m, n // group_size, dtype=torch.uint8),
            x.new_empty(m, dtype=_F32))


def _norm_kernel(op, x: Tensor, w: Tensor, eps: float, f: FP8Format, group_size: int, ymax: Tensor,
                 y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """RMSNorm pass 1 on the kernels: (xq, xs, rstd), and `ymax` / `y` written unless empty."""
    R.check_groups(x.shape[1], group_size)
    xq, xs, rstd = _saved_norm(x, f, group_size)
    op.rmsnorm_quant(x.contiguous(), w.contiguous(), float(eps), _u8(xq), xs, rstd, ymax, y, f.name == "e5m2")
    return xq, xs, rstd


@rmsnorm_quant.register_fake
def _(x, w, eps, fmt, group_size):
    return *_saved_norm(x, fmt, group_size), x.new_empty(x.shape[0], dtype=_F32)


@KernelOp
def rmsnorm_save(x: Tensor, w: Tensor, eps: float, fmt: str, group_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, xq, xs, rstd): the output of a norm that feeds no GEMM (R.rmsnorm_output: per-head q/k norms, Gemma's
    post-norms) and what its backward reads, in one pass over x (the reference takes four fp32 passes for y)."""
    f = get_format(fmt)
    op = _kernels(x, w, group_size=group_size)
    if op is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        xq, xs, rstd, _ = R.rmsnorm_quant(x, w, eps, f, group_size)
        return R.rmsnorm_output(x, rstd, w), xq, xs, rstd
    y = torch.empty_like(x)
    return y, *_norm_kernel(op, x, w, eps, f, group_size, ymax=x.new_empty(0, dtype=_F32), y=y)


@rmsnorm_save.register_fake
def _(x, w, eps, fmt, group_size):
    return torch.empty_like(x), *_saved_norm(x, fmt, group_size)


@KernelOp
def rmsnorm_rebuild(xq: Tensor, xs: Tensor, rstd: Tensor, w: Tensor, scale: Tensor, fmt: str, group_size: int,
                    rowmajor: bool = True, transposed: bool = False) -> tuple[Tensor, Tensor]:
    f = get_format(fmt)
    op = _kernels(xq, w, group_size=group_size, rows=xq.shape[0])
    if op is None or w.dtype != torch.bfloat16:
        return R.rmsnorm_rebuild(xq, xs, rstd, w, scale, f, group_size, rowmajor, transposed)
    q, qt = _pair(*xq.shape, f.dtype, rowmajor, transposed, xq.device)
    op.rmsnorm_rebuild(_u8(xq), xs, rstd, w.contiguous(), scale, _u8(q), _u8(qt), xq.dtype == torch.float8_e5m2,
                       f.name == "e5m2")
    return q, qt


@rmsnorm_rebuild.register_fake
def _(xq, xs, rstd, w, scale, fmt, group_size, rowmajor=True, transposed=False):
    return _pair(*xq.shape, _dtype(fmt), rowmajor, transposed, xq.device)


@KernelOp
def rmsnorm_backward(dy: Tensor, xq: Tensor, xs: Tensor, rstd: Tensor, w: Tensor, group_size: int,
                     dres: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    op = _kernels(dy, w, xq, *([] if dres is None else [dres]), group_size=group_size)
    if op is None or dy.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or dy.shape[1] > 16384 or (
            dres is not None and dres.dtype != torch.bfloat16):
        return R.rmsnorm_backward(dy, xq, xs, rstd, w, group_size, dres)
    dx = torch.empty_like(dy)
    dw = torch.zeros(w.shape[0], dtype=_F32, device=dy.device)
    empty = torch.empty(0, dtype=torch.bfloat16, device=dy.device)
    op.rmsnorm_backward(dy.contiguous(), _u8(xq), xs, rstd, w.contiguous(),
                        empty if dres is None else dres.contiguous(), dx, dw, xq.dtype == torch.float8_e5m2)
    return dx, dw


@rmsnorm_backward.register_fake
def _(dy, xq, xs, rstd, w, group_size, dres=None):
    return torch.empty_like(dy), dy.new_empty(w.shape[0], dtype=_F32)


# ---------------------------------------------------------------- act(gate) * up (`act` in R.GATED_ACTS)
# One kernel family for every act: the kernels take its index in R.GATED_ACTS.

@KernelOp
def silu_mul_quant(gu: Tensor, fmt: str, group_size: int, act: str = "silu") -> tuple[Tensor, Tensor, Tensor]:
    f = get_format(fmt)
    op = _kernels(gu, group_size=group_size)
    if op is None or gu.dtype != torch.bfloat16:
        return R.silu_mul_quant(gu, f, group_size, act)
    m, n = gu.shape
    R.check_groups(n // 2, group_size)
    q = torch.empty(m, n, dtype=f.dtype, device=gu.device)
    s = torch.empty(m, n // group_size, dtype=torch.uint8, device=gu.device)
    amax = torch.empty(m, dtype=_F32, device=gu.device)
    op.silu_mul_quant(gu.contiguous(), _u8(q), s, amax, f.name == "e5m2", _act_index(act))
    return q, s, amax


@silu_mul_quant.register_fake
def _(gu, fmt, group_size, act="silu"):
    m, n = gu.shape
    return (gu.new_empty(m, n, dtype=_dtype(fmt)), gu.new_empty(m, n // group_size, dtype=torch.uint8),
            gu.new_empty(m, dtype=_F32))


def group_quant(x: Tensor, fmt: FP8Format, group_size: int) -> tuple[Tensor, Tensor]:
    """`R.group_quant` of a 2-D tensor. On CUDA it is silu_mul_quant's kernel: for any [M, 2I] input its codes
    and exponents are exactly this (its third output, the row maxima of silu(g) u, is dropped). A traced graph
    takes that op where its shape allows (the op's kernel-or-reference choice is made when it runs: a tracer's
    tensors have no addresses to check)."""
    fits = x.dtype == torch.bfloat16 and group_size == KERNEL_GROUP and x.shape[1] % (2 * group_size) == 0
    if fits and (tracing(x) or _kernels(x, group_size=group_size) is not None):
        q, s, _ = silu_mul_quant(x, fmt, group_size)
        return q, s
    return R.group_quant(x, get_format(fmt), group_size)


@KernelOp
def group_dequant(codes: Tensor, sexp: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """`R.group_dequant` in `dtype`: one kernel for bf16 (a code times a power of two is exact there)."""
    op = _kernels(codes, sexp, group_size=group_size, dtypes=(torch.float8_e4m3fn, torch.float8_e5m2))
    if op is None or dtype != torch.bfloat16:
        return R.group_dequant(codes, sexp, group_size).to(dtype)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    op.group_dequant(_u8(codes).contiguous(), sexp.contiguous(), out, codes.dtype == torch.float8_e5m2)
    return out


@group_dequant.register_fake
def _(codes, sexp, group_size, dtype):
    return codes.new_empty(codes.shape, dtype=dtype)


@KernelOp
def silu_mul_rebuild(q: Tensor, s: Tensor, scale: Tensor, fmt: str, group_size: int, rowmajor: bool = True,
                     transposed: bool = False, act: str = "silu") -> tuple[Tensor, Tensor]:
    f = get_format(fmt)
    op = _kernels(q, group_size=group_size, rows=q.shape[0])
    if op is None:
        return R.silu_mul_rebuild(q, s, scale, f, group_size, rowmajor, transposed, act)
    out, out_t = _pair(q.shape[0], q.shape[1] // 2, f.dtype, rowmajor, transposed, q.device)
    op.silu_mul_rebuild(_u8(q), s, scale, _u8(out), _u8(out_t), q.dtype == torch.float8_e5m2, f.name == "e5m2",
                        _act_index(act))
    return out, out_t


@silu_mul_rebuild.register_fake
def _(q, s, scale, fmt, group_size, rowmajor=True, transposed=False, act="silu"):
    return _pair(q.shape[0], q.shape[1] // 2, _dtype(fmt), rowmajor, transposed, q.device)


@KernelOp
def silu_mul_backward(da: Tensor, q: Tensor, s: Tensor, group_size: int, act: str = "silu") -> tuple[Tensor, Tensor]:
    op = _kernels(da, q, group_size=group_size)
    if op is None or da.dtype != torch.bfloat16:
        return R.silu_mul_backward(da, q, s, group_size, act)
    dgu = torch.empty(q.shape, dtype=da.dtype, device=da.device)
    amax = torch.empty(q.shape[0], dtype=_F32, device=da.device)
    op.silu_mul_backward(da.contiguous(), _u8(q), s, dgu, amax, q.dtype == torch.float8_e5m2, _act_index(act))
    return dgu, amax


@silu_mul_backward.register_fake
def _(da, q, s, group_size, act="silu"):
    return da.new_empty(q.shape), da.new_empty(q.shape[0], dtype=_F32)


# ---------------------------------------------------------------- RoPE on the fused q/k/v output (CUDA only)

def rope_available(qkv: Tensor, cos: Tensor, head_dim: int) -> bool:
    """Whether the fused RoPE kernel applies (bf16 on CUDA, head_dim % 16 == 0, HF's [b or 1, s, d] cos/sin)."""
    if tracing(qkv):  # traced graphs use HF's RoPE, which the compiler fuses itself
        return False
    return (qkv.is_cuda and qkv.dtype == torch.bfloat16 and cos.dtype == torch.bfloat16 and head_dim % 16 == 0
            and cos.dim() == 3 and os.environ.get("COAT_ACT_REFERENCE", "0") != "1"
            and load_op("CoatQuantBuilder") is not None)


def _bshd(qkv: Tensor, batch: int, heads: int, hd: int) -> Tensor:
    """[b, s, h, d] memory seen as [b, h, s, d]: HF's q/k/v strides."""
    return qkv.new_empty(batch, qkv.shape[0] // batch, heads, hd).transpose(1, 2)


def _rope_outputs(qkv: Tensor, batch: int, nh: int, nkv: int, hd: int) -> tuple[Tensor, Tensor, Tensor]:
    return _bshd(qkv, batch, nh, hd), _bshd(qkv, batch, nkv, hd), _bshd(qkv, batch, nkv, hd)


@KernelOp
def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, batch: int, nh: int, nkv: int,
             hd: int) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = _rope_outputs(qkv, batch, nh, nkv, hd)
    load_op("CoatQuantBuilder").rope_qkv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), q.transpose(1, 2),
                                         k.transpose(1, 2), v.transpose(1, 2), nh, nkv, hd)
    return q, k, v


@rope_qkv.register_fake
def _(qkv, cos, sin, batch, nh, nkv, hd):
    return _rope_outputs(qkv, batch, nh, nkv, hd)


@KernelOp
def rope_qkv_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, nh: int, nkv: int,
                      hd: int) -> Tensor:
    b, _, s, _ = dq.shape
    dqkv = dq.new_empty(b * s, (nh + 2 * nkv) * hd)
    dq, dk, dv = (g.transpose(1, 2).contiguous() for g in (dq, dk, dv))  # [b, s, h, d]
    load_op("CoatQuantBuilder").rope_qkv_backward(dq, dk, dv, cos.contiguous(), sin.contiguous(), dqkv, nh, nkv, hd)
    return dqkv


@rope_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin, nh, nkv, hd):
    return dq.new_empty(dq.shape[0] * dq.shape[2], (nh + 2 * nkv) * hd)


# ---------------------------------------------------------------- the LM head's cross-entropy (activation/loss.py)
# Plain functions, not custom ops: the backward writes over its input, and a traced graph takes the reference.

def _xent_kernels(logits: Tensor):
    """The compiled module where the cross-entropy kernels apply (eager CUDA bf16 [m, n], n % 8 == 0)."""
    if tracing(logits) or logits.dim() != 2 or logits.shape[1] % 8 or not logits.is_contiguous():
        return None
    return _kernels(logits, dtypes=(torch.bfloat16,))


def xent_forward(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """R.xent_forward: one read of the bf16 logits instead of an fp32 copy and five passes."""
    op = _xent_kernels(logits)
    if op is None:
        return R.xent_forward(logits, target)
    lse = torch.empty(logits.shape[0], dtype=_F32, device=logits.device)
    picked = torch.empty_like(lse)
    op.xent_forward(logits, target.contiguous(), lse, picked)
    return lse, picked


def xent_backward_(logits: Tensor, lse: Tensor, target: Tensor, scale: Tensor) -> Tensor:
    """R.xent_backward, written over `logits` where the kernel applies (then returned): no fp32 copy."""
    op = _xent_kernels(logits)
    if op is None:
        return R.xent_backward(logits, lse, target, scale)
    op.xent_backward(logits, lse.contiguous(), target.contiguous(), scale.contiguous())
    return logits
