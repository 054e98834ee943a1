"""`"coat": {"gradients": ...}`: where ZeRO keeps a CoatAdamW engine's reduced gradients until the step.

- "per_parameter" (default): each reduced gradient of this rank's partition gets its own allocation, made when
  backward reaches its parameter, as eager PyTorch allocates each `.grad`, and freed by the step. Gradient
  memory grows while the activations that produced it are freed, so backward's peak is the activations', not
  activations plus every gradient. The step reads the pieces where they lie (step.py), so nothing of
  partition size is made.
- "partition_buffer": DeepSpeed's own layout: one buffer of the whole gradient partition, which ZeRO-1/2
  allocates at the first reduced bucket of backward, while nearly all activations are still alive, and ZeRO-3 at
  set-up, alive through forward too (+2 B/param at the peak: 15 GiB at 8B on one GPU).
- "release": not kept at all: each bucket's pieces are stepped as soon as DeepSpeed reduces them, and dropped
  (release.py: its clipping and non-finite semantics). ZeRO-1/2/3 on the device, bf16 gradients, FP8 states,
  no gradient accumulation; refused elsewhere (`config_refusal` here, release.refusal in the engine).

"per_parameter" and "partition_buffer" hold the same values and step bit-identically; so does "release" with
gradient clipping off (tests/test_zero_state.py, tests/test_release.py). The first two: ZeRO-1/2 with contiguous
gradients and bf16 gradient accumulation, and ZeRO-3, on the device; Offload keeps DeepSpeed's host staging
whatever the value.
"""
from __future__ import annotations

from typing import Any, Mapping
from ...keys import check_choice

GRADIENTS = ("per_parameter", "partition_buffer", "release")
DEFAULT = GRADIENTS[0]
PARTITION_BUFFER = GRADIENTS[1]
KEY = "coat.gradients"
RELEASE = "release"


def check_gradients(value: Any) -> str:
    """The value of coat.gradients, or a one-line ValueError naming the key and the allowed values."""
    return check_choice(KEY, value, GRADIENTS)


def refused(why: str) -> str:
    """The one line that refuses "release" where it cannot run: the key, why, and the values allowed there."""
    return f"{KEY}={RELEASE!r} {why}; allowed there: {[g for g in GRADIENTS if g != RELEASE]}"


def config_refusal(cfg: Mapping, hf_auto: bool = False) -> str | None:
    """Why a config's coat.gradients "release" cannot run, from the config alone (check.py, before any model;
    the engine checks the engine too: release.refusal). With hf_auto, HF's "auto" values are left to HF."""
    if (cfg.get("coat") or {}).get("gradients") != RELEASE:
        return None
    gas = cfg.get("gradient_accumulation_steps", 1)
    if gas != 1 and not (hf_auto and gas == "auto"):
        return refused(f"steps as gradients are reduced: gradient_accumulation_steps must be 1 (it is {gas!r})")
    zero = cfg.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        return refused(f"needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is {stage!r})")
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if str((zero.get(k) or {}).get("device", "none")).lower() != "none"]
    if offloaded:
        return refused(f"runs on the device, not under Offload (zero_optimization.{offloaded[0]})")
    bf16 = (cfg.get("bf16") or {}).get("enabled", False)
    if bf16 is not True and not (hf_auto and bf16 == "auto"):
        return refused("needs bf16 gradients (bf16.enabled true)")
    accum = (cfg.get("data_types") or {}).get("grad_accum_dtype")
    if accum not in (None, "bf16"):
        return refused(f"needs bf16 gradients (data_types.grad_accum_dtype is {accum!r})")
    return None
