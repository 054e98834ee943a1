"""Which of DeepSpeed's ZeRO optimizer wrappers an engine runs, asked in one place.

DeepSpeed 0.19.8 names the wrapper nowhere one can read it; each is known by the master partitions it keeps:
ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`) its `fp32_partitioned_groups_flat`, ZeRO-1/2 (`DeepSpeedZeroOptimizer`)
its `single_partition_of_fp32_groups`, and `BF16_Optimizer` (stage 0 with bf16, or ZeRO-1 with fp32 gradient
accumulation) its `fp32_groups_flat_partition`. A DeepSpeed release that renames them changes only this file.
"""
from __future__ import annotations

ZERO3, ZERO12, BF16 = "zero3", "zero1_2", "bf16_optimizer"
_MASTERS = {ZERO3: "fp32_partitioned_groups_flat", ZERO12: "single_partition_of_fp32_groups",
            BF16: "fp32_groups_flat_partition"}


def zero_kind(zo) -> str | None:
    """ZERO3, ZERO12 or BF16 for DeepSpeed's optimizer wrapper `zo`; None for anything else (a plain optimizer)."""
    return next((kind for kind, attr in _MASTERS.items() if hasattr(zo, attr)), None)


def is_zero3(zo) -> bool:
    return zero_kind(zo) == ZERO3


def master_partitions(zo) -> list:
    """The master partitions (one flat tensor per param group or ZeRO-3 sub-group) of wrapper `zo`."""
    return getattr(zo, _MASTERS[zero_kind(zo)])
