"""The recipe of issue 46's runs, written once: the model, the corpora, the batch, the schedule, how often and on
how much each run validates, and what the scheduler assumes of a run's speed before one has measured its own.

The batch is fixed in samples over all ranks, so 1, 2 or 4 GPUs read the same samples at every step (the main job's
sample index runs over rank x micro-batch) and validate on the same windows; only the micro-batch changes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from benchmarks import configs as e2e
from benchmarks.common import ROOT

BASELINE = "bf16"
PRESETS = ("exact", "lowest_memory", "largest_model")          # coat's, each against BF16
CONFIGS = {n: e2e.CONFIGS[n][1] for n in (BASELINE, *PRESETS)}  # the shipped file each runs, as it is
LABELS = {n: e2e.LABELS[n] for n in CONFIGS}
MULTI_SEED = (BASELINE, "lowest_memory")   # every --seeds; the other presets run the first seed only (issue 46)
EXPORT_SEED = 0   # BF16's seed whose final model is exported and fine-tuned (with this seed's data order) by each
assert all(not e2e.CONFIGS[n][2] for n in CONFIGS), "a config of these runs must be a shipped file as it is"


@dataclass(frozen=True)
class Recipe:
    """One phase's runs: the main job's flags, but for the micro-batch, which is global_batch / GPUs."""
    corpus: str              # a folder of --data-root (data/prepare_corpus.py writes them)
    model_size: str | None   # None: fine-tune BF16's exported model
    seq_len: int
    global_batch: int        # samples per optimizer step over all ranks
    steps: int
    lr: float
    warmup_steps: int        # then cosine to 10% of lr (the shipped configs' WarmupCosineLR, cos_min_ratio 0.1)
    eval_every: int
    eval_batches: int        # validation micro-batches per rank: eval_batches x global_batch windows in all
    save_every: int          # 0: a checkpoint only at the end and on the deadline's signal

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def eval_windows(self) -> int:
        return self.eval_batches * self.global_batch

    def facts(self) -> dict:
        return {**asdict(self), "tokens_per_step": self.tokens_per_step, "tokens": self.steps * self.tokens_per_step,
                "eval_windows": self.eval_windows}


# Pretraining: 32 x 2048 = 65,536 tokens a step (micro-batch 8 on 4 GPUs), 3,100 steps = 203.2M tokens (>= 200M),
# 1.76 epochs of the kernel's 115.4M. lr 6e-4 (what GPT-3 and nanoGPT train ~125-350M models at; clipping 1.0 and
# weight decay 0.1 come from the configs) after a 100-step warm-up (3%: the configs' 20 are for 200-step jobs).
# Validation every 155 steps (5%) on 256 fixed windows of 2048 (524K tokens, 12% of the 4.4M validation split,
# spread evenly over its four held-out folders): the same windows for every run, so the runs' differences carry
# little sampling noise, while 2M tokens would quadruple the cost of the 21 evaluations (from ~2% of the run to ~7%).
PRETRAIN = Recipe(corpus="kernel", model_size="350m", seq_len=2048, global_batch=32, steps=3100, lr=6e-4,
                  warmup_steps=100, eval_every=155, eval_batches=8, save_every=1000)
# Fine-tuning BF16's final model on perldoc (2.7M tokens): 4 x 2048 = 8,192 tokens a step, 1,000 steps = 8.2M tokens
# (3.0 epochs; a larger batch would repeat the small corpus more). lr 1e-4, a sixth of pretraining's peak and above
# its final 6e-5, after a 50-step warm-up (5%), cosine to 1e-5. Validated before the first step (--eval-first: the
# FP8 forward of the trained weights against BF16's) and every 100 steps on 96 windows (197K tokens, 89% of the
# 220K validation split).
FINETUNE = Recipe(corpus="perldoc", model_size=None, seq_len=2048, global_batch=4, steps=1000, lr=1e-4,
                  warmup_steps=50, eval_every=100, eval_batches=24, save_every=0)
# --smoke: the same phases on CPU ranks with the tiny model, the small corpora, a few steps (its runs' start-up
# dominates: fewer steps check the same paths)
SMOKE_PRETRAIN = Recipe(corpus="manpages", model_size="tiny", seq_len=64, global_batch=4, steps=20, lr=3e-3,
                        warmup_steps=4, eval_every=5, eval_batches=2, save_every=10)
SMOKE_FINETUNE = Recipe(corpus="perldoc", model_size=None, seq_len=64, global_batch=4, steps=10, lr=1e-3,
                        warmup_steps=2, eval_every=5, eval_batches=2, save_every=0)
# --recipe moe (issue 60): the moe-90m Qwen3-MoE (16 experts, top 4: 90M parameters, 34M active; causal_lm.MODEL_SIZES)
# pretrained on the kernel corpus, 16 x 1024 = 16,384 tokens a step, 300 steps = 4.9M tokens: what one ~10-minute
# device call holds for eight runs side by side on one GPU (the issue's ~400M model on 200M tokens would take hours of
# it). lr 1e-3 for the small width after a 30-step warm-up; validation every 50 steps on 64 windows (65K tokens), with
# the router's aux loss and each expert's share of the routed tokens.
MOE_PRETRAIN = Recipe(corpus="kernel", model_size="moe-90m", seq_len=1024, global_batch=16, steps=300, lr=1e-3,
                      warmup_steps=30, eval_every=50, eval_batches=4, save_every=0)
SMOKE_MOE_PRETRAIN = Recipe(corpus="manpages", model_size="moe-tiny", seq_len=64, global_batch=4, steps=10, lr=3e-3,
                            warmup_steps=2, eval_every=5, eval_batches=2, save_every=0)
# --recipe long (issue 61): training at long context in FP8. A 125M Llama pretrained in BF16 on the kernel corpus at seq
# 2048, 300 steps of 32 x 2048 (19.7M tokens), exported, then fine-tuned at 16,384 tokens on the same corpus (its
# files whole and concatenated: a window spans several) with BF16, each preset and LONG_CONFIGS, side by side on one
# GPU, 200 steps of one sequence (3.3M tokens): what one ~10-minute device call holds (issue 46's 350M model on 203M
# tokens takes ~35 minutes of one GPU, and no call carries it back). Validated before the first step and every 50
# steps on 16 windows (262K tokens). lr 2e-4 after a 20-step warm-up: the positions past 2048 are new to the model.
LONG_PRETRAIN = Recipe(corpus="kernel", model_size="125m", seq_len=2048, global_batch=32, steps=300, lr=1e-3,
                       warmup_steps=30, eval_every=100, eval_batches=2, save_every=0)
LONG_FINETUNE = Recipe(corpus="kernel", model_size=None, seq_len=16384, global_batch=1, steps=200, lr=2e-4,
                       warmup_steps=20, eval_every=50, eval_batches=16, save_every=0)
SMOKE_LONG_PRETRAIN = replace(SMOKE_PRETRAIN, steps=8, eval_every=4, save_every=0)
SMOKE_LONG_FINETUNE = Recipe(corpus="manpages", model_size=None, seq_len=256, global_batch=1, steps=4, lr=1e-3,
                             warmup_steps=1, eval_every=2, eval_batches=2, save_every=0)
# The long recipe's configurations beyond CONFIGS: a preset with the coat.activation keys docs/activation.md sets for a
# long sequence, each layer recomputed from an FP8 copy of its input in pinned host memory, the MLP (and FP8
# attention's backward) over tiles of a quarter of the sequence
LONG_CONFIGS = {"long_context": ("largest_model", {"checkpoint": True, "checkpoint_store": "host_fp8"},
                                  "coat_ds largest-model preset, FP8 checkpoints on the host, tiled MLP and attention")}
LABELS.update({n: label for n, (_, _, label) in LONG_CONFIGS.items()})
LONG_TILES = 4   # tiles of a sequence (tile_tokens = seq_len / LONG_TILES)


def long_config(name: str, seq_len: int) -> dict:
    """LONG_CONFIGS[name]'s DeepSpeed config: its preset's file with the activation keys, tiles for `seq_len`."""
    preset, keys, _ = LONG_CONFIGS[name]
    cfg = json.loads((ROOT / CONFIGS[preset]).read_text())
    cfg["coat"]["activation"].update(keys, tile_tokens=seq_len // LONG_TILES)
    return cfg


GPU_COUNTS = (1, 2, 4)   # those that divide both global batches

# Outliers of BF16's final model: its decoder layers' inputs on 8 micro-batches of 4 validation windows of the
# pretraining corpus (64K tokens, spread over the split)
OUTLIER_BATCHES, OUTLIER_MICRO_BATCH = 8, 4


@dataclass(frozen=True)
class Speed:
    """What the scheduler assumes of a phase before a run of it has measured its own (measured rates replace it)."""
    tokens_per_s: dict       # config -> tokens/s over 4 GPUs, all ranks (scaled by GPUs / 4)
    start_s: float           # the launcher, the data, the model and the engine, before the first step
    save_s: float            # one checkpoint (the last one also an export)


# 4 H100s, assumed from the committed 1.1B rows (BF16 34.7k tokens/s a GPU at micro-batch 4, seq 2048: ~270 TFLOP/s)
# at a lower utilization for hidden 1024 (~200 TFLOP/s over 2.55 GFLOP a token): ~90k a GPU. coat's presets are
# taken as fast as BF16 (its FP8 GEMMs gain little at this width), those with attention in FP8 5% slower.
PRETRAIN_SPEED = Speed({"bf16": 350_000, "exact": 350_000, "lowest_memory": 330_000, "largest_model": 330_000},
                       start_s=60.0, save_s=10.0)
# micro-batch 1 a GPU: the step's fixed costs (ZeRO's reduce-scatter and step, coat's per-layer host work) weigh more
FINETUNE_SPEED = Speed({n: 100_000 for n in CONFIGS}, start_s=45.0, save_s=10.0)
SMOKE_SPEED = Speed({n: 2_000 for n in (*CONFIGS, *LONG_CONFIGS)}, start_s=25.0, save_s=1.0)
MOE_SPEED = Speed({n: 120_000 for n in CONFIGS}, start_s=40.0, save_s=5.0)   # moe-90m alone on one H200 (assumed)
# one H200 (x4: the figures are over 4 GPUs): pretraining 125M at micro-batch 32 alone; a 16K fine-tuning beside four
LONG_SPEED = {"pretrain": Speed({"bf16": 720_000}, start_s=40.0, save_s=5.0),
              "finetune": Speed({n: 80_000 for n in (*CONFIGS, *LONG_CONFIGS)}, start_s=40.0, save_s=5.0)}
EVAL_SPEEDUP = 3.0   # a validation token costs a third of a training one (forward only)
