"""Everything coat_ds knows about HF transformers: the FP8 decoder layer, the model-family policies and the
in-place swap of a model's decoder layers."""
from .registry import InjectionPolicy, get_policy, register_policy, supported_model_types
from .swap import inject, is_injected, policy_for, revert

__all__ = ["InjectionPolicy", "get_policy", "register_policy", "supported_model_types", "inject", "revert",
           "is_injected", "policy_for", "CoatDecoderLayer"]


def __getattr__(name: str):
    # The FP8 layer imports the activation kernels: loaded on first use, so that policies list without them.
    if name == "CoatDecoderLayer":
        from .decoder_layer import CoatDecoderLayer
        return CoatDecoderLayer
    raise AttributeError(name)
