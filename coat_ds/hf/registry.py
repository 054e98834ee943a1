"""Policy registry: HF `config.model_type` -> which modules of that family are its decoder layers.

A family with the Llama block shape (RMSNorm -> attention -> residual -> RMSNorm -> gated MLP -> residual; the MLP
may be a mixture-of-experts block with transformers 5's 3D experts),
or Gemma's (a norm also after attention and after the MLP), needs only a policy, never its own injection
code: the policy names the norms (`Norms`), and the FP8 layer reads everything else (sliding window, biases,
per-head q/k norms, head layout, gated activation, attention scaling and backend) from the stock modules
it takes over."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn


@dataclass(frozen=True)
class Norms:
    """A decoder block's RMSNorms: the stock submodule that plays each role (None: the block has none), and the
    weight each one multiplies by, w + weight_offset (Gemma's norms scale by 1 + w). Llama: a norm before
    attention and one before the MLP. Gemma 3: also one after each (applied before the residual add).
    Per-head q/k norms are read from the attention module itself (self_attn.q_norm / k_norm) and take the
    same offset."""

    attn_in: str = "input_layernorm"
    mlp_in: str = "post_attention_layernorm"
    attn_out: Optional[str] = None
    mlp_out: Optional[str] = None
    weight_offset: float = 0.0

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.attn_in, self.attn_out, self.mlp_in, self.mlp_out) if n)


@dataclass(frozen=True)
class InjectionPolicy:
    """model_type: the HF `config.model_type` this policy serves ("llama", ...).
    layer_class_names: class names of the decoder layers to swap; matched by name so that the registry
    does not import modeling files, and so that a class transformers derives from it (same name) matches.
    attention_kwargs: optional, stock layer -> extra keyword arguments for HF's attention function that the
    stock attention module computes in its own forward (Mistral's sliding window); None: nothing extra.
    norms: the block's norm layout (`Norms`); Llama's by default.
    sparse_blocks: class names of the family's mixture-of-experts blocks (the decoder layer's `mlp`); coat_ds makes
    them ZeRO-3 leaf modules wherever they stay stock (their experts gathered together, whichever get tokens)."""

    model_type: str
    layer_class_names: tuple[str, ...]
    attention_kwargs: Optional[Callable[[nn.Module], dict[str, Any]]] = None
    norms: Norms = Norms()
    sparse_blocks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_type or not isinstance(self.model_type, str):
            raise ValueError(f"model_type={self.model_type!r} must be a non-empty string")
        if isinstance(self.layer_class_names, str) or not self.layer_class_names:
            raise ValueError(f"layer_class_names={self.layer_class_names!r} must be a non-empty tuple of class names")
        if isinstance(self.sparse_blocks, str):
            raise ValueError(f"sparse_blocks={self.sparse_blocks!r} must be a tuple of class names")


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
