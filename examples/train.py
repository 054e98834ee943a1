"""Causal-LM training of a Llama-family model with DeepSpeed and coat_ds (FP8 optimizer states and activations).

    deepspeed examples/train.py --deepspeed ds_configs/zero2_coat.json            # the default job
    deepspeed --num_gpus 8 examples/train.py --deepspeed ds_configs/zero2_coat.json --model-size 125m
    deepspeed --hostfile hostfile examples/train.py --deepspeed ds_configs/zero3_coat.json --model-size 1b
    python examples/train.py --deepspeed ds_configs/zero2_coat.json --steps 20     # one process, no launcher

Everything about the optimizer, ZeRO stage, precision and FP8 activations comes from the JSON config; this
script brings the loop, on the model and data builders of coat_ds.workloads (which the benchmarks share). Defaults
run offline on any machine (DeepSpeed's CPU accelerator when there is no GPU): a small Llama built from a config,
trained on the running interpreter's standard library sources. See docs/train.md for every flag and config key.

Outputs in --save-dir: log.jsonl (one line per step and per evaluation), loss.png (train/val loss and
memory), summary.json, checkpoints/ (DeepSpeed checkpoints; `latest` is only moved once a checkpoint is
complete, so a kill mid-write never breaks --resume).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))          # coat_ds from a checkout

from coat_ds.workloads import data as data_lib  # noqa: E402
from coat_ds.workloads.causal_lm import (MODEL_SIZES, build_model, default_allocator, initialize,  # noqa: E402
                                       lm_loss, model_size_names, moe_eval, set_single_process_env)
from coat_ds.workloads.cli import (Parser, check_ds_config, check_model, check_sp_size, fail,  # noqa: E402
                                   read_ds_config, refuse)
from coat_ds.workloads.learning_rate import warn_pretraining_rate  # noqa: E402

# ------------------------------------------------------------------------------------------------------------
# Configuration: defaults live here; every one of them is a flag.
# ------------------------------------------------------------------------------------------------------------
DEFAULTS = dict(
    deepspeed="ds_configs/zero2_coat.json",
    model=None, model_size="small", data=None, data_dtype="uint16", vocab_size=data_lib.DEFAULT_VOCAB,
    seq_len=256, steps=200, eval_every=50, eval_batches=8, save_dir="runs/train", save_every=100, keep_last=2,
    seed=1234, micro_batch=None, grad_accum=None, lr=None, warmup_steps=None, peer_timeout=30.0, sp_size=1,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--deepspeed", "--deepspeed_config", dest="deepspeed", metavar="JSON",
                   help="DeepSpeed config (optimizer, ZeRO, precision, the coat section)")
    p.add_argument("--model", help="HF model name or path to fine-tune (default: a Llama built from --model-size)")
    p.add_argument("--model-size", choices=model_size_names(),
                   help="shape of the Llama built when --model is unset (a public shape keeps its vocabulary)")
    p.add_argument("--data", help="text file or folder, tokenized .npy/.bin (or a folder with train/val ones), or "
                                  "a datasets.save_to_disk folder (default: the Python standard library sources)")
    p.add_argument("--data-dtype", choices=list(data_lib.TOKEN_DTYPES), help="token dtype of a raw .bin file")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the BPE trained on text data (no --model)")
    p.add_argument("--seq-len", type=int, help="tokens per sample")
    p.add_argument("--sp-size", type=int, metavar="N",
                   help="Ulysses sequence parallelism: each sample's tokens split over N ranks (DeepSpeed's ALST "
                        "attention; N divides the ranks, the attention heads and --seq-len; docs/activation.md)")
    p.add_argument("--steps", type=int, help="optimizer steps in total (a resumed run counts from 0 too)")
    p.add_argument("--eval-every", type=int, help="validate every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, help="validation micro-batches per rank")
    p.add_argument("--eval-first", action="store_true",
                   help="validate before the first step too (step 0 of a fresh run: a fine-tuning's starting point)")
    p.add_argument("--save-dir", help="run directory: log, plot, summary and checkpoints/")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps (0: only at the end and on signals)")
    p.add_argument("--keep-last", type=int, help="checkpoints kept on disk (older ones are deleted)")
    p.add_argument("--resume", action="store_true", help="continue from save-dir/checkpoints/latest")
    p.add_argument("--resume-from", metavar="TAG", help="continue from save-dir/checkpoints/TAG (e.g. step0000200)")
    p.add_argument("--seed", type=int, help="model init and data order")
    p.add_argument("--export", metavar="DIR", help="at the end, write an HF save_pretrained model + tokenizer")
    p.add_argument("--micro-batch", type=int, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--grad-accum", type=int, help="override gradient_accumulation_steps")
    p.add_argument("--lr", type=float, help="override optimizer.params.lr")
    p.add_argument("--warmup-steps", type=int, help="override scheduler.params.warmup_num_steps")
    p.add_argument("--peer-timeout", type=float, metavar="S",
                   help="a rank silent this long (or whose process ended, on the same node: at once) is lost: every "
                        "rank stops with one line, exit 1 (coat_ds.launch.watchdog; 0: off)")
    p.add_argument("--plan", action="store_true", help="print what each GPU will hold and the largest micro-batch "
                                                        "(python -m coat_ds.plan), then exit without training")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # from the launcher
    p.set_defaults(**DEFAULTS)
    args = p.parse_args(argv)
    for key in ("steps", "seq_len", "eval_batches", "keep_last", "sp_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} is invalid; allowed: an integer >= 1")
    for key in ("eval_every", "save_every"):
        if getattr(args, key) < 0:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} is invalid; allowed: an integer >= 0")
    if not (math.isfinite(args.peer_timeout) and args.peer_timeout >= 0):
        p.error(f"--peer-timeout={args.peer_timeout} is invalid; allowed: seconds >= 0 (0: off)")
    for key in ("micro_batch", "grad_accum"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)} is invalid; allowed: an integer >= 1")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        p.error(f"--lr={args.lr} is invalid; allowed: a finite float >= 0")
    if args.warmup_steps is not None and not 1 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps={args.warmup_steps} is invalid; allowed: an integer in [1, --steps={args.steps})")
    return args


def load_ds_config(args: argparse.Namespace) -> dict:
    """Read the JSON config, apply the command-line overrides ("auto" values are filled from flags), check it."""
    cfg = read_ds_config(args.deepspeed)
    cfg.pop("train_batch_size", None)  # derived by DeepSpeed from micro batch x grad accum x world size
    if args.micro_batch is not None or cfg.get("train_micro_batch_size_per_gpu") in (None, "auto"):
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch or 4
    if args.grad_accum is not None or cfg.get("gradient_accumulation_steps") in (None, "auto"):
        cfg["gradient_accumulation_steps"] = args.grad_accum or 1
    if args.lr is not None and "optimizer" in cfg:
        cfg["optimizer"].setdefault("params", {})["lr"] = args.lr
    sched = cfg.get("scheduler", {}).get("params", {})
    if "scheduler" in cfg:  # the schedule spans this run (--steps), whatever the file says
        sched["total_num_steps"] = args.steps
        if args.warmup_steps is not None:
            sched["warmup_num_steps"] = args.warmup_steps
    if isinstance(sched.get("warmup_num_steps"), int) and sched.get("total_num_steps", 0) <= sched["warmup_num_steps"]:
        sched["warmup_num_steps"] = max(1, sched["total_num_steps"] // 10)  # short runs: warm up for 10%
    return check_ds_config(cfg)


# ------------------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------------------
def save_checkpoint(engine, ckpt_dir: Path, step: int, client_state: dict, keep_last: int) -> Path:
    """Write to a temporary tag, then rename it and atomically point `latest` at it (save_atomically); a failed
    save (a full disk, say) ends the job with one line that says why, exit code 1, `latest` untouched."""
    import deepspeed.comm as dist
    from coat_ds.deepspeed.checkpoint.save import CheckpointSaveError, save_atomically, writer

    try:
        path = Path(save_atomically(engine, str(ckpt_dir), f"step{step:07d}", client_state))
    except CheckpointSaveError as e:   # the same on every rank: rank 0 says it, under the progress bar
        fail(str(e))
    if writer(engine):
        old = sorted(d for d in ckpt_dir.glob("step*") if d.is_dir() and not d.name.endswith(".tmp"))
        for d in old[:-keep_last]:
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    return path


def resume_tag(args: argparse.Namespace, ckpt_dir: Path) -> str | None:
    """The tag --resume (`latest`) or --resume-from names, its files checked before any model or data."""
    if not (args.resume or args.resume_from):
        return None
    from coat_ds.deepspeed.check import check_tag
    from coat_ds.deepspeed.checkpoint import CheckpointError
    from coat_ds.deepspeed.checkpoint.files import LATEST, latest_tag

    tag = args.resume_from or latest_tag(str(ckpt_dir))
    if tag is None:
        refuse(f"--resume: no checkpoint to resume from ({ckpt_dir / LATEST} does not exist or is empty)")
    try:
        check_tag(str(ckpt_dir / tag))
    except CheckpointError as e:
        refuse(unusable(ckpt_dir, tag, e))
    return tag


def unusable(ckpt_dir: Path, tag: str, err: Exception) -> str:
    """One line: what is wrong with `tag`, and the tags that could be resumed from instead."""
    from coat_ds.deepspeed.check import intact_tags

    good = intact_tags(str(ckpt_dir), exclude=tag) if ckpt_dir.is_dir() else []
    hint = f"intact tags: {', '.join(good)} (resume with --resume-from TAG)" if good else "no intact tag to resume from"
    return f"checkpoint {tag} cannot be loaded: {err}; {hint}"


def clean_partial_checkpoints(ckpt_dir: Path) -> None:
    """Remove `*.tmp` tags left by a run killed while saving; `latest` never points at them."""
    for d in ckpt_dir.glob("*.tmp"):
        shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------------------
# Logging, plot and summary
# ------------------------------------------------------------------------------------------------------------
def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(records: list[dict], path: Path) -> None:
    """Train/validation loss and peak memory against the step, as a PNG (skipped without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; no loss.png (pip install matplotlib)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    if val:
        ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in train], [r["peak_mem_gb"] for r in train], lw=1)
    ax2.set(xlabel="step", ylabel="GiB", title="peak memory (rank 0)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(records: list[dict], info: dict) -> dict:
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "eval"]
    steady = [r["tokens_per_s"] for r in train[min(3, len(train) - 1):]] if train else []
    s = dict(info)
    s.update(steps_done=train[-1]["step"] if train else 0,
             first_loss=train[0]["loss"] if train else None, last_loss=train[-1]["loss"] if train else None,
             last_val_loss=val[-1]["val_loss"] if val else None,
             best_val_loss=min((r["val_loss"] for r in val), default=None),
             tokens_per_s=sorted(steady)[len(steady) // 2] if steady else None,
             peak_mem_gb=max((r["peak_mem_gb"] for r in train), default=None))
    return s


def print_summary(s: dict) -> None:
    f = lambda v, spec=".4f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"model      {s['model']}  ({s['params'] / 1e6:.1f}M params)",
        f"config     {s['config']}  (ZeRO-{s['zero_stage']}, {s['precision']}, optimizer {s['optimizer']}, "
        f"FP8 decoder layers {s['fp8_layers']})",
        f"data       {s['data']}",
        f"batch      {s['micro_batch']} x {s['grad_accum']} accum x {s['world_size'] // s['sp_size']} "
        + ("ranks" if s["sp_size"] == 1 else f"sequence-parallel groups of {s['sp_size']} ranks")
        + f" x {s['seq_len']} tokens = {s['tokens_per_step']} tokens/step",
        f"steps      {s['steps_done']}/{s['steps']} in {s['wall_s']:.0f} s" + ("  (interrupted)" if s["interrupted"]
                                                                              else ""),
        f"loss       train {f(s['first_loss'])} -> {f(s['last_loss'])}   val {f(s['last_val_loss'])} "
        f"(best {f(s['best_val_loss'])})",
        f"speed      {f(s['tokens_per_s'], ',.0f')} tokens/s (median step)   peak memory {f(s['peak_mem_gb'], '.2f')} "
        f"GiB (rank 0, {s['device']})",
        f"files      {s['log']}  {s['plot']}",
        f"checkpoint {s['checkpoint']}",
    ]
    width = max(map(len, lines))
    print("=" * width + "\n" + "\n".join(lines) + "\n" + "=" * width, flush=True)


