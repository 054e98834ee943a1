"""Attach partition layouts to the flat tensors DeepSpeed hands CoatAdamW, right after it builds them.

From the pieces of parameters each flat tensor holds (partitions.py) we build a ShardLayout per flat tensor,
number the groups that partition boundaries cut identically on every rank, and bind it to CoatAdamW
(`bind_partition`): its state creation and FP8 step for that tensor then go through the layout. Parameters
DeepSpeed leaves whole (stage 0 without bf16, fp16 stage 0) keep CoatAdamW's own per-parameter path: its groups
are already the canonical ones. ZeRO-1/2/3 optimizers also get the step of step.py (the kernel reads
the gradient partition in place; BF16_Optimizer only its bf16 weight copy) or, for `"coat": {"gradients":
"release"}`, release.py's, and `"coat": {"master_weights": ...}` bf16 masters or bf16 + remainder masters
(master.py; the remainders, zero at the start where the fp32 master is the widened bf16 weights, are kept by
the layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ...optim import CoatAdamW
from . import release, states as host_states
from . import step as zero_step
from .gradients import RELEASE
from .layout import ShardLayout, local_cut_keys
from .master import use_bf16_master
from .partitions import partitions


def _group_of(opt: CoatAdamW, flat: torch.Tensor, index: int) -> dict:
    for g in opt.param_groups:
        if any(p is flat for p in g["params"]):
            return g
    return opt.param_groups[min(index, len(opt.param_groups) - 1)]  # ZeRO-3 empties 'params' between steps


def bind(engine, master: str, gradients: str, states: str = host_states.DEFAULT) -> int:
    """Give every flat partition of a CoatAdamW engine its layout, for its coat.master_weights `master`,
    coat.gradients `gradients` and coat.states `states`; returns how many tensors were bound."""
    opt = engine.basic_optimizer
    if not isinstance(opt, CoatAdamW):
        return 0
    if master != "fp32":
        use_bf16_master(engine, master)
    comm_device = get_accelerator().current_device_name()
    zo = engine.optimizer
    sub_to_group = getattr(zo, "sub_group_to_group_id", None)
    bound = 0
    for i, (flat, segments, pg) in enumerate(partitions(engine)):
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
        rem = torch.zeros(flat.numel(), dtype=torch.int16, device=flat.device) if master == "fp32_remainder" else None
        opt.bind_partition(flat, ShardLayout(segments, flat.numel(), g, pg, cut_index, comm_device,
                                             stochastic=master == "bf16_sr", remainder=rem))
        bound += 1
    if gradients == RELEASE:  # ZeRO-1/2/3's release step, or a one-line refusal (any other engine too)
        zero_step.install(zo, release.mixin(zo), gradients)
    if states == host_states.HOST:  # ZeRO-3 with release only: the FP8 moments to pinned host memory
        why = host_states.engine_refusal(zo, gradients)
        if why is not None:
            raise ValueError(why)
        host_states.install(zo)
    elif bound and (zero_step.ENABLED or master != "fp32"):  # bound: ZeRO-1/2/3 or BF16_Optimizer (partitions())
        zero_step.install(zo, zero_step.mixin(zo), gradients)
    engine._coat_bound = bound
    return bound
