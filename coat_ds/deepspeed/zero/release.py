"""`"coat": {"gradients": "release"}`: ZeRO-1/2/3 step each reduced gradient's slice of this rank's partition as
soon as it is reduced, then free it, so that no model-sized (nor partition-sized) gradient ever exists.

DeepSpeed reduces gradients bucket by bucket as backward goes, the same buckets in the same order on every rank:
ZeRO-1/2 in `reduce_ipg_grads`, ZeRO-3 by reduce-scattering each bucket and handing this rank's slices to
`partition_grads`. Right after, the stage's mixin (ReleaseStep: ZeRO-1/2, Release3Step: ZeRO-3) steps the pieces
of the bucket's parameters that lie in this rank's partition, reading each reduced gradient where it lies
(DeepSpeed's reduction buffer or reduce-scattered slice), writes their bf16 weights (ZeRO-1/2's bf16 partition,
ZeRO-3's `ds_tensor`s) and drops every gradient of the bucket. The step of a set of pieces is the partition step
(layout.ShardLayout.step) restricted to them: the same kernel, per tensor, on the same whole groups, inputs and
random bits, so with clipping off it is the per-partition step bit for bit. A group that a partition boundary cuts
belongs to one parameter, so its owners reach it in the same bucket and swap it there. engine.step() steps what no
gradient reached (with zeros, as DeepSpeed's zero-filled partition would) and does DeepSpeed's bookkeeping; then
ZeRO-1/2 all-gathers the weights, ZeRO-3 its persistent parameters (the others are gathered from their
`ds_tensor` as forward reaches them). ZeRO-3 keeps no gradient partition at all (NoGradPartitions).
ZeRO-1 without overlap_comm reduces only after backward (its full gradients live until then): release saves
the partition buffer there; ZeRO-2 and ZeRO-3 the gradients too.

Per bucket one scalar all-reduce adds the bucket's squared gradient norm to the step's running sum, a device tensor
(the global norm as it accumulates); nothing is read on the host until engine.step(), so the host queues backward
ahead of the device. The kernel's gradient scale is computed on the device from that sum:
- non-finite: the scale is NaN, which the step kernel takes as "change nothing" (kernels.adamw_step), so that
  bucket and every later one of the step are skipped (their gradients dropped); pieces stepped before stay stepped
  (their gradients were finite). engine.step() reads the sum once: the step counts as overflowed (DeepSpeed's
  `overflow`, skipped_steps, loss scale), CoatAdamW counts a skipped step and the step counts of partitions first
  reached at or after the bad bucket are rolled back. No inf/NaN reaches weights or states.
- clipping (`gradient_clipping` c > 0): the global norm is known only after backward, so a bucket's gradient is
  multiplied by 1 / max(1, (N_prev + 1e-6) / c, (N_sofar + 1e-6) / c): N_prev the previous step's global
  norm (DeepSpeed's formula with it; saved in checkpoints), N_sofar the norm of this step's gradients reduced
  so far, this bucket included (a lower bound of this step's norm, so a spike is clipped at once, at least as
  hard as its own size demands). Clipping off: DeepSpeed's own scale (1 / loss scale), exactly.

Refused (one line naming the key, `refusal`): gradient accumulation, Offload, fp16, fp32 gradient accumulation
dtypes, param groups without FP8 states, engines without DeepSpeed's ZeRO-1/2/3 optimizer.
"""
from __future__ import annotations

import bisect
import copy
import math
import warnings

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, OPTIMIZER_STEP_TIMER

from .gradients import refused as _refuse
from .kind import ZERO3, ZERO12, master_partitions, zero_kind
from .layout import FlatPieces, ShardLayout
from .partitions import hp_piece, zero3_slice
from .step import GradPartitions, Zero3Step, Zero12Step

SAVED_NORM = "coat_release_norm"  # ZeRO state_dict key: the global norm the next step's clipping uses


