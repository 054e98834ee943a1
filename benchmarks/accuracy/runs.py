"""One run of the main job (`deepspeed examples/train.py`): its command, its launch under a deadline (a signal the
job answers by checkpointing, so that --resume continues it), and what its run directory holds, as curves."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.accuracy.recipe import Recipe
from benchmarks.common import ROOT, free_port, launcher, read_json, read_log
from benchmarks.harness import Deadline, run_process

PROGRESS_S = 60.0


def command(recipe: Recipe, config: str, seed: int, gpus: int, run_dir: Path, data_root: Path,
            model: Path | None = None, export: Path | None = None, resume: bool = False,
            devices: str | None = None) -> list[str]:
    """The main job's command line for one run of DeepSpeed config file `config` (a fine-tuning when `model` is
    given: validated before its first step too), on `gpus` GPUs: these CUDA ids where `devices` names them (runs
    side by side), else the first."""
    where = ["--include", f"localhost:{devices}"] if devices else ["--num_gpus", str(gpus)]
    cmd = [launcher(), *where, "--master_port", str(free_port()), "examples/train.py",
           "--deepspeed", config, "--data", str(data_root / recipe.corpus), "--seq-len", str(recipe.seq_len),
           "--micro-batch", str(recipe.global_batch // gpus), "--steps", str(recipe.steps), "--lr", str(recipe.lr),
           "--warmup-steps", str(recipe.warmup_steps), "--eval-every", str(recipe.eval_every),
           "--eval-batches", str(recipe.eval_batches), "--save-every", str(recipe.save_every), "--keep-last", "1",
           "--seed", str(seed), "--save-dir", str(run_dir)]
    cmd += ["--model", str(model), "--eval-first"] if model else ["--model-size", recipe.model_size]
    return cmd + (["--export", str(export)] if export else []) + (["--resume"] if resume else [])


def last_train_step(log: Path) -> int:
    """The step of log.jsonl's last train record (0 where none): read from the file's end, the log grows long."""
    try:
        with open(log, "rb") as fh:
            start = max(0, fh.seek(0, os.SEEK_END) - 8192)
            fh.seek(start)
            lines = fh.read().decode(errors="replace").splitlines()[1 if start else 0:]   # the first one cut
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            return rec["step"]
    return 0


def launch(cmd: list[str], run_dir: Path, start_step: int, stop: Deadline, name: str, total: int) -> dict:
    """Run the job (harness.run_process), its output appended to run_dir/launch.log, told to stop at `stop` once it
    has logged a step (it checkpoints on the signal) -> {exit_code, signalled, killed, start (Unix time), startup_s
    (to its first step), wall_s}."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log, t0, seen = run_dir / "log.jsonl", time.time(), {"first": None, "shown": time.time()}

    def watch() -> None:
        now, step = time.time(), last_train_step(log)
        if seen["first"] is None and step > start_step:
            seen["first"] = now
        if now - seen["shown"] >= PROGRESS_S:
            print(f"  [{name}] step {step}/{total}, {now - t0:.0f} s", flush=True)
            seen["shown"] = now

    with open(run_dir / "launch.log", "a") as out:
        out.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
    r = run_process(cmd, stop_at=stop.stop_at, kill_at=stop.kill_at, log=run_dir / "launch.log", cwd=ROOT,
                    watch=watch, ready=lambda: seen["first"] is not None)
    return {**{k: r[k] for k in ("exit_code", "signalled", "killed", "start", "wall_s")},
            "startup_s": None if seen["first"] is None else seen["first"] - t0}


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's `latest` checkpoint, None where it has none (the main job's tags: stepNNNNNNN)."""
    tag = run_dir / "checkpoints" / "latest"
    try:
        return int(tag.read_text().strip().removeprefix("step"))
    except (OSError, ValueError):
        return None


def read_run(run_dir: Path, recipe: Recipe, train_tokens: int | None) -> dict:
    """What a run directory says of its run: the curves (train: step, tokens, loss, lr; validation: step, tokens,
    loss), how far it got, tokens seen, epochs, median tokens/s over its steps, parameters and peak memory."""
    records = read_log(run_dir / "log.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "eval"]
    summary = read_json(run_dir / "summary.json", {})
    done = train[-1]["step"] if train else 0
    tokens = done * recipe.tokens_per_step
    return {"steps_done": done, "tokens_seen": tokens, "epochs": tokens / train_tokens if train_tokens else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train) if train else None,
            "params": summary.get("params"), "peak_mem_gb": max((r["peak_mem_gb"] for r in train), default=None),
            "finished": done == recipe.steps and any(r["step"] == recipe.steps for r in val),
            "train": [[r["step"], r["step"] * recipe.tokens_per_step, round(r["loss"], 5), float(f"{r['lr']:.5g}")]
                      for r in train],
            "val": [[r["step"], r["step"] * recipe.tokens_per_step, round(r["val_loss"], 5)] for r in val],
            **({"router": {k: val[-1][k] for k in ROUTER}} if val and ROUTER[0] in val[-1] else {})}


ROUTER = ("aux_loss", "share_max", "share_min")   # a mixture of experts' last validation: its router's balance


def failure(run_dir: Path, lines: int = 30) -> str:
    """The end of the job's output, for a run that failed; one line where the job said `error: ...`."""
    try:
        text = (run_dir / "launch.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if line.startswith("error:")]
    return errors[-1] if errors else "\n".join(text[-lines:])
