"""Attach partition layouts to the flat fp32 tensors DeepSpeed hands CoatAdamW, right after it builds them.

DeepSpeed's ZeRO-1/2 and bf16 optimizers describe each parameter's piece of a rank's partition in
`param._hp_mapping` (the same map its universal checkpoints use); ZeRO-3 partitions each parameter
evenly (`ds_tensor`). From these we build a ShardLayout per flat tensor, number the groups that
partition boundaries cut identically on every rank, and route CoatAdamW's state creation and FP8
step for those tensors through the layout. Parameters DeepSpeed leaves whole (stage 0 without bf16,
fp16 stage 0) keep CoatAdamW's own per-parameter path: its groups are already the canonical ones.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

from ..optim import CoatAdamW
from .layout import Segment, ShardLayout, local_cut_keys, skipped



def layout_of(opt: CoatAdamW, p: torch.Tensor) -> ShardLayout | None:
    """The layout bound to flat tensor p (kept on the optimizer, not the tensor: tensors get pickled)."""
    entry = getattr(opt, "_coat_layouts", {}).get(id(p))
    return entry[1] if entry is not None and entry[0] is p else None


def _names(engine) -> dict:
    names = getattr(engine, "param_names", None)
    if names:
        return names
    return {p: n for n, p in engine.module.named_parameters()}


def _hp_segments(lp_params, names) -> list[Segment]:
    out = []
    for lp in lp_params:
        m = getattr(lp, "_hp_mapping", None)
        if m is None:
            continue
        out.append(Segment(names[lp], lp.numel(), m.lp_fragment_address.start, m.hp_fragment_address.start,
                           m.hp_fragment_address.numel))
    return out


def _z3_segments(params, names, rank: int) -> list[Segment]:
    out, flat = [], 0
    for p in params:
        part = p.ds_tensor.ds_numel
        start = rank * part
        n = max(0, min(part, p.ds_numel - start))
        if n:
            out.append(Segment(names[p], p.ds_numel, start, flat, n))
        flat += part
    return out


def partitions(engine) -> list[tuple[torch.Tensor, list[Segment], object]]:
    """(flat fp32 tensor, its segments, its data-parallel group) for every flat tensor of the engine's optimizer."""
    zo, names = engine.optimizer, _names(engine)
    if hasattr(zo, "fp32_partitioned_groups_flat"):  # ZeRO-3
        rank = dist.get_rank(group=zo.dp_process_group)
        return [(flat, _z3_segments(zo.fp16_groups[i], names, rank), zo.dp_process_group)
                for i, flat in enumerate(zo.fp32_partitioned_groups_flat)]
    if hasattr(zo, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return [(flat, _hp_segments(zo.bit16_groups[i], names), zo.real_dp_process_group[i])
                for i, flat in enumerate(zo.single_partition_of_fp32_groups)]
    if hasattr(zo, "fp32_groups_flat_partition"):  # bf16 optimizer (stage 0 with bf16)
        return [(flat, _hp_segments(zo.bf16_groups[i], names), zo.real_dp_process_group[i])
                for i, flat in enumerate(zo.fp32_groups_flat_partition)]
    return []


def _group_of(opt: CoatAdamW, flat: torch.Tensor, index: int) -> dict:
    for g in opt.param_groups:
        if any(p is flat for p in g["params"]):
            return g
    return opt.param_groups[min(index, len(opt.param_groups) - 1)]  # ZeRO-3 empties 'params' between steps


def bind(engine) -> int:
    """Give every flat partition of a CoatAdamW engine its layout; returns how many tensors were bound."""
    opt = engine.basic_optimizer
    if not isinstance(opt, CoatAdamW):
        return 0
    from deepspeed.accelerator import get_accelerator

    comm_device = get_accelerator().current_device_name()
    found = partitions(engine)
    zo = engine.optimizer
    sub_to_group = getattr(zo, "sub_group_to_group_id", None)
    bound = 0
    opt._coat_layouts = {}
    for i, (flat, segments, pg) in enumerate(found):
        gi = sub_to_group[i] if sub_to_group is not None else i
        group = opt.param_groups[gi] if gi < len(opt.param_groups) else _group_of(opt, flat, i)
        g = group["group_size"]
        world = dist.get_world_size(group=pg) if dist.is_initialized() else 1
        mine = local_cut_keys(segments, g)
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine, group=pg)
        else:
            everyone = [mine]
        cut_index = {k: n for n, k in enumerate(sorted({k for keys in everyone for k in keys}))}
        opt._coat_layouts[id(flat)] = (flat, ShardLayout(segments, flat.numel(), g, pg, cut_index, comm_device))
        bound += 1
    if bound:
        _route(opt, collective=True)
    engine._coat_bound = bound
    return bound


def _route(opt: CoatAdamW, collective: bool) -> None:
    """Send CoatAdamW's state creation and FP8 step for partitioned tensors through their layout.

    The per-rank inf/NaN check becomes collective (inside the layout step): one rank skipping alone
    would leave the others waiting in the exchange."""
    if getattr(opt, "_coat_routed", False):
        return
    init_state, fp8_step = opt._init_state, opt._fp8_step

    def _init_state_routed(self, p, group):
        layout = layout_of(self, p)
        if layout is None or not group["fp8_state"] or self.state[p]:
            return init_state(p, group)
        self.state[p].update(layout.init_state(p, group))
        return self.state[p]

    def _fp8_step_routed(self, params, group, step):
        plain = [p for p in params if layout_of(self, p) is None]
        if plain:
            fp8_step(plain, group, step)
        for p in params:
            layout = layout_of(self, p)
            if layout is not None and not layout.fp8_step(self, p, group, step):
                skipped(self, p)

    opt._init_state = types.MethodType(_init_state_routed, opt)
    opt._fp8_step = types.MethodType(_fp8_step_routed, opt)
    if collective:
        opt.check_finite = False
    opt._coat_routed = True