def refusal(zo) -> str | None:
    """Why the ZeRO optimizer `zo` of a CoatAdamW engine cannot release gradients (the engine-side check)."""
    kind = zero_kind(zo)
    if kind not in (ZERO12, ZERO3):
        return _refuse(f"needs DeepSpeed's ZeRO-1/2/3 optimizer (this engine has {type(zo).__name__})")
    offloaded = _offloaded(zo, kind)
    if offloaded:
        return _refuse(f"runs on the device, not under Offload (zero_optimization.{offloaded})")
    if zo.gradient_accumulation_steps > 1:
        return _refuse(f"steps as gradients are reduced: gradient_accumulation_steps must be 1 "
                       f"(it is {zo.gradient_accumulation_steps})")
    if zo.dtype != torch.bfloat16 or zo.torch_autocast_gradscaler or zo.zenflow:
        return _refuse(f"needs bf16 gradients (this engine's are {zo.dtype})")
    if _fp32_accumulation(zo, kind):
        return _refuse("needs bf16 gradients (data_types.grad_accum_dtype is fp32)")
    opt, to_group = zo.optimizer, getattr(zo, "sub_group_to_group_id", None)
    for i, master in enumerate(master_partitions(zo)):
        gi = i if to_group is None else to_group[i]
        if not opt.param_groups[gi]["fp8_state"] or opt.partition_of(master) is None:
            return _refuse(f"needs FP8 optimizer states in every param group (param_groups[{gi}] has fp8_state false)")
    return None


def _offloaded(zo, kind: str) -> str | None:
    """The zero_optimization key that offloads what release steps on the device, or None."""
    if kind == ZERO12:
        return "offload_optimizer" if zo.cpu_offload else None
    return "offload_optimizer" if zo.offload_optimizer else "offload_param" if zo.offload_param else None


def _fp32_accumulation(zo, kind: str) -> bool:
    """Whether ZeRO keeps the reduced gradients in fp32 (data_types.grad_accum_dtype)."""
    if kind == ZERO3:
        return zo.gradient_accumulation_dtype != torch.bfloat16
    return any(zo._use_compact_grad_partition_buffer(i) for i in range(len(zo.bit16_groups)))


class SlicePieces(FlatPieces):
    """Gradient slices of a flat partition by where they lie in it (gaps between them: not read)."""

    def __init__(self, slices: dict[int, torch.Tensor]) -> None:
        self.starts = sorted(slices)
        self.tensors = [slices[s].reshape(-1) for s in self.starts]
        self.numel = sum(t.numel() for t in self.tensors)


class SubLayouts:
    """ShardLayout.step restricted to the pieces of some parameters: the bodies, cut groups and random-bit keys
    of those parameters (cut groups renumbered from the global numbering, so identically on every rank)."""

    def __init__(self, layout: ShardLayout) -> None:
        self.layout = layout
        starts = [s.flat_start for s in layout.segments]
        self.body_owner = [layout.segments[bisect.bisect_right(starts, b[0]) - 1].name for b in layout.bodies]
        by_id = {cid: key for key, cid in layout.cut_index.items()}
        self.cut_owner = [by_id[c[0]][0] for c in layout.cuts]
        self._cache: dict[frozenset, ShardLayout] = {}

    def of(self, names: frozenset) -> ShardLayout:
        sub = self._cache.get(names)
        if sub is None:
            sub = self._cache[names] = self._build(names)
        return sub

    def _build(self, names: frozenset) -> ShardLayout:
        full = self.layout
        bodies = [k for k, o in enumerate(self.body_owner) if o in names]
        cuts = [k for k, o in enumerate(self.cut_owner) if o in names]
        keys = sorted(k for k in full.cut_index if k[0] in names)
        renumber = {full.cut_index[k]: n for n, k in enumerate(keys)}
        sub = copy.copy(full)
        sub.cut_index = {k: renumber[full.cut_index[k]] for k in keys}
        sub.bodies = [full.bodies[k] for k in bodies]
        sub.cuts = [(renumber[full.cuts[k][0]], *full.cuts[k][1:]) for k in cuts]
        sub.sr_keys = [full.sr_keys[k] for k in bodies] + [full.sr_keys[len(full.bodies) + k] for k in cuts]
        sub._views_key = None  # its own per-parameter views (_body_views)
        return sub


Slice = tuple  # (master partition index, flat start, gradient slice) of one parameter's piece on this rank


