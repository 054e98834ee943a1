"""Built-in policies: Llama (1/2/3, GQA, llama3 rope scaling), Mistral, Qwen2.

All three share the Llama block shape; they differ only in what the stock attention module passes to
HF's attention interface (sliding window) and in which biases the projections carry. RoPE (llama3
scaling included) is computed once per model outside the decoder layers, so no policy touches it."""
from __future__ import annotations

from typing import Any

from torch import nn

from .registry import InjectionPolicy, register_policy

# The FP8 MLP fuses SiLU(gate) * up (COAT's SwiGLU); other activations would need another kernel.
SUPPORTED_HIDDEN_ACTS = ("silu",)


def check_llama_block(hf_config: Any) -> list[str]:
    """Reasons a Llama-shaped config cannot take the FP8 layers (empty: it can)."""
    problems = []
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in SUPPORTED_HIDDEN_ACTS:
        problems.append(f"hidden_act={act!r} is not supported by the FP8 MLP; allowed: {list(SUPPORTED_HIDDEN_ACTS)}")
    return problems


def mistral_attention_kwargs(attn: nn.Module) -> dict[str, Any]:
    """Mistral applies one sliding window from the config to every layer (None: full attention)."""
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def qwen2_attention_kwargs(attn: nn.Module) -> dict[str, Any]:
    """Qwen2 decides per layer (config.layer_types); the stock module stores the result."""
    return {"sliding_window": getattr(attn, "sliding_window", None)}


LLAMA = register_policy(InjectionPolicy("llama", ("LlamaDecoderLayer",), check=check_llama_block))
MISTRAL = register_policy(InjectionPolicy("mistral", ("MistralDecoderLayer",), check=check_llama_block,
                                          attention_kwargs=mistral_attention_kwargs))
QWEN2 = register_policy(InjectionPolicy("qwen2", ("Qwen2DecoderLayer",), check=check_llama_block,
                                        attention_kwargs=qwen2_attention_kwargs))
