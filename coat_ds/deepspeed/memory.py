"""What DeepSpeed keeps on each GPU for a job's model states, read from its JSON config alone (no engine built).

The DeepSpeed half of the planner (coat_ds/plan.py adds the activations and the loss). Bytes per GPU, for N
parameters over W data-parallel ranks, as DeepSpeed 0.19.8 allocates them (measured in benchmarks/results/
e2e*.json and offload.json; docs/plan.md has the derivation):
- the bf16 model copy: 2N (ZeRO-3: 2N/W plus the gathered parameters, up to stage3_max_live_parameters);
- the master: fp32 4N/W (ZeRO-1/2/3); none with coat's bf16 masters (the bf16 partition is the master);
- optimizer states: FusedAdam 8N/W, CoatAdamW its FP8 moments with their group scales (~2.1N/W);
- gradients: ZeRO-2/3 a partition of N/W in `data_types.grad_accum_dtype` (bf16 by default), allocated when
  the first bucket is reduced in backward and freed by the step; ZeRO-0/1 every parameter's bf16 .grad;
  CoatAdamW's ZeRO-3, and its ZeRO-1/2 with bf16 gradients (coat.gradients "per_parameter", zero/gradients.py),
  allocate each one as backward reaches its parameter, so they grow while the activations are freed; with
  "release", ZeRO-2 and ZeRO-3 step each bucket's gradients as they are reduced and keep none;
- DeepSpeed's own step for a stock optimizer flattens the gradient partition and converts it to fp32
  (+2 +4 B per partition value, stage_1_and_2.py step); CoatAdamW's ZeRO step (zero/step.py) reads the
  partition in place, one parameter's fp32 pieces at a time;
- Offload moves master, states and gradient partition to the host, beside DeepSpeed's bf16 staging copy of the
  partition (none with a bf16 master: the master is that copy) and a bf16 gradient buffer of the largest tensor;
- coat.states "host" (ZeRO-3 with gradients released) keeps CoatAdamW's FP8 moments in pinned host memory at
  their exact size and streams them to the GPU one ZeRO-3 sub-group at a time: the GPU holds STATE_WINDOWS
  sub-groups' states (the largest sub-group of stage3.py's _create_fp16_sub_groups, largest_sub_group).
- a resume (engine.load_checkpoint at the same world size) adds to the host what it reads at once: for CoatAdamW
  one tensor of a memory-mapped file at a time (checkpoint/load.py), for any other optimizer DeepSpeed's
  torch.load of the rank's whole optimizer file (resume_host).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .optimizer_type import NAME
from .zero.gradients import DEFAULT as GRADIENTS_DEFAULT, PARTITION_BUFFER
from .zero.states import WINDOWS as STATE_WINDOWS   # sub-groups whose streamed states the GPU holds at once

ADAM_STATE_BYTES = 8.0                   # fp32 exp_avg + exp_avg_sq
# coat.master_weights -> device bytes per partition value beyond the bf16 model copy (zero/master.py says why)
MASTER_BYTES = {"fp32": 4, "bf16_sr": 0, "bf16_rn": 0, "fp32_remainder": 2}
DEFAULT_BUCKET = 500_000_000             # DeepSpeed's reduce_bucket_size / allgather_bucket_size default
DEFAULT_SUB_GROUP = 1_000_000_000        # ZeRO-3's sub_group_size default
DEFAULT_MAX_LIVE = 1_000_000_000         # ZeRO-3's stage3_max_live_parameters default
HOST_STATES = "host"                     # coat.states: CoatAdamW's moments in pinned host memory (ZeRO-3, release)


@dataclass(frozen=True)
class ZeroJob:
    """The parts of a DeepSpeed config that decide model-state memory, for `world` data-parallel ranks."""
    stage: int
    world: int
    offload: bool            # offload_optimizer to cpu/nvme: master, states, gradient partition on the host
    coat: bool               # the optimizer is CoatAdamW
    state_bytes: float       # optimizer state bytes per parameter
    master: str              # coat.master_weights ("fp32" for any other optimizer)
    param_bytes: int         # 2 (bf16/fp16) or 4 (fp32 training)
    grad_bytes: int          # bytes per gradient-partition value
    reduce_bucket: int       # values in the gradient bucket (contiguous gradients)
    sub_group: int = DEFAULT_SUB_GROUP   # ZeRO-3 steps its partition in sub-groups of this many values
    max_live: int = DEFAULT_MAX_LIVE     # ZeRO-3 keeps up to this many gathered parameter values alive
    coat_step: bool = True   # CoatAdamW's own ZeRO step (False: DeepSpeed's flatten + fp32 copy, as before it)
    gradients: str = PARTITION_BUFFER   # coat.gradients where it applies (zero/gradients.py), else DeepSpeed's buffer
    host_states: bool = False  # coat.states "host": CoatAdamW's states on the host, streamed per sub-group

    @property
    def grads_per_parameter(self) -> bool:
        """Gradients allocated as backward goes (per parameter), or stepped and dropped per bucket (release)."""
        return self.gradients != PARTITION_BUFFER

    @property
    def mixed(self) -> bool:
        return self.param_bytes == 2


def zero_job(cfg: Mapping[str, Any], world: int, state_bytes: float, master: str,
             gradients: str = GRADIENTS_DEFAULT, states: str | None = None) -> ZeroJob:
    """ZeroJob of DeepSpeed config `cfg` (a dict), `state_bytes` per parameter for CoatAdamW's states, its
    coat.master_weights, coat.gradients and coat.states."""
    zero = cfg.get("zero_optimization") or {}
    zero = zero if isinstance(zero, Mapping) else {"stage": 1 if zero else 0}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    coat = (cfg.get("optimizer") or {}).get("type") == NAME
    fp32_states = coat and (cfg["optimizer"].get("params") or {}).get("fp8_state") is False
    mixed = any((cfg.get(k) or {}).get("enabled") is True for k in ("bf16", "fp16"))
    grad_dtype = (cfg.get("data_types") or {}).get("grad_accum_dtype")
    stage, grad_bytes = int(zero.get("stage", 0)), 4 if grad_dtype == "fp32" or not mixed else 2
    return ZeroJob(stage=stage, world=world, offload=offload, coat=coat,
                   state_bytes=ADAM_STATE_BYTES if not coat or fp32_states else state_bytes,
                   master=master if coat else "fp32", param_bytes=2 if mixed else 4,
                   grad_bytes=grad_bytes,
                   gradients=gradients if coat and not offload and (stage == 3 or stage in (1, 2) and mixed
                                                                    and grad_bytes == 2) else PARTITION_BUFFER,
                   reduce_bucket=_int(zero.get("reduce_bucket_size"), DEFAULT_BUCKET),
                   sub_group=_int(zero.get("sub_group_size"), DEFAULT_SUB_GROUP),
                   max_live=_int(zero.get("stage3_max_live_parameters"), DEFAULT_MAX_LIVE),
                   host_states=coat and states == HOST_STATES)


def _int(value: Any, default: int) -> int:
    """A size from the config; HF's "auto" (or nothing) is DeepSpeed's default."""
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def largest_sub_group(tensors: Iterable[int], world: int, sub_group: int) -> int:
    """Per-rank values of ZeRO-3's largest optimizer sub-group (DeepSpeed 0.19.8 stage3.py _create_fp16_sub_groups):
    parameters in model order, each contributing its partition ceil(numel / world), close a sub-group once it
    reaches `sub_group` values; one group if the whole partition is no larger."""
    sizes = [-(-t // world) for t in tensors]
    if sub_group >= sum(sizes):
        return sum(sizes)
    largest = running = 0
    for size in sizes:
        running += size
        if running >= sub_group:
            largest, running = max(largest, running), 0
    return max(largest, running)


def model_states(job: ZeroJob, n: int, layer_params: int, largest: int, sub_group: int = 0) -> dict[str, float]:
    """Bytes per GPU: `weights` (the model copy; ZeRO-3: its partition and `gathered`, what the layers at work
    gather), `master`, `optimizer`, `gradients` (when allocated), and `host` (per rank, under Offload or coat.states
    "host"). `layer_params`: one decoder layer's, `largest`: the largest tensor's, `sub_group`: the largest ZeRO-3
    sub-group's values per rank (largest_sub_group)."""
    part = n / job.world if job.stage >= 1 else n
    # ZeRO-3: the partition plus what is gathered: the layers at work, or as many values as stay alive (gathered
    # parameters reused within stage3_max_reuse_distance are kept, up to max_live: a 1.1B model stays whole). At
    # world 1 nothing: DeepSpeed 0.19.8 points a parameter at its partition, the whole tensor (NoGatherHandle)
    gathered = job.param_bytes * max(2 * layer_params + largest, min(n, job.max_live)) \
        if job.stage == 3 and job.world > 1 else 0.0
    weights = job.param_bytes * n / job.world + gathered if job.stage == 3 else job.param_bytes * n
    master = MASTER_BYTES[job.master] * part if job.mixed else 0.0
    grads = job.grad_bytes * part if job.stage >= 2 else 2.0 * n if job.mixed else 4.0 * n
    if job.gradients == "release" and job.stage >= 2:  # stepped per bucket: none outlives its bucket
        grads = 0.0
    optimizer = job.state_bytes * part
    if job.offload:   # the host keeps master and gradient partition in fp32, or both in bf16 with a bf16 master,
        # the bf16 copy of the partition it stages to the GPU (a bf16 master is that copy) and a bf16 gradient
        # buffer of the largest tensor
        bf16_master = MASTER_BYTES[job.master] == 0
        host = (4.0 if bf16_master else 10.0) * part + 2.0 * largest + optimizer
        return dict(weights=weights, master=0.0, optimizer=0.0, gradients=0.0, host=host, gathered=gathered)
    if job.host_states:  # the moments at their exact size on the host, STATE_WINDOWS sub-groups' of them on the GPU
        return dict(weights=weights, master=master, optimizer=STATE_WINDOWS * job.state_bytes * sub_group,
                    gradients=grads, host=optimizer, gathered=gathered)
    return dict(weights=weights, master=master, optimizer=optimizer, gradients=grads, host=0.0, gathered=gathered)


