"""An fp32 master held as a bf16 weight plus a 16-bit remainder, exactly (plain PyTorch, the source of truth).

split(x) -> (hi, lo): lo is the low 16 bits of x's fp32 pattern as they are; hi is the high 16 bits plus the
top bit of lo (integer arithmetic on the bit pattern, so a carry into the exponent is exact: 0x3F7FFFFF, just
below 1.0, gives hi = 1.0). hi is therefore x rounded to the nearest bf16, ties away from zero, and
join(hi, lo) = ((hi - (lo >> 15)) << 16) | lo gives back x bit for bit, +-0, subnormals and +-inf included
(TransformerEngine's `store_param_remainders` split). A NaN splits into the canonical bf16 NaN 0x7FC0 and
joins back to a NaN (not its payload).

Why not round to nearest *even* (what torch's cast and DeepSpeed's master -> model copy do): under it an even
bf16 value is the rounding of 65,537 fp32 patterns (both neighbouring ties land on it), one more than 16 bits
can tell apart, so no 16-bit remainder can undo it. Ties away from zero give every bf16 value exactly 65,536.
The two roundings differ only on exact ties (lo == 0x8000) with an even high half: about 2^-17 of the values
a step writes, where hi is one bf16 ulp larger in magnitude than the nearest-even cast. CoatAdamW writes the
bf16 weights of a plain fp32 master as this same high half (`bf16_weight`; the kernels' `bf16_copy`), so the
fp32 and the remainder master train bit-identically."""
from __future__ import annotations

import torch

BF16_NAN = 0x7FC0
CHUNK = 1 << 22  # values per piece in bf16_weight: split's int64 temporaries stay ~32 MB each


def _u32(x: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns as int64 in [0, 2^32)."""
    return x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF


def _bits16(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 16-bit patterns in [0, 2^16) -> a 16-bit tensor of `dtype` with those bits."""
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(dtype)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x -> (bf16 hi, int16 lo), same shape: hi = x rounded to nearest (ties away from zero), lo what undoes it."""
    u = _u32(x)
    lo = u & 0xFFFF
    hi = ((u >> 16) + (lo >> 15)) & 0xFFFF
    hi = torch.where((u & 0x7FFFFFFF) > 0x7F800000, BF16_NAN, hi)
    return _bits16(hi, torch.bfloat16).view(x.shape), _bits16(lo, torch.int16).view(x.shape)


def bf16_weight(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 model weight of an fp32 master x: split(x)'s high half, into `out` (contiguous bf16) if given.
    Split piece by piece, so that a whole ZeRO partition costs no partition-sized int64 temporaries."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) if out is None else out
    src, dst = x.reshape(-1), out.view(-1)
    for a in range(0, src.numel(), CHUNK):
        dst[a:a + CHUNK] = split(src[a:a + CHUNK])[0]
    return out


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """(bf16 hi, int16 lo) -> the fp32 master they hold, exactly."""
    h = hi.contiguous().view(torch.int16).long() & 0xFFFF
    low = lo.contiguous().view(torch.int16).long() & 0xFFFF
    u = (((h - (low >> 15)) & 0xFFFF) << 16) | low
    return torch.where(u >= 2 ** 31, u - 2 ** 32, u).to(torch.int32).view(torch.float32).view(hi.shape)


def check_finite(x: torch.Tensor, where: str) -> None:
    """Refuse a non-finite fp32 master before it is split (a NaN would not come back bit for bit)."""
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{where}: {bad} non-finite master value(s); an fp32 master with remainders holds finite "
                         "values only")