# ------------------------------------------------------------------------------------------------------------
# The job
# ------------------------------------------------------------------------------------------------------------
def load_inputs(args: argparse.Namespace, ds_config: dict | None = None):
    """Data and model, on the host (under ZeRO-3 partitioned over the ranks as it is built): bad inputs fail here,
    before any device memory is touched."""
    try:
        if args.model:
            from transformers import AutoConfig
            model_vocab = AutoConfig.from_pretrained(args.model).vocab_size
        else:
            model_vocab = None
    except (OSError, ValueError) as e:
        refuse(f"--model {args.model}: cannot load its config ({str(e).strip().splitlines()[0]})")
    try:
        tokens = data_lib.load(args.data, args.seq_len, tokenizer=args.model, vocab_size=args.vocab_size,
                               data_dtype=args.data_dtype, model_vocab=model_vocab)
    except data_lib.DataError as e:
        refuse(str(e))
    return tokens, build_model(args, tokens.vocab_size, args.seq_len, ds_config)


@dataclass
class Run:
    """What the loop, evaluation and checkpointing share: the engine, the data and where results go."""
    args: argparse.Namespace
    engine: Any
    batches: Any
    rank: int
    world: int
    micro_bs: int
    grad_accum: int
    save_dir: Path
    mpu: Any = None   # --sp-size: DeepSpeed's sequence-parallel groups (coat_ds.deepspeed.sequence_parallel)

    @property
    def data_parallel(self) -> int:
        """Ranks that train on other samples: the world over --sp-size (the ranks of an SP group share samples)."""
        return self.world // self.args.sp_size

    @property
    def tokens_per_step(self) -> int:
        return self.micro_bs * self.grad_accum * self.data_parallel * self.args.seq_len

    @property
    def ckpt_dir(self) -> Path:
        return self.save_dir / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.save_dir / "log.jsonl"

    @property
    def data_key(self) -> list:
        """What fixes the data order; a resumed run warns when it differs."""
        return [self.args.seed, self.args.seq_len, self.micro_bs, self.grad_accum, self.data_parallel]

    def loss(self, x, y):
        """The mean loss of samples x -> y: lm_loss, or with --sp-size the SP group's over its ranks' shards."""
        if self.mpu is None:
            return lm_loss(self.engine, x, y)
        from coat_ds.deepspeed.sequence_parallel import lm_loss as sp_loss

        return sp_loss(self.engine, self.mpu, x, y)

    def log(self, record: dict) -> None:
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def resume(run: Run, tag: str | None) -> int:
    """Load checkpoint `tag` (None: a fresh run); the step to start from."""
    if tag is None:
        return 0
    from coat_ds.deepspeed.checkpoint import CheckpointError

    try:
        load_path, client = run.engine.load_checkpoint(str(run.ckpt_dir), tag=tag)
    except CheckpointError as e:  # what check_tag cannot see (e.g. another optimizer's states)
        refuse(unusable(run.ckpt_dir, tag, e))
    if load_path is None:
        refuse(f"--resume: DeepSpeed found no loadable checkpoint in {run.ckpt_dir}")
    if client.get("data") != run.data_key:
        print(f"warning: resuming with a different seed/seq-len/batch/world size than the checkpoint "
              f"({client.get('data')}); the data order will differ", file=sys.stderr)
    return int(client["step"])


