"""HF Trainer against a plain deepspeed.initialize loop on the same DeepSpeed config: tokens/s, memory, and
where the Trainer's extra time goes.

A run (path:preset:model:micro_batch:tuning[:profile]) is a process of its own; docs/benchmarks.md has the commands,
docs/deepspeed.md ("HF Trainer speed") what each tuning changes."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import deepspeed
import torch

from benchmarks import harness
from benchmarks.common import (GIB, ROOT, StepProbe, WarningLog, check_positive, parser, worker_cmd)
from benchmarks.configs import MODELS, build_model, merge_into
from benchmarks.e2e import ratio
from benchmarks.worker import Worker, base_optimizer, oom_needed_gb
from coat_ds.workloads import causal_lm as train_lib

HF_CONFIG = "ds_configs/hf/zero2_coat.json"
PRESETS = {  # name: (label, its HF config; bf16 is HF_CONFIG with AdamW and no "coat" section)
    "bf16": ("BF16 + FusedAdam", HF_CONFIG),
    "coat": ("coat full (shipped)", HF_CONFIG),
    "coat_lowmem": ("coat full, bf16_sr master + attention_fp8", "ds_configs/hf/zero2_lowest_memory.json"),
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


# --- What one run trains: the DeepSpeed config and the TrainingArguments ----------------------------------------------
def parse_run(spec: str) -> dict:
    """path:preset:model:micro_batch:tuning[:profile] -> a dict; ValueError: the bad field and the allowed values."""
    parts = spec.split(":")
    if len(parts) not in (5, 6) or parts[5:] not in ([], ["profile"]):
        raise ValueError(f"--runs {spec!r}: expected path:preset:model:micro_batch:tuning[:profile]")
    path, preset, model, mb, tuning = parts[:5]
    for key, val, allowed in (("path", path, ("trainer", "plain")), ("preset", preset, tuple(PRESETS)),
                              ("model", model, tuple(MODELS)), ("tuning", tuning, tuple(TUNINGS))):
        if val not in allowed:
            raise ValueError(f"--runs {spec!r}: {key} {val!r} is unknown; allowed: {list(allowed)}")
    if not mb.isdigit() or int(mb) < 1:
        raise ValueError(f"--runs {spec!r}: micro_batch {mb!r} is invalid; allowed: an integer >= 1")
    return {"path": path, "preset": preset, "model": model, "micro_batch": int(mb), "tuning": tuning,
            "profiled": len(parts) == 6, "spec": spec}


def hf_ds_config(run: dict) -> dict:
    """The HF-style config ("auto" values) of the run's preset under its tuning."""
    cfg = json.loads((ROOT / PRESETS[run["preset"]][1]).read_text())
    if run["preset"] == "bf16":   # the same settings with AdamW (FusedAdam on GPUs) and stock layers
        cfg.pop("coat", None)
        cfg["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
        if not torch.cuda.is_available():
            cfg["optimizer"]["params"]["torch_adam"] = True
    merge_into(cfg, TUNINGS[run["tuning"]][0])
    return cfg


def training_args(run: dict, steps: int, out_dir: str):
    """Default TrainingArguments on the run's HF config but for steps, batch, warm-up, no saving or reports."""
    from transformers import TrainingArguments

    on_cuda = torch.cuda.is_available()
    kw = dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=run["micro_batch"],
              bf16=on_cuda, use_cpu=not on_cuda, deepspeed=hf_ds_config(run), report_to="none", save_strategy="no",
              warmup_steps=2, learning_rate=3e-4, weight_decay=0.1, adam_beta2=0.95, disable_tqdm=True, seed=1234)
    kw.update(TUNINGS[run["tuning"]][1])
    return TrainingArguments(**kw)


