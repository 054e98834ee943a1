"""fp32 -> bf16 rounding: to nearest even, or stochastic with counter-based random bits (plain PyTorch).

Stochastic rounding adds 16 random bits to the low half of the fp32 bit pattern and truncates: a value
rounds up with probability (distance to the lower bf16) / ulp, so updates below a bf16 ulp survive in
expectation. The bits are a pure function of (seed, step, stream, index) — stream names the parameter,
index is the value's position in it — so they do not depend on how ZeRO partitions the parameter, on a
resume, or on the device. The hash (written identically in csrc/includes/coat_fp8_math.h):

    key  = fold of lowbias32(h ^ word) over the 32-bit halves of seed, step, stream (h starts at KEY0)
    bits = lowbias32(key + lo(index) * GOLDEN + hi(index) * GOLDEN_HI) >> 16     (all mod 2^32)

lowbias32 is C. Wellons' 2-multiply 32-bit mixer; key + index * GOLDEN is a Weyl sequence, so this is
splitmix-style: one mixing round per value, the per-(seed, step, stream) work done once per tensor."""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
KEY0 = 0x3C6EF372
GOLDEN = 0x9E3779B9
GOLDEN_HI = 0x7F4A7C15
MIX1, MIX2 = 0x7FEB352D, 0x846CA68B
BF16_NAN = 0x7FC0


def _mul32(a, b: int):
    """a * b mod 2^32 for a in [0, 2^32) (int or int64 tensor) without leaving int64: b split in 16-bit halves."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & M32


def lowbias32(x):
    """The 32-bit mixer, on a Python int or an int64 tensor of values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def stream_key(seed: int, step: int, stream: int) -> int:
    """The per-tensor key: every 32-bit half of seed, step and stream (taken mod 2^64) folded in."""
    h = KEY0
    for word in (seed, step, stream):
        word &= (1 << 64) - 1
        h = lowbias32(h ^ (word & M32))
        h = lowbias32(h ^ (word >> 32))
    return h


def sr_bits(seed: int, step: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in [0, 2^16)) for each value position in `index` (int64, >= 0) of `stream`."""
    index = index.long()
    lo, hi = index & M32, (index >> 32) & M32
    x = (stream_key(seed, step, stream) + _mul32(lo, GOLDEN) + _mul32(hi, GOLDEN_HI)) & M32
    return lowbias32(x) >> 16


def _bits_to_bf16(b: torch.Tensor) -> torch.Tensor:
    """int64 bf16 bit patterns in [0, 2^16) -> bfloat16."""
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def round_bf16(x: torch.Tensor, sr: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """fp32 x -> bf16, same shape. sr = None: round to nearest even (torch's cast). sr = (seed, step, stream,
    offset): stochastic rounding, flat position i of x taking the bits of index offset + i.

    NaN stays NaN (0x7FC0), +-inf stays +-inf; a finite value above the largest bf16 may round up to inf."""
    if sr is None:
        return x.to(torch.bfloat16)
    seed, step, stream, offset = sr
    flat = x.float().reshape(-1)
    u = flat.view(torch.int32).long() & M32
    idx = torch.arange(flat.numel(), device=x.device, dtype=torch.int64) + offset
    out = ((u + sr_bits(seed, step, stream, idx)) >> 16) & 0xFFFF
    out = torch.where(flat.isnan(), BF16_NAN, out)
    return _bits_to_bf16(out).view(x.shape)
