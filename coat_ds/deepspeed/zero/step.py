"""ZeRO's optimizer step for CoatAdamW engines: the FP8 kernel reads the gradient partition where it lies.

Per param group, DeepSpeed's ZeRO-1/2 step (stage_1_and_2.py) flattens the rank's bit16 gradient
partition (+2 B/param), converts it to fp32 (+4 B/param), multiplies it by 1/(clip x loss scale), runs
the optimizer on the fp32 master and copies the master into the bit16 model partition; ZeRO-3 does the
same per sub-group (stage3.py `_prepare_fp32_grad_for_sub_group`). CoatAdamW's kernel takes bf16, fp16
or fp32 gradients and that scalar itself, and writes the bf16 model copy as it goes, so here it gets the
views DeepSpeed already keeps of the partition (`averaged_gradients[i]`, one per parameter piece: with
contiguous gradients they lie in one reduction buffer, in reduction order, hence pieces and not one
tensor) and nothing of partition size is allocated. Widening bf16/fp16 to fp32 is exact and the scalar
is DeepSpeed's own (its unscale_and_clip_grads applied to a 1), so the step is bit-identical to
DeepSpeed's with its weight copy rounded as below (tests/test_zero_state.py). A non-finite gradient is caught by DeepSpeed's own overflow
check or norm where it computes one; only where it does not does CoatAdamW read the gradient to check.

DeepSpeed 0.19.8 builds its ZeRO optimizers itself (no factory to hook), so bind() gives the instance a
subclass of its own class (`install`). ZeRO-3's step calls overridable methods per sub-group, so four
small overrides suffice. ZeRO-1/2 do their per-group work inline in `step`, so that override re-states
`DeepSpeedZeroOptimizer.step` of DeepSpeed 0.19.8 (overflow check, norm, loss scale, all-gather) around
its own per-group body, and hands back to DeepSpeed's step where it does not apply (autocast's grad
scaler, ZenFlow, Offload with an fp32 master: that path has no fp32 copy on the device to save).

The bf16 model weights of an fp32 master are written as CoatAdamW's kernel writes them: the high half of
formats.remainder's split (nearest, ties away from zero), so that "fp32" and "fp32_remainder" masters train
bit-identically. That holds for every copy made here and for the ones DeepSpeed makes around CoatAdamW's step on
the device (ZeRO-3's per-sub-group copy, BF16_Optimizer's `update_lp_params`, loads included); DeepSpeed's own
step under Offload and with `ENABLED = False` keeps its nearest-even cast (a difference at exact ties only).
"""
from __future__ import annotations

import functools

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import is_invalid_grad_norm
from deepspeed.runtime.zero.stage_1_and_2 import (INITIAL_MICRO_STEP_ID, OPTIMIZER_ALLGATHER_TIMER,
                                                  OPTIMIZER_STEP_TIMER, OPTIMIZER_TIMERS, all_gather_dp_groups)
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, SINGLE_PARTITION_OF_FP32_GROUPS

from ...formats.remainder import bf16_weight, check_finite
from .gradients import DEFAULT as GRADIENTS_DEFAULT, PARTITION_BUFFER, RELEASE
from .kind import ZERO3, ZERO12, zero_kind
from .layout import FlatPieces

ENABLED = True  # False: DeepSpeed's own step for fp32 masters (what the tests compare with)


