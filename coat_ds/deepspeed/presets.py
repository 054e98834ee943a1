"""The preset configs of a checkout's ds_configs/ (named by what they give) and their HF Trainer ("auto") twins.

    python -m coat_ds.deepspeed.presets           # rewrite the files
    python -m coat_ds.deepspeed.presets --check   # exit 1 naming each file that differs (a test runs it)

Each preset is a measured config of ds_configs/ (the ZeRO layout, optimizer and FP8 activation flow the
benchmarks ran) with one intent's "coat" settings laid over it; docs/presets.md says what each trades.
The files are generated so that every setting is written once: the exact master is EXACT_MASTER below.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"   # the checkout's (not in a wheel)

# The exact intent's master weights: an fp32 master in 2 B/param (bf16 weights plus int16 remainders), bit-identical
# to "fp32". Under Offload the host keeps DeepSpeed's fp32 master (a remainder saves nothing there and is refused).
EXACT_MASTER = {"zero2": "fp32_remainder", "zero3": "fp32_remainder", "zero2_offload": "fp32"}

LAYOUTS = {  # preset prefix -> the measured config it starts from
    "zero2": "zero2_coat.json",
    "zero3": "zero3_coat.json",
    "zero2_offload": "zero2_coat_offload.json",
    "zero3_offload": "zero3_coat.json",
}
# What a layout lays over its measured config. zero3_offload: CoatAdamW's FP8 moments in pinned host memory, streamed
# per ZeRO-3 sub-group of 1e8 values a rank (coat.states 'host'; three sub-groups' states on the device at once), and
# each decoder layer recomputed in backward (activation.checkpoint): what fits Llama-3.1-70B at seq 4096 on four
# 80 GB GPUs (without it micro-batch 1 ran out of memory at 76.9 GiB, docs/deepspeed.md); buckets of 2e8 values, so
# that a 70B backward reduces (and steps) ~350 of them, as a 13B one does at 5e7 (each costs host work). It is the
# mixture-of-experts preset too (Qwen3-30B-A3B on one 80 GB GPU; coat sets the sparse blocks' ZeRO-3 leaves itself)
LAYOUT_OVER = {"zero3_offload": {"zero_optimization": {"sub_group_size": 100000000, "reduce_bucket_size": 200000000},
                                 "coat": {"states": "host", "activation": {"checkpoint": True}}}}
INTENTS = {  # what each intent lays over the "coat" section (master_weights None: EXACT_MASTER of the layout)
    "exact": {"master_weights": None},
    "lowest_memory": {"master_weights": "bf16_sr", "activation": {"attention_fp8": True, "cache_weights": False}},
    # lowest memory with gradient release (each bucket stepped as it is reduced): no gradient kept until the step
    "largest_model": {"master_weights": "bf16_sr", "gradients": "release",
                      "activation": {"attention_fp8": True, "cache_weights": False}},
}
# Each preset's peak learning rate, for the sizes it is for: LLaMA's and Llama 2's pretraining rates, 3e-4 at 7-13B
# (the ZeRO-2 / ZeRO-3 presets: 1B to 13B on one node) and 1.5e-4 at 70B (zero3_offload); the measured configs'
# 1e-3 is the main job's small default model's (at 1e-3 Llama-3.1-8B's loss rose 12.6 -> 19.3 in 7 steps, issue 57).
# Pretraining rates: a trained model (--model) is fine-tuned at ~2e-5 (--lr; the main job says so in one line,
# coat_ds/workloads/learning_rate.py). Warm-up and schedule stay the measured config's (examples set the steps).
PRETRAIN_LR = 3e-4
LR = {"zero3_offload": 1.5e-4}   # layout -> its rate where it is for larger models than PRETRAIN_LR's
# Where each intent is shipped: release steps each bucket on the device as ZeRO reduces it, so not under DeepSpeed's
# Offload (coat_ds/deepspeed/zero/release.py); the host states step through release only (zero/states.py)
ONLY_ON = {"largest_model": ("zero2", "zero3", "zero3_offload"), "exact": ("zero2", "zero3", "zero2_offload"),
           "lowest_memory": ("zero2", "zero3", "zero2_offload")}  # host states step as release does
HF_TWINS = ("zero2_coat.json", "zero3_coat.json")  # hf/ twins of measured configs, beside the presets'

# What HF Trainer fills from TrainingArguments ("auto"); the scheduler is left out so that the Trainer builds
# its own from lr_scheduler_type / warmup_steps (DeepSpeed's warmup schedulers refuse HF's default warmup 0).
# Bucket sizes stay concrete: HF's "auto" is hidden_size^2 (4.2M at 1.1B: 157 ZeRO-2 reductions a step instead
# of 25, each a Python loop, a copy and a collective; docs/deepspeed.md, HF Trainer speed).
HF_AUTO = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
           "gradient_clipping", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
           "optimizer.params.eps", "optimizer.params.weight_decay")


def preset(layout: str, intent: str) -> dict:
    """The plain-DeepSpeed preset: concrete values, DeepSpeed's scheduler (examples set its steps)."""
    cfg = json.loads((CONFIGS / LAYOUTS[layout]).read_text())
    merge(cfg, LAYOUT_OVER.get(layout, {}))
    cfg["optimizer"]["params"]["lr"] = lr(layout)
    over = INTENTS[intent]
    coat = cfg.setdefault("coat", {})
    coat["master_weights"] = over["master_weights"] or EXACT_MASTER[layout]
    if "gradients" in over:
        coat["gradients"] = over["gradients"]
    coat["activation"] = {**coat.get("activation", {}), **over.get("activation", {})}
    return cfg


