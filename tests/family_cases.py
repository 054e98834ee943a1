"""One small default-config model per registered family, built as users build them (AutoConfig.for_model +
AutoModelForCausalLM.from_config): small sizes through config kwargs, HF's defaults otherwise (use_cache=True).
Shared by tests/test_families.py and the 2-rank ZeRO-3 job it launches; a family registered without a case
here fails that test."""
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
}


def build(model_type: str, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**SMALL, **CASES[model_type], **kw})
    assert config.use_cache
    return AutoModelForCausalLM.from_config(config)
