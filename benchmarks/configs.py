"""The configurations and models the benchmarks run: each configuration a shipped file of ds_configs/ and what it adds
to its "coat" section, each model a Llama-shaped (or another family's) HF config by name. Every runner builds its
DeepSpeed config and its model here, so that only the named change differs between two rows."""
from __future__ import annotations

import argparse
import json
import math
import shutil

from benchmarks.common import ROOT, check_positive, names_of, parse_cores
from coat_ds.workloads import causal_lm as train_lib
from coat_ds.workloads.shapes import SHAPES  # public shapes: TinyLlama's, Llama-2's, Llama-3.1's

# Llama-3.2-3B's config.json (tied embeddings; its llama3 RoPE scaling left out, as the other Llama shapes')
_LLAMA32_3B = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                   intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)
# Llama shapes by name: the main job's 125m and the public ones of coat_ds.workloads.shapes.
MODELS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512, vocab_size=512),   # wide enough that the decoder layer's activations dominate
    **{f"tiny-{family}": dict(model_type=family, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=512)
       for family in ("qwen3", "gemma3_text")},                  # the other families' smoke shapes
    "tiny-qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                           num_experts=8, num_experts_per_tok=2, vocab_size=512),   # moe_one_gpu's smoke shape
    "tiny-gqa": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                     intermediate_size=512, vocab_size=512),    # the smoke's stand-in for Llama-3.1-70B (8:1 GQA)
    "llama-125m": dict(train_lib.MODEL_SIZES["125m"], vocab_size=32000),
    "llama3.2-3b": _LLAMA32_3B,
    # the same with its own lm_head (3.6B parameters): ALST's tiled loss cannot train tied embeddings under ZeRO-3
    "llama3.2-3b-untied": dict(_LLAMA32_3B, tie_word_embeddings=False),
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
    """Configuration `name`'s DeepSpeed config with the overrides (`zero_set`: parse_zero_set's); on CPU BF16 uses
    torch's AdamW (`torch_adam`): FusedAdam would JIT-build a C++ op there."""
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
    """'KEY=VALUE,...' (e.g. 'reduce_bucket_size=2e8') -> zero_optimization entries; ValueError says what is allowed."""
    out: dict = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        kind = ZERO_SET_KEYS.get(key)
        if kind is None:
            raise ValueError(f"--zero-set {item!r}: {key!r} is not a key it sets; allowed: {sorted(ZERO_SET_KEYS)}")
        value = value.lower()
        try:
            number = float(value) if kind is int else math.nan
        except ValueError:
            number = math.nan
        if kind is bool and value in ("true", "false"):
            out[key] = value == "true"
        elif number >= 0 and number.is_integer():
            out[key] = int(number)
        else:
            allowed = "true or false" if kind is bool else "a whole number >= 0 (e.g. 2e8)"
            raise ValueError(f"--zero-set {item!r}: {value!r} is invalid for {key}; allowed: {allowed}")
    return out


def build_model(model: str, device, dtype, seed: int, layers: int | None = None):
    """A randomly initialised model of shape `model` (MODELS) on `device` in `dtype`, `layers` deep where given."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r} is unknown; allowed: {list(MODELS)}")
    return train_lib.from_shape(shape_of(model, layers), seed, device, dtype)


def shape_of(model: str, layers: int | None = None) -> dict:
    """`model`'s HF config fields, `layers` deep where given (two such stand-ins part per-layer memory from rest)."""
    return dict(MODELS[model], max_position_embeddings=4096, **({"num_hidden_layers": layers} if layers else {}))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...]) -> list[str]:
    """The --configs names, each one known, after p.error for any unknown name or `positive` option below 1."""
    check_positive(p, args, positive)
    return names_of(p, "configs", args.configs, LABELS)

