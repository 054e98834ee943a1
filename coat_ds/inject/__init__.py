"""Model injection: swap HF Llama-family decoder layers for coat_ds's FP8 precision-flow layers."""
from .registry import InjectionPolicy, get_policy, register_policy, supported_model_types
from .swap import inject, is_injected, policy_for, revert

__all__ = ["InjectionPolicy", "get_policy", "register_policy", "supported_model_types", "inject", "revert",
           "is_injected", "policy_for"]