class Release:
    """Releasing at any ZeRO stage (module docstring): per bucket the norm, the clipping scale and the step of this
    rank's pieces, all on the device; at engine.step() what no gradient reached and DeepSpeed's bookkeeping. The
    stage's mixin says when buckets are reduced and where pieces lie: `_coat_index(p)`, the master partition holding
    p's piece, `_coat_target(i)`, (master, model partition to write or None, param group) of partition i, and
    `_coat_grad_scale`, DeepSpeed's own gradient scale (step.py)."""

    _coat_release_norm: float | None = None  # the previous step's global gradient norm (clipping)
    _coat_home = None  # states.HostStates under coat.states 'host' (ZeRO-3): the FP8 moments in host memory

    def _coat_ready(self) -> None:
        if "_coat_subs" not in vars(self):  # first use: the layouts are bound by now
            self._coat_subs = [SubLayouts(self.optimizer.partition_of(m)) for m in master_partitions(self)]
            self._coat_release_reset()

    def _coat_release_reset(self) -> None:
        self._coat_released: set[int] = set()  # param ids whose gradients were reduced (and dropped) this step
        # partitions whose step count advanced this step -> whether the sum was finite when they were first reached
        self._coat_begun: dict[int, torch.Tensor] = {}
        device = torch.device(get_accelerator().current_device_name())
        self._coat_sumsq = torch.zeros(1, dtype=torch.float32, device=device)  # this step's, so far (all ranks')

    def _coat_rest(self, groups: list) -> list:
        """The parameters of `groups` that no gradient reached this step (the same on every rank)."""
        return [p for group in groups for p in group if self.get_param_id(p) not in self._coat_released]

    @torch.no_grad()
    def _coat_release(self, params: list, *grads: list) -> None:
        """Step this rank's slices of `params` (the same list on every rank; `_coat_slice(p, *grads)` of each); once
        the step's sum is non-finite the kernel's scale is NaN and nothing changes. No host read."""
        if not params:
            return
        self._coat_ready()
        self._coat_released.update(self.get_param_id(p) for p in params)
        slices = [s for s in map(self._coat_slice, params, *grads) if s is not None]
        self._coat_add_bucket(slices)
        self._coat_step_pieces(params, slices, self._coat_release_scale())
        if self._coat_home is not None:  # coat.states 'host': sub-groups now complete go back to the host
            self._coat_home.done(params)

    def _coat_add_bucket(self, slices: list[Slice]) -> None:
        """Add the bucket's squared norm (all ranks') to this step's, on the device."""
        sumsq = torch.zeros_like(self._coat_sumsq)
        for _, _, g in slices:
            sumsq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        if dist.get_world_size(group=self.dp_process_group) > 1:
            dist.all_reduce(sumsq, group=self.dp_process_group)
        self._coat_sumsq += sumsq

    def _coat_step_pieces(self, params: list, slices: list[Slice], scale: torch.Tensor) -> None:
        opt, names = self.optimizer, {}
        for p in params:
            names.setdefault(self._coat_index(p), set()).add(self.param_names[p])
        flag = None  # the sum's finiteness after this bucket, made once where a partition is first reached
        for i in sorted(names):  # every rank: the partitions of the bucket's parameters, in order
            master, lp, group = self._coat_target(i)
            sub = self._coat_subs[i].of(frozenset(names[i]))
            mine = {start: g for gi, start, g in slices if gi == i}
            if not mine and not sub.cut_index:
                continue
            if self._coat_home is not None:
                self._coat_home.acquire(i)
            opt._init_state(master, group)
            if i not in self._coat_begun:  # counted now, rolled back at engine.step() if this bucket was skipped
                flag = self._coat_sumsq.isfinite() if flag is None else flag
                self._coat_begun[i] = flag
                opt.state[master]["step"] += 1
            step = int(opt.state[master]["step"].item())  # a host tensor (fp8_zeros): no device sync
            sub.step(opt, master, group, step, SlicePieces(mine), grad_scale=scale, lp_out=lp, finite=True)

    def _coat_release_scale(self) -> torch.Tensor:
        """What this bucket's gradient is multiplied by (module docstring), on the device: with clipping off
        DeepSpeed's own; NaN (the kernel changes nothing) once the step's sum is non-finite."""
        sumsq = self._coat_sumsq
        if self.clip_grad <= 0:
            scale = self._coat_grad_scale(None, sumsq.device)
        else:
            prev = self._coat_release_norm
            floor = 1.0 if prev is None else max(1.0, (prev + 1e-6) / self.clip_grad)
            clip = ((sumsq.sqrt() / self.loss_scale + 1e-6) / self.clip_grad).clamp(min=floor)
            scale = 1.0 / (clip * self.loss_scale)
        return torch.where(sumsq.isfinite(), scale, float("nan"))

    def _coat_step_end(self) -> None:
        """DeepSpeed's bookkeeping of a released step from the step's one host read (its squared norm): overflow,
        loss scale, this step's (unclipped) global norm."""
        sumsq = float(self._coat_sumsq)
        self.overflow = not math.isfinite(sumsq)
        if self.overflow:
            self._coat_overflowed()
        prev_scale = self.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            self._global_grad_norm = float("inf")
        else:
            self._global_grad_norm = math.sqrt(sumsq) / prev_scale
            self._coat_release_norm = self._global_grad_norm
        self._coat_release_reset()

    def _coat_overflowed(self) -> None:
        """A skipped step: the step counts of partitions first reached at or after the bad bucket rolled back (one
        read of their flags), the skip counted and warned."""
        begun = list(self._coat_begun.items())
        finite = torch.cat([f for _, f in begun]).tolist() if begun else []
        for (i, _), ok in zip(begun, finite):
            if not ok:
                self.optimizer.state[self._coat_target(i)[0]]["step"] -= 1
        self.optimizer.skipped_steps += 1
        warnings.warn("CoatAdamW: non-finite gradient on some rank (coat.gradients 'release'); the rest of "
                      "this step is skipped on every rank, pieces stepped before it stay stepped", RuntimeWarning)


