"""End-to-end memory and speed: BF16 + FusedAdam vs coat_ds optimizer-only vs coat_ds full, one process each; the
harness (workers, micro-batch ladder, memory breakdown) that e2e_real_shapes, hf_trainer_speed and offload reuse.

    python -m benchmarks.e2e --model llama-1b --equal-batch 2 --out /tmp/e2e             # one GPU
    python -m benchmarks.e2e --model llama2-7b --num-gpus 2 --zero-stage 2 --out /tmp/e2e  # ZeRO-2, 2 GPUs
    python -m benchmarks.e2e --smoke --out /tmp/e2e_smoke                                # CPU, tiny, < 60 s

A DeepSpeed engine never gives its memory back: each configuration climbs its ladder in a worker of its own
(docs/benchmarks.md: the search, the memory breakdown, e2e.json's fields).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

_T0 = time.time()   # process start: a worker's time budget counts its imports and engine set-up too

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from benchmarks.common import (GIB, RESULTS, ROOT, StepProbe, WarningLog, add_worker_args, proc_bytes,  # noqa: E402
                               check_positive, names_of, parse_cores, provenance, run_worker, worker_cmd,
                               write_results)
from benchmarks.memory_trace import recorded  # noqa: E402
from coat_ds.deepspeed.teardown import torn_down  # noqa: E402
from coat_ds.deepspeed.zero.kind import master_partitions, zero_kind  # noqa: E402
from coat_ds.hf.loss import is_applied  # noqa: E402
from coat_ds.workloads import causal_lm as train_lib  # noqa: E402  (engine initialisation, the loss, the shapes)
from coat_ds.workloads.shapes import SHAPES  # noqa: E402  (public shapes: TinyLlama's, Llama-2's, Llama-3.1's)

# Llama shapes by name: the main job's 125m and the public ones of coat_ds.workloads.shapes.
MODELS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512, vocab_size=512),   # wide enough that the decoder layer's activations dominate
    **{f"tiny-{family}": dict(model_type=family, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=512)
       for family in ("qwen3", "gemma3_text")},                  # the other families' smoke shapes
    "tiny-gqa": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                     intermediate_size=512, vocab_size=512),    # the smoke's stand-in for Llama-3.1-70B (8:1 GQA)
    "llama-125m": dict(train_lib.MODEL_SIZES["125m"], vocab_size=32000),
    **SHAPES,
}

COAT, LOWEST = "ds_configs/zero2_coat.json", "ds_configs/zero2_lowest_memory.json"
_BF16_SR, _ATTN_FP8 = {"master_weights": "bf16_sr"}, {"activation": {"attention_fp8": True}}
# The configurations: label, a file of ds_configs/, and what it adds to that file's "coat" section (merged key by key
# into nested sections)
CONFIGS = {
    "bf16": ("BF16 + FusedAdam", "ds_configs/zero2_bf16.json", {}),
    "coat_opt": ("coat_ds optimizer-only", "ds_configs/zero2_coat_optimizer_only.json",
                 {"loss": {"chunked": False}}),   # optimizer-only: BF16's activations and loss
    "coat_full": ("coat_ds full", COAT, {}),
    "coat_full_bf16sr": ("coat_ds full, bf16 master (stochastic rounding)", COAT, _BF16_SR),
    "coat_full_bf16rn": ("coat_ds full, bf16 master (round to nearest: ablation)", COAT, {"master_weights": "bf16_rn"}),
    "coat_full_rem": ("coat_ds full, exact fp32 master as bf16 weights + int16 remainders", COAT,
                      {"master_weights": "fp32_remainder"}),
    "coat_full_attn_fp8": ("coat_ds full, attention saved in FP8", COAT, _ATTN_FP8),
    "coat_full_bf16sr_attn_fp8": ("coat_ds full, bf16 master, attention saved in FP8", COAT, {**_BF16_SR, **_ATTN_FP8}),
    "lowest_memory": ("coat_ds lowest-memory preset: bf16 master, attention in FP8, chunked loss", LOWEST, {}),
    "exact": ("coat_ds exact preset: fp32 master as bf16 weights + int16 remainders", "ds_configs/zero2_exact.json",
              {}),
    "lowest_memory_grad_buffer": ("coat_ds lowest-memory preset with DeepSpeed's gradient partition buffer "
                                  "(before issue 34)", LOWEST, {"gradients": "partition_buffer"}),
    "largest_model": ("coat_ds largest-model preset: lowest memory with gradient release",
                      "ds_configs/zero2_largest_model.json", {}),
    "largest_model_z3": ("coat_ds largest-model preset, ZeRO-3", "ds_configs/zero3_largest_model.json", {}),
    "largest_model_z3_offload": ("coat_ds largest-model preset, ZeRO-3, FP8 states in pinned host memory",
                                 "ds_configs/zero3_offload_largest_model.json", {}),
    "lowest_memory_z3": ("coat_ds lowest-memory preset, ZeRO-3", "ds_configs/zero3_lowest_memory.json", {}),
}
# the peer a single-GPU user would pick instead: no DeepSpeed config, a plain loop (PeerWorker)
PEERS = {"torchao_fp8": "torchao float8 (compiled, every linear but lm_head) + AdamWFp8 (bf16 stochastic "
                        "rounding), plain loop"}
LABELS = {**{n: label for n, (label, *_) in CONFIGS.items()}, **PEERS}
E2E_CONFIGS = "bf16,coat_opt,coat_full,coat_full_bf16sr"   # e2e.py's default (round to nearest is for convergence)
TARGETS = {"memory_reduction": 1.54, "speedup_at_max_batch": 1.43}   # COAT's paper, Llama-2-7B


# --- Configurations and models (convergence, offload and hf_trainer_speed build theirs here too) ----------------------
def merge_into(section: dict, extra: dict) -> None:
    """`extra`'s keys into `section`, recursing into sub-sections both have."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(section.get(k), dict):
            merge_into(section[k], v)
        else:
            section[k] = v


