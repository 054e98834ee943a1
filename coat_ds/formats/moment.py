"""Fp8Moment: one group-quantized tensor (an Adam moment) as a value, instead of three loose tensors.

A moment is FP8 codes plus, per group of `group_size` consecutive values, a scale and an exponent
(group_quant.py). A *piece* of a moment (what one ZeRO rank holds of a parameter) keeps the groups of
the whole: `offset` is the position of its first code in its first group, and its metadata covers
every group its codes touch. Slices are views: copying into one writes the moment it was cut from.

An optimizer's state keeps the three tensors under `<prefix>_q`, `<prefix>_scale`, `<prefix>_expo`
(the on-disk keys of CoatAdamW checkpoints); `to_state` / `from_state` are the one place that spells
them, and `from_state` repairs the dtypes a generic load may have changed (torch's optimizer load casts
floating state to the parameter's dtype; tools store codes as uint8).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .fp8 import FP8Format, get_format
from .group_quant import dequantize as _dequantize, n_groups

SUFFIXES = ("_q", "_scale", "_expo")  # codes, scale, exponent


@functools.cache  # read on every step
def state_keys(prefix: str) -> tuple[str, str, str]:
    """The state-dict keys of a moment stored under `prefix` (e.g. exp_avg_q, exp_avg_scale, exp_avg_expo)."""
    return tuple(prefix + s for s in SUFFIXES)


@dataclass
class Fp8Moment:
    codes: torch.Tensor  # fmt.dtype, any shape (read flat)
    scale: torch.Tensor  # fp32, one per group touched
    expo: torch.Tensor  # fp32, one per group touched
    group_size: int
    fmt: FP8Format
    offset: int = 0  # position of codes[0] in its group (non-zero only for a piece cut inside a group)

    @classmethod
    def zeros(cls, shape: int | tuple | torch.Size, fmt: str | FP8Format, group_size: int,
              device: torch.device | str | None = None, groups: int | None = None) -> "Fp8Moment":
        """An all-zero moment (scale 0, exponent 1: decodes to exact zeros). `groups`: how many (scale, exponent)
        pairs, by default those of `shape`'s values; a ZeRO partition holds those of each parameter piece."""
        fmt = get_format(fmt)
        codes = torch.zeros(shape, dtype=fmt.dtype, device=device)
        k = n_groups(codes.numel(), group_size) if groups is None else groups
        return cls(codes, torch.zeros(k, device=device), torch.ones(k, device=device), group_size, fmt)

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, exponent): what the quantization kernels take."""
        return self.codes, self.scale, self.expo

    def piece(self, start: int, n: int, first_group: int, offset: int) -> "Fp8Moment":
        """A view: codes start..start+n-1 (flat), whose first lies at `offset` in the group `first_group`
        of this moment's metadata."""
        k = n_groups(offset + n, self.group_size) if n else 0
        return Fp8Moment(self.codes.reshape(-1).narrow(0, start, n), self.scale.narrow(0, first_group, k),
                         self.expo.narrow(0, first_group, k), self.group_size, self.fmt, offset)

    def slice(self, start: int, stop: int) -> "Fp8Moment":
        """A view of values start..stop-1 with the metadata of every group they touch."""
        pos = self.offset + start
        return self.piece(start, stop - start, pos // self.group_size, pos % self.group_size)

    def copy_(self, src: "Fp8Moment") -> "Fp8Moment":
        """Write `src` (same format, group size, offset and sizes) into this moment's tensors, in place."""
        same = (src.fmt, src.group_size, src.offset, src.numel, src.scale.numel())
        if same != (self.fmt, self.group_size, self.offset, self.numel, self.scale.numel()):
            raise ValueError(f"Fp8Moment.copy_: (format, group size, offset, values, groups) {same} do not match "
                             f"{(self.fmt, self.group_size, self.offset, self.numel, self.scale.numel())}")
        self.codes.view(torch.uint8).reshape(-1).copy_(src.codes.view(torch.uint8).reshape(-1))
        self.scale.copy_(src.scale)
        self.expo.copy_(src.expo)
        return self

    def dequantize(self) -> torch.Tensor:
        """fp32 values, the codes' shape (the reference math)."""
        pad = self.offset if self.numel else 0  # align the codes with their groups
        codes = torch.cat([self.codes.new_zeros(pad), self.codes.reshape(-1)])
        x = _dequantize(codes, self.scale, self.expo, self.group_size)
        return x[pad:].view(self.codes.shape)

    def to_state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The moment's tensors under the state-dict keys of `prefix`."""
        return dict(zip(state_keys(prefix), self.tensors))

    @classmethod
    def from_state(cls, state: dict, prefix: str, fmt: str | FP8Format, group_size: int) -> "Fp8Moment":
        """The moment stored under `prefix` in `state`, dtypes repaired: codes back to `fmt` (from uint8 bits
        or from the values a cast widened them to), scale and exponent to fp32. No copy when already right."""
        fmt = get_format(fmt)
        q, s, e = state_keys(prefix)
        codes, scale, expo = state[q], state[s], state[e]
        if codes.dtype == torch.uint8:
            codes = codes.view(fmt.dtype)
        elif codes.dtype != fmt.dtype:
            codes = codes.to(fmt.dtype)
        if scale.dtype != torch.float32 or expo.dtype != torch.float32:
            scale, expo = scale.float(), expo.float()
        return cls(codes, scale, expo, group_size, fmt)