class ReleaseStep(Release, Zero12Step):
    """Mixed into DeepSpeedZeroOptimizer (ZeRO-1/2) for coat.gradients 'release'; see the module docstring."""

    def copy_grads_in_partition(self, param, group_idx=None):
        """Nothing to copy: the bucket's pieces are stepped from DeepSpeed's reduction buffer before it is reused."""

    def reduce_ipg_grads(self, comm_dtype=None):
        dtypes = [comm_dtype] if comm_dtype is not None else list(self.ipg_buckets.keys())
        params = [self.bit16_groups[g][k] for d in dtypes for g, k, _ in self.ipg_buckets[d].params]
        super().reduce_ipg_grads(comm_dtype)
        if not self.overlap_comm or get_accelerator().current_stream() is None:  # None: no streams (CPU)
            self._coat_release_bucket(params)
            return
        # after the reduction, on ZeRO's reduction stream: backward goes on beside both, and the compute stream waits
        # for them where DeepSpeed's own overlap waits for a reduction, at the next bucket's (average_tensor), before
        # it refills this bucket's buffer. A gradient outside the buffer (a parameter larger than a bucket) was made
        # on the compute stream: recorded on this one, its memory is not handed on before the step has read it.
        stream = self.reduction_stream
        for p in params:
            if p.grad is not None:
                p.grad.record_stream(stream)
        with get_accelerator().stream(stream):
            self._coat_release_bucket(params)

    def get_all_grad_tensors(self, tensor_list, dtype):
        return []  # every gradient was stepped and dropped: nothing to gather (DeepSpeed would make zeros)

    def get_flat_partition(self, *args, **kw):
        return None

    def _coat_index(self, param) -> int:
        return self._get_param_group_idx(param)

    def _coat_target(self, i: int) -> tuple:
        master = self.single_partition_of_fp32_groups[i]
        lp = self.parallel_partitioned_bit16_groups[i][dist.get_rank(group=self.real_dp_process_group[i])]
        return master, None if master is lp else lp, self.optimizer.param_groups[i]

    def _coat_slice(self, param) -> Slice | None:
        """(group, flat start, gradient slice) of this rank's piece of param, or None."""
        if not self.is_param_in_current_partition[self.get_param_id(param)] or param.numel() == 0:
            return None
        grad = self.get_gradient_for_reduction(param)
        lp_start, flat_start, n = hp_piece(param)
        grad = torch.zeros(n, dtype=self.dtype, device=param.device) if grad is None else \
            grad.reshape(-1).narrow(0, lp_start, n)
        return self._get_param_group_idx(param), flat_start, grad

    def _coat_release_bucket(self, params: list) -> None:
        """Step this rank's pieces of `params`, then drop their gradients."""
        self._coat_release(params)
        for p in params:
            self.clear_grad_attribute(p)
            p.grad = None

    def step(self, closure=None):
        """The end of a released step: pieces no gradient reached step with zeros (as DeepSpeed's zero-filled
        partition would), then DeepSpeed's bookkeeping (norm, overflow, loss scale) and the all-gather."""
        self._coat_ready()
        self.micro_step_id = INITIAL_MICRO_STEP_ID
        self.timers(OPTIMIZER_STEP_TIMER).start()
        self._coat_release_bucket(self._coat_rest(self.bit16_groups))
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._coat_step_end()
        self._lazy_init_hp_params_optimizer_state()
        self._coat_gather_weights()  # pieces stepped before an overflow are gathered too

    def state_dict(self):
        sd = super().state_dict()
        sd[SAVED_NORM] = self._coat_release_norm
        return sd

    def _load_legacy_checkpoint(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False):
        super()._load_legacy_checkpoint(state_dict_list, load_optimizer_states, load_from_fp32_weights)
        saved = state_dict_list[dist.get_rank(group=self.dp_process_group) % len(state_dict_list)]
        self._coat_release_norm = saved.get(SAVED_NORM)