def ds_config(name: str, *, micro_batch: int, zero_stage: int | None = None, on_cpu: bool = False,
              lr: float | None = None, total_steps: int | None = None, warmup_steps: int | None = None,
              zero_set: dict | None = None) -> dict:
    """The DeepSpeed config of configuration `name` with the benchmark's overrides applied (`zero_set`: keys of
    zero_optimization, parse_zero_set's). On CPU the BF16 baseline uses torch's AdamW (`torch_adam`): FusedAdam
    would JIT-build a C++ op there."""
    if name not in CONFIGS:
        raise ValueError(f"configuration {name!r} is unknown; allowed: {list(CONFIGS)}")
    _, source, coat = CONFIGS[name]
    cfg = json.loads((ROOT / source).read_text())
    if coat:
        merge_into(cfg.setdefault("coat", {}), coat)
    cfg.pop("train_batch_size", None)
    cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1, steps_per_print=10 ** 9)
    cfg.setdefault("wall_clock_breakdown", False)
    if zero_stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
    if zero_set:
        cfg.setdefault("zero_optimization", {}).update(zero_set)
    opt = cfg.get("optimizer", {})
    if on_cpu and opt.get("type", "").lower() in ("adam", "adamw"):
        opt.setdefault("params", {})["torch_adam"] = True
    if lr is not None:
        opt.setdefault("params", {})["lr"] = lr
    sched = cfg.get("scheduler", {}).get("params")
    if sched is not None:
        if total_steps is not None:
            sched["total_num_steps"] = total_steps
        elif sched.get("total_num_steps") == "auto":
            sched["total_num_steps"] = 10 ** 6
        if warmup_steps is not None:
            sched["warmup_num_steps"] = warmup_steps
    cfg["_source"] = source
    return cfg


# what --zero-set may change: ZeRO's buckets and overlap, the levers of its communication at small micro-batches
ZERO_SET_KEYS = {"reduce_bucket_size": int, "allgather_bucket_size": int, "stage3_prefetch_bucket_size": int,
                 "stage3_max_live_parameters": int, "stage3_max_reuse_distance": int,
                 "stage3_param_persistence_threshold": int, "overlap_comm": bool, "contiguous_gradients": bool,
                 "use_multi_rank_bucket_allreduce": bool}


def check_bind_cores(text: str | None) -> None:
    """--bind-cores' value, and numactl there to bind with (DeepSpeed's --bind_cores_to_rank runs it)."""
    if not text:
        return
    if text != "all":
        parse_cores(text)
    if shutil.which("numactl") is None:
        raise ValueError(f"--bind-cores {text}: needs numactl on PATH (DeepSpeed's --bind_cores_to_rank runs it); "
                         "allowed here: leave --bind-cores out")


def parse_zero_set(text: str | None) -> dict:
    """'KEY=VALUE,...' (e.g. 'reduce_bucket_size=2e8') -> the zero_optimization entries; ValueError naming the key
    and what is allowed."""
    out: dict = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        kind = ZERO_SET_KEYS.get(key)
        if kind is None:
            raise ValueError(f"--zero-set {item!r}: {key!r} is not a key it sets; allowed: {sorted(ZERO_SET_KEYS)}")
        value = value.lower()
        try:
            if kind is bool:
                if value not in ("true", "false"):
                    raise ValueError
                out[key] = value == "true"
            else:
                number = float(value)
                if number < 0 or number != int(number):
                    raise ValueError
                out[key] = int(number)
        except ValueError:
            allowed = "true or false" if kind is bool else "a whole number >= 0 (e.g. 2e8)"
            raise ValueError(f"--zero-set {item!r}: {value!r} is invalid for {key}; allowed: {allowed}") from None
    return out


def build_model(model: str, device, dtype, seed: int, layers: int | None = None):
    """A randomly initialised model of shape `model` (MODELS) on `device` in `dtype`, `layers` deep where given."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r} is unknown; allowed: {list(MODELS)}")
    return train_lib.from_shape(shape_of(model, layers), seed, device, dtype)


def shape_of(model: str, layers: int | None = None) -> dict:
    """`model`'s HF config fields, with `layers` decoder layers where given (a shallower stand-in of the same width
    parts a step's per-layer memory from its constant part in two short runs)."""
    return dict(MODELS[model], max_position_embeddings=4096, **({"num_hidden_layers": layers} if layers else {}))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...]) -> list[str]:
    """The --configs names, each one known, after p.error for any unknown name or `positive` option below 1."""
    check_positive(p, args, positive)
    return names_of(p, "configs", args.configs, LABELS)


