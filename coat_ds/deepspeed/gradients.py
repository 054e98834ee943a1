"""`"coat": {"gradients": ...}`: where ZeRO keeps a CoatAdamW engine's reduced gradients until the step.

- "per_parameter" (default): each reduced gradient of this rank's partition gets its own allocation, made when
  backward reaches its parameter, as eager PyTorch allocates each `.grad`, and freed by the step. Gradient
  memory grows while the activations that produced it are freed, so backward's peak is the activations', not
  activations plus every gradient. The step reads the pieces where they lie (zero_step.py), so nothing of
  partition size is made.
- "partition_buffer": DeepSpeed's own layout: one buffer of the whole gradient partition, which ZeRO-1/2
  allocates at the first reduced bucket of backward, while nearly all activations are still alive, and ZeRO-3 at
  set-up, alive through forward too (+2 B/param at the peak: 15 GiB at 8B on one GPU).

Both hold the same values and step bit-identically (tests/test_zero_state.py). ZeRO-1/2 with contiguous gradients
and bf16 gradient accumulation, ZeRO-3, on the device; Offload keeps DeepSpeed's host staging whatever the value.
"""
from __future__ import annotations

from typing import Any

GRADIENTS = ("per_parameter", "partition_buffer")
DEFAULT = GRADIENTS[0]
KEY = "coat.gradients"


def check_gradients(value: Any) -> str:
    """The value of coat.gradients, or a one-line ValueError naming the key and the allowed values."""
    if value not in GRADIENTS:
        raise ValueError(f"{KEY}={value!r} is invalid; allowed: {list(GRADIENTS)}")
    return value

