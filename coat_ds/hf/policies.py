"""Built-in policies: Llama (1/2/3, GQA, llama3 rope scaling), Mistral, Qwen2, Qwen3.

All share the Llama block shape. What differs is read from the stock modules by the FP8 layer (Qwen2's
per-layer sliding window, Qwen2's q/k/v biases, Qwen3's per-head q/k norms), except Mistral's sliding window, which
MistralAttention takes from its config inside its forward: the policy hands that one over.
RoPE (llama3 scaling included) is computed once per model outside the decoder layers and handed to
them as `position_embeddings`.

Gemma 3 (text, `Gemma3ForCausalLM`): its policy names the four norms of its block (a norm after attention and
after the MLP, before each residual add) and their (1 + w) weight; the layer reads the rest from the stock
modules: GeGLU (tanh-GELU act_fn), per-head q/k norms, query_pre_attn_scalar (the attention's `scaling`), and
each layer's window (local layers) while the model hands each layer the RoPE of its type and the embeddings
come scaled by sqrt(hidden) from the stock embedding.

Mixture of experts (Qwen3-MoE, Mixtral): the same block with a sparse MLP (a top-k router `gate` and transformers
5's 3D `experts`); the FP8 layer runs the stock router in bf16/fp32 and the experts' GEMMs in FP8
(activation/experts.py), and a Qwen3-MoE layer that keeps a dense MLP (mlp_only_layers) the dense flow. Mixtral's
window comes from its config, as Mistral's. gpt-oss and Qwen2-MoE are refused (coverage.WHY_NOT says why)."""
from __future__ import annotations

from typing import Any

from torch import nn

from .registry import InjectionPolicy, Norms, register_policy


def mistral_attention_kwargs(layer: nn.Module) -> dict[str, Any]:
    """One window from the config for every layer (None: full attention)."""
    return {"sliding_window": getattr(layer.self_attn.config, "sliding_window", None)}


LLAMA = register_policy(InjectionPolicy("llama", ("LlamaDecoderLayer",)))
MISTRAL = register_policy(InjectionPolicy("mistral", ("MistralDecoderLayer",),
                                          attention_kwargs=mistral_attention_kwargs))
QWEN2 = register_policy(InjectionPolicy("qwen2", ("Qwen2DecoderLayer",)))
QWEN3 = register_policy(InjectionPolicy("qwen3", ("Qwen3DecoderLayer",)))
GEMMA3 = register_policy(InjectionPolicy(
    "gemma3_text", ("Gemma3DecoderLayer",),
    norms=Norms(attn_in="input_layernorm", attn_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
                mlp_out="post_feedforward_layernorm", weight_offset=1.0)))
QWEN3_MOE = register_policy(InjectionPolicy("qwen3_moe", ("Qwen3MoeDecoderLayer",),
                                            sparse_blocks=("Qwen3MoeSparseMoeBlock",)))
MIXTRAL = register_policy(InjectionPolicy("mixtral", ("MixtralDecoderLayer",),
                                          attention_kwargs=mistral_attention_kwargs,
                                          sparse_blocks=("MixtralSparseMoeBlock",)))