class Zero12Step:
    """Mixed into DeepSpeedZeroOptimizer (ZeRO-1/2) of a CoatAdamW engine; see the module docstring."""

    _coat_bf16_master = False  # master.py sets it when the master partitions are bf16
    _coat_remainder = False  # ... and when they are the high halves of fp32 masters (layouts keep the remainders)
    _coat_per_parameter_grads = True  # coat.gradients (gradients.py); bind() sets it from the config

    def copy_grads_in_partition(self, param, group_idx=None):
        """A reduced gradient of this rank's partition into an allocation of its own, made now, as backward
        reaches the parameter (coat.gradients "per_parameter"). DeepSpeed 0.19.8 copies it into one buffer of
        the whole partition, allocated at the first reduced bucket while the activations are still alive; the
        values, dtype and `.grad` re-pointing are the same, only the storage differs. Offload and an fp32
        compact partition buffer keep DeepSpeed's own path.

        The allocation is the compute stream's (compute_stream_tensor)."""
        if group_idx is None:
            group_idx = self._get_param_group_idx(param)
        if not self._coat_per_parameter_grads or self.cpu_offload or self._use_compact_grad_partition_buffer(group_idx):
            return super().copy_grads_in_partition(param, group_idx)
        grad = self.get_gradient_for_reduction(param)
        own = compute_stream_tensor(param.numel(), self.dtype, grad.device)
        own.copy_(grad.view(-1))
        grad.data = own.view_as(grad)

    def step(self, closure=None):
        if self.torch_autocast_gradscaler or self.zenflow or (self.cpu_offload and not self._coat_bf16_master):
            return super().step(closure)
        go, norm = self._coat_check_and_scale()
        if not go:
            return
        finite = self.check_grad_overflow or (norm is not None and not is_invalid_grad_norm(norm))
        if torch.is_tensor(self._global_grad_norm):  # a check above already waited for the norm: reading it is free,
            self._global_grad_norm = self._global_grad_norm.item()  # and HF Trainer's .item() then waits on no step
        self.timers(OPTIMIZER_STEP_TIMER).start()
        for i in range(len(self.bit16_groups)):
            self._coat_step_group(i, norm, finite)
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._lazy_init_hp_params_optimizer_state()
        if self.cpu_offload:
            self.reset_cpu_buffers()
        self._coat_gather_weights()

    def _coat_gather_weights(self) -> None:
        """The end of DeepSpeed's step: every rank's updated bf16 partitions all-gathered into the model."""
        self.timers(OPTIMIZER_ALLGATHER_TIMER).start()
        all_gather_dp_groups(groups_flat=self.bit16_groups_flat, partitioned_param_groups=self.parallel_partitioned_bit16_groups,
                             dp_process_group=self.real_dp_process_group, start_alignment_factor=self.nccl_start_alignment_factor,
                             allgather_bucket_size=self.allgather_bucket_size)
        self.timers(OPTIMIZER_ALLGATHER_TIMER).stop()
        for i in range(len(self.bit16_groups)):
            self._update_model_bit16_weights(i)
        self.timers.log(OPTIMIZER_TIMERS)

    def _coat_check_and_scale(self) -> tuple[bool, torch.Tensor | None]:
        """DeepSpeed's step up to the optimizer: overflow check, global norm, loss-scale update.
        (False, None) when the step is skipped (gradients dropped as DeepSpeed drops them)."""
        self.micro_step_id = INITIAL_MICRO_STEP_ID
        self._wait_for_offload_copies()
        if self.cpu_offload:
            self._offload_accumulated_param_ids = set()
        if not self.compute_grad_norm:
            self._global_grad_norm = None
        self.overflow = False
        if self.check_grad_overflow:
            self.check_overflow(partition_gradients=self.partition_gradients)
        norm = None
        if self.compute_grad_norm and not self.overflow:
            if self.cpu_offload:
                self._apply_muon_updates_cpu_offload()
            norm = self.scaled_global_norm()
            if (self.dtype != torch.bfloat16 or self.check_grad_overflow) and is_invalid_grad_norm(norm):
                self.overflow = True
        prev_scale = self.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            self._coat_drop_gradients()
            return False, None
        self._commit_muon_momentum()
        if norm is not None:
            self._global_grad_norm = norm / prev_scale
        return True, norm

    def _coat_drop_gradients(self) -> None:
        if self.compute_grad_norm:
            self._global_grad_norm = float("inf")
        self.zero_grad(set_to_none=True)
        self._release_preflattened_grad_buffers()
        if self.cpu_offload:
            self.reset_cpu_buffers()
        else:
            for k in self.averaged_gradients.keys():
                self.averaged_gradients[k] = None
                self.all_grad_tensors[k] = None
        for timer in OPTIMIZER_TIMERS:
            self.timers(timer).start()
            self.timers(timer).stop()

    def _coat_grad_scale(self, norm, device: torch.device) -> torch.Tensor:
        """What DeepSpeed's unscale_and_clip_grads multiplies the gradient by (its own code, applied to a 1)."""
        probe = torch.ones(1, dtype=torch.float32, device=device)
        self.unscale_and_clip_grads([probe], norm)
        return probe

    def _coat_grad_pieces(self, i: int) -> list[torch.Tensor]:
        self.free_grad_in_param_list(self.params_not_in_partition[i])
        pre = self._get_preflattened_grad_partition(i)
        pieces = [pre] if pre is not None else list(self.averaged_gradients[i])
        self.free_grad_in_param_list(self.params_in_partition[i])  # our views keep the buffer until the step ends
        return pieces

    def _coat_step_group(self, i: int, norm, finite: bool) -> None:
        opt, master = self.optimizer, self.single_partition_of_fp32_groups[i]
        group = opt.param_groups[i]
        lp = self.parallel_partitioned_bit16_groups[i][dist.get_rank(group=self.real_dp_process_group[i])]
        if opt.partition_of(master) is None or not group["fp8_state"]:
            return self._coat_step_plain(i, norm, master, lp)
        grads = master.grad if self.cpu_offload else FlatPieces(self._coat_grad_pieces(i))
        opt.step_partition(master, group, grads, grad_scale=self._coat_grad_scale(norm, master.device),
                           lp_out=None if master is lp or self.cpu_offload else lp, finite=finite)
        if self.cpu_offload:  # the host bf16 master is what the model partition receives
            lp.data.copy_(master.data, non_blocking=True)
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None

    def _coat_step_plain(self, i: int, norm, master: torch.Tensor, lp: torch.Tensor) -> None:
        """DeepSpeed's own per-group body, for a group with fp32 moments (fp8_state=False)."""
        grad = torch.cat([t.reshape(-1) for t in self._coat_grad_pieces(i)]).to(master.dtype)
        master.grad = grad
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None
        self.unscale_and_clip_grads([grad], norm)
        self._optimizer_step(i)
        master.grad = None
        write_lp(lp, master)

    def state_dict(self):
        sd = super().state_dict()
        if self._coat_bf16_master and not self.cpu_offload:  # views of the model's flat buffer: save just them
            sd[SINGLE_PARTITION_OF_FP32_GROUPS] = _saved_masters(self, sd[SINGLE_PARTITION_OF_FP32_GROUPS],
                                                                  self.single_partition_of_fp32_groups)
        return sd

    def _load_legacy_checkpoint(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False):
        super()._load_legacy_checkpoint(state_dict_list, load_optimizer_states, load_from_fp32_weights)
        if self._coat_remainder:  # DeepSpeed copied the saved fp32 masters into bf16: split them exactly instead
            rank = dist.get_rank(group=self.dp_process_group)
            saved = state_dict_list[rank][SINGLE_PARTITION_OF_FP32_GROUPS] if load_from_fp32_weights else None
            _load_remainders(self, self.single_partition_of_fp32_groups, saved)


