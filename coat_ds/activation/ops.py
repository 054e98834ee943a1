"""The fused activation ops: CUDA kernels (CoatQuantBuilder) where they apply, else the reference.

Same signatures and results as `reference`. The kernels take bf16 inputs on CUDA and 1 x 16 groups;
anything else (CPU, fp32 models, other group sizes, a failed build) runs the plain-PyTorch reference."""
from __future__ import annotations

import os

import torch

from ..formats import FP8Format
from ..ops.loader import load_op
from . import reference as R

KERNEL_GROUP = 16


def _kernels(*tensors: torch.Tensor, group_size: int = KERNEL_GROUP, rows: int | None = None):
    """The compiled module if the kernels apply to these tensors (bf16/FP8 on CUDA, 1 x 16 groups, 16-byte
    aligned; `rows`, where given, a multiple of 16 for the tile kernels), else None."""
    t = tensors[0]
    if not t.is_cuda or group_size != KERNEL_GROUP or os.environ.get("COAT_ACT_REFERENCE", "0") == "1":
        return None
    if t.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    if rows is not None and rows % 16:
        return None
    if any(x.data_ptr() % 16 for x in tensors):
        return None
    return load_op("CoatQuantBuilder")


def _u8(t: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device="cuda") if t is None else t.view(torch.uint8)


def _e5m2(fmt: FP8Format) -> bool:
    return fmt.name == "e5m2"


def _alloc(m: int, n: int, fmt: FP8Format, rowmajor: bool, transposed: bool, device):
    q = torch.empty(m, n, dtype=fmt.dtype, device=device) if rowmajor else None
    qt = torch.empty(n, m, dtype=fmt.dtype, device=device) if transposed else None
    return q, qt


def row_amax(x: torch.Tensor) -> torch.Tensor:
    op = _kernels(x)
    if op is None or x.dtype != torch.bfloat16 or x.shape[1] % 8:
        return R.row_amax(x)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    op.row_amax(x.contiguous(), out)
    return out


tensor_scale = R.tensor_scale


def quant_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, rowmajor: bool = True,
                 transposed: bool = False):
    op = _kernels(x, rows=x.shape[0])
    if op is None or x.dtype != torch.bfloat16 or x.shape[1] % 16:
        return R.quant_tensor(x, scale, fmt, rowmajor, transposed)
    q, qt = _alloc(*x.shape, fmt, rowmajor, transposed, x.device)
    op.quant_tensor(x.contiguous(), scale, _u8(q), _u8(qt), _e5m2(fmt))
    return q, qt


def rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float, fmt: FP8Format, group_size: int):
    op = _kernels(x, w, group_size=group_size)
    if op is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return R.rmsnorm_quant(x, w, eps, fmt, group_size)
    m, n = x.shape
    R.check_groups(n, group_size)
    xq = torch.empty(m, n, dtype=fmt.dtype, device=x.device)
    xs = torch.empty(m, n // group_size, dtype=torch.uint8, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    ymax = torch.empty(m, dtype=torch.float32, device=x.device)
    op.rmsnorm_quant(x.contiguous(), w.contiguous(), float(eps), _u8(xq), xs, rstd, ymax, _e5m2(fmt))
    return xq, xs, rstd, ymax


def rmsnorm_rebuild(xq, xs, rstd, w, scale, fmt: FP8Format, group_size: int, rowmajor=True, transposed=False):
    op = _kernels(xq, w, group_size=group_size, rows=xq.shape[0])
    if op is None or w.dtype != torch.bfloat16:
        return R.rmsnorm_rebuild(xq, xs, rstd, w, scale, fmt, group_size, rowmajor, transposed)
    q, qt = _alloc(*xq.shape, fmt, rowmajor, transposed, xq.device)
    op.rmsnorm_rebuild(_u8(xq), xs, rstd, w.contiguous(), scale, _u8(q), _u8(qt), xq.dtype == torch.float8_e5m2,
                       _e5m2(fmt))
    return q, qt


def rmsnorm_backward(dy, xq, xs, rstd, w, group_size: int, dres: torch.Tensor | None = None):
    op = _kernels(dy, w, xq, *([] if dres is None else [dres]), group_size=group_size)
    if op is None or dy.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or dy.shape[1] > 16384 or (
            dres is not None and dres.dtype != torch.bfloat16):
        return R.rmsnorm_backward(dy, xq, xs, rstd, w, group_size, dres)
    dx = torch.empty_like(dy)
    dw = torch.zeros(w.shape[0], dtype=torch.float32, device=dy.device)
    empty = torch.empty(0, dtype=torch.bfloat16, device=dy.device)
    op.rmsnorm_backward(dy.contiguous(), _u8(xq), xs, rstd, w.contiguous(),
                        empty if dres is None else dres.contiguous(), dx, dw, xq.dtype == torch.float8_e5m2)
    return dx, dw


def silu_mul_quant(gu: torch.Tensor, fmt: FP8Format, group_size: int):
    op = _kernels(gu, group_size=group_size)
    if op is None or gu.dtype != torch.bfloat16:
        return R.silu_mul_quant(gu, fmt, group_size)
    m, n = gu.shape
    R.check_groups(n // 2, group_size)
    q = torch.empty(m, n, dtype=fmt.dtype, device=gu.device)
    s = torch.empty(m, n // group_size, dtype=torch.uint8, device=gu.device)
    amax = torch.empty(m, dtype=torch.float32, device=gu.device)
    op.silu_mul_quant(gu.contiguous(), _u8(q), s, amax, _e5m2(fmt))
    return q, s, amax


def silu_mul_rebuild(q, s, scale, fmt: FP8Format, group_size: int, rowmajor=True, transposed=False):
    op = _kernels(q, group_size=group_size, rows=q.shape[0])
    if op is None:
        return R.silu_mul_rebuild(q, s, scale, fmt, group_size, rowmajor, transposed)
    out, out_t = _alloc(q.shape[0], q.shape[1] // 2, fmt, rowmajor, transposed, q.device)
    op.silu_mul_rebuild(_u8(q), s, scale, _u8(out), _u8(out_t), q.dtype == torch.float8_e5m2, _e5m2(fmt))
    return out, out_t


def silu_mul_backward(da: torch.Tensor, q, s, group_size: int):
    op = _kernels(da, q, group_size=group_size)
    if op is None or da.dtype != torch.bfloat16:
        return R.silu_mul_backward(da, q, s, group_size)
    dgu = torch.empty(q.shape, dtype=da.dtype, device=da.device)
    amax = torch.empty(q.shape[0], dtype=torch.float32, device=da.device)
    op.silu_mul_backward(da.contiguous(), _u8(q), s, dgu, amax, q.dtype == torch.float8_e5m2)
    return dgu, amax
