"""Policy registry: HF `config.model_type` -> how to find and check that family's decoder layers.

A family with the Llama block shape (RMSNorm -> attention -> residual -> RMSNorm -> gated MLP -> residual)
needs only a policy, never its own injection code."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

ConfigCheck = Callable[[Any], "list[str]"]
AttentionKwargs = Callable[[nn.Module], "dict[str, Any]"]


def _no_problems(hf_config: Any) -> list[str]:
    return []


def _no_attention_kwargs(attn: nn.Module) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class InjectionPolicy:
    """What the swap needs to know about one model family.

    model_type: the HF `config.model_type` this policy serves ("llama", ...).
    layer_class_names: class names of the decoder layers to swap; matched by name so that the policy
        does not import the modeling file (and works with subclasses HF generates, e.g. for FSDP).
    check: returns why a config cannot be injected (empty list: it can); inject raises them as one
        ValueError, so an unsupported variant fails at once, not with wrong numbers later.
    attention_kwargs: per-layer extra arguments for HF's attention interface that the stock attention
        module computes itself (Mistral/Qwen2 sliding window); the FP8 layer passes them on.
    """

    model_type: str
    layer_class_names: tuple[str, ...]
    check: ConfigCheck = field(default=_no_problems)
    attention_kwargs: AttentionKwargs = field(default=_no_attention_kwargs)


_POLICIES: dict[str, InjectionPolicy] = {}


def register_policy(policy: InjectionPolicy, *, overwrite: bool = False) -> InjectionPolicy:
    """Add `policy` under its model_type; registering a type twice is an error unless `overwrite`."""
    if not isinstance(policy, InjectionPolicy):
        raise TypeError(f"policy must be an InjectionPolicy, got {type(policy).__name__}")
    if policy.model_type in _POLICIES and not overwrite:
        raise ValueError(f"model_type={policy.model_type!r} already has a policy; pass overwrite=True to replace it")
    _POLICIES[policy.model_type] = policy
    return policy


def supported_model_types() -> list[str]:
    return sorted(_POLICIES)


def get_policy(model_type: str) -> InjectionPolicy:
    """The policy for `model_type`; an unknown type is a ValueError that lists the supported ones."""
    try:
        return _POLICIES[model_type]
    except KeyError:
        raise ValueError(f"model_type={model_type!r} has no coat_ds injection policy; "
                         f"supported: {supported_model_types()}") from None