# --- Measuring: the same clock and probe for both paths, driven at each step's end ------------------------------------
class Meter:
    """What either path calls at each step's end: the clock (the median interval between step ends after the
    warm-up, and their mean between two syncs; peaks reset there) and a profiled run's StepProbe after them."""

    def __init__(self, run: dict, args: argparse.Namespace, on_cuda: bool) -> None:
        self.run, self.args, self.on_cuda = run, args, on_cuda
        self.last = args.warmup + args.steps                      # the last timed step
        self.total = self.last + (2 if run["profiled"] else 0)
        self.t0 = self.t_end = None
        self.ends: list[float] = []
        self.probe = StepProbe(on_cuda) if run["profiled"] else None

    def step_end(self, k: int) -> None:
        """k: the number of the step that just ended (1-based)."""
        if k == self.args.warmup:
            if self.on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()
        elif self.args.warmup < k <= self.last:
            self.ends.append(time.perf_counter())
        if k == self.last:
            if self.on_cuda:
                torch.cuda.synchronize()
            self.t_end = time.perf_counter()
        if self.probe is not None and self.last <= k <= self.last + 2:
            self.probe.mark()

    def result(self, engine, loss: float) -> dict:
        """The run's row: step times, memory, what the engine was built with, the last loss, the probe's."""
        if self.t_end is None:
            raise RuntimeError(f"the run ended before step {self.last}")
        intervals = [b - a for a, b in zip([self.t0] + self.ends, self.ends)]
        med, mean = statistics.median(intervals), (self.t_end - self.t0) / self.args.steps
        tokens = self.run["micro_batch"] * self.args.seq_len
        mem = {"peak_alloc_gb": None, "peak_reserved_gb": None, "fits": True}
        if self.on_cuda:
            res = torch.cuda.max_memory_reserved()
            mem = {"peak_alloc_gb": torch.cuda.max_memory_allocated() / GIB, "peak_reserved_gb": res / GIB,
                   "fits": res <= self.args.mem_fraction * torch.cuda.get_device_properties(0).total_memory}
        base = base_optimizer(engine)
        return {"step_time_s": med, "step_time_mean_s": mean, "tokens_per_s": tokens / med,
                "tokens_per_s_mean": tokens / mean, "step_times_s": intervals, **mem,
                "engine": type(engine).__name__, "optimizer": type(base).__name__,
                "param_groups": len(base.param_groups),
                "zero_optimization": dict(engine._config._param_dict.get("zero_optimization", {})),
                "fp8_layers": sum(type(m).__name__ == "CoatDecoderLayer" for m in engine.module.modules()),
                "loss": loss, "profile": self.probe and self.probe.result}


# --- Workers: one run each --------------------------------------------------------------------------------------------
def trainer_worker(run: dict, args: argparse.Namespace) -> dict:
    """HF Trainer with the run's config and TrainingArguments; the meter in an on_step_end callback."""
    from transformers import Trainer, TrainerCallback

    train_lib.set_single_process_env()
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    meter = Meter(run, args, on_cuda)

    class Measure(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            meter.step_end(state.global_step)

    model = build_model(run["model"], device, torch.bfloat16 if on_cuda else torch.float32, 1234)
    targs = training_args(run, meter.total, args.scratch)
    ids = torch.randint(0, model.config.vocab_size, (meter.total * run["micro_batch"], args.seq_len),
                        generator=torch.Generator().manual_seed(1234))
    data = [{"input_ids": x, "labels": x} for x in ids]   # random tokens; HF shifts the labels itself
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()])
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h] or [out.training_loss]
    return meter.result(trainer.model_wrapped, losses[-1])


class PlainWorker(Worker):
    """e2e's loop on the config as HF Trainer fills it, the model as it runs it (use_cache off), HF's one param
    group."""

    def setup_engine(self):
        run, total = self.args.run, self.args.total
        net = self.model()
        net.config.use_cache = False
        targs = training_args(run, total, self.args.scratch)
        targs.hf_deepspeed_config.trainer_config_finalize(targs, net, total)   # HF's own fill of the "auto" values
        engine, *_ = deepspeed.initialize(model=net, config=targs.hf_deepspeed_config.config,
                                          model_parameters=[q for q in net.parameters() if q.requires_grad])
        engine.train()
        return engine


def plain_worker(run: dict, args: argparse.Namespace) -> dict:
    meter = Meter(run, args, torch.cuda.is_available())
    w = PlainWorker(argparse.Namespace(result=args.result, seed=1234, seq_len=args.seq_len, model=run["model"],
                                       run=run, total=meter.total, scratch=args.scratch))
    x, y = w.rung_inputs(run["micro_batch"])
    for k in range(1, meter.total + 1):
        loss = w.one_step(x, y)
        meter.step_end(k)
    return meter.result(w.engine, float(loss.detach().float()))


