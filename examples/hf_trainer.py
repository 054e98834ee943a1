"""The same Llama as examples/train.py, trained by HF `Trainer` with a coat_ds DeepSpeed config.

    deepspeed examples/hf_trainer.py --deepspeed ds_configs/zero2_coat.json --steps 100
    deepspeed examples/hf_trainer.py --deepspeed ds_configs/hf/zero2_coat.json     # HF "auto" values
    deepspeed examples/hf_trainer.py --deepspeed ds_configs/hf/zero2_lowest_memory.json   # a preset (docs/presets.md)
    deepspeed --num_gpus 8 examples/hf_trainer.py --deepspeed ds_configs/zero3_coat.json --model-size 125m

The JSON is the single source of truth: the Trainer's arguments (batch size, accumulation, lr, betas, eps,
weight decay, clipping, bf16, warmup) are read from it, so HF's consistency check between TrainingArguments
and the DeepSpeed config always passes; a JSON without a scheduler (ds_configs/hf/) trains at a constant lr, as
DeepSpeed does without one. DeepSpeed builds the optimizer named in the config ("CoatAdamW"),
and DeepSpeed's engine applies the `"coat": {"activation": ...}` section (FP8 layers) when the Trainer builds it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # coat_ds from a checkout

from coat_ds.workloads import data as data_lib  # noqa: E402
from coat_ds.workloads.causal_lm import MODEL_SIZES, build_model  # noqa: E402
from coat_ds.workloads.cli import Parser, check_ds_config, check_model, read_ds_config, refuse  # noqa: E402


class Windows:
    """Non-overlapping windows of a token stream as {"input_ids", "labels"} rows (HF shifts labels itself)."""

    def __init__(self, stream, seq_len: int, limit: int | None = None) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.n = len(stream) // seq_len if limit is None else min(limit, len(stream) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import numpy as np
        import torch

        ids = torch.from_numpy(np.asarray(self.stream[i * self.seq_len:(i + 1) * self.seq_len], dtype=np.int64))
        return {"input_ids": ids, "labels": ids}


def given(value, default):
    """A value of the JSON, or `default` where it is absent or "auto" (ds_configs/hf/: the Trainer fills it)."""
    return default if value is None or value == "auto" else value


def training_arguments(ds_config: dict, args: argparse.Namespace):
    """TrainingArguments whose every DeepSpeed-checked value is the one in the JSON (our defaults for "auto")."""
    from deepspeed.accelerator import get_accelerator
    from transformers import TrainingArguments

    opt = ds_config.get("optimizer", {}).get("params", {})
    betas = given(opt.get("betas"), [0.9, 0.95])
    micro = given(ds_config.get("train_micro_batch_size_per_gpu"), 4)
    sched = ds_config.get("scheduler", {}).get("params")
    warmup = 0
    if sched is not None:  # DeepSpeed's scheduler: its warmup must be positive (ds_configs/hf/ have none)
        warmup = sched.get("warmup_num_steps", 0)
        warmup = warmup if isinstance(warmup, int) and 0 < warmup < args.steps else max(1, args.steps // 10)
        sched["warmup_num_steps"] = warmup
        sched["total_num_steps"] = args.steps   # HF checks it against max_steps
    return TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, seed=args.seed, deepspeed=ds_config,
        per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
        gradient_accumulation_steps=given(ds_config.get("gradient_accumulation_steps"), 1),
        learning_rate=given(opt.get("lr"), 1e-3), adam_beta1=betas[0], adam_beta2=betas[1],
        adam_epsilon=given(opt.get("eps"), 1e-8), weight_decay=given(opt.get("weight_decay"), 0.1),
        max_grad_norm=given(ds_config.get("gradient_clipping"), 1.0), warmup_steps=warmup,
        lr_scheduler_type="linear" if sched is not None else "constant",  # no scheduler: DeepSpeed's constant lr
        bf16=bool(given(ds_config.get("bf16", {}).get("enabled"), "bf16" in ds_config)),
        use_cpu=get_accelerator().device_name() == "cpu",      # DeepSpeed's CPU accelerator (no GPU here)
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=False,
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed", default="ds_configs/zero2_coat.json", help="DeepSpeed JSON config")
    p.add_argument("--model", help="HF model name or path (default: a Llama built from --model-size)")
    p.add_argument("--model-size", default="small", choices=list(MODEL_SIZES))
    p.add_argument("--data", help="as in examples/train.py (default: the Python standard library sources)")
    p.add_argument("--data-dtype", default="uint16", choices=list(data_lib.TOKEN_DTYPES))
    p.add_argument("--vocab-size", type=int, default=data_lib.DEFAULT_VOCAB)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-samples", type=int, default=64, help="validation windows for the final evaluation")
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    ds_config = check_ds_config(read_ds_config(args.deepspeed), hf_auto=True)  # one line, before model or data
    check_model(args.model)
    try:
        tokens = data_lib.load(args.data, args.seq_len, tokenizer=args.model, vocab_size=args.vocab_size,
                               data_dtype=args.data_dtype)
    except data_lib.DataError as e:
        refuse(str(e))
    model = build_model(argparse.Namespace(model=args.model, model_size=args.model_size, seed=args.seed),
                        tokens.vocab_size, args.seq_len)

    import coat_ds  # noqa: F401  DeepSpeed's engine now knows "CoatAdamW" and the "coat" section
    from transformers import Trainer

    targs = training_arguments(ds_config, args)
    trainer = Trainer(model=model, args=targs, train_dataset=Windows(tokens.train, args.seq_len),
                      eval_dataset=Windows(tokens.val, args.seq_len, limit=args.eval_samples))
    result = trainer.train()
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    engine = trainer.model_wrapped                       # the DeepSpeedEngine the Trainer built
    optimizer = type(getattr(engine, "basic_optimizer", None)).__name__
    fp8_layers = sum(type(m).__name__ == "CoatDecoderLayer" for m in trainer.model.modules())
    if trainer.is_world_process_zero():
        print(json.dumps({"engine": type(engine).__name__, "optimizer": optimizer, "fp8_layers": fp8_layers,
                          "train_loss_first": losses[0] if losses else None,
                          "train_loss_last": losses[-1] if losses else None, "train_loss_mean": result.training_loss,
                          "eval_loss": metrics["eval_loss"], "steps": trainer.state.global_step}), flush=True)
    ok = all(math.isfinite(v) for v in losses + [metrics["eval_loss"]])
    trainer.accelerator.end_training()   # the process group goes before Python's finalization, where it can abort
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
