"""FP8 formats that coat_ds stores tensors in."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    name: str
    dtype: torch.dtype
    max: float

    @property
    def expansion_range(self) -> float:
        """Largest max/min ratio range expansion aims for: F^2/2 (448^2/2 for E4M3).

        Past it the smallest values of a group would fall below the format's subnormals."""
        return self.max * self.max / 2

    @property
    def log2_max(self) -> float:
        return math.log2(self.max)


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0)
FORMATS = {f.name: f for f in (E4M3, E5M2)}


def get_format(name: str | FP8Format, key: str = "format") -> FP8Format:
    """Look a format up by name; a bad name is a ValueError naming `key` and the allowed values."""
    if isinstance(name, FP8Format):
        return name
    try:
        return FORMATS[str(name).lower()]
    except KeyError:
        raise ValueError(f"{key}={name!r} is not an FP8 format; allowed: {sorted(FORMATS)}") from None


def cast_to_fp8(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Round to nearest even, saturating: torch's own cast turns out-of-range values into NaN."""
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype)
