"""HF Trainer against a plain deepspeed.initialize loop on the same DeepSpeed config: tokens/s, memory, and
where the Trainer's extra time goes (device syncs by Python line, Python functions, top host calls and GPU
idle gaps of one step).

    python benchmarks/hf_trainer_speed.py --out benchmarks/results          # one H100, < 9 min: the plan "all"
    python benchmarks/hf_trainer_speed.py --runs trainer:coat:llama-1b:4:one_gpu:profile --out /tmp/hf
    python benchmarks/hf_trainer_speed.py --smoke --out /tmp/hf              # CPU, tiny: checks the script only

A run is path:preset:model:micro_batch:tuning[:profile], each in its own process (a DeepSpeed engine never
gives its memory back); the plan lists them in order of priority and --time-budget skips what does not fit.
Presets: the shipped HF config ds_configs/hf/zero2_coat.json ("coat"), the same with AdamW and no "coat"
section ("bf16"), the lowest-memory one ("coat_lowmem": bf16 master with stochastic rounding, attention
saved in FP8). Tunings (docs/deepspeed.md, "HF Trainer speed"): "hf_auto" (the issue's case: default
TrainingArguments and reduce_bucket_size "auto", which HF fills with hidden_size^2), "tuned"
(reduce_bucket_size 5e7, no per-step NaN check of the loss, non-blocking input copies) and "one_gpu"
(tuned, and overlap_comm off).
The plain loop (benchmarks/e2e.py's harness) runs the config exactly as HF Trainer fills it (HF's own
HfTrainerDeepSpeedConfig), on the model as the Trainer runs it (use_cache off, one param group). Step time:
the median interval between consecutive step ends after the warm-up (Trainer: an on_step_end callback),
beside the mean over the timed steps between two device syncs. Random tokens.

Output: hf_trainer.json (device, versions, command, date, one row per run, the ratios the targets name)
and hf_trainer.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (the plain-loop harness, model shapes, run metadata)

ROOT = e2e.ROOT
HF_CONFIG = "ds_configs/hf/zero2_coat.json"
PRESETS = {  # name: (label, its own HF config file if shipped, else what it adds to or removes from HF_CONFIG)
    "bf16": ("BF16 + FusedAdam", None, None),
    "coat": ("coat full (shipped)", None, {}),
    "coat_lowmem": ("coat full, bf16_sr master + attention_fp8", "ds_configs/hf/zero2_lowest_memory.json",
                    {"master_weights": "bf16_sr", "activation": {"attention_fp8": True}}),
}
_HF_ARGS = {"logging_nan_inf_filter": False, "accelerator_config": {"non_blocking": True}}
TUNINGS = {  # name: (DeepSpeed config overrides, TrainingArguments overrides)
    # the case: HF's "auto" bucket (hidden_size^2, whatever the config says) and default TrainingArguments
    "hf_auto": ({"zero_optimization": {"reduce_bucket_size": "auto"}}, {}),
    # any world size: fewer ZeRO-1/2 gradient buckets (host work and stream handoffs per bucket), HF's syncs off
    "tuned": ({"zero_optimization": {"reduce_bucket_size": 50_000_000}}, _HF_ARGS),
    # one GPU: nothing to overlap, so no reduction stream to hand each bucket to and back
    "one_gpu": ({"zero_optimization": {"reduce_bucket_size": 50_000_000, "overlap_comm": False}}, _HF_ARGS),
}
_1B4 = "llama-1b:4"
PLANS = {  # runs in order of priority (the time budget skips the last ones); ":profile" adds the probe's two steps
    "all": [f"trainer:coat:{_1B4}:hf_auto:profile", f"trainer:coat:{_1B4}:one_gpu:profile",   # the issue; the fix
            f"plain:coat:{_1B4}:one_gpu:profile", f"trainer:bf16:{_1B4}:one_gpu",              # the two targets
            "trainer:coat_lowmem:llama2-7b:4:one_gpu",                                         # 7B on one GPU
            "trainer:coat:llama-1b:28:one_gpu", "plain:coat:llama-1b:28:one_gpu",             # largest batches
            "trainer:bf16:llama-1b:12:one_gpu", "plain:bf16:llama-1b:12:one_gpu",
            f"trainer:bf16:{_1B4}:hf_auto", f"trainer:coat:{_1B4}:tuned", f"plain:coat:{_1B4}:tuned",
            f"plain:bf16:{_1B4}:one_gpu", "plain:coat_lowmem:llama2-7b:4:one_gpu"],
    "smoke": ["trainer:bf16:tiny:1:hf_auto", "trainer:coat:tiny:1:hf_auto:profile", "trainer:coat:tiny:1:one_gpu",
              "plain:coat:tiny:1:one_gpu:profile"],
}
NEEDS_S = {"llama2-7b": 150, "tiny": 10}   # a run's wall time on one H100 (1.1B: 45 s): don't start one that can't end
TARGETS = {"trainer_over_plain_coat": 0.9, "coat_over_bf16_trainer_mb4": 1.3}
GIB = 2 ** 30


# ---------------------------------------------------------------------------------------------------------
# What one run trains: the DeepSpeed config and the TrainingArguments
# ---------------------------------------------------------------------------------------------------------
def parse_run(spec: str) -> dict:
    """path:preset:model:micro_batch:tuning[:profile] -> a dict; ValueError naming the bad field and the allowed
    values."""
    parts = spec.split(":")
    if len(parts) not in (5, 6) or parts[5:] not in ([], ["profile"]):
        raise ValueError(f"--runs {spec!r}: expected path:preset:model:micro_batch:tuning[:profile]")
    path, preset, model, mb, tuning = parts[:5]
    for key, val, allowed in (("path", path, ("trainer", "plain")), ("preset", preset, tuple(PRESETS)),
                              ("model", model, tuple(e2e.MODELS)), ("tuning", tuning, tuple(TUNINGS))):
        if val not in allowed:
            raise ValueError(f"--runs {spec!r}: {key} {val!r} is unknown; allowed: {list(allowed)}")
    if not mb.isdigit() or int(mb) < 1:
        raise ValueError(f"--runs {spec!r}: micro_batch {mb!r} is invalid; allowed: an integer >= 1")
    return {"path": path, "preset": preset, "model": model, "micro_batch": int(mb), "tuning": tuning,
            "profiled": len(parts) == 6, "spec": spec}


def hf_ds_config(preset: str, tuning: str, on_cpu: bool) -> dict:
    """The HF-style config ("auto" values) of a preset under a tuning."""
    _, own, extra = PRESETS[preset]
    if own is not None and (ROOT / own).is_file():
        cfg, extra = json.loads((ROOT / own).read_text()), {}
    else:
        cfg = json.loads((ROOT / HF_CONFIG).read_text())
    if extra is None:   # BF16 baseline: the same settings with AdamW (FusedAdam on GPUs) and stock layers
        cfg.pop("coat", None)
        cfg["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
        if on_cpu:
            cfg["optimizer"]["params"]["torch_adam"] = True
    else:
        e2e.merge_into(cfg.setdefault("coat", {}), extra)
    e2e.merge_into(cfg, TUNINGS[tuning][0])
    return cfg


def training_args(run: dict, cfg: dict, steps: int, out_dir: str):
    """Default TrainingArguments but for what the benchmark fixes (steps, batch, warm-up, no saving or reports)."""
    import torch
    from transformers import TrainingArguments

    on_cuda = torch.cuda.is_available()
    kw = dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=run["micro_batch"],
              bf16=on_cuda, use_cpu=not on_cuda, deepspeed=cfg, report_to="none", save_strategy="no",
              warmup_steps=2, learning_rate=3e-4, weight_decay=0.1, adam_beta2=0.95, disable_tqdm=True, seed=1234)
    kw.update(TUNINGS[run["tuning"]][1])
    return TrainingArguments(**kw)


class RandomTokens:
    """Windows of random tokens as {"input_ids", "labels"} (HF shifts the labels itself)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import torch

        g = torch.Generator().manual_seed(self.seed + i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------------------------------------------------
# Measuring: the same clock and probe for both paths, driven at each step's end
# ---------------------------------------------------------------------------------------------------------
class StepClock:
    """Step ends after the warm-up: per-step intervals (the median is the headline) and the mean over the
    timed steps between two device syncs; the allocator's peaks are reset where the timed steps begin."""

    def __init__(self, warmup: int, steps: int, sync, reset_peak) -> None:
        self.warmup, self.steps, self.sync, self.reset_peak = warmup, steps, sync, reset_peak
        self.t0, self.t_end, self.ends = None, None, []

    def step_end(self, k: int) -> None:
        """k: the number of the step that just ended (1-based)."""
        if k == self.warmup:
            self.sync()
            self.reset_peak()
            self.t0 = time.perf_counter()
        elif self.warmup < k <= self.warmup + self.steps:
            self.ends.append(time.perf_counter())
            if k == self.warmup + self.steps:
                self.sync()
                self.t_end = time.perf_counter()

    def summary(self, tokens_per_step: int) -> dict:
        if self.t_end is None:
            raise RuntimeError(f"StepClock: the run ended before step {self.warmup + self.steps}")
        intervals = [b - a for a, b in zip([self.t0] + self.ends, self.ends)]
        med, mean = statistics.median(intervals), (self.t_end - self.t0) / self.steps
        return {"step_time_s": med, "step_time_mean_s": mean, "tokens_per_s": tokens_per_step / med,
                "tokens_per_s_mean": tokens_per_step / mean, "step_times_s": intervals}


def python_top(stats, n: int = 40) -> list[dict]:
    """The Python functions of one step with the most cumulative time (cProfile, which slows Python ~2x: read
    the ranking, not the milliseconds), a function per file:line; the profiler's own frames left out."""
    rows = sorted(((ct, nc, tt, f"{Path(fn).parent.name}/{Path(fn).name}:{ln} {name}")
                   for (fn, ln, name), (_, nc, tt, ct, _) in stats.stats.items()
                   if "hf_trainer_speed.py" not in fn and "cProfile" not in fn and fn != "~"), reverse=True)
    return [{"function": f, "calls": nc, "cum_ms": ct * 1e3, "self_ms": tt * 1e3} for ct, nc, tt, f in rows[:n]]


class count_synchronize:
    """Counts torch.cuda.synchronize calls by the first caller outside torch and DeepSpeed's accelerator until
    stop() (CUDA's sync debug mode does not report an explicit device sync; DeepSpeed's ZeRO-1/2 make one per
    gradient bucket under overlap_comm where use_multi_rank_bucket_allreduce is false)."""

    def __init__(self) -> None:
        import torch

        self.sites: dict[str, int] = {}
        self._orig = torch.cuda.synchronize

        def counted(*a, **kw):
            f = sys._getframe(1)
            while f is not None and ("/torch/" in f.f_code.co_filename or "/accelerator/" in f.f_code.co_filename):
                f = f.f_back
            where = "?" if f is None else f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"
            self.sites[where] = self.sites.get(where, 0) + 1
            return self._orig(*a, **kw)
        torch.cuda.synchronize = counted

    def stop(self) -> dict[str, int]:
        import torch

        torch.cuda.synchronize = self._orig
        return dict(sorted(self.sites.items(), key=lambda kv: -kv[1]))


class Probe:
    """Two windows of one step each, from one step's end to the next: the device syncs made in the first (CUDA's
    sync debug mode, by Python line) and its Python functions (cProfile), and a torch.profiler trace of the
    second (top kernels, top host calls, GPU idle gaps)."""

    def __init__(self, first: int, on_cuda: bool, sync, top: int = 15) -> None:
        self.first, self.on_cuda, self.sync, self.top = first, on_cuda, sync, top
        self.result: dict = {}
        self._caught = self._prof = None

    def step_end(self, k: int) -> None:
        import torch

        if k == self.first:
            import cProfile

            if self.on_cuda:
                self._warn = warnings.catch_warnings(record=True)
                self._caught = self._warn.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            self._sync_sites = count_synchronize() if self.on_cuda else None
            self._cprof = cProfile.Profile()
            self._cprof.enable()
        elif k == self.first + 1:
            import pstats

            self._cprof.disable()
            stats = pstats.Stats(self._cprof)
            self.result["python_top"] = python_top(stats)
            self.result["zero_reductions"] = sum(v[1] for (fn, _, name), v in stats.stats.items()
                                                 if name == "average_tensor" and "stage_1_and_2" in fn)
            if self._sync_sites is not None:
                self.result["device_synchronize"] = self._sync_sites.stop()
            if self._caught is not None:
                torch.cuda.set_sync_debug_mode("default")
                self._warn.__exit__(None, None, None)
                self.result["syncs"] = e2e.sync_sites(self._caught)
            self.result.setdefault("syncs", {})
            self._start_profile()
        elif k == self.first + 2 and self._prof is not None:
            self.sync()
            self._prof.__exit__(None, None, None)
            self.result.update(self._summary(self._prof, time.perf_counter() - self._t0))

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _summary(self, prof, wall_s: float) -> dict:
        import tempfile

        events = prof.key_averages()
        attr = e2e.device_time_attr(events) if self.on_cuda else "self_cpu_time_total"
        kernels, device_ms = e2e.rows_of(events, attr, e2e.is_device_event if self.on_cuda else (lambda e: True),
                                         self.top)
        host, host_ms = e2e.rows_of(events, "self_cpu_time_total", lambda e: True, self.top)
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(f"{d}/trace.json")
            trace = json.loads(Path(f"{d}/trace.json").read_text())
        from llama_layer import gpu_gaps
        return {"step_wall_ms": wall_s * 1e3, "device_ms": device_ms if self.on_cuda else None,
                "host_self_ms": host_ms, "top_kernels": kernels if self.on_cuda else [], "host_top": host,
                "gpu_gaps": gpu_gaps(trace).splitlines()}


def device_of(on_cuda: bool):
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")


def memory(on_cuda: bool, limit_fraction: float) -> dict:
    import torch

    if not on_cuda:
        return {"peak_alloc_gb": None, "peak_reserved_gb": None, "fits": True}
    res = torch.cuda.max_memory_reserved()
    return {"peak_alloc_gb": torch.cuda.max_memory_allocated() / GIB, "peak_reserved_gb": res / GIB,
            "fits": res <= limit_fraction * torch.cuda.get_device_properties(0).total_memory}


def engine_facts(engine) -> dict:
    """What the engine was built with: the ZeRO settings DeepSpeed got, the optimizer and its param groups."""
    base = e2e.base_optimizer(engine)
    zero = dict(engine._config._param_dict.get("zero_optimization", {}))
    return {"engine": type(engine).__name__, "optimizer": type(base).__name__,
            "param_groups": len(base.param_groups), "zero_optimization": zero,
            "fp8_layers": sum(type(m).__name__ == "CoatDecoderLayer" for m in engine.module.modules())}


# ---------------------------------------------------------------------------------------------------------
# Workers: one run each
# ---------------------------------------------------------------------------------------------------------
def _model(run: dict, on_cuda: bool):
    import torch

    return e2e.build_model(run["model"], device_of(on_cuda), torch.bfloat16 if on_cuda else torch.float32, 1234)


def _sync_and_peak(on_cuda: bool):
    import torch

    if not on_cuda:
        return (lambda: None), (lambda: None)
    return torch.cuda.synchronize, torch.cuda.reset_peak_memory_stats


def trainer_worker(run: dict, args: argparse.Namespace) -> dict:
    """HF Trainer with the run's config and TrainingArguments; clock and probe in an on_step_end callback."""
    import torch

    from coat_ds.recipes import causal_lm as train_lib

    train_lib.set_single_process_env()
    import coat_ds  # noqa: F401  DeepSpeed's engine now knows "CoatAdamW" and the "coat" section
    from transformers import Trainer, TrainerCallback

    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(device_of(True))
    sync, reset_peak = _sync_and_peak(on_cuda)
    total = args.warmup + args.steps + (2 if run["profiled"] else 0)
    clock = StepClock(args.warmup, args.steps, sync, reset_peak)
    probe = Probe(args.warmup + args.steps, on_cuda, sync) if run["profiled"] else None

    class Measure(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            clock.step_end(state.global_step)
            if probe is not None:
                probe.step_end(state.global_step)

    model = _model(run, on_cuda)
    cfg = hf_ds_config(run["preset"], run["tuning"], not on_cuda)
    targs = training_args(run, cfg, total, args.scratch)
    data = RandomTokens(total * run["micro_batch"], args.seq_len, model.config.vocab_size, 1234)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()])
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h] or [out.training_loss]
    return {**clock.summary(run["micro_batch"] * args.seq_len), **memory(on_cuda, args.mem_fraction),
            **engine_facts(trainer.model_wrapped), "loss": losses[-1],
            "profile": probe.result if probe is not None else None}


