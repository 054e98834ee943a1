"""Whether a job's learning rate fits what it trains: a trained model (`--model`) about to be fine-tuned at a
pretraining rate is said in one line, before the model is loaded (the presets carry pretraining rates: 3e-4 and
1.5e-4, docs/presets.md; at such a rate a pretrained model's first steps undo much of its training)."""
from __future__ import annotations

import os
import sys

# Above this, a rate is a pretraining one: the presets' (3e-4, 1.5e-4), GPT-3's 6e-5 to 6e-4. Full fine-tuning runs
# at 1e-5 to 1e-4 (the accuracy benchmark fine-tunes its 350M at 1e-4, benchmarks/accuracy/recipe.py).
FINE_TUNING_MAX_LR = 1e-4
FINE_TUNING_LR = 2e-5   # what the line suggests: Llama 2's supervised fine-tuning rate
# DeepSpeed's schedulers whose peak is a scheduler parameter rather than the optimizer's lr, and its default there
PEAK_KEYS = {"WarmupLR": ("warmup_max_lr", None), "WarmupDecayLR": ("warmup_max_lr", 1e-3),
             "OneCycle": ("cycle_max_lr", None)}


def peak_lr(ds_config: dict) -> float | None:
    """The highest rate the config's schedule reaches: WarmupLR's and WarmupDecayLR's warmup_max_lr, OneCycle's
    cycle_max_lr, else (WarmupCosineLR, no scheduler) the optimizer's lr; None where it is not a number ("auto")."""
    lr = ((ds_config.get("optimizer") or {}).get("params") or {}).get("lr")
    sched = ds_config.get("scheduler") or {}
    key, default = PEAK_KEYS.get(sched.get("type"), (None, None))
    if key is not None:
        lr = (sched.get("params") or {}).get(key, default if default is not None else lr)
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def pretraining_rate_note(model: str | None, ds_config: dict) -> str | None:
    """One line where `model` (a trained model to fine-tune; None: one built from scratch) would train at a rate
    above FINE_TUNING_MAX_LR; None otherwise."""
    lr = peak_lr(ds_config)
    if not model or lr is None or lr <= FINE_TUNING_MAX_LR:
        return None
    return (f"warning: --model {model} is a trained model and this job's peak learning rate {lr:g} is a pretraining "
            f"rate (fine-tuning runs at <= {FINE_TUNING_MAX_LR:g}); pass --lr {FINE_TUNING_LR:g} to fine-tune it "
            f"(docs/presets.md, learning rates)")


def warn_pretraining_rate(model: str | None, ds_config: dict) -> None:
    """pretraining_rate_note's line on stderr, from the first rank only (before DeepSpeed: the launcher's RANK)."""
    note = pretraining_rate_note(model, ds_config)
    if note and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
