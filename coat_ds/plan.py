"""`python -m coat_ds.plan`: will a training job fit on its GPUs, and at what micro-batch?

    python -m coat_ds.plan --model llama3-8b --seq 4096 --micro-batch max --config ds_configs/zero2_coat.json
    python -m coat_ds.plan --model path/to/config.json --gpus-per-node 8 --nodes 2 --zero-stage 3 --gpu-memory h100

Prints, per GPU, what the job keeps at its peak (parameters, gradients, master weights, optimizer states,
activations, logits/loss, DeepSpeed's buffers), the host memory per rank and per node where states live there
(Offload, coat.states "host"), and the largest micro-batch that fits, beside BF16 + FusedAdam on the same ZeRO
set-up; under it, which shipped presets fit the job, without and with activation checkpointing (--checkpoint
plans HF's gradient_checkpointing). DeepSpeed's own estimators count model states only; here the activations come from
what each flow keeps per token and hidden unit (docs/activation.md's accounting, which
benchmarks/results/llama_layer.json measured) and the peak from the phases of a step (docs/plan.md), checked
against every end-to-end row in benchmarks/results/ (tests/test_plan.py).

Plain arithmetic on the JSON config and the model's shape: nothing is built, no GPU is needed. DeepSpeed's
part (ZeRO partitioning, buckets, its step) is coat_ds/deepspeed/memory.py, the model's shape coat_ds/plan_shape.py,
a mixture of experts' experts and router coat_ds/plan_moe.py, checkpoint stores, tiles and Ulysses coat_ds/plan_long.py.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from .activation.loss import DEFAULT_CHUNK_TOKENS, LossConfig, by_tokens, slice_rows
from .deepspeed.config import coat_section
from .deepspeed.memory import (HOST_STATES, ZeroJob, buffers, largest_sub_group, model_states, resume_host,
                               setup_bytes, step_transient, zero_job)
from .deepspeed.presets import INTENTS
from .formats import Fp8Moment
from .hf.loss import EXACT_MODEL_TYPES
from .plan_long import (CHECKPOINT_INPUT, RECOMPUTE_NOTE, STOCK_NORM_BACKWARD, STOCK_NORM_SAVES,  # noqa: F401
                        TILED_MLP_INPUT, check_sp, checkpoint_gpu, checkpoint_host, checkpoint_kept, follows_moments,
                        largest, layer_moments, longest_line, recomputed_layer, reduces_from_input, shard_tokens,
                        sp_title, step_inputs, tile_bytes, tiled, tiles_final_norm, ulysses_kept,
                        where_note)  # CHECKPOINT_INPUT: the API
from .plan_shape import PlanError, Shape, resolve_shape, shape_from_hf  # noqa: F401 (shape_from_hf: the API)

GIB = 2 ** 30
GPUS = {"h100": 79.18, "h200": 139.8, "a100-80": 79.15, "a100-40": 39.39}   # GiB torch reports as total
USABLE = 0.95   # of GPU memory for what the allocator reserves (benchmarks/e2e.py's fit rule)
# the allocator reserves above the allocated peak ~2 GiB plus 6-24% of the activations and logits (its blocks
# of freed activations) in benchmarks/results/e2e*.json; a fit needs peak + this reserve <= USABLE x memory
RESERVE_FIXED, RESERVE_ACT = 2 * 2 ** 30, 0.10
FINAL_NORM = STOCK_NORM_SAVES + 2   # B/token/hidden: the stock final RMSNorm's saves, lm_head's input
FINAL_NORM_TILED = 4.0   # over tiles (tile_tokens, hf/final_norm.py): its bf16 input, lm_head's input
CHECKPOINT_FLAG = {"config": None, "on": True, "off": False}   # --checkpoint
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ what the forward keeps and the loss adds
def layer_bytes(shape: Shape, activation: Any, sparse: bool | None = None) -> float:
    """Bytes per token per hidden unit one decoder layer keeps for backward (docs/activation.md's table):
    `activation` is coat's ActivationConfig, or None for the stock bf16 layer (SDPA attention); `sparse`: a layer
    with routed experts (plan_moe) in place of the dense MLP (None: where the model has experts)."""
    h, g = shape.hidden, (activation.group_size if activation else 16)
    q_kv = shape.hd * (shape.heads + 2 * shape.kv_heads) / h        # q, k, v widths over hidden
    out = shape.hd * shape.heads / h                                 # attention output width over hidden
    i = shape.intermediate / h
    full = activation is not None and activation.enabled and activation.mode == "full"
    linear = activation is not None and activation.enabled and activation.mode == "linear"
    qk = shape.hd * (shape.heads + shape.kv_heads) / h * shape.qk_norm  # per-head q/k norm inputs over hidden
    if full:   # FP8 norm inputs with 1/g exponents + fp32 rstd; gate/up FP8 with 1/g exponents; tiled: the MLP's
        # bf16 input alone (TiledMlpFn: its norm and FP8 operands are recomputed)
        tile = tiled(activation) and (shape.experts is None or sparse is False)   # routed experts run untiled
        norms = (shape.norms - tile) * (1 + 1 / g + 4 / h) + qk * (1 + 1 / g + 4 / shape.hd)
        mlp = TILED_MLP_INPUT if tile else 2 * i * (1 + 1 / g)
    else:      # the stock RMSNorm keeps its fp32 input and its normed output (bf16; fp32 where the family multiplies
        # by its weight in fp32, Gemma 3); a norm before q/k/v or gate/up also the linear's input (FP8: 1 B); the
        # others (q/k norms before RoPE, Gemma's post-norms before the residual add) nothing more
        kept = 8 if shape.fp32_norms else 6
        norms, mlp = 2 * (kept + (1 if linear else 2)) + (shape.norms - 2 + qk) * kept, (7 if linear else 8) * i
    if activation is not None and activation.enabled and activation.attention_fp8:
        attention = q_kv * (1 + 1 / g)                               # E4M3 q, k, v + scales; output recomputed
    else:      # bf16 q, k, v and output, fp32 log-sum-exp per head; FP8 linears add o_proj's FP8 input
        attention = 2 * q_kv + 2 * out + 4 * shape.heads / h + (out if linear else 0)
    if shape.experts is not None and sparse is not False:
        mlp = shape.experts.saved_bytes(h, activation)
    return norms + attention + mlp


def loss_bytes(tokens: int, shape: Shape, chunk: int | None, walks_tokens: bool = True) -> dict[str, float]:
    """What the loss adds, by phase: `forward` (the logits at their largest), `backward` (the loss's own
    backward, besides lm_head's bf16 weight gradient it returns: plan.phases counts that under "buffers"),
    `first_grad` (what is still alive when the first gradient bucket is reduced). Stock (`chunk` None): bf16
    logits, an fp32 copy and the fp32 log-softmax kept for backward, whose backward makes two more fp32 tensors of
    the logits' size and then a bf16 gradient. Chunked (activation/loss.py): forward `chunk` tokens of bf16 logits
    at a time (the CUDA kernels make no fp32 copy) and per token its saves (fp32 log-sum-exp, int64 target, bool
    kept: 13 B); backward, up to as many tokens as the vocabulary has entries, vocabulary slices (tokens x
    loss.slice_rows bf16 logits) beside the fp32 gradient of the hidden states and one fp32 product of its size;
    past that (`walks_tokens`: ea247a3, loss.by_tokens), chunks of tokens, beside the bf16 gradient of the hidden
    states and the weight gradient summed in fp32 (4 B a weight), the chunk's logits freed before that sum is
    rounded to the bf16 gradient."""
    v, h = shape.vocab, shape.hidden
    if chunk is None:
        return dict(forward=10.0 * v * tokens, backward=12.0 * v * tokens, first_grad=2.0 * v * tokens)
    saves = 13.0 * tokens
    forward = 2.0 * v * min(chunk, tokens) + saves
    if walks_tokens and by_tokens(tokens, v):
        backward = 2.0 * tokens * h + 4.0 * v * h + max(2.0 * v * min(chunk, tokens) - 2.0 * v * h, 0.0)
    else:
        backward = 2.0 * tokens * slice_rows(chunk, v, tokens) + 8.0 * tokens * h
    return dict(forward=forward, backward=backward + saves, first_grad=2.0 * tokens * h)


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Job:
    """A training job per GPU: its model, sequence, ZeRO set-up, activation flow and loss."""
    shape: Shape
    seq: int
    zero: ZeroJob
    activation: Any = None          # ActivationConfig or None (stock layers)
    chunk: int | None = None        # coat.loss chunk tokens, None: the stock loss
    weight_cache: bool = False      # the FP8 weight cache (2 B per decoder-layer parameter)
    checkpoint: bool = False        # activation checkpointing of the decoder layers (HF's or coat's)
    sp: int = 1                     # Ulysses sequence-parallel ranks a sample's tokens are split over (plan_long)


@dataclass(frozen=True)
class Plan:
    micro_batch: int
    parts: dict          # name -> bytes per GPU at the peak
    peak: float
    phase: str
    host: float          # per rank, under Offload or coat.states "host"
    resume: float = 0.0  # host bytes per rank while a checkpoint is resumed (memory.resume_host)
    setup: float = 0.0   # what deepspeed.initialize holds at once (memory.setup_bytes), before any step

    @property
    def highest(self) -> float:
        """The most the GPU holds from set-up on: the step's peak or set-up's (what max_memory_allocated reads
        without a reset after deepspeed.initialize)."""
        return max(self.peak, self.setup)

    @property
    def reserve(self) -> float:
        """What the allocator is expected to reserve above the allocated peak (RESERVE_*)."""
        return RESERVE_FIXED + RESERVE_ACT * (self.parts.get("activations", 0.0) + self.parts.get("logits/loss", 0.0))

    def fits(self, memory: float) -> bool:
        """The step's peak with the allocator's reserve, and set-up (few, large blocks: no reserve), within USABLE."""
        return self.peak + self.reserve <= USABLE * memory and self.setup <= USABLE * memory


def activation_bytes(job: Job, tokens: int) -> float:
    """Where the step is not followed moment by moment (plan_long.follows_moments), what the forward keeps for
    backward on one GPU, counted in every phase: every layer's activations, or under activation checkpointing
    every layer's kept input (plan_long.checkpoint_gpu: by checkpoint_store) plus one layer's activations while
    backward recomputes it (less what attention's query tiles save: plan_long.recomputed_layer), and one MLP tile's
    (plan_long.tile_bytes); and the final norm's. `tokens`: the GPU's (its shard under Ulysses: plan_long.ulysses_*)."""
    s, sp, act = job.shape, job.sp, job.activation
    final_norm = FINAL_NORM_TILED if tiles_final_norm(act) else FINAL_NORM
    kinds = [(n, layer_bytes(s, act, sparse) + ulysses_kept(s, act, sp)) for n, sparse in
             ((s.layers - s.sparse_layers, False), (s.sparse_layers, True)) if n]
    if not job.checkpoint:
        return tokens * s.hidden * (sum(n * b for n, b in kinds) + final_norm)
    layers = checkpoint_gpu(s.layers, act) + recomputed_layer(s, act, max(b for _, b in kinds), sp)
    return tokens * s.hidden * (layers + final_norm) + tile_bytes(s.intermediate, act, tokens)


def states_of(job: Job) -> dict[str, float]:
    """model_states of the job's shape, with its largest ZeRO-3 sub-group (the states streamed under coat.states)."""
    s, z = job.shape, job.zero
    sub_group = largest_sub_group(s.tensors(), z.world, z.sub_group) if z.host_states else 0
    return model_states(z, s.params, s.layer_params, s.largest, sub_group)


def phases(job: Job, micro_batch: int) -> dict[str, dict[str, float]]:
    """Per phase of a step, what is allocated on one GPU, by part (bytes): the long-context flow moment by moment
    (plan_long.follows_moments: moment_phases), any other with one layer's activations in every phase."""
    s, t = job.shape, shard_tokens(job, micro_batch)
    st = states_of(job)
    cache = 2.0 * s.cached_params if job.weight_cache else 0.0
    states = dict(parameters=st["weights"] + cache, master=st["master"], optimizer=st["optimizer"])
    # the chunked loss's backward walks token chunks past the vocabulary's size (ea247a3); a row measured before
    # says loss_walks_tokens = False on its activation config (tests/test_plan.py)
    loss = loss_bytes(t, s, job.chunk, getattr(job.activation, "loss_walks_tokens", True))
    head = job.zero.param_bytes * s.vocab * s.hidden   # lm_head's weight (and its gradient's bytes)
    # ZeRO-3 gathers the decoder layers for their forward and backward: at the loss's backward only lm_head is
    # gathered (6 MoE layers measured 2.6 GiB under a plan with two layers gathered there, the slope exact).
    # The gradient partition, from the first bucket (per-parameter gradients grow as the activations are freed)
    in_backward = job.zero.stage >= 2 and not job.zero.offload and not job.zero.grads_per_parameter
    at_loss = dict(states, parameters=states["parameters"] - st["gathered"] + (head if st["gathered"] else 0))
    step = {"optimizer step": dict(states, gradients=st["gradients"],
                                   buffers=step_transient(job.zero, s.params, s.largest))}
    if follows_moments(s, job.activation, job.checkpoint):
        return moment_phases(job, t, states, at_loss, loss, head, st["gradients"], in_backward) | step
    acts = activation_bytes(job, t)
    experts = s.experts.backward_bytes(s.hidden, job.activation, t) if s.experts and s.sparse_layers else 0.0
    return {
        "forward": dict(states, activations=acts, **{"logits/loss": loss["forward"]}),
        "loss backward": dict(at_loss, activations=acts, **{"logits/loss": loss["backward"]},
                              buffers=head if job.chunk else 0.0),
        "first gradient bucket": dict(states, activations=acts, **{"logits/loss": loss["first_grad"]},
                                      gradients=st["gradients"] if in_backward else 0.0,
                                      buffers=head + buffers(job.zero) + experts),
    } | step


def moment_phases(job: Job, tokens: int, states: dict, at_loss: dict, loss: dict, head: float, gradients: float,
                  in_backward: bool) -> dict[str, dict[str, float]]:
    """The long-context flow's step moment by moment (docs/plan.md, "Long context"): a layer's forward (its
    attention, its MLP's tiles), the loss's forward and backward, the final norm's backward (lm_head's gradient
    reduced as the norm's weight gradient reaches the bucket: the first bucket), and the last layer's backward
    (plan_long.layer_moments: its recompute, MLP, attention and q/k/v projection), each holding the checkpoints
    (plan_long.checkpoint_kept) and the step's inputs (plan_long.step_inputs). `at_loss`: the states with ZeRO-3's
    gathered layers replaced by lm_head; `gradients`: the partition where any is kept through backward."""
    s, act = job.shape, job.activation
    th, base = tokens * s.hidden, step_inputs(s) + checkpoint_kept(s.layers, act, "loss")
    tiled_norm = tiles_final_norm(act) and tokens > act.tile_tokens   # one tile runs the stock module
    norm = FINAL_NORM_TILED if tiled_norm else FINAL_NORM             # its saves and lm_head's input
    if tiled_norm:   # TiledRowsFn's backward: its bf16 input, dout, dx; one tile of the stock norm's forward (its
        # output) and backward; lm_head's gradient, reduced once the norm's weight gradient (summed at the end) comes
        rows = min(act.tile_tokens, tokens) * s.hidden
        final = dict(activations=th * (base + 2 + 2 + 2) + rows * (2 + STOCK_NORM_SAVES + STOCK_NORM_BACKWARD),
                     buffers=head + buffers(job.zero))
    else:            # the stock norm's backward peaks after its weight gradient (its first node) reduced lm_head's
        final = dict(activations=th * (base + STOCK_NORM_SAVES + STOCK_NORM_BACKWARD), buffers=buffers(job.zero))
    out = {
        "loss forward": dict(states, activations=th * (base + norm), **{"logits/loss": loss["forward"]}),
        "loss backward": dict(at_loss, activations=th * (base + norm), **{"logits/loss": loss["backward"]},
                              buffers=head if job.chunk else 0.0),
        "final norm backward": dict(at_loss, **final, gradients=gradients if in_backward else 0.0),
    }
    kept = layer_bytes(s, act) + ulysses_kept(s, act, job.sp)
    leaf_hook = job.zero.stage == 3 and not reduces_from_input(act)   # coat's layers are ZeRO-3 leaf modules
    for name, (per_token, fixed) in layer_moments(s, act, kept, s.layers, tokens, job.seq, job.sp,
                                                  leaf_hook).items():
        during = {} if name.startswith("forward") else dict(gradients=gradients, buffers=buffers(job.zero))
        out[name] = dict(states, activations=th * per_token + fixed, **during)
    return out


def plan(job: Job, micro_batch: int) -> Plan:
    """What one GPU holds at its peak with `micro_batch` samples of job.seq tokens (job.sp GPUs share each sample)."""
    by_phase = phases(job, micro_batch)
    phase = max(by_phase, key=lambda p: sum(by_phase[p].values()))
    host = states_of(job)["host"] + shard_tokens(job, micro_batch) * job.shape.hidden * checkpoint_host(  # host_fp8's
        job.shape.layers * job.checkpoint, job.activation)
    return Plan(micro_batch, by_phase[phase], sum(by_phase[phase].values()), phase, host, resume_of(job, host),
                setup_bytes(job.zero, job.shape.params))


def resume_of(job: Job, host: float) -> float:
    """Host bytes per rank while the job resumes from a checkpoint (ZeRO-3: its largest sub-group's master at once)."""
    s, z = job.shape, job.zero
    sub_group = largest_sub_group(s.tensors(), z.world, z.sub_group) if z.stage == 3 else 0
    return resume_host(z, s.params, host, sub_group)


def max_micro_batch(job: Job, memory: float, cap: int = 1 << 16) -> int:
    """The largest micro-batch that fits a GPU of `memory` bytes (0: not even 1); the peak grows with it."""
    return largest(lambda mb: plan(job, mb).fits(memory), cap)


def longest_seq(job: Job, memory: float) -> int:
    """The longest sequence that fits a GPU of `memory` bytes at micro-batch 1 (0: none), a multiple of job.sp."""
    return job.sp * largest(lambda n: plan(replace(job, seq=n * job.sp), 1).fits(memory))


def fewest_gpus(cfg: Mapping[str, Any], model: str, seq: int, memory: float, most: int = 64) -> int | None:
    """The fewest data-parallel GPUs (powers of two up to `most`) on which config `cfg` trains `model` at
    micro-batch 1; None if even `most` do not suffice."""
    shape = resolve_shape(model)
    world = 1
    while world <= most:
        if max_micro_batch(job_from_config(cfg, shape, seq, world), memory) >= 1:
            return world
        world *= 2
    return None


# ------------------------------------------------------------------ from a DeepSpeed config
def coat_state_bytes(cfg: Mapping[str, Any]) -> float:
    """CoatAdamW's state bytes per parameter for the config's group_size and v_format: m and v as the
    optimizer allocates them (formats.Fp8Moment: codes + per-group scale and exponent)."""
    params = (cfg.get("optimizer") or {}).get("params") or {}
    g = int(params.get("group_size", 128))
    n = g * 64
    moments = [Fp8Moment.zeros(n, fmt, g) for fmt in ("e4m3", params.get("v_format", "e4m3"))]
    return sum(t.numel() * t.element_size() for m in moments for t in m.tensors) / n


def loss_chunk(cfg: Mapping[str, Any]) -> int | None:
    """coat.loss: chunk tokens where a coat section computes the chunked loss (its default), None: stock."""
    coat = cfg.get("coat")
    if not isinstance(coat, Mapping):
        return None
    try:
        loss = LossConfig.from_dict(coat.get("loss"))
    except ValueError as e:
        raise PlanError(str(e)) from None
    return loss.chunk_tokens if loss.chunked else None


def states_place(cfg: Mapping[str, Any]) -> Any:
    """coat.states as the config gives it, None where it gives none (job_from_config checks the value through
    coat_section; the planner plans "host")."""
    coat = cfg.get("coat")
    return coat.get("states") if isinstance(coat, Mapping) else None


def _check_host_states(zero: ZeroJob) -> None:
    """coat.states "host" streams CoatAdamW's states per ZeRO-3 sub-group as released gradients are stepped."""
    if not (zero.coat and zero.stage == 3 and zero.gradients == "release" and not zero.offload):
        raise PlanError(f"coat.states={HOST_STATES!r} is planned for CoatAdamW under ZeRO-3 with coat.gradients "
                        f"'release' and no offload_optimizer (here: ZeRO-{zero.stage}, coat.gradients "
                        f"{zero.gradients!r}, offload {zero.offload}); allowed elsewhere: no coat.states")


def job_from_config(cfg: Mapping[str, Any], shape: Shape, seq: int, world: int, *, chunk: Any = "config",
                    coat_step: bool = True, checkpoint: bool | None = None, sp: int = 1) -> Job:
    """The Job of DeepSpeed config `cfg` (a dict) for `world` ranks (`sp` sharing a sample). `chunk`: "config" (what
    the config says), None (stock loss) or chunk tokens; `checkpoint`: activation checkpointing (None: the
    config's coat.activation.checkpoint; True also for HF's gradient_checkpointing, which the config cannot say)."""
    try:
        section = coat_section({k: v for k, v in cfg.items() if k != "coat"} |
                               {"coat": {k: v for k, v in (cfg.get("coat") or {}).items() if k != "loss"}})
    except ValueError as e:
        raise PlanError(str(e)) from None
    act = section.activation if section.activation is not None and section.activation.enabled else None
    cache = act is not None and act.resolve(cfg.get("gradient_accumulation_steps", 1)).cache_enabled
    zero = replace(zero_job(cfg, world, coat_state_bytes(cfg), section.master_weights, section.gradients,
                            states_place(cfg)), coat_step=coat_step)
    if states_place(cfg) == HOST_STATES:
        _check_host_states(zero)
    chunk = loss_chunk(cfg) if chunk == "config" else chunk
    return Job(shape, seq, zero, act, chunk if chunk_runs(shape) else None,
               cache and zero.stage != 3, bool(act and act.checkpoint) if checkpoint is None else checkpoint, sp)


def chunk_runs(shape: Shape) -> bool:
    """Whether the engine computes the chunked loss for this family (coat_ds/hf/loss.py; the others run HF's stock
    loss, full fp32 logits, whatever coat.loss says: Qwen3-MoE and Mixtral today)."""
    return shape.family in EXACT_MODEL_TYPES


def bf16_baseline(cfg: Mapping[str, Any]) -> dict:
    """The same DeepSpeed set-up with BF16 + FusedAdam (DeepSpeed's "AdamW"): no coat section."""
    base = {k: v for k, v in cfg.items() if k != "coat"}
    params = dict((cfg.get("optimizer") or {}).get("params") or {})
    base["optimizer"] = {"type": "AdamW", "params": {k: v for k, v in params.items()
                                                     if k in ("lr", "betas", "eps", "weight_decay")}}
    base["bf16"] = {"enabled": True}
    if states_place(cfg) == HOST_STATES:   # BF16's way to keep its optimizer on the host: DeepSpeedCPUAdam, Offload
        base["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "offload_optimizer": {"device": "cpu"}}
    return base


def read_config(spec: str) -> tuple[dict, str]:
    """A DeepSpeed JSON config: a path, or a shipped preset name (ds_configs/<name>.json, ds_configs/hf/...)."""
    candidates = [Path(spec), ROOT / "ds_configs" / f"{spec}.json", ROOT / "ds_configs" / "hf" / f"{spec}.json"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        names = sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json"))
        raise PlanError(f"--config {spec}: no such file or preset; allowed: a DeepSpeed JSON path or {names}")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise PlanError(f"--config {spec}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--config {spec}: the top level must be a JSON object")
    return cfg, str(path)


# ------------------------------------------------------------------ the command
ROWS = ("parameters", "gradients", "master", "optimizer", "activations", "logits/loss", "buffers")
LABELS = {"parameters": "parameters (+ FP8 weight cache)", "master": "master weights", "optimizer": "optimizer states",
          "buffers": "DeepSpeed buffers, step transients"}


def gpu_memory(value: str) -> float:
    """--gpu-memory: GiB, or a GPU name (GPUS)."""
    if value.lower() in GPUS:
        return GPUS[value.lower()] * GIB
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not (math.isfinite(gib) and gib > 0):
        raise PlanError(f"--gpu-memory={value!r} is invalid; allowed: GiB > 0 or one of {sorted(GPUS)}")
    return gib * GIB


def columns(jobs: dict[str, Job], micro_batch: str, memory: float) -> list[tuple[str, Plan, int]]:
    """(label, plan at the asked or the largest micro-batch, largest micro-batch) per job."""
    out = []
    for label, job in jobs.items():
        best = max_micro_batch(job, memory)
        mb = max(best, 1) if micro_batch == "max" else int(micro_batch)
        out.append((label, plan(job, mb), best))
    return out


def render(title: str, cols: list[tuple[str, Plan, int]], memory: float, gpus_per_node: int = 1) -> str:
    """The table: one column per job, GiB per GPU at each job's peak; the host's per rank and per node."""
    w = max(38, *(len(c[0]) + 2 for c in cols))
    fmt = lambda name, vals: f"{name:34s}" + "".join(f"{v:>{w}s}" for v in vals)  # noqa: E731
    lines = [title, fmt("", [c[0] for c in cols]), fmt("micro-batch", [str(c[1].micro_batch) for c in cols])]
    for part in ROWS:
        vals = [f"{c[1].parts.get(part, 0.0) / GIB:.2f}" if c[1].parts.get(part) else "-" for c in cols]
        lines.append(fmt(LABELS.get(part, part), vals))
    lines.append(fmt("peak (GiB)", [f"{c[1].peak / GIB:.2f}" for c in cols]))
    lines.append(fmt("  at", [c[1].phase for c in cols]))
    lines.append(fmt("+ allocator reserve (estimate)", [f"{c[1].reserve / GIB:.2f}" for c in cols]))
    lines.append(fmt(f"fits ({USABLE:.0%} of {memory / GIB:.1f} GiB)",
                     ["yes" if c[1].fits(memory) else "no" for c in cols]))
    lines.append(fmt("largest micro-batch", [str(c[2]) if c[2] else "none (not 1)" for c in cols]))
    if any(c[1].host for c in cols):
        lines.append(fmt("host memory per rank", [f"{c[1].host / GIB:.2f}" for c in cols]))
        lines.append(fmt(f"host memory per node ({gpus_per_node} ranks)",
                         [f"{c[1].host * gpus_per_node / GIB:.2f}" for c in cols]))
    lines.append(fmt("host at resume, per rank", [f"{c[1].resume / GIB:.2f}" for c in cols]))
    lines.append(fmt(f"host at resume, per node ({gpus_per_node} ranks)",
                     [f"{c[1].resume * gpus_per_node / GIB:.2f}" for c in cols]))
    return "\n".join(lines)


# ------------------------------------------------------------------ which preset fits
@dataclass(frozen=True)
class PresetFit:
    """A preset's largest micro-batch for a job, without and with activation checkpointing, and its host need."""
    name: str
    micro_batch: int
    checkpointed: int
    host: float          # bytes per rank


def preset_configs() -> dict[str, dict]:
    """The plain presets of ds_configs/ by name (<layout>_<intent>.json: coat_ds/deepspeed/presets.py writes them;
    one added by hand under such a name counts too)."""
    return {p.stem: read_config(str(p))[0] for p in sorted((ROOT / "ds_configs").glob("*.json"))
            if p.stem.endswith(tuple(INTENTS))}


def preset_fits(shape: Shape, seq: int, world: int, memory: float,
                configs: Mapping[str, dict] | None = None, sp: int = 1) -> list[PresetFit]:
    """The presets that train `shape` at micro-batch 1 or more on `world` GPUs of `memory` bytes (`sp` a sample), with
    or without activation checkpointing; least host memory first, then the largest micro-batch."""
    fits = []
    for name, cfg in (preset_configs() if configs is None else configs).items():
        jobs = [job_from_config(cfg, shape, seq, world, checkpoint=ck, sp=sp) for ck in (False, True)]
        mb, ck = (max_micro_batch(job, memory) for job in jobs)
        if ck:
            fits.append(PresetFit(name, mb, ck, plan(jobs[0], 1).host))
    return sorted(fits, key=lambda f: (f.host, -f.micro_batch, -f.checkpointed, f.name))


def render_fits(fits: list[PresetFit], what: str, gpus_per_node: int) -> str:
    """The preset search's lines under the table."""
    if not fits:
        return f"no preset of ds_configs/ fits {what}: more GPUs (--gpus-per-node, --nodes)"
    lines = [f"presets that fit {what}: largest micro-batch without / with activation checkpointing; host memory "
             f"GiB per rank / per node"]
    for f in fits:
        host = f"{f.host / GIB:.2f} / {f.host * gpus_per_node / GIB:.2f}" if f.host else "-"
        lines.append(f"  {f.name:34s}{f.micro_batch or 'none':>6} / {f.checkpointed:<6}{host:>22s}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coat_ds.plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="shipped shape name, config.json (or its folder), or a hub "
                                                  "name in the local HF cache")
    p.add_argument("--config", default="zero2_coat", help="DeepSpeed JSON (path or ds_configs/ preset name)")
    p.add_argument("--seq", "--seq-len", type=int, default=2048, help="tokens per sample")
    p.add_argument("--micro-batch", default="max", help="samples per GPU, or 'max'")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override zero_optimization.stage")
    p.add_argument("--offload", choices=["none", "cpu"], help="override zero_optimization.offload_optimizer")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", default="h100", help=f"GiB per GPU, or one of {sorted(GPUS)}")
    p.add_argument("--loss", choices=["config", "chunked", "stock"], default="config",
                   help="coat's loss: as the config says, chunked linear + cross-entropy, or stock fp32 logits")
    p.add_argument("--vocab-size", type=int, help="override the model's vocabulary")
    p.add_argument("--checkpoint", choices=sorted(CHECKPOINT_FLAG), default="config",
                   help="activation checkpointing of the decoder layers: as the config's coat.activation.checkpoint "
                        "says, or on (HF's gradient_checkpointing=True, which no DeepSpeed config says) or off")
    p.add_argument("--longest", action="store_true", help="print the longest sequence that fits at micro-batch 1")
    p.add_argument("--sp-size", type=int, default=1, help="Ulysses sequence parallelism: GPUs sharing each sample")
    args = p.parse_args(argv)
    for key in ("seq", "gpus_per_node", "nodes", "sp_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} is invalid; allowed: an integer >= 1")
    if args.micro_batch != "max" and not (args.micro_batch.isdigit() and int(args.micro_batch) >= 1):
        p.error(f"--micro-batch={args.micro_batch!r} is invalid; allowed: an integer >= 1 or 'max'")
    return args


def overridden(cfg: dict, args: argparse.Namespace) -> dict:
    """The config with the command line's ZeRO stage and Offload."""
    cfg = json.loads(json.dumps(cfg))
    zero = cfg.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif args.offload == "none":
        zero.pop("offload_optimizer", None)
    return cfg


def report(model: str, cfg: dict, source: str, seq: int, micro_batch: str = "max", *, gpus_per_node: int = 1,
           nodes: int = 1, memory: float = GPUS["h100"] * GIB, loss: str = "config", vocab: int | None = None,
           checkpoint: str = "config", presets: bool = True, longest: bool = False, sp_size: int = 1) -> str:
    """The planner's table for DeepSpeed config `cfg` (read from `source`) beside BF16 + FusedAdam (DeepSpeedCPUAdam
    where coat's states are on the host), (`presets`) which presets fit, (`longest`) its longest sequence (Ulysses:
    `sp_size` GPUs share each sample, checked first as the main job checks it)."""
    shape, world = resolve_shape(model, vocab), gpus_per_node * nodes
    check_sp(sp_size, world, shape, seq)
    chunk = {"config": "config", "chunked": DEFAULT_CHUNK_TOKENS, "stock": None}[loss]
    job = job_from_config(cfg, shape, seq, world, chunk=chunk, checkpoint=CHECKPOINT_FLAG[checkpoint], sp=sp_size)
    base = job_from_config(bf16_baseline(cfg), shape, seq, world, checkpoint=job.checkpoint, sp=sp_size)
    jobs = {f"{Path(source).stem} ({(cfg.get('optimizer') or {}).get('type', 'client')})": job,
            "BF16 + " + ("DeepSpeedCPUAdam" if base.zero.offload else "FusedAdam"): base}
    z = job.zero
    where = " + Offload" if z.offload else " + states on the host" if z.host_states else ""
    e = shape.experts
    active = f" ({shape.active_params / 1e9:.2f}B active a token: {e.num} experts, {e.top_k} a token)" if e else ""
    title = (f"{model}: {shape.params / 1e9:.2f}B parameters{active}, vocabulary {shape.vocab:,}, seq {seq}; "
             f"ZeRO-{z.stage}{where} on {world} GPU(s) ({nodes} node(s) x {gpus_per_node}); GiB per GPU at the "
             "peak of a step" + sp_title(seq, sp_size))
    cols = columns(jobs, micro_batch, memory)
    out = [render(title, cols, memory, gpus_per_node)]
    if job.checkpoint:
        out += [RECOMPUTE_NOTE, where_note(shape.layers, job.activation, shape.hidden, sp_size)]
    out += [f"{label}: deepspeed.initialize holds {p.setup / GIB:.2f} GiB at once (set-up), above the step's peak"
            for label, p, _ in cols if p.setup > p.peak]
    if longest:
        n = longest_seq(job, memory)
        out.append(longest_line(n, world, memory, sp_size, plan(replace(job, seq=n), 1).host, gpus_per_node))
    if (loss_chunk(cfg) if chunk == "config" else chunk) and not chunk_runs(shape):
        out.append(f"loss: HF's stock loss (full fp32 logits): coat_ds has no chunked loss for model_type "
                   f"{shape.family!r} (coat_ds/hf/loss.py)")
    if presets:
        what = f"{model} at seq {seq} on {world} GPU(s) of {memory / GIB:.1f} GiB"
        out.append(render_fits(preset_fits(shape, seq, world, memory, sp=sp_size), what, gpus_per_node))
    return "\n".join(out)


def build(args: argparse.Namespace) -> str:
    """The report for parsed flags (PlanError on bad input)."""
    cfg, source = read_config(args.config)
    return report(args.model, overridden(cfg, args), source, args.seq, args.micro_batch,
                  gpus_per_node=args.gpus_per_node, nodes=args.nodes, memory=gpu_memory(args.gpu_memory),
                  loss=args.loss, vocab=args.vocab_size, checkpoint=args.checkpoint, longest=args.longest,
                  sp_size=args.sp_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(build(args))
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
