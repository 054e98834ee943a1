"""FP8 GEMMs through torch._scaled_mm, with the fallbacks that keep FP8 storage where FP8 GEMMs are missing.

_scaled_mm wants a row-major first operand and a column-major second one, every dimension a multiple of
16 on CUDA, and FP8 Tensor Cores (compute capability 8.9+). Otherwise the operands are dequantized and
multiplied in the output dtype (one warning per process for a GPU without FP8 GEMMs)."""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import Tensor

from ..kernels.custom_op import KernelOp


FP8_GEMM_CAPABILITY = (8, 9)  # FP8 Tensor Cores: Ada, Hopper and newer


@functools.lru_cache(maxsize=None)
def _has_fp8_gemm(device_index: int) -> bool:
    ok = torch.cuda.get_device_capability(device_index) >= FP8_GEMM_CAPABILITY
    if not ok:
        warnings.warn("coat_ds: this GPU has no FP8 GEMMs; activations stay FP8 in memory but the GEMMs run in "
                      "bf16", RuntimeWarning, stacklevel=3)
    return ok


def _fp8_gemm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type != "cuda":
        return True
    if not _has_fp8_gemm(a.device.index or 0):
        return False
    return a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


@KernelOp  # opaque to the compiler, like the other FP8 ops: the graph keeps the exact cuBLAS call eager runs
def fp8_mm(a: Tensor, sa: Tensor, b_t: Tensor, sb: Tensor, out_dtype: torch.dtype,
           bias: Optional[Tensor] = None) -> Tensor:
    """(a * sa) @ (b_t * sb)^T: a [M, K] and b_t [N, K] FP8 row-major, sa/sb fp32 0-d scales -> [M, N]."""
    b = b_t.t()
    if a.device.type == "cpu":  # torch's CPU _scaled_mm is a naive loop (~400x slower); same fp32 math via mm
        out = (a.float() @ b.float()) * (sa * sb)
        return (out if bias is None else out + bias).to(out_dtype)
    if _fp8_gemm_ok(a, b):
        if out_dtype == torch.float32 and bias is not None:  # _scaled_mm takes a bias only for 16-bit outputs
            return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype) + bias
        return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    out = (a.to(out_dtype) * sa.to(out_dtype)) @ (b.to(out_dtype) * sb.to(out_dtype))
    return out if bias is None else out + bias


@fp8_mm.register_fake
def _(a, sa, b_t, sb, out_dtype, bias=None):
    return a.new_empty(a.shape[0], b_t.shape[0], dtype=out_dtype)