def prepare_save_dir(run: Run, start: int, resumed: bool) -> None:
    """Rank 0: the output directories, no half-written checkpoints, and a log that ends at `start`."""
    run.save_dir.mkdir(parents=True, exist_ok=True)
    run.ckpt_dir.mkdir(exist_ok=True)
    clean_partial_checkpoints(run.ckpt_dir)
    # keep the log consistent with the checkpoint: drop records past the step we resume from
    kept = [r for r in read_log(run.log_path) if r["step"] <= start] if resumed else []
    run.log_path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def catch_stop_signals() -> dict:
    """SIGTERM/SIGINT only set a flag: the loop stops after the step, checkpoints, and exits 128 + signal."""
    stop = {"signal": 0}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.update(signal=signum))
    return stop


def evaluate(run: Run, step: int) -> float:
    import torch
    import deepspeed.comm as dist

    engine = run.engine
    moe = getattr(engine.module.config, "num_experts", None) is not None   # a mixture of experts: its router too
    engine.eval()
    losses, aux, counts = [], [], []
    with torch.no_grad():
        for x, y in run.batches.val_batches(run.args.eval_batches):
            if moe:
                loss, a, c = moe_eval(engine, x, y)
                aux.append(a.detach().float())
                counts.append(c)
            else:
                loss = run.loss(x, y)
            losses.append(loss.detach())
    engine.train()
    v = torch.stack(losses).mean().reshape(1).float().to(engine.device)
    dist.all_reduce(v)
    val = v.item() / run.world
    router = {}
    if moe:   # the router's balance over these windows: its aux loss, each expert's share of the routed tokens x E
        a, c = torch.stack(aux).mean().reshape(1).to(engine.device), torch.stack(counts).sum(0).float()
        dist.all_reduce(a)
        dist.all_reduce(c)
        share = c / c.sum(dim=1, keepdim=True) * c.shape[1]   # 1.0 each where balanced
        router = {"aux_loss": a.item() / run.world, "share_max": share.max(dim=1).values.mean().item(),
                  "share_min": share.min(dim=1).values.mean().item()}
    if run.rank == 0:
        run.log({"kind": "eval", "step": step, "val_loss": val, **router})
        engine.monitor.write_events([("Eval/val_loss", val, step * run.tokens_per_step)])
    return val


