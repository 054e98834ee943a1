"""Public Llama, Qwen3, Qwen3-MoE and Gemma 3 shapes by name, with their vocabularies: what the planner
(`python -m coat_ds.plan --model llama3-8b`) and the benchmarks mean by a model name, without a download. The main job's own sizes, whose
vocabulary comes from its data, are causal_lm.MODEL_SIZES."""
from __future__ import annotations

SHAPES = {
    # TinyLlama-1.1B (the main job's 1b is its shape, causal_lm.MODEL_SIZES; not imported: causal_lm imports this)
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=5632, vocab_size=32000),
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000),
    "llama2-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                       intermediate_size=13824, vocab_size=32000),
    "llama2-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=32000),
    "llama3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256),                 # Llama-3-8B's too
    "llama3.1-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                         intermediate_size=28672, vocab_size=128256),                # Llama-3-70B's too
    # per-head q/k norms; Qwen3-8B's config.json
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936),
    # four norms a layer, per-head q/k norms, tied embeddings, 5 local (1024-token window) : 1 global layers;
    # Gemma-3-4B's text_config
    "gemma3-4b": dict(model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, intermediate_size=10240, vocab_size=262208,
                      tie_word_embeddings=True, sliding_window=1024),
    # mixture of experts: 128 experts of 768, 8 a token (3.3B of 30.5B parameters active), every layer sparse,
    # top-k weights renormalized; Qwen3-30B-A3B's config.json (intermediate_size: its dense MLP, unused there)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, vocab_size=151936),
}
ALIASES = {"llama3-8b": "llama3.1-8b", "llama3-70b": "llama3.1-70b"}
