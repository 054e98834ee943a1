"""The engine worker, a process per configuration (a DeepSpeed engine never gives its memory back): its engine, a
ladder of micro-batch sizes on it, the memory breakdown from the real tensors. e2e.py starts it; convergence,
hf_trainer_speed and offload subclass it (docs/benchmarks.md: the search and the breakdown)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from benchmarks.common import GIB, ROOT, T0, StepProbe, WarningLog, proc_bytes
from benchmarks.configs import CONFIGS, PEERS, build_model, ds_config, parse_zero_set
from benchmarks.memory_trace import recorded
from coat_ds.deepspeed.zero.kind import master_partitions, zero_kind
from coat_ds.hf.loss import is_applied
from coat_ds.workloads import causal_lm as train_lib  # engine initialisation, the loss


# --- Memory accounting from the real tensors --------------------------------------------------------------------------
def _tensors(obj, depth: int = 0):
    """Every tensor in a (nested) container."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v, depth + 1)


class StorageCounter:
    """Bytes of distinct storages, each counted once (views share one); `new`: the last add()'s tensors. add()
    returns the bytes on `device`'s kind; those elsewhere (host states, Offload) go to `host[name]` (issue 57)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.seen: set[int] = set()
        self.device_type = torch.device(device).type
        self.host: dict[str, int] = {}

    def add(self, tensors, name: str = "other_gb") -> int:
        self.new = []
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key != 0 and key not in self.seen:
                self.seen.add(key)
                self.new.append(t)
        away = sum(t.untyped_storage().nbytes() for t in self.new if t.device.type != self.device_type)
        if away:
            self.host[name] = self.host.get(name, 0) + away
        return sum(t.untyped_storage().nbytes() for t in self.new if t.device.type == self.device_type)


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
    """Gradient storage after backward: model and master `.grad`s, the ZeRO wrapper's gradient-named buffers."""
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
        """--model randomly initialised on this device (bf16 on CUDA), setting vocab and n_params; under a ZeRO-3
        `cfg` partitioned as it is built (zero.Init), so a model larger than a GPU (70B: 141 GB in bf16) builds."""
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
        """The engine in training mode, its set-up's transients freed, the memory limit set, the set-up record."""
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
        """Record an OOM (any rank: the one that ran out may not be rank 0) and end now: ranks may be mid-collective,
        the launcher stops the others."""
        msg = str(e).splitlines()[0]
        self.emit({"kind": "oom", "rank": self.rank, "micro_batch": b, "phase": phase, "error": msg,
                   "needed_gb": oom_needed_gb(msg)}, every_rank=True)
        sys.stdout.flush()
        os._exit(17)

    def sync(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()

    def reduce(self, vals: list[float], op: str = "MAX") -> list[float]:
        """`vals` reduced over the ranks by `op` (MAX: the slowest rank's time, the largest peak; SUM: the job's)."""
        t = torch.tensor(vals, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=getattr(self.dist.ReduceOp, op))
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
        """The allocator's peak since the last reset (None on CPU); `reset` starts a new one."""
        self.sync()
        if not self.on_cuda:
            return None
        peak = self.accel.max_memory_allocated() / GIB
        if reset:
            self.accel.reset_peak_memory_stats()
        return peak

    def breakdown(self, x, y) -> dict:
        """One instrumented step: tensors per category and the allocator's view around it."""
        engine, counter = self.engine, StorageCounter(self.device)
        # ZeRO-3 keeps each parameter's partition in `ds_tensor` (the parameter itself is empty between uses)
        weights = counter.add((t for p in engine.module.parameters() for t in (p, getattr(p, "ds_tensor", None))),
                              "model_weights_gb")
        base = base_optimizer(engine)
        # the master partitions (ZeRO-3 lists them in its optimizer's param groups only while it steps)
        zo = engine.optimizer
        masters = master_partitions(zo) if zero_kind(zo) else [p for g in base.param_groups for p in g["params"]]
        master = counter.add(masters, "master_weights_gb")
        # coat.master_weights 'fp32_remainder': the masters' low halves, kept by the partition layouts
        layouts = [getattr(base, "partition_of", lambda p: None)(p) for p in masters]
        master += counter.add((lay.remainder for lay in layouts if getattr(lay, "remainder", None) is not None),
                              "master_weights_gb")
        opt_state = counter.add((t for st in base.state.values() for t in _tensors(st)), "optimizer_state_gb")
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
        fp8_cache = counter.add((t for m in engine.module.modules() for v in vars(m).values()
                                 if isinstance(getattr(v, "_codes", None), dict) for t in v._codes.values()),
                                "fp8_weight_cache_gb")
        # what lives across the step (weights, masters, states, the FP8 weight cache); gradients are left out of
        # it: one allocated as backward goes may sit where a freed activation was, at the same address
        kept = set(counter.seen)
        grads = counter.add(grad_tensors(engine), "grads_gb")
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
                # what the categories above keep off the GPU (pinned host states, Offload): not in its peak
                **({"host_gb": {k: v / GIB for k, v in counter.host.items()}} if counter.host else {}),
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
        peak_alloc, peak_res, dt = self.reduce([accel.max_memory_allocated(), accel.max_memory_reserved(), dt])
        rec = {"kind": "rung", "micro_batch": b, "peak_alloc_gb": peak_alloc / GIB, "peak_reserved_gb": peak_res / GIB,
               "step_time_s": dt / args.steps, "tokens_per_s": b * args.seq_len * self.world * args.steps / dt,
               "loss": float(loss.detach().float()), "fits": bool(peak_res <= self.limit)}
        if first:
            rec["breakdown"] = self.breakdown(x, y)
            rec.update(self.phases(x, y), **self.host_memory())
        return rec

    def phases(self, x, y) -> dict:
        """One more step's forward, backward (under release the optimizer's kernels run there too) and
        engine.step() seconds, synced between them (slowest rank)."""
        marks = [time.perf_counter()]
        loss = self.train_lib.lm_loss(self.engine, x, y)
        for act in (lambda: self.engine.backward(loss), self.engine.step, lambda: None):
            self.sync()
            marks.append(time.perf_counter())
            act()
        fwd, bwd, step = self.reduce([b - a for a, b in zip(marks, marks[1:])])
        return {"phase_s": {"forward": fwd, "backward": bwd, "step": step}}

    def host_memory(self) -> dict:
        """Host GiB of the job: every rank's resident set and peak summed, and the node's MemTotal - MemAvailable."""
        rss, hwm = (v / GIB for v in self.reduce([proc_bytes("VmRSS"), proc_bytes("VmHWM")], "SUM"))
        used = proc_bytes("MemTotal", "/proc/meminfo") - proc_bytes("MemAvailable", "/proc/meminfo")
        return {"host_rss_gb": rss, "host_peak_rss_gb": hwm, "node_used_gb": used / GIB}

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
            spent = time.time() - T0 > args.budget_s or len(points) + (0 if hi is None else 1) >= args.max_rungs
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
    """From PyTorch's OOM message: allocated plus tried to allocate (a lower bound: the step would go on)."""
    unit = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}
    size = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
    tried = re.search(r"Tried to allocate " + size, msg)
    held = re.search(size + r" is allocated by PyTorch", msg)
    return sum(float(m.group(1)) * unit[m.group(2)] for m in (tried, held)) / GIB if tried and held else None


def profile_step(inputs, one_step, sync, on_cuda: bool, b: int) -> dict:
    """A warm step, one at micro-batch `b` timed alone, then two seen from both sides (common.StepProbe): the
    kernels (what limits a GPU-bound step), the host calls and syncs by Python line (a host-bound one)."""
    try:
        x, y = inputs()
        probe, marks = StepProbe(on_cuda), []
        for i in range(4):   # a warm step, the timed one, the two probed
            marks.append(time.perf_counter())
            if i >= 2:
                probe.mark()
            one_step(x, y)
            sync()
        probe.mark()
        return {"kind": "profile", "micro_batch": b, "step_wall_ms": (marks[2] - marks[1]) * 1e3, **probe.result}
    except Exception as e:  # noqa: BLE001 - a profile is a diagnostic; the measurements above stand without it
        return {"kind": "profile", "micro_batch": b, "error": f"{type(e).__name__}: {e}"}


def next_batch(points: list[tuple[int, float]], lo: int | None, hi: int | None, limit: float,
               max_batch: int) -> int | None:
    """The next micro-batch: doubling, cut short by a linear fit of peak memory through the two largest sizes that
    fit, then bisection inside [largest fit, smallest failure)."""
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