# --- Memory accounting from the real tensors --------------------------------------------------------------------------
def _tensors(obj, depth: int = 0):
    """Every tensor in a (nested) container."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v, depth + 1)


class StorageCounter:
    """Bytes of distinct storages, each counted once across all categories (views share a storage); `new`: the
    tensors the last add() counted."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, tensors) -> int:
        self.new = []
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key != 0 and key not in self.seen:
                self.seen.add(key)
                self.new.append(t)
        return sum(t.untyped_storage().nbytes() for t in self.new)


def base_optimizer(engine):
    """The optimizer that owns the Adam state (ZeRO and bf16 wrappers keep it as `.optimizer`)."""
    opt = engine.optimizer
    for _ in range(4):
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt or not hasattr(inner, "state"):
            break
        opt = inner
    return opt


def grad_tensors(engine):
    """Gradient storage after backward: the model's `.grad`s, the master params' `.grad`s, and whatever the
    ZeRO / bf16 optimizer wrapper holds under a gradient-named attribute (buckets, partition buffers)."""
    base = base_optimizer(engine)
    yield from (p.grad for p in engine.module.parameters())
    yield from (p.grad for g in base.param_groups for p in g["params"])
    if engine.optimizer is not base:
        for name, val in vars(engine.optimizer).items():
            if "grad" in name.lower() or "ipg" in name.lower():
                yield from _tensors(val)