def plain_worker(run: dict, args: argparse.Namespace) -> dict:
    """benchmarks/e2e.py's loop (forward, engine.backward, engine.step) on the config HF Trainer would fill."""
    import torch

    on_cuda = torch.cuda.is_available()
    total = args.warmup + args.steps + (2 if run["profiled"] else 0)

    class Plain(e2e.Worker):
        def setup_engine(self):
            net = _model(run, self.on_cuda)
            net.config.use_cache = False        # as HF Trainer runs it (TrainingArguments.use_cache)
            self.vocab, self.limit = net.config.vocab_size, float("inf")
            cfg = hf_ds_config(run["preset"], run["tuning"], not self.on_cuda)
            targs = training_args(run, cfg, total, args.scratch)   # HF's own fill of the "auto" values
            targs.hf_deepspeed_config.trainer_config_finalize(targs, net, total)
            import deepspeed
            # as HF Trainer builds it: one param group of every trainable parameter (a config "optimizer")
            engine, *_ = deepspeed.initialize(model=net, config=targs.hf_deepspeed_config.config,
                                              model_parameters=[q for q in net.parameters() if q.requires_grad])
            engine.train()
            return engine

    w = Plain(argparse.Namespace(result=args.result, seed=1234, seq_len=args.seq_len))
    sync, reset_peak = _sync_and_peak(on_cuda)
    clock = StepClock(args.warmup, args.steps, sync, reset_peak)
    probe = Probe(args.warmup + args.steps, on_cuda, sync) if run["profiled"] else None
    x, y = w.rung_inputs(run["micro_batch"])
    for k in range(1, total + 1):
        loss = w.one_step(x, y)
        clock.step_end(k)
        if probe is not None:
            probe.step_end(k)
    return {**clock.summary(run["micro_batch"] * args.seq_len), **memory(on_cuda, args.mem_fraction),
            **engine_facts(w.engine), "loss": float(loss.detach().float()),
            "profile": probe.result if probe is not None else None}