def worker(args: argparse.Namespace) -> int:
    run = parse_run(args.run)
    t0, wlog = time.time(), WarningLog()
    try:
        rec = (trainer_worker if run["path"] == "trainer" else plain_worker)(run, args)
    except torch.OutOfMemoryError as e:
        msg = str(e).splitlines()[0]
        rec = {"oom": msg, "needed_gb": oom_needed_gb(msg)}
    rec.update(run, wall_s=time.time() - t0, config=hf_ds_config(run), coat_warnings=wlog.messages)
    Path(args.result).write_text(json.dumps(rec))
    return 0


# --- Parent: one worker per run, then the ratios and the chart --------------------------------------------------------
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


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options and the runs (--runs, or the plan's), every run checked before any process starts."""
    p = parser(__doc__, "out", "seq_len", "mem_fraction", "verbose", worker=True, steps=(6, "timed steps"),
               warmup=(5, "untimed steps (coat's first steps tune GEMMs)"),
               time_budget=(520.0, "seconds for everything (JIT builds included); runs that would start later are "
                                   "skipped"), smoke="tiny model on the CPU: checks the script only")
    p.add_argument("--plan", default="all", choices=[k for k in PLANS if k != "smoke"])
    p.add_argument("--runs", nargs="+", help="path:preset:model:micro_batch:tuning ... (instead of --plan)")
    p.add_argument("--merge", action="store_true", help="keep the rows of an existing hf_trainer.json not rerun now")
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--scratch", default="/tmp/hf_trainer_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_positive(p, args, ("seq_len", "warmup", "steps"))
    if args.smoke:
        args.seq_len, args.warmup, args.steps = 32, 1, 2
    specs = args.runs or PLANS["smoke" if args.smoke else args.plan]
    for s in specs:
        try:
            parse_run(s)
        except ValueError as e:
            p.error(str(e))
    return args, specs


def run_one(spec: str, args: argparse.Namespace, out: Path, deadline: harness.Deadline) -> dict:
    """One run's worker -> its row (or how it failed)."""
    print(f"== {spec}", flush=True)
    r = harness.worker_row(lambda result: worker_cmd(
        "benchmarks.hf_trainer_speed", args, ("seq_len", "warmup", "steps", "mem_fraction"), run=spec,
        result=result, scratch=out / "trainer_out"), deadline.left(), echo=lambda line: args.verbose, **parse_run(spec))
    if "error" in r:
        print(f"   failed: {r['error']}", flush=True)
    if "tokens_per_s" in r:
        print(f"   {r['tokens_per_s']:,.0f} tok/s (median), {r['tokens_per_s_mean']:,.0f} (mean), peak "
              f"{r['peak_alloc_gb'] or 0:.2f} GiB, {r['wall_s']:.0f} s", flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    args, specs = parse_args(argv)
    if args.worker:
        return harness.worker_exit(lambda: worker(args))
    out, t0, done, call = Path(args.out), time.time(), {}, harness.this_call()
    out.mkdir(parents=True, exist_ok=True)
    setting = {"seq_len": args.seq_len, "warmup_steps": args.warmup, "timed_steps": args.steps}
    ours = {**setting, "hf_config": HF_CONFIG, "tunings": TUNINGS, "presets": {k: v[0] for k, v in PRESETS.items()},
            "targets": TARGETS, "smoke": args.smoke}
    into = lambda rows: harness.into_file(out / "hf_trainer.json" if args.merge else None, rows,  # noqa: E731
                                          lambda r: r["spec"], ours, call, setting, "runs")
    into([])   # --merge: the runs not rerun now stay, so they must have been timed alike (refused before any run)
    deadline = harness.Deadline(args.time_budget, start=t0)
    harness.run_waves([[s] for s in specs], deadline, lambda _, s: done.update({s: run_one(s, args, out, deadline)}),
                      lambda *_: None, str, est=lambda s: NEEDS_S.get(parse_run(s)["model"], 45))
    res = into([done.get(s) or {**parse_run(s), "error": f"skipped: time budget ({args.time_budget:.0f} s) spent"}
                for s in specs])
    res.update(**summarize(res["runs"]), wall_s=time.time() - t0)
    res["targets_met"] = targets_met(res)
    path = harness.write_results(res, out, "hf_trainer")
    print(json.dumps({k: res[k] for k in ("trainer_over_plain", "coat_over_bf16", "targets_met")}, indent=1))
    print(f"-> {path}")
    return 0 if all("error" not in r and "oom" not in r for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