class GradPartitions(dict):
    """ZeRO-3's map of parameter (ds_id) -> this rank's gradient partition, each allocated (zeroed, on the compute
    stream) when backward first reaches the parameter and dropped after the step (coat.gradients "per_parameter").
    DeepSpeed 0.19.8 fills the map with views of one buffer of the whole partition, allocated at set-up and kept
    through forward and backward; its readers (partition_grads, the backward epilogue, the step) index the map."""

    def __init__(self, numels: dict[int, int], dtype: torch.dtype, device) -> None:
        super().__init__()
        self.numels, self.dtype, self.device = numels, dtype, device

    def __missing__(self, ds_id: int) -> torch.Tensor:
        self[ds_id] = t = compute_stream_tensor(self.numels[ds_id], self.dtype, self.device, zero=True)
        return t


GRAD_MAP = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"  # DeepSpeed 0.19.8's private map (mangled)


class Zero3Step:
    """Mixed into DeepSpeedZeroOptimizer_Stage3 of a CoatAdamW engine: the per-sub-group hooks of its step, and
    its gradient partitions allocated per parameter (GradPartitions, `_coat_use_grad_partitions`)."""

    _coat_bf16_master = False  # master.py sets it when the master partitions are the bf16 model partitions
    _coat_remainder = False  # ... and when they are the high halves of fp32 masters (layouts keep the remainders)
    _coat_grad_map: type = GradPartitions  # release.Release3Step's holds none

    def _coat_use_grad_partitions(self) -> None:
        """Replace DeepSpeed's gradient buffer (a partition-sized tensor alive from set-up) by GradPartitions. On the
        device only: Offload copies gradients into host buffers of its own from the same map."""
        if not replaces_grad_buffer(self) or isinstance(getattr(self, GRAD_MAP), GradPartitions):
            return
        params = [p for group in self.fp16_groups for p in group]
        setattr(self, GRAD_MAP, self._coat_grad_map({p.ds_id: p.partition_numel() for p in params},
                                                    self.gradient_accumulation_dtype, self.device))
        self.grad_partitions_flat_buffer = torch.empty(0, dtype=self.gradient_accumulation_dtype, device=self.device)

    def step(self, closure=None):
        out = super().step(closure)
        grads = getattr(self, GRAD_MAP)
        if isinstance(grads, GradPartitions):  # stepped or skipped, the gradients are spent
            grads.clear()
        return out

    def has_overflow(self, partition_gradients=True):
        grads = getattr(self, GRAD_MAP)
        if partition_gradients and isinstance(grads, GradPartitions) and grads:  # DeepSpeed reads the flat buffer
            with get_accelerator().stream(self.reduce_and_partition_stream):
                for g in grads.values():
                    self.inf_or_nan_tracker.logical_or_(~torch.isfinite(g).all())
        return super().has_overflow(partition_gradients)

    def _coat_group(self, i: int) -> dict | None:
        """The param group of sub-group i if this step takes it over (bound FP8 group, on the device)."""
        flat = self.fp32_partitioned_groups_flat[i]
        group = self.optimizer.param_groups[self.sub_group_to_group_id[i]]
        if (self.offload_optimizer or self.torch_autocast_gradscaler or self.zenflow or not group["fp8_state"]
                or self._swappable_optimizer_subgroup(i) or self.optimizer.partition_of(flat) is None):
            return None
        return group

    def _prepare_fp32_grad_for_sub_group(self, i: int) -> None:
        if self._coat_group(i) is None:
            return super()._prepare_fp32_grad_for_sub_group(i)
        self._coat_grads[i] = FlatPieces(self.averaged_gradients[i])
        self.averaged_gradients[i] = None

    def unscale_and_clip_grads(self, i: int, total_norm) -> None:
        if i not in self._coat_grads:
            return super().unscale_and_clip_grads(i, total_norm)
        self._coat_scales[i] = self._coat_grad_scale(total_norm, self.fp32_partitioned_groups_flat[i].device)

    def _coat_grad_scale(self, total_norm, device: torch.device) -> torch.Tensor:
        """DeepSpeed 0.19.8's stage-3 unscale_and_clip_grads, as the scalar the kernel multiplies the gradient by."""
        combined_scale = self.loss_scale
        if self.clip_grad > 0.:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
        return torch.ones(1, dtype=torch.float32, device=device).mul_(1. / combined_scale)

    def _optimizer_step(self, i: int) -> None:
        if i not in self._coat_grads:
            return super()._optimizer_step(i)
        master, lp = self.fp32_partitioned_groups_flat[i], self.fp16_partitioned_groups_flat[i]
        in_kernel = lp is not None and lp.dtype == torch.bfloat16 and lp is not master
        # DeepSpeed's step already skipped a step whose gradient norm is not finite
        self.optimizer.step_partition(master, self._coat_group(i), self._coat_grads.pop(i),
                                      grad_scale=self._coat_scales.pop(i), lp_out=lp if in_kernel else None,
                                      finite=True)
        if in_kernel or lp is master:
            self._coat_lp_written.add(i)

    def _reassign_or_swap_out_partitioned_parameters(self, i: int) -> None:
        lp = self.fp16_partitioned_groups_flat[i]
        if i in self._coat_lp_written:
            self._coat_lp_written.discard(i)
        elif lp is not None and not self.offload_optimizer:  # DeepSpeed's copy, rounded as the kernel rounds
            write_lp(lp, self.fp32_partitioned_groups_flat[i])
        else:
            return super()._reassign_or_swap_out_partitioned_parameters(i)
        self._unflatten_partitioned_parameters(i)

    def _rigid_state_dict(self):
        sd = super()._rigid_state_dict()
        if self._coat_bf16_master:  # views of the model's flat buffer: save just them
            sd[FP32_FLAT_GROUPS] = _saved_masters(self, sd[FP32_FLAT_GROUPS], self.fp32_partitioned_groups_flat)
        return sd

    def _rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
        super()._rigid_load_state_dict(state_dict, load_optimizer_states)
        if self._coat_remainder:
            _load_remainders(self, self.fp32_partitioned_groups_flat, state_dict[FP32_FLAT_GROUPS])