def worker(args: argparse.Namespace) -> int:
    import torch

    run = parse_run(args.run)
    t0, wlog = time.time(), e2e.WarningLog()
    try:
        rec = (trainer_worker if run["path"] == "trainer" else plain_worker)(run, args)
    except torch.OutOfMemoryError as e:
        rec = {"oom": str(e).splitlines()[0], "needed_gb": e2e.oom_needed_gb(str(e).splitlines()[0])}
    cfg = hf_ds_config(run["preset"], run["tuning"], not torch.cuda.is_available())
    rec.update(run, wall_s=time.time() - t0, config=cfg, coat_warnings=wlog.messages)
    Path(args.result).write_text(json.dumps(rec))
    return 0


# ---------------------------------------------------------------------------------------------------------
# Parent: one worker per run, then the ratios and the chart
# ---------------------------------------------------------------------------------------------------------
def launch(spec: str, args: argparse.Namespace, result: Path, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--run", spec, "--result", str(result),
           "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--mem-fraction", str(args.mem_fraction), "--scratch", str(result.parent / "trainer_out")]
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    print(f"== {spec}", flush=True)
    result.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        tail, rc = proc.stdout[-3000:], proc.returncode
    except subprocess.TimeoutExpired as e:
        tail, rc = (e.stdout or b"")[-3000:], 124
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    if rc == 0 and result.exists():
        rec = json.loads(result.read_text())
    else:
        rec = {**parse_run(spec), "error": f"worker exit {rc}: {tail}"}
    if args.verbose or "error" in rec:
        print(tail, flush=True)
    return rec