# --- Worker: one configuration, one engine, a ladder of micro-batch sizes ---------------------------------------------
class Worker:
    """One configuration's engine and the ladder's shared state: where records go, the memory limit, the data."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.train_lib, self.dist = args, train_lib, dist   # subclasses reach them here
        self.wlog = WarningLog()
        train_lib.set_single_process_env()
        deepspeed.init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.accel, self.on_cuda, self.device = get_accelerator(), torch.cuda.is_available(), torch.device("cpu")
        if self.on_cuda:
            self.device = torch.device(self.accel.device_name(int(os.environ.get("LOCAL_RANK", 0))))
            torch.cuda.set_device(self.device)
        self.out = Path(args.result)
        self.t_start = time.time()
        self.engine = self.setup_engine()
        self.gen = torch.Generator(device="cpu").manual_seed(args.seed + self.rank)

    def model(self, dtype=None, cfg: dict | None = None):
        """The randomly initialised model of --model on this device (bf16 on CUDA); sets vocab and n_params. Under a
        ZeRO-3 config `cfg` it is partitioned as it is built (zero.Init): no rank holds the whole model, so one
        larger than a GPU (70B: 141 GB in bf16) can be built."""
        dtype = dtype or (torch.bfloat16 if self.on_cuda else torch.float32)
        with train_lib.built_partitioned(cfg):
            net = build_model(self.args.model, self.device, dtype, self.args.seed, getattr(self.args, "layers", None))
        self.vocab = net.config.vocab_size
        self.n_params = sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())
        return net

    def setup_engine(self):
        """Build the model and the engine; emit the set-up record (parameters, config, memory limit)."""
        args = self.args
        cfg = ds_config(args.config, micro_batch=args.start_batch, zero_stage=args.zero_stage,
                        on_cpu=not self.on_cuda, zero_set=parse_zero_set(args.zero_set))
        source = cfg.pop("_source")
        net = self.model(cfg=cfg)
        partitioned = all(hasattr(p, "ds_id") for p in net.parameters())   # built under zero.Init
        try:
            engine = self.train_lib.initialize(net, cfg)
        except torch.OutOfMemoryError as e:
            self.oom_exit(args.start_batch, e, "engine set-up")
        return self.started(engine, config_source=source, chunked_loss=is_applied(engine.module), ds_config=cfg,
                            built_partitioned=partitioned)

    def started(self, engine, **rec):
        """The engine in training mode, its set-up's transients (flat copies, fp32 partitions a bf16 master frees)
        freed, the memory limit set; the set-up record emitted."""
        engine.train()
        self.accel.empty_cache()
        total = self.accel.total_memory()
        self.limit = self.args.mem_fraction * total if self.on_cuda else float("inf")
        self.emit({"kind": "setup", "params": self.n_params, "world_size": self.world, **rec,
                   "cores": len(os.sched_getaffinity(0)), "omp_threads": torch.get_num_threads(),
                   "setup_s": time.time() - self.t_start, "device_total_gb": total / GIB,
                   "limit_gb": self.limit / GIB if math.isfinite(self.limit) else None})
        return engine

    def emit(self, rec: dict, every_rank: bool = False) -> None:
        if self.rank == 0 or every_rank:
            with open(self.out, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def oom_exit(self, b: int, e: Exception, phase: str) -> None:
        """Record an out-of-memory error (any rank: the one that ran out may not be rank 0) and end the worker now:
        ranks may be mid-collective, the launcher stops the others."""
        msg = str(e).splitlines()[0]
        self.emit({"kind": "oom", "rank": self.rank, "micro_batch": b, "phase": phase, "error": msg,
                   "needed_gb": oom_needed_gb(msg)}, every_rank=True)
        sys.stdout.flush()
        os._exit(17)

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()

    def reduce_max(self, vals: list[float]) -> list[float]:
        t = torch.tensor(vals, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def one_step(self, x, y):
        loss = self.train_lib.lm_loss(self.engine, x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def allocated(self) -> int | None:
        """Bytes allocated once the queued kernels have run (None on CPU)."""
        self.sync()
        return self.accel.memory_allocated() if self.on_cuda else None

    def peak_gb(self, reset: bool) -> float | None:
        """The allocator's peak since the last reset once the queued kernels have run (None on CPU); `reset` starts
        a new one."""
        self.sync()
        if not self.on_cuda:
            return None
        peak = self.accel.max_memory_allocated() / GIB
        if reset:
            self.accel.reset_peak_memory_stats()
        return peak

    def breakdown(self, x, y) -> dict:
        """One instrumented step: tensors per category and the allocator's view around it."""
        engine, counter = self.engine, StorageCounter()
        # ZeRO-3 keeps each parameter's partition in `ds_tensor` (the parameter itself is empty between uses)
        weights = counter.add(t for p in engine.module.parameters() for t in (p, getattr(p, "ds_tensor", None)))
        base = base_optimizer(engine)
        # the master partitions (ZeRO-3 lists them in its optimizer's param groups only while it steps)
        zo = engine.optimizer
        masters = master_partitions(zo) if zero_kind(zo) else [p for g in base.param_groups for p in g["params"]]
        master = counter.add(masters)
        # coat.master_weights 'fp32_remainder': the masters' low halves, kept by the partition layouts
        layouts = [getattr(base, "partition_of", lambda p: None)(p) for p in masters]
        master += counter.add(lay.remainder for lay in layouts if getattr(lay, "remainder", None) is not None)
        opt_state = counter.add(t for st in base.state.values() for t in _tensors(st))
        param_keys = set(counter.seen)
        saved: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key and key not in param_keys:
                saved[key] = st.nbytes()
            return t

        a0 = self.allocated()
        self.peak_gb(reset=True)
        on = getattr(self.args, "memory_trace", False) and self.rank == 0   # offload / hf_trainer_speed: none
        with recorded(self.device.index or 0, on) as trace:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = self.train_lib.lm_loss(engine, x, y)
            a1 = self.allocated()
            engine.backward(loss)
            a2 = self.allocated()
        fp8_cache = counter.add(t for m in engine.module.modules() for v in vars(m).values()
                                if isinstance(getattr(v, "_codes", None), dict) for t in v._codes.values())
        # what lives across the step (weights, masters, states, the FP8 weight cache); gradients are left out of
        # it: one allocated as backward goes may sit where a freed activation was, at the same address
        kept = set(counter.seen)
        grads = counter.add(grad_tensors(engine))
        peak_fb = self.peak_gb(reset=True)
        engine.step()
        peak_step = self.peak_gb(reset=False)
        acts = sum(v for k, v in saved.items() if k not in kept)
        return {"weights_gb": (weights + master + fp8_cache) / GIB, "model_weights_gb": weights / GIB,
                "master_weights_gb": master / GIB, "fp8_weight_cache_gb": fp8_cache / GIB,
                "optimizer_state_gb": opt_state / GIB, "grads_gb": grads / GIB, "activations_gb": acts / GIB,
                "alloc_forward_delta_gb": (a1 - a0) / GIB if self.on_cuda else None,
                "alloc_backward_delta_gb": (a2 - a0) / GIB if self.on_cuda else None,
                # which phase sets the peak: forward+backward, or the ZeRO optimizer step (fp32 gradient copies)
                "peak_forward_backward_gb": peak_fb, "peak_optimizer_step_gb": peak_step,
                **({"memory_trace": trace} if trace else {})}

    def rung_inputs(self, b: int):
        x_all = torch.randint(0, self.vocab, (b, self.args.seq_len + 1), generator=self.gen)
        return x_all[:, :-1].to(self.device), x_all[:, 1:].to(self.device)

    def rung(self, b: int, first: bool) -> dict:
        args, accel = self.args, self.accel
        x, y = self.rung_inputs(b)
        accel.empty_cache()   # a larger rung's cached blocks would count as this one's reserved memory
        # the first rung warms up longer: coat's first steps still tune GEMMs and grow the allocator, and its
        # small-batch steps leave the GPU ~25% idle, so 2 warm-up steps read 1.35x at 1.1B micro-batch 4
        # where 5 read 1.50x (e2e_llama-1b_mb4_warmup*.json)
        for _ in range(args.warmup + (4 if first else 0)):
            self.one_step(x, y)
        self.sync()
        accel.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = self.one_step(x, y)
        self.sync()
        dt = time.perf_counter() - t0
        peak_alloc, peak_res, dt = self.reduce_max([accel.max_memory_allocated(), accel.max_memory_reserved(), dt])
        rec = {"kind": "rung", "micro_batch": b, "peak_alloc_gb": peak_alloc / GIB, "peak_reserved_gb": peak_res / GIB,
               "step_time_s": dt / args.steps, "tokens_per_s": b * args.seq_len * self.world * args.steps / dt,
               "loss": float(loss.detach().float()), "fits": bool(peak_res <= self.limit)}
        if first:
            rec["breakdown"] = self.breakdown(x, y)
            rec.update(self.phases(x, y), **self.host_memory())
        return rec

    def phases(self, x, y) -> dict:
        """One more step timed by phase, the device synced between them: forward, backward (under release the
        optimizer's kernels run there too) and engine.step(), in seconds (slowest rank)."""
        marks = [time.perf_counter()]
        loss = self.train_lib.lm_loss(self.engine, x, y)
        for act in (lambda: self.engine.backward(loss), self.engine.step, lambda: None):
            self.sync()
            marks.append(time.perf_counter())
            act()
        fwd, bwd, step = self.reduce_max([b - a for a, b in zip(marks, marks[1:])])
        return {"phase_s": {"forward": fwd, "backward": bwd, "step": step}}

    def host_memory(self) -> dict:
        """Host memory of the whole job: every rank's resident set (pinned buffers included) and peak, summed, and
        the node's used memory (MemTotal - MemAvailable) in GiB."""
        rss, hwm = (float(sum(self.reduce_sum([proc_bytes(k)]))) / GIB for k in ("VmRSS", "VmHWM"))
        used = proc_bytes("MemTotal", "/proc/meminfo") - proc_bytes("MemAvailable", "/proc/meminfo")
        return {"host_rss_gb": rss, "host_peak_rss_gb": hwm, "node_used_gb": used / GIB}

    def reduce_sum(self, vals: list[float]) -> list[float]:
        t = torch.tensor(vals, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return t.tolist()

    def climb(self) -> tuple[int | None, int | None]:
        """The ladder of micro-batch sizes -> (largest that fit, smallest that did not)."""
        args = self.args
        lo, hi = None, args.known_fail
        points: list[tuple[int, float]] = []
        b, first = args.start_batch, True
        while b is not None:
            try:
                rec = self.rung(b, first)
            except torch.OutOfMemoryError as e:
                self.oom_exit(b, e, "training step")
            rec["elapsed_s"] = time.time() - self.t_start
            self.emit(rec)
            if self.rank == 0:
                print(f"[{args.config}] micro-batch {b}: peak {rec['peak_alloc_gb']:.2f} GiB allocated, "
                      f"{rec['peak_reserved_gb']:.2f} reserved, {rec['tokens_per_s']:,.0f} tokens/s", flush=True)
            # --then-batch: the second size is given (a planner's prediction), not doubled
            jump = args.then_batch if first and args.then_batch and (rec["fits"] or args.then_batch < b) else None
            first = False
            if rec["fits"]:
                lo = b if lo is None else max(lo, b)
                points.append((b, rec["peak_reserved_gb"] * GIB))
            else:
                hi = b if hi is None else min(hi, b)
            spent = time.time() - _T0 > args.budget_s or len(points) + (0 if hi is None else 1) >= args.max_rungs
            b = None if spent else (jump or next_batch(points, lo, hi, self.limit, args.max_batch))
        return lo, hi


class PlainLoop:
    """What a single-GPU user of torchao runs instead of a DeepSpeed engine: the model, its optimizer, a loop."""

    def __init__(self, module, optimizer, device):
        self.module, self.optimizer, self.device = module, optimizer, device
        self.compiled = torch.compile(module)

    def __call__(self, **kw):
        return self.compiled(**kw)

    def train(self):
        self.module.train()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class PeerWorker(Worker):
    """torchao's float8 training (per-tensor dynamic scaling, every linear but the LM head, under torch.compile)
    with torchao's AdamWFp8 (bf16 weights stepped with stochastic rounding: no fp32 master, as coat's lowest-memory
    preset), HF's stock loss; no DeepSpeed."""

    def setup_engine(self):
        from torchao.float8 import convert_to_float8_training
        from torchao.optim import AdamWFp8

        net = self.model(torch.bfloat16)
        convert_to_float8_training(net, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        hp = json.loads((ROOT / CONFIGS["lowest_memory"][1]).read_text())["optimizer"]["params"]
        opt = AdamWFp8(net.parameters(), lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                       weight_decay=hp["weight_decay"], bf16_stochastic_round=True)
        return self.started(PlainLoop(net, opt, self.device), config_source="torchao", chunked_loss=False,
                            ds_config=None)

    def breakdown(self, x, y) -> dict:
        """The allocator's view only (torchao's FP8 states are tensor subclasses without one storage)."""
        self.peak_gb(reset=True)
        self.engine.backward(self.train_lib.lm_loss(self.engine, x, y))
        peak_fb = self.peak_gb(reset=True)
        self.engine.step()
        return {"peak_forward_backward_gb": peak_fb, "peak_optimizer_step_gb": self.peak_gb(reset=False)}


def worker(args: argparse.Namespace) -> int:
    w = (PeerWorker if args.config in PEERS else Worker)(args)
    lo, hi = w.climb()
    pb = args.profile_batch or lo
    if args.profile and pb is not None:
        w.emit(profile_step(lambda: w.rung_inputs(pb), w.one_step, w.sync, w.on_cuda, pb))
    w.emit({"kind": "done", "largest_fitting": lo, "smallest_failing": hi, "coat_warnings": w.wlog.messages,
            "elapsed_s": time.time() - w.t_start})
    w.dist.barrier()
    return 0


def oom_needed_gb(msg: str) -> float | None:
    """What the process needed when it ran out, from PyTorch's message: what PyTorch had allocated plus what it
    tried to allocate (a lower bound: the step would have gone on allocating)."""
    unit = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}
    size = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
    tried = re.search(r"Tried to allocate " + size, msg)
    held = re.search(size + r" is allocated by PyTorch", msg)
    return sum(float(m.group(1)) * unit[m.group(2)] for m in (tried, held)) / GIB if tried and held else None


def profile_step(inputs, one_step, sync, on_cuda: bool, b: int) -> dict:
    """One training step at micro-batch `b` timed alone, then two seen from both sides (common.StepProbe): the
    kernels by device time (what limits a GPU-bound step), the host calls and the device syncs with their Python
    lines (what limits a host-bound one: a sync drains the launch queue, so the GPU then waits on Python)."""
    try:
        x, y = inputs()
        one_step(x, y)
        sync()
        t0 = time.perf_counter()
        one_step(x, y)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
        probe = StepProbe(on_cuda)
        for _ in range(2):
            probe.mark()
            one_step(x, y)
            sync()
        probe.mark()
        return {"kind": "profile", "micro_batch": b, "step_wall_ms": wall_ms, **probe.result}
    except Exception as e:  # noqa: BLE001 - a profile is a diagnostic; the measurements above stand without it
        return {"kind": "profile", "micro_batch": b, "error": f"{type(e).__name__}: {e}"}


def next_batch(points: list[tuple[int, float]], lo: int | None, hi: int | None, limit: float,
               max_batch: int) -> int | None:
    """The next micro-batch to try: doubling, cut short by a linear fit of peak memory against batch size
    through the two largest sizes that fit, then bisection inside [largest fit, smallest failure)."""
    if lo is None:                       # nothing fit yet: halve
        return None if hi is None or hi <= 1 else hi // 2
    if lo >= max_batch or (hi is not None and hi <= lo + 1):
        return None
    guess = 2 * lo
    fit = sorted(points)[-2:]
    if len(fit) == 2 and math.isfinite(limit) and fit[1][0] > fit[0][0]:
        (b0, m0), (b1, m1) = fit
        slope = (m1 - m0) / (b1 - b0)
        if slope > 0:
            guess = min(int((limit - m1) / slope) + b1, 4 * lo)
    if hi is not None:
        guess = min(guess, hi - 1) if guess < hi else (lo + hi) // 2
    guess = min(guess, max_batch)
    return guess if guess > lo else None


# --- Parent: one worker per configuration, then the summary and the chart ---------------------------------------------
def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def launch(args: argparse.Namespace, name: str, result: Path, start: int, known_fail: int | None,
           budget: float) -> tuple[int, str]:
    """Run one worker (under `deepspeed --num_gpus N` when N > 1); returns its exit code and output tail. The
    worker stops climbing at `budget - 20` s; `budget + 30` s is the hard stop."""
    devices = getattr(args, "devices", None)   # CUDA ids ("2,3"): workers side by side (e2e_scaling); several go to
    # the launcher's --include alone (beside CUDA_VISIBLE_DEVICES it would count only those GPUs)
    cores = f"0-{(os.cpu_count() or 1) - 1}" if args.bind_cores == "all" else args.bind_cores   # None: unbound
    cmd = worker_cmd("benchmarks.e2e", args, ("model", "seq_len", "max_batch", "steps", "warmup", "mem_fraction",
                     "seed", "max_rungs", "zero_stage", "profile_batch", "profile", "then_batch", "layers",
                     "memory_trace", "zero_set"),
                     args.num_gpus, devices, cores, config=name, start_batch=start, known_fail=known_fail,
                     budget_s=max(budget - 20, 10), result=result)
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    env = {"CUDA_VISIBLE_DEVICES": devices} if devices and args.num_gpus == 1 else {}
    if cores and args.num_gpus == 1:   # as DeepSpeed's launcher sets it for a bound rank
        env["OMP_NUM_THREADS"] = str(len(parse_cores(cores)))
    return run_worker(cmd, budget + 30, echo=lambda line: args.verbose or line.startswith("[") or "rror" in line,
                      env=env or None)


# what a row keeps of the rung at the equal micro-batch and of the largest that fit
RUNG_FIELDS = ("micro_batch", "peak_alloc_gb", "peak_reserved_gb", "tokens_per_s", "step_time_s")


def summarize_config(name: str, records: list[dict], equal_batch: int, errors: list[str]) -> dict:
    setup = next((r for r in records if r["kind"] == "setup"), {})
    rungs = [r for r in records if r["kind"] == "rung"]
    ooms = [r["micro_batch"] for r in records if r["kind"] == "oom"]
    warns = sorted({w for r in records if r["kind"] == "done" for w in r.get("coat_warnings", [])})
    eq = next((r for r in rungs if r["micro_batch"] == equal_batch), None)
    best = max((r for r in rungs if r["fits"]), key=lambda r: r["micro_batch"], default=None)
    failing = sorted([r["micro_batch"] for r in rungs if not r["fits"]] + ooms)
    row = {"name": name, "label": LABELS[name],
           **{k: setup.get(k) for k in ("config_source", "ds_config", "params", "setup_s", "chunked_loss",
                                        "built_partitioned", "cores", "omp_threads")},
           "equal_batch": None if eq is None else {k: eq[k] for k in RUNG_FIELDS},
           "breakdown": None, "max_batch": None,
           "smallest_failing_batch": failing[0] if failing else None,
           "rungs": [{k: v for k, v in r.items() if k not in ("kind", "breakdown")} for r in rungs],
           "profile": next((r for r in records if r["kind"] == "profile"), None),
           "coat_warnings": warns, "errors": errors}
    first = next((r for r in rungs if "breakdown" in r), None)
    if first is not None:
        bd = dict(first["breakdown"])
        if "weights_gb" in bd:   # a peer's breakdown has the allocator's view only
            known = bd["weights_gb"] + bd["optimizer_state_gb"] + bd["grads_gb"] + bd["activations_gb"]
            bd["other_gb"] = first["peak_alloc_gb"] - known   # transients at the peak: logits, temporaries
        bd["at_micro_batch"] = first["micro_batch"]
        row["breakdown"] = bd
    if best is not None:
        row["max_batch"] = {k: best[k] for k in RUNG_FIELDS}
        row["max_batch"]["exact"] = bool(failing and failing[0] == best["micro_batch"] + 1)
    row.update(max_micro_batch(records, best))
    return row


def max_micro_batch(records: list[dict], best: dict | None) -> dict:
    """max_micro_batch (0: does not fit at micro-batch 1) and, when 0, what micro-batch 1 needed: from the OOM
    message, or the peak reserved memory of a step that ran but passed the fit rule."""
    if best is not None:
        return {"max_micro_batch": best["micro_batch"]}
    one = [r for r in records if r.get("micro_batch") == 1 and r["kind"] in ("oom", "rung")]
    if not one:   # nothing was tried at 1 (the worker failed otherwise): unknown, not 0
        return {"max_micro_batch": None}
    r = one[-1]
    if r["kind"] == "rung":
        return {"max_micro_batch": 0, "needed_gb_at_1": r["peak_reserved_gb"], "needed_from": "peak reserved"}
    return {"max_micro_batch": 0, "needed_gb_at_1": r.get("needed_gb"), "oom_phase": r.get("phase"),
            "needed_from": "OOM message: allocated by PyTorch + tried to allocate", "oom_error": r["error"]}


def ratio(a, b):
    return a / b if a and b else None


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-1b", choices=list(MODELS))
    p.add_argument("--configs", default=E2E_CONFIGS, help=f"comma-separated, from {list(LABELS)}")
    p.add_argument("--num-gpus", type=int, default=1, help="world size (deepspeed launcher when > 1)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override the configs' ZeRO stage")
    p.add_argument("--zero-set", help="KEY=VALUE,... of zero_optimization for every config (buckets, overlap: "
                                      f"{', '.join(ZERO_SET_KEYS)}), e.g. reduce_bucket_size=2e8")
    p.add_argument("--bind-cores", help="bind each rank to cores of its own, as `deepspeed --bind_cores_to_rank "
                                        "--bind_core_list LIST` does (numactl): 'all' (the host's cores) or a "
                                        "core list, e.g. 0-31")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--equal-batch", type=int, default=1, help="micro-batch at which peak memory is compared")
    p.add_argument("--max-batch", type=int, default=256, help="largest micro-batch the search tries")
    p.add_argument("--steps", type=int, default=3, help="timed steps per micro-batch size")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per micro-batch size (the first size: 4 more)")
    p.add_argument("--max-rungs", type=int, default=7, help="micro-batch sizes tried per configuration")
    p.add_argument("--mem-fraction", type=float, default=0.95, help="'fits': peak reserved <= this x device memory")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds for all configurations together")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps (CPU is fine)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--profile", action="store_true",
                   help="record one step's top kernels, top host-side calls and device syncs (at the largest batch)")
    p.add_argument("--profile-batch", type=int, help="profile at this micro-batch instead of the largest that fits")
    p.add_argument("--verbose", action="store_true", help="echo the workers' whole output")
    p.add_argument("--layers", type=int, help="the model's decoder layers instead of its shape's (a stand-in)")
    p.add_argument("--memory-trace", action="store_true",
                   help="rank 0's allocator trace over the first micro-batch's instrumented step: the blocks alive "
                        "at its peak by allocating line (benchmarks/memory_trace.py)")
    add_worker_args(p)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--start-batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--known-fail", type=int, help=argparse.SUPPRESS)
    p.add_argument("--then-batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=1e9, help=argparse.SUPPRESS)
    return p, p.parse_args(argv)


def run_config(args: argparse.Namespace, name: str, result: Path, share: float, remaining) -> dict:
    """One configuration's worker (restarted once below the failing size after an OOM) -> its summary row.
    `remaining()` is the time left for a restart."""
    result.unlink(missing_ok=True)
    errors: list[str] = []
    rc, tail = launch(args, name, result, args.equal_batch, None, share)
    recs = read_records(result)
    if rc != 0:
        ooms = [r["micro_batch"] for r in recs if r["kind"] == "oom"]
        fit = [r["micro_batch"] for r in recs if r["kind"] == "rung" and r["fits"]]
        errors.append(f"worker exit {rc}" + (f" (OOM at micro-batch {ooms[-1]})" if ooms else f": {tail[-1500:]}"))
        left = remaining()
        if ooms and left > 90:        # restart once, below the failing size
            start = (max(fit) + ooms[-1]) // 2 if fit else ooms[-1] // 2
            if start >= 1 and start not in fit:
                rc2, tail2 = launch(args, name, result, start, ooms[-1], left)
                recs = read_records(result)
                if rc2 != 0:
                    errors.append(f"restart exit {rc2}: {tail2[-1500:]}")
    return summarize_config(name, recs, args.equal_batch, errors)


def run_configs(args: argparse.Namespace, names: list[str], out: Path, prefix: str) -> list[dict]:
    """One worker per configuration, in turn, sharing args.time_budget -> their summary rows (their records in
    `out`, made first)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    for i, name in enumerate(names):
        share = (args.time_budget - (time.time() - t0)) / (len(names) - i)
        remaining = lambda: args.time_budget - (time.time() - t0) - (len(names) - i - 1) * 60  # noqa: E731
        rows.append(run_config(args, name, out / f"{prefix}_{name}.jsonl", share, remaining))
    return rows


def headline(args: argparse.Namespace, rows: list[dict], t0: float) -> dict:
    """e2e.json: every configuration's ratios to BF16 (coat full's at the top), the rows, how they were measured."""
    by = {r["name"]: r for r in rows}
    at = lambda n, which, key: ((by.get(n) or {}).get(which) or {}).get(key)  # noqa: E731
    peak, tps, tps_eq = ("equal_batch", "peak_alloc_gb"), ("max_batch", "tokens_per_s"), ("equal_batch", "tokens_per_s")
    vs_bf16 = {n: {"memory_reduction": ratio(at("bf16", *peak), at(n, *peak)),
                   "speedup_at_max_batch": ratio(at(n, *tps), at("bf16", *tps)),
                   "speedup_at_equal_batch": ratio(at(n, *tps_eq), at("bf16", *tps_eq))} for n in by if n != "bf16"}
    full = {r["micro_batch"]: r["peak_alloc_gb"] for r in by.get("coat_full", {}).get("rungs", [])}
    common = {str(r["micro_batch"]): r["peak_alloc_gb"] / full[r["micro_batch"]]
              for r in by.get("bf16", {}).get("rungs", []) if r["micro_batch"] in full}
    setup, shape = rows[0], shape_of(args.model, args.layers)
    return {
        **provenance(), "model": args.model, "params": setup.get("params"), "shape": shape,
        "world_size": args.num_gpus, "zero_stage": args.zero_stage if args.zero_stage is not None else
        ((setup.get("ds_config") or {}).get("zero_optimization") or {}).get("stage"),
        "seq_len": args.seq_len, "equal_micro_batch": args.equal_batch,
        **{k: vs_bf16.get("coat_full", {}).get(k) for k in ("memory_reduction", "speedup_at_max_batch",
                                                             "speedup_at_equal_batch")},
        "vs_bf16": vs_bf16, "memory_reduction_by_batch": common,
        "max_micro_batch": {r["name"]: r.get("max_micro_batch") for r in rows},
        # a whole model's forward, through the engine: all it keeps for backward per token, hidden unit and layer
        "forward_kept_b_per_token_hidden_layer": {
            r["name"]: r["breakdown"]["alloc_forward_delta_gb"] * GIB / (
                r["breakdown"]["at_micro_batch"] * args.seq_len * shape["hidden_size"] * shape["num_hidden_layers"])
            for r in rows if r["breakdown"] and r["breakdown"].get("alloc_forward_delta_gb") is not None},
        "targets": TARGETS, "fit_rule": f"peak reserved <= {args.mem_fraction} x device memory",
        "configs": rows, "wall_s": time.time() - t0, "smoke": args.smoke,
    }


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.worker:
        with torn_down():   # its exit code is the worker's, not an abort of Python's finalization
            return worker(args)
    if args.smoke:
        args.model, args.seq_len, args.steps, args.warmup = "tiny", 32, 1, 0
        args.max_batch, args.equal_batch, args.max_rungs = min(args.max_batch, 2), 1, 2
    names = check_args(p, args, ("seq_len", "equal_batch", "max_batch", "steps", "num_gpus", "max_rungs",
                                 "profile_batch"))
    if not 0 < args.mem_fraction <= 1:
        p.error(f"--mem-fraction={args.mem_fraction} is invalid; allowed: a float in (0, 1]")
    try:
        parse_zero_set(args.zero_set)
        check_bind_cores(args.bind_cores)
    except ValueError as e:
        p.error(str(e))

    out = Path(args.out)
    t0 = time.time()
    rows = run_configs(args, names, out, "e2e")
    res = headline(args, rows, t0)
    path = write_results(res, out, "e2e")
    f = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    print(f"memory reduction at micro-batch {args.equal_batch}: {f(res['memory_reduction'])} (target "
          f"{TARGETS['memory_reduction']}x); speedup at max batch: {f(res['speedup_at_max_batch'])} (target "
          f"{TARGETS['speedup_at_max_batch']}x)  ->  {path}")
    return 0 if all(r["equal_batch"] or r.get("max_micro_batch") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