class Bf16Step:
    """Mixed into DeepSpeed's BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation) of a CoatAdamW engine:
    its copy of the fp32 master partitions into the bf16 model (DeepSpeed 0.19.8's `update_lp_params`, after
    each step and on load) rounded as the kernel rounds."""

    @torch.no_grad()
    def update_lp_params(self) -> None:
        for i, (parts, master) in enumerate(zip(self.bf16_partitioned_groups, self.fp32_groups_flat_partition)):
            write_lp(parts[dist.get_rank(group=self.real_dp_process_group[i])], master)
        all_gather_dp_groups(groups_flat=self.bf16_groups_flat, partitioned_param_groups=self.bf16_partitioned_groups,
                             dp_process_group=self.real_dp_process_group,
                             start_alignment_factor=self.nccl_start_alignment_factor,
                             allgather_bucket_size=self.allgather_bucket_size)


def compute_stream_tensor(numel: int, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
    """A new tensor from the compute stream's memory pool, usable on the current stream. ZeRO reduces and copies
    gradients on a stream of its own (overlap_comm, ZeRO-3's reduce_and_partition_stream), whose pool never receives
    the blocks freed activations leave: a gradient allocated there would sit beside that freed memory (reserved,
    not reused) instead of in it."""
    accel = get_accelerator()
    here, compute = accel.current_stream(), accel.default_stream()
    with accel.stream(compute):
        t = torch.zeros(numel, dtype=dtype, device=device) if zero else torch.empty(numel, dtype=dtype, device=device)
    if here != compute:
        here.wait_stream(compute)  # the block's last users ran on the compute stream, and so did the zeroing
        t.record_stream(here)  # its reuse once freed waits for this stream too
    return t


@torch.no_grad()
def write_lp(lp: torch.Tensor, master: torch.Tensor) -> None:
    """The model's partition lp from its master: a bf16 one from an fp32 master as CoatAdamW's kernel writes it
    (formats.remainder.bf16_weight: ties away from zero), anything else as DeepSpeed copies it."""
    if lp.dtype == torch.bfloat16 and master.dtype == torch.float32:
        bf16_weight(master.data, out=lp.data)
    else:
        lp.data.copy_(master.data)


def _saved_masters(zo, saved: list, flats: list) -> list:
    """What a checkpoint holds for bf16 master partitions `flats` (DeepSpeed's `saved`: views of them, padding
    cut off): copies, or for remainder masters the fp32 masters themselves (what an fp32-master run saves)."""
    if not zo._coat_remainder:
        return [t.clone() for t in saved]
    out = []
    for t, flat in zip(saved, flats):
        layout = zo.optimizer.partition_of(flat)
        full = flat.float() if layout is None else layout.master(flat)
        out.append(full.reshape(-1)[:t.numel()].clone())
    return out


@torch.no_grad()
def _load_remainders(zo, flats: list, saved: list | None) -> None:
    """After DeepSpeed's load into bf16 master partitions: the saved masters split into high halves and
    remainders (fp32 files: exact; bf16 ones, as bf16_sr writes: remainder 0); saved None: loaded from the
    bf16 weights, remainder 0."""
    for i, flat in enumerate(flats):
        layout = zo.optimizer.partition_of(flat)
        if layout is None:
            continue
        if saved is None:
            layout.remainder.zero_()
            continue
        values = saved[i].reshape(-1)[:flat.numel()].float()
        check_finite(values, "checkpoint master")
        layout.write_master(flat, 0, values)


@functools.lru_cache(maxsize=None)
def _subclass(mixin: type, base: type) -> type:
    return type(f"Coat{base.__name__}", (mixin, base), {"__module__": __name__})


def mixin(zo) -> type:
    """This module's mixin for DeepSpeed's optimizer wrapper `zo` (coat.gradients "release" has release.mixin's)."""
    return {ZERO3: Zero3Step, ZERO12: Zero12Step}.get(zero_kind(zo), Bf16Step)


def replaces_grad_buffer(zo, gradients: str = GRADIENTS_DEFAULT, master: str | None = None) -> bool:
    """Whether install() replaces ZeRO-3's partition-sized gradient buffer by GradPartitions (so set-up need not
    build it): ZeRO-3 on the device, coat.gradients other than "partition_buffer", and a step of coat's to come
    (`master`, coat.master_weights, before bind: it installs one for release, a master other than fp32, or while
    ENABLED; None: installed already)."""
    ours = master is None or gradients == RELEASE or ENABLED or master != "fp32"
    return (ours and zero_kind(zo) == ZERO3 and gradients != PARTITION_BUFFER
            and not (zo.offload_optimizer or zo.offload_param))


def install(zo, cls: type, gradients: str = GRADIENTS_DEFAULT) -> None:
    """Give the ZeRO optimizer `zo` (stage 1, 2 or 3, or BF16_Optimizer) of a CoatAdamW engine the step of mixin
    `cls` (mixin(zo), or release.mixin(zo): a Zero12Step or Zero3Step), its reduced gradients kept as
    coat.gradients says (gradients.py)."""
    if not isinstance(zo, cls):
        zo.__class__ = _subclass(cls, type(zo))
    zo._coat_grads, zo._coat_scales, zo._coat_lp_written = {}, {}, set()
    zo._coat_per_parameter_grads = gradients == "per_parameter"
    if issubclass(cls, Zero3Step) and gradients != PARTITION_BUFFER:
        zo._coat_use_grad_partitions()