def resume_host(job: ZeroJob, n: float, host: float, sub_group: int = 0) -> float:
    """Host bytes per rank while engine.load_checkpoint resumes at the same world size: `host` (what the rank keeps
    there: Offload, coat.states "host") plus what the load holds at once. CoatAdamW's (checkpoint/load.py) maps each
    file and copies one tensor at a time into place: the largest is a ZeRO-3 sub-group's saved master
    (`sub_group`: largest_sub_group's values) or a ZeRO-1/2 partition's, or, read before the optimizer, the model
    file's weights (ZeRO-0/1/2: DeepSpeed copies the module's state dict whole). A bf16 master is saved in bf16,
    any other in fp32. Another optimizer's load is DeepSpeed's: the rank's whole optimizer file (master and states),
    read into memory."""
    part = n / job.world if job.stage >= 1 else n
    master = 2 if job.coat and job.mixed and MASTER_BYTES[job.master] == 0 else 4
    module = job.param_bytes * n if job.stage < 3 else 0.0
    if job.stage == 0:  # the optimizer is in the model file, read (or mapped) whole with the weights
        return host + module + (master + job.state_bytes) * part
    if not job.coat:
        return host + max(module, (master + job.state_bytes) * part)
    return host + max(module, master * (sub_group if job.stage == 3 else part))