class NoGradPartitions(GradPartitions):
    """ZeRO-3's map of gradient partitions under release: always empty, each slice being stepped and dropped as its
    bucket is reduced (Release3Step.partition_grads). DeepSpeed's backward epilogue, which lists every parameter's
    partition for its step, reads a 0-element tensor."""

    def __missing__(self, ds_id: int) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)


class Release3Step(Release, Zero3Step):
    """Mixed into DeepSpeedZeroOptimizer_Stage3 for coat.gradients 'release'; see the module docstring."""

    _coat_grad_map = NoGradPartitions

    def partition_grads(self, params_to_release, grad_partitions):
        """Step this rank's slices of the bucket's parameters, reduce-scattered just now, and drop the gradients
        (DeepSpeed 0.19.8 copies the slices into the gradient partition for the step)."""
        self._coat_release(params_to_release, grad_partitions)
        for p in params_to_release:  # as DeepSpeed frees them: on ZeRO-3's reduction stream
            if p.grad is not None and not get_accelerator().is_synchronized_device():
                p.grad.record_stream(get_accelerator().current_stream())
            p.grad = None
        return []

    def _coat_index(self, param) -> int:
        return self.grad_position[self.get_param_id(param)][0]

    def _coat_target(self, i: int) -> tuple:
        master, lp = self.fp32_partitioned_groups_flat[i], self.fp16_partitioned_groups_flat[i]
        return master, None if master is lp else lp, self.optimizer.param_groups[self.sub_group_to_group_id[i]]

    def _coat_slice(self, param, grad: torch.Tensor | None = None) -> Slice | None:
        """(sub-group, flat start, gradient slice: zeros where None) of this rank's slice of param, or None."""
        _, n, _ = zero3_slice(param, dist.get_rank(group=self.dp_process_group))
        if n == 0:
            return None
        i, start, _ = self.grad_position[self.get_param_id(param)]
        grad = torch.zeros(n, dtype=self.gradient_accumulation_dtype, device=self.device) if grad is None else \
            grad.reshape(-1).narrow(0, 0, n)
        return i, start, grad

    def step(self, closure=None):
        """The end of a released step: slices no gradient reached step with zeros (as DeepSpeed's zero-filled
        partition would), DeepSpeed's bookkeeping, and its persistent parameters gathered again."""
        self._coat_ready()
        self._pre_step()
        self._partition_all_parameters()
        self.timers(OPTIMIZER_STEP_TIMER).start()
        self._coat_release(self._coat_rest(self.fp16_groups))
        if self._coat_home is not None:
            self._coat_home.flush()
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._coat_step_end()
        self.zero_grad(set_to_none=True)
        self.averaged_gradients = {}
        self._post_step({OPTIMIZER_STEP_TIMER})

    def _rigid_state_dict(self):
        if self._coat_home is not None:  # the host blocks hold the states once their copies back are done
            self._coat_home.sync()
        sd = super()._rigid_state_dict()
        sd[SAVED_NORM] = self._coat_release_norm
        return sd

    def _rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
        super()._rigid_load_state_dict(state_dict, load_optimizer_states)
        self._coat_release_norm = state_dict.get(SAVED_NORM)


def mixin(zo) -> type:
    """The mixin of `zo` for coat.gradients 'release' (bind() installs it), or a ValueError naming the key."""
    why = refusal(zo)
    if why is not None:
        raise ValueError(why)
    return Release3Step if zero_kind(zo) == ZERO3 else ReleaseStep
