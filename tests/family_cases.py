"""One small default-config model per registered family, built as users build them (AutoConfig.for_model +
AutoModelForCausalLM.from_config): small sizes through config kwargs, HF's defaults otherwise (use_cache=True).
Shared by tests/test_families.py and the 2-rank ZeRO-3 job of tests/launched/test_families_zero3.py; a family
registered without a case here fails them."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, SEQ = 256, 24
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
# Beyond SMALL: a head_dim that fits hidden 64, and windows shorter than SEQ so that local layers differ
# from global ones (Gemma 3: one local and one global layer, each with its own RoPE base).
CASES = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    # mixtures of experts: 8 experts, 2 a token (HF's defaults otherwise: every Qwen3-MoE layer sparse, no aux loss
    # in the output unless output_router_logits)
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
}

# test_inject's bounds, but for Gemma 3: its post-norms rescale each branch to unit RMS before the residual add,
# so an FP8 GEMM's error is not diluted by the residual as in a pre-norm block. Measured over 3 seeds: FP8
# linears alone (mode linear) logits 0.091..0.096; mode full logits 0.104..0.114, gradients max 0.21..0.26,
# mean 0.165..0.174 (Qwen3 on the same sizes: 0.055..0.060, 0.17..0.18, 0.125..0.127).
# Mixtures of experts: FP8 attention moves a few near-tied tokens to other experts (1..3 of 48 a layer here, routing
# itself is stock), which changes those tokens' expert and router gradients outright. Measured over 3 seeds: logits
# 0.042..0.055, router gradient 0.28..0.39, other gradients max 0.22..0.33, mean 0.13..0.17.
MOE_BOUNDS = dict(logits_tol=0.08, grad_max=0.5, grad_mean=0.22)
BOUNDS = {"gemma3_text": dict(logits_tol=0.15, grad_max=0.35, grad_mean=0.22), "qwen3_moe": MOE_BOUNDS,
          "mixtral": MOE_BOUNDS}

# Steps for the stock model to memorize its sequence (harness.memorizing): Mixtral's 8 experts a layer (no shared
# dense path) need more than 60 at these sizes (measured: 60 not enough, 100 enough)
MEMORIZE_STEPS = {"mixtral": 120}


def build(model_type: str, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**SMALL, **CASES[model_type], **kw})
    assert config.use_cache
    return AutoModelForCausalLM.from_config(config)
