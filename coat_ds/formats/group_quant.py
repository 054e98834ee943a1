"""Per-group FP8 quantization with dynamic range expansion: the reference math.

This file is the single source of truth; the CUDA and CPU kernels are tested against it.

A tensor is read flat and cut into groups of G consecutive values (the last may be short).
For a group with M = max|x| and m = min non-zero |x|, COAT maps x through
f(x) = sign(x) (|x|/c)^k with c = sqrt(M m) and scales by s = (M/c)^k / F, F the format's max.
The centre cancels out of the formula: q = sign(x) (|x|/d)^k with d = c s^(1/k) = M F^(-1/k), so
per group we store only the scale d and the exponent k (8 bytes instead of COAT's 12):

    k = clamp(floor(16 log2(R) / log2(M/m)) / 16, 1/16, 16)     R = F^2/2   (k = 1: no expansion)
    d = 2^(log2 M - log2 F / k)
    q = FP8(sign(x) 2^(k (log2|x| - log2 d)))          x = sign(q) 2^(log2|q| / k + log2 d)

An all-zero group stores d = 0, k = 1 and decodes to exact zeros. k is finite even when every
value of the group has one magnitude (M = m): it is capped at K_MAX.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .fp8 import FP8Format, cast_to_fp8, get_format

K_STEPS = 16  # k is a multiple of 1/16
K_MIN = 1.0 / K_STEPS
K_MAX = 16.0
GROUP_SIZES = (32, 64, 128, 256)


class GroupQuantized(NamedTuple):
    codes: torch.Tensor  # FP8, same shape as the input
    scale: torch.Tensor  # fp32 [n_groups]: d
    expo: torch.Tensor  # fp32 [n_groups]: k


def n_groups(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size


def check_group_size(group_size: int, key: str = "group_size") -> int:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{key}={group_size!r} is not supported; allowed: {list(GROUP_SIZES)}")
    return group_size


def _grouped(x: torch.Tensor, group_size: int, fill: float) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = n_groups(flat.numel(), group_size) * group_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), fill)])
    return flat.view(-1, group_size)


def group_params(x: torch.Tensor, fmt: FP8Format, group_size: int, expansion: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale d, exponent k) of each group of x."""
    a = _grouped(x, group_size, 0.0).abs()
    big = a.amax(dim=1)
    small = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin(dim=1)
    log_big = torch.log2(big)
    if expansion:
        span = log_big - torch.log2(small)  # 0 when all magnitudes are equal: k hits K_MAX
        k = torch.floor(K_STEPS * math.log2(fmt.expansion_range) / span) / K_STEPS
        k = k.clamp(K_MIN, K_MAX)
    else:
        k = torch.ones_like(big)
    d = torch.exp2(log_big - fmt.log2_max / k)
    zero = big == 0
    return torch.where(zero, 0.0, d), torch.where(zero, 1.0, k)


def quantize(x: torch.Tensor, fmt: str | FP8Format = "e4m3", group_size: int = 128, expansion: bool = True) -> GroupQuantized:
    fmt = get_format(fmt)
    d, k = group_params(x, fmt, group_size, expansion)
    g = _grouped(x, group_size, 0.0)
    y = torch.exp2(k[:, None] * (torch.log2(g.abs()) - torch.log2(d)[:, None]))
    y = torch.where(g == 0, 0.0, y.copysign(g))
    codes = cast_to_fp8(y, fmt).reshape(-1)[: x.numel()].view(x.shape)
    return GroupQuantized(codes, d, k)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, expo: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    q = _grouped(codes.float(), group_size, 0.0)
    x = torch.exp2(torch.log2(q.abs()) / expo[:, None] + torch.log2(scale)[:, None])
    x = torch.where(q == 0, 0.0, x.copysign(q))
    return x.reshape(-1)[: codes.numel()].view(codes.shape)


def relative_error(x: torch.Tensor, fmt: str | FP8Format, group_size: int = 128, expansion: bool = True) -> float:
    """Mean |x - Q(x)| / |x| over the non-zero entries."""
    q = quantize(x, fmt, group_size, expansion)
    xr = dequantize(*q, group_size)
    nz = x != 0
    return ((x - xr).abs()[nz] / x.abs()[nz]).mean().item()