def ratio(a, b):
    return a / b if a and b else None


def summarize(rows: list[dict]) -> dict:
    """Trainer over plain for each run both paths ran; coat over BF16 per (path, model, batch, tuning)."""
    tps = {(r["path"], r["preset"], r["model"], r["micro_batch"], r["tuning"]): r.get("tokens_per_s") for r in rows}
    trainer_over_plain, coat_over_bf16 = {}, {}
    for (path, preset, model, mb, tuning), v in tps.items():
        key = f"{preset}:{model}:{mb}:{tuning}"
        if path == "trainer" and ("plain", preset, model, mb, tuning) in tps:
            trainer_over_plain[key] = ratio(v, tps[("plain", preset, model, mb, tuning)])
        if preset == "coat" and (path, "bf16", model, mb, tuning) in tps:
            coat_over_bf16[f"{path}:{model}:{mb}:{tuning}"] = ratio(v, tps[(path, "bf16", model, mb, tuning)])
    return {"trainer_over_plain": trainer_over_plain, "coat_over_bf16": coat_over_bf16}


def targets_met(summary: dict) -> dict:
    """The issue's targets, where this run measured them (None: not measured here)."""
    top = summary["trainer_over_plain"].get("coat:llama-1b:4:one_gpu")
    cob = summary["coat_over_bf16"].get("trainer:llama-1b:4:one_gpu")
    return {"trainer_over_plain_coat_1b_mb4": None if top is None else top >= TARGETS["trainer_over_plain_coat"],
            "coat_over_bf16_trainer_1b_mb4": None if cob is None else cob >= TARGETS["coat_over_bf16_trainer_mb4"]}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["runs"] if r.get("tokens_per_s")]
    labels = [f"{r['path']}\n{r['preset']}\n{r['model']} mb{r['micro_batch']}\n{r['tuning']}" for r in rows]
    colors = [("#1f77b4" if r["path"] == "trainer" else "#aec7e8") if r["preset"] == "bf16" else
              ("#d62728" if r["path"] == "trainer" else "#ff9896") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    ax.bar(range(len(rows)), [r["tokens_per_s"] / 1e3 for r in rows], color=colors)
    for i, r in enumerate(rows):
        mem = r.get("peak_alloc_gb")
        ax.text(i, r["tokens_per_s"] / 1e3, f"{r['tokens_per_s'] / 1e3:.1f}k" + (f"\n{mem:.1f} GiB" if mem else ""),
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("tokens/s (thousands, median step)")
    ax.set_title(f"HF Trainer vs plain deepspeed.initialize loop, {res['device']}, seq {res['seq_len']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prebuild() -> dict:
    """JIT-build the CUDA ops side by side before any timed run (a bare node has none built); their exit codes
    and seconds (a failed build leaves the runs on the slow reference path: coat_warnings say so too)."""
    snippets = {"FusedAdam": "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()",
                "CoatAdam": "from coat_ds.kernels.loader import load_op; assert load_op('CoatAdamBuilder')",
                "CoatQuant": "from coat_ds.kernels.loader import load_op; assert load_op('CoatQuantBuilder')"}
    t0 = time.time()
    procs = {k: subprocess.Popen([sys.executable, "-c", s], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for k, s in snippets.items()}
    out = {k: {"rc": p.wait(), "tail": p.stdout.read()[-500:]} for k, p in procs.items()}
    return {"seconds": time.time() - t0, **{k: v if v["rc"] else {"rc": 0} for k, v in out.items()}}


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description="HF Trainer against a plain deepspeed.initialize loop, same config")
    p.add_argument("--plan", default="all", choices=[k for k in PLANS if k != "smoke"])
    p.add_argument("--runs", nargs="+", help="path:preset:model:micro_batch:tuning ... (instead of --plan)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (coat's first steps tune GEMMs)")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--mem-fraction", type=float, default=0.95, help="'fits': peak reserved <= this x device memory")
    p.add_argument("--time-budget", type=float, default=520.0,
                   help="seconds for everything (JIT builds included); runs that would start later are skipped")
    p.add_argument("--merge", action="store_true", help="keep the rows of an existing hf_trainer.json not rerun now")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script only")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--scratch", default="/tmp/hf_trainer_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    e2e.check_positive(p, args, ("seq_len", "warmup", "steps"))
    return p, args


def specs_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    if args.smoke:
        args.seq_len, args.warmup, args.steps = 32, 1, 2
        specs = args.runs or PLANS["smoke"]
    else:
        specs = args.runs or PLANS[args.plan]
    for s in specs:
        try:
            parse_run(s)
        except ValueError as e:
            p.error(str(e))
    return specs


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.worker:
        return worker(args)
    specs = specs_of(p, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import torch
    built = prebuild() if torch.cuda.is_available() else None
    print(f"prebuild: {built}", flush=True)
    rows = []
    for i, spec in enumerate(specs):
        left = args.time_budget - (time.time() - t0)
        if left < NEEDS_S.get(parse_run(spec)["model"], 45):
            rows.append({**parse_run(spec), "error": f"skipped: time budget ({args.time_budget:.0f} s) spent"})
            continue
        rows.append(launch(spec, args, out / "hf_trainer_run.json", left))
        r = rows[-1]
        if "tokens_per_s" in r:
            print(f"   {r['tokens_per_s']:,.0f} tok/s (median), {r['tokens_per_s_mean']:,.0f} (mean), peak "
                  f"{r['peak_alloc_gb'] or 0:.2f} GiB, {r['wall_s']:.0f} s", flush=True)
    (out / "hf_trainer_run.json").unlink(missing_ok=True)
    path = out / "hf_trainer.json"
    if args.merge and path.exists():
        rows = [r for r in json.loads(path.read_text())["runs"] if r["spec"] not in specs] + rows
    res = {"device": e2e.device_name(), "seq_len": args.seq_len, "warmup_steps": args.warmup,
           "timed_steps": args.steps, "hf_config": HF_CONFIG, "tunings": TUNINGS,
           "presets": {k: v[0] for k, v in PRESETS.items()}, "runs": rows, **summarize(rows), "targets": TARGETS}
    res.update(targets_met=targets_met(res), versions=e2e.versions(), command=e2e.command(), date=e2e.now(),
               wall_s=time.time() - t0, smoke=args.smoke, prebuild=built)
    path.write_text(json.dumps(res, indent=1))
    try:
        plot(res, out / "hf_trainer.png")
    except ImportError as e:
        print(f"warning: no plot ({e})", file=sys.stderr)
    print(json.dumps({k: res[k] for k in ("trainer_over_plain", "coat_over_bf16", "targets_met")}, indent=1))
    print(f"-> {path}")
    return 0 if all("error" not in r and "oom" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