def setup_bytes(job: ZeroJob, n: int) -> float:
    """What deepspeed.initialize holds at once on a GPU (DeepSpeed 0.19.8's ZeRO-1/2 optimizer, N parameters of
    param_bytes each over W ranks): the flat copy of the weights (the module's weights point into it) with the
    master partition and the zero gradient initialize_optimizer_states gives it, N x param_bytes + 2 x N/W x the
    master's bytes a value (bf16 for a CoatAdamW master that is not "fp32", built so from set-up; else fp32; under
    Offload both are on the host). 8B with a bf16 master on one GPU: 6N, 44.87 GiB, where long_context.json's
    131,072-token rows peaked. Flattening first holds the module's weights beside the flat copy (4N), on the GPU only
    where that much is free (else on the host): below this for one rank that keeps its master on the GPU, and never
    what decides a fit. ZeRO-3 and stage 0: not modeled (0)."""
    if job.stage not in (1, 2):
        return 0.0
    master = 2 if job.coat and job.master != "fp32" else 4
    return job.param_bytes * n + (0.0 if job.offload else 2.0 * master * n / job.world)


def buffers(job: ZeroJob) -> float:
    """DeepSpeed's gradient bucket (contiguous gradients), alive through backward."""
    return float(job.reduce_bucket * job.grad_bytes) if job.stage >= 1 else 0.0


def step_transient(job: ZeroJob, n: int, largest: int) -> float:
    """What the optimizer step adds on the GPU above the model states and gradients. Under coat.gradients
    "release" the buckets were stepped in backward, one piece at a time from bf16 (no fp32 copy: none shows in
    the 70B-wide allocator traces, memory_trace_*.json), and engine.step() is left the pieces no gradient reached."""
    if job.offload or (job.gradients == "release" and job.stage >= 1):
        return 0.0
    part = n / job.world if job.stage >= 1 else n
    if job.coat and job.coat_step and job.stage >= 1:
        return 8.0 * min(largest, part)            # one parameter's fp32 gradient and update at a time
    if job.stage in (1, 2) and job.grad_bytes == 2:
        return 6.0 * part                           # the flat bf16 partition and its fp32 copy
    if job.stage == 3:
        return 4.0 * min(job.sub_group, part)       # each sub-group's gradient in fp32
    return 0.0