def checkpoint(run: Run, step: int) -> Path:
    client = {"step": step, "data": run.data_key}
    return save_checkpoint(run.engine, run.ckpt_dir, step, client, run.args.keep_last)


def train_step(run: Run, step: int, stop: dict) -> tuple[float, bool, float]:
    """One optimizer step (all micro-batches) -> (mean loss over ranks, whether any rank was signalled, seconds)."""
    import torch
    import deepspeed.comm as dist

    t0 = time.perf_counter()
    loss_sum = 0.0
    for micro in range(run.grad_accum):
        x, y = run.batches.train_batch(step, micro)
        loss = run.loss(x, y)
        run.engine.backward(loss)
        run.engine.step()
        loss_sum += loss.detach().float()
    # one collective per step: the mean loss and whether any rank was signalled (all stop together)
    stats = torch.stack([torch.as_tensor(loss_sum / run.grad_accum, dtype=torch.float32).cpu(),
                         torch.tensor(float(stop["signal"]))]).to(run.engine.device)
    dist.all_reduce(stats)
    return stats[0].item() / run.world, stats[1].item() > 0, time.perf_counter() - t0


def log_step(run: Run, step: int, mean_loss: float, dt: float, peak: float, bar) -> None:
    """Rank 0: the step's record in log.jsonl, DeepSpeed's monitors and the progress bar."""
    lr = run.engine.get_lr()[0]
    tps = run.tokens_per_step
    rec = {"kind": "train", "step": step, "loss": mean_loss, "lr": lr, "tokens": step * tps,
           "tokens_per_s": tps / dt, "step_time_s": dt, "peak_mem_gb": peak}
    run.log(rec)
    run.engine.monitor.write_events([("Train/tokens_per_s", rec["tokens_per_s"], step * tps),
                                     ("Train/peak_mem_gb", peak, step * tps)])
    bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{tps / dt:,.0f}", mem=f"{peak:.2f}G",
                    lr=f"{lr:.2e}", refresh=False)
    bar.update(1)


