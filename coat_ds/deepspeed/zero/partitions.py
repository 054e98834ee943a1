"""Where each parameter's pieces lie in a rank's flat ZeRO partitions, read from DeepSpeed's optimizer wrappers.

ZeRO-1/2 and BF16_Optimizer describe each parameter's piece of a rank's partition in `param._hp_mapping` (the
same map DeepSpeed's universal checkpoints use; `hp_piece` reads it); ZeRO-3 cuts every parameter into equal
slices, one per rank (`zero3_slice`: the one place that does that arithmetic). bind.py builds the layouts from
these Segments; checkpoint/load.py writes restored weights to this rank's slices.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .kind import BF16, ZERO3, ZERO12, zero_kind
from .layout import Segment


def zero3_slice(param, rank: int) -> tuple[int, int, int]:
    """(start, count, size) of `rank`'s slice of a ZeRO-3 parameter: DeepSpeed cuts it into slices of `size` values
    (its `ds_tensor`), one per rank, of which `count` values from `start` are the parameter's (the last is padded;
    0 for a rank past the parameter's end)."""
    size = param.ds_tensor.ds_numel
    start = rank * size
    return start, max(0, min(size, param.ds_numel - start)), size


def hp_piece(param) -> tuple[int, int, int] | None:
    """(start in the parameter, start in the flat partition, count) of this rank's piece of a ZeRO-1/2 or
    BF16_Optimizer parameter, from DeepSpeed's `_hp_mapping`; None where this rank holds none of it."""
    m = getattr(param, "_hp_mapping", None)
    if m is None:
        return None
    return m.lp_fragment_address.start, m.hp_fragment_address.start, m.hp_fragment_address.numel


def _names(engine) -> dict:
    names = getattr(engine, "param_names", None)
    if names:
        return names
    return {p: n for n, p in engine.module.named_parameters()}


def _hp_segments(lp_params, names) -> list[Segment]:
    return [Segment(names[lp], lp.numel(), *piece) for lp in lp_params if (piece := hp_piece(lp)) is not None]


def _z3_segments(params, names, rank: int) -> list[Segment]:
    out, flat = [], 0
    for p in params:
        start, n, size = zero3_slice(p, rank)
        if n:
            out.append(Segment(names[p], p.ds_numel, start, flat, n))
        flat += size
    return out


def partitions(engine) -> list[tuple[torch.Tensor, list[Segment], object]]:
    """(flat fp32 tensor, its segments, its data-parallel group) for every flat tensor of the engine's optimizer."""
    zo, names = engine.optimizer, _names(engine)
    kind = zero_kind(zo)
    if kind == ZERO3:
        rank = dist.get_rank(group=zo.dp_process_group)
        return [(flat, _z3_segments(zo.fp16_groups[i], names, rank), zo.dp_process_group)
                for i, flat in enumerate(zo.fp32_partitioned_groups_flat)]
    if kind == ZERO12:
        return [(flat, _hp_segments(zo.bit16_groups[i], names), zo.real_dp_process_group[i])
                for i, flat in enumerate(zo.single_partition_of_fp32_groups)]
    if kind == BF16:
        return [(flat, _hp_segments(zo.bf16_groups[i], names), zo.real_dp_process_group[i])
                for i, flat in enumerate(zo.fp32_groups_flat_partition)]
    return []
