"""Built-in policies: Llama (1/2/3, GQA, llama3 rope scaling), Mistral, Qwen2.

All three share the Llama block shape. What differs is read from the stock modules by the FP8 layer:
Mistral's and Qwen2's sliding window, Qwen2's q/k/v biases. RoPE (llama3 scaling included) is computed
once per model outside the decoder layers and handed to them as `position_embeddings`."""
from __future__ import annotations

from .registry import InjectionPolicy, register_policy

LLAMA = register_policy(InjectionPolicy("llama", ("LlamaDecoderLayer",)))
MISTRAL = register_policy(InjectionPolicy("mistral", ("MistralDecoderLayer",)))
QWEN2 = register_policy(InjectionPolicy("qwen2", ("Qwen2DecoderLayer",)))