def train(run: Run, start: int, stop: dict) -> tuple[int, Path | None, bool]:
    """The loop, from `start` to --steps or a stop signal -> (last step, last checkpoint, stopped by a signal)."""
    from deepspeed.accelerator import get_accelerator
    from tqdm import tqdm

    args, accel = run.args, get_accelerator()
    bar = tqdm(total=args.steps, initial=start, disable=run.rank != 0, dynamic_ncols=True, unit="step")
    step, last_ckpt = start, None
    run.engine.train()
    stopping = False
    while step < args.steps and not stopping:
        accel.reset_peak_memory_stats()
        mean_loss, stopping, dt = train_step(run, step, stop)
        step += 1
        if run.rank == 0:
            log_step(run, step, mean_loss, dt, accel.max_memory_allocated() / 2**30, bar)
        if not math.isfinite(mean_loss):
            fail(f"the loss became {mean_loss} at step {step}; lower --lr or check the data")
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            evaluate(run, step)
        if args.save_every and step % args.save_every == 0 and step < args.steps and not stopping:
            last_ckpt = checkpoint(run, step)
    bar.close()
    return step, last_ckpt, stopping


def fp8_layers(model) -> int:
    """How many decoder layers the engine runs in FP8: what the config's coat section did, not what it says."""
    from coat_ds.hf import CoatDecoderLayer

    return sum(isinstance(m, CoatDecoderLayer) for m in model.modules())