def lr(layout: str) -> float:
    """The peak learning rate a layout's presets carry (LR, PRETRAIN_LR)."""
    return LR.get(layout, PRETRAIN_LR)


def merge(into: dict, over: dict) -> None:
    """Lay `over` into `into`, section by nested section."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def shipped() -> list[tuple[str, str]]:
    """Every (layout, intent) that has a preset."""
    return [(layout, intent) for layout in LAYOUTS for intent in INTENTS if layout in ONLY_ON.get(intent, LAYOUTS)]


def file_name(layout: str, intent: str) -> str:
    return f"{layout}_{intent}.json"


def file_names() -> list[str]:
    """The presets' file names, in ds_configs/ and in ds_configs/hf/."""
    return [file_name(layout, intent) for layout, intent in shipped()]


def hf_twin(cfg: dict) -> dict:
    """The same config for HF Trainer: "auto" wherever TrainingArguments decide, no DeepSpeed scheduler."""
    cfg = copy.deepcopy(cfg)
    cfg.pop("scheduler", None)
    cfg["train_batch_size"] = "auto"  # DeepSpeed derives it; HF checks it against its own batch arithmetic
    for dotted in HF_AUTO:
        *path, key = dotted.split(".")
        node = cfg
        for part in path:
            node = node.get(part, {})
        if key in node:
            node[key] = "auto"
    return cfg


def rendered() -> dict[Path, str]:
    """Every generated file and its text."""
    out = {}
    for layout, intent in shipped():
        cfg = preset(layout, intent)
        out[CONFIGS / file_name(layout, intent)] = cfg
        out[CONFIGS / "hf" / file_name(layout, intent)] = hf_twin(cfg)
    for name in HF_TWINS:
        out[CONFIGS / "hf" / name] = hf_twin(json.loads((CONFIGS / name).read_text()))
    return {path: json.dumps(cfg, indent=2) + "\n" for path, cfg in out.items()}


def stale() -> list[Path]:
    """Generated files whose text on disk is not what this script writes."""
    return [p for p, text in rendered().items() if not p.is_file() or p.read_text() != text]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        for path in bad:
            print(f"{path.relative_to(CONFIGS.parent)} differs from what coat_ds.deepspeed.presets writes; run it")
        return 1 if bad else 0
    for path, text in rendered().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