def run_info(run: Run, ds_config: dict, n_params: int, tokens, **rest) -> dict:
    """The summary's description of the job (what summarize adds the results to)."""
    args = run.args
    zero = ds_config.get("zero_optimization", {}).get("stage", 0)
    return dict(model=args.model or f"llama-{args.model_size}", params=n_params, config=args.deepspeed,
                zero_stage=zero, precision="bf16" if ds_config.get("bf16", {}).get("enabled") else
                "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32",
                optimizer=ds_config.get("optimizer", {}).get("type", "client"),
                fp8_layers=fp8_layers(run.engine.module),
                data=tokens.source, micro_batch=run.micro_bs, grad_accum=run.grad_accum, world_size=run.world,
                sp_size=args.sp_size,
                seq_len=args.seq_len, tokens_per_step=run.tokens_per_step, steps=args.steps, **rest)


def print_plan(args: argparse.Namespace, ds_config: dict) -> None:
    """--plan: coat_ds.plan's table for this job (model, config, seq, micro-batch, world size, --sp-size), on rank 0."""
    import torch
    from coat_ds.node import launcher_local_ranks
    from coat_ds.plan import GPUS, GIB, PlanError, report

    world, local = int(os.environ.get("WORLD_SIZE", "1")), launcher_local_ranks()  # any launcher's variable
    on_gpu = torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(0).total_memory if on_gpu else GPUS["h100"] * GIB
    # what build_model gives it: the data's vocabulary (a public shape keeps its own)
    vocab = None if args.model or args.model_size not in MODEL_SIZES else (args.vocab_size + 63) // 64 * 64
    try:
        table = report(args.model or args.model_size, ds_config, args.deepspeed, args.seq_len,
                       str(ds_config["train_micro_batch_size_per_gpu"]), gpus_per_node=local,
                       nodes=max(1, world // local), memory=memory, vocab=vocab, sp_size=args.sp_size)
    except PlanError as e:
        refuse(str(e))
    if os.environ.get("RANK", "0") == "0":
        print(table + ("" if on_gpu else "\n(no GPU here: planned for an H100; python -m coat_ds.plan --gpu-memory "
                                          "for another)"), flush=True)


def attention_heads(args: argparse.Namespace) -> tuple[int, int]:
    """(query heads, key/value heads) of the model the job will train, from its config alone."""
    if args.model:
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(args.model).get_text_config()
        except (OSError, ValueError) as e:
            refuse(f"--model {args.model}: cannot load its config ({str(e).strip().splitlines()[0]})")
        heads = cfg.num_attention_heads
        return heads, getattr(cfg, "num_key_value_heads", None) or heads
    from coat_ds.workloads.shapes import SHAPES

    shape = MODEL_SIZES[args.model_size] if args.model_size in MODEL_SIZES else SHAPES[args.model_size]
    heads = shape["num_attention_heads"]
    return heads, shape.get("num_key_value_heads", heads)


def main(argv: list[str] | None = None) -> int:
    default_allocator()
    args = parse_args(argv)
    ds_config = load_ds_config(args)
    check_model(args.model)   # a --model path that is not a folder, said as such (not as a hub id HF cannot parse)
    if args.sp_size > 1:      # before any model memory: one line naming --sp-size and the sizes allowed
        check_sp_size(args.sp_size, *attention_heads(args), args.seq_len)
    if args.plan:
        print_plan(args, ds_config)
        return 0
    warn_pretraining_rate(args.model, ds_config)   # a trained model at a pretraining rate: one line, before loading it
    tag = resume_tag(args, Path(args.save_dir) / "checkpoints")  # None: a fresh run
    if args.export and Path(args.export).is_file():
        refuse(f"--export {args.export}: is a file; give a directory")
    tokens, model = load_inputs(args, ds_config)

    import deepspeed
    import deepspeed.comm as dist
    from coat_ds.launch.teardown import torn_down
    from coat_ds.launch.watchdog import watching

    set_single_process_env()
    deepspeed.init_distributed()
    # a lost rank stops every other one within --peer-timeout (at once on its own node), in one line; the process
    # group goes before Python's finalization, where a live one can abort the process (torn_down)
    with torn_down(), watching(args.peer_timeout, hint="resume from the last checkpoint with --resume"):
        code = run_job(args, ds_config, tokens, model, tag)
        dist.barrier()   # inside: a rank that fails at the very end (its export) stops the others too
    return code


def run_job(args: argparse.Namespace, ds_config: dict, tokens, model, tag: str | None) -> int:
    """Engine, resume, the loop, the last checkpoint, evaluation, summary and export; the exit code."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    save_dir = Path(args.save_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, mpu = make_engine(args, model, ds_config)
    micro_bs, grad_accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    sp = args.sp_size   # the ranks of an SP group (consecutive) train on the same samples
    batches = data_lib.Batches(tokens, args.seq_len, micro_bs, grad_accum, rank // sp, world // sp, args.seed)
    run = Run(args, engine, batches, rank, world, micro_bs, grad_accum, save_dir, mpu)
    plot_path = save_dir / "loss.png"

    start = resume(run, tag)
    if rank == 0:
        prepare_save_dir(run, start, tag is not None)
    dist.barrier()
    stop = catch_stop_signals()
    t_start = time.time()
    if args.eval_first and start == 0:
        evaluate(run, 0)
    step, last_ckpt, interrupted = train(run, start, stop)
    if step > start or last_ckpt is None:
        last_ckpt = checkpoint(run, step)
    if not interrupted:
        evaluate(run, step)
    if rank == 0:
        records = read_log(run.log_path)
        plot(records, plot_path)
        info = run_info(run, ds_config, n_params, tokens, wall_s=time.time() - t_start, interrupted=interrupted,
                        device=get_accelerator().device_name(), log=str(run.log_path), plot=str(plot_path),
                        checkpoint=str(last_ckpt))
        s = summarize(records, info)
        (save_dir / "summary.json").write_text(json.dumps(s, indent=1))
        print_summary(s)
    if args.export and not interrupted:
        export(engine, tokens, Path(args.export), rank)
    return 128 + (stop["signal"] or signal.SIGTERM) if interrupted else 0


def make_engine(args: argparse.Namespace, model, ds_config: dict):
    """(engine, mpu): deepspeed.initialize after `import coat_ds`; with --sp-size, DeepSpeed's Ulysses attention
    registered for the model first and its sequence-parallel groups (the mpu) given to the engine."""
    if args.sp_size == 1:
        return initialize(model, ds_config), None
    import deepspeed
    from coat_ds.deepspeed import sequence_parallel as sp
    from coat_ds.workloads.causal_lm import param_groups

    why = sp.attention_refusal(model, args.seq_len)
    if why is not None:
        refuse(why)
    mpu = sp.register(model, args.sp_size, ds_config["train_micro_batch_size_per_gpu"], args.seq_len)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config, mpu=mpu)
    return engine, mpu


def export(engine, tokens, out: Path, rank: int) -> None:
    """HF `save_pretrained` of the trained model (16-bit weights, gathered under ZeRO-3) and its tokenizer."""
    state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_partition_weights() else None
    if rank != 0:
        return
    # FP8 layers keep the stock submodules and state_dict keys, so this is a stock HF checkpoint
    engine.module.save_pretrained(str(out), state_dict=state)
    if tokens.tokenizer is not None:
        tokens.tokenizer.save_pretrained(str(out))
    print(f"exported an HF model to {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}))", flush=True)


if __name__ == "__main__":
    sys.exit(main())
