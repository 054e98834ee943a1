"""What a swap covers, in one line: which decoder layers run FP8 and what stays stock (bf16); for a model that
no policy serves, or that a policy would serve only in part, a refusal that says what would stay stock and
why. Never a silent partial swap. Knows no activation kernels (inject must explain itself without them)."""
from __future__ import annotations

from collections import Counter

from torch import nn

from .registry import InjectionPolicy, Norms

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# Outside the decoder layers, every family keeps these stock: the FP8 flow is the decoder layers'.
STAYS_STOCK = "embeddings, final norm, lm_head, rotary embeddings"


# Families refused with the reason their blocks differ (beyond what missing_parts names).
WHY_NOT = {
    "gpt_oss": "attention sinks, and experts with biases, gate/up interleaved and a clamped SwiGLU, which the FP8 "
               "flow has no kernels for",
    "qwen2_moe": "a shared expert with its own sigmoid gate beside the routed experts",
}


def is_sparse(mlp: nn.Module | None) -> bool:
    """Whether `mlp` is a mixture-of-experts block (a router `gate` and an `experts` module)."""
    return mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _experts_missing(mlp: nn.Module) -> list[str]:
    """What a sparse block lacks of transformers 5's experts contract the FP8 experts take over: 3D gate_up_proj
    [E, 2I, H] and down_proj [E, H, I], gate then up concatenated, no biases, the default act(gate) * up, no
    post-expert norm, a router returning (logits, weights, indices), no jitter noise."""
    experts, gate = mlp.experts, mlp.gate
    # transformers' experts classes (use_experts_implementation) keep both as 3D parameters; their data may be
    # partitioned here (ZeRO-3's zero.Init), so the contract is read from the class, not from the shapes
    missing = [f"mlp.experts.{n}" for n in ("gate_up_proj", "down_proj")
               if not isinstance(getattr(experts, n, None), nn.Parameter)]
    if not hasattr(experts, "num_experts") or not hasattr(experts, "has_gate"):
        missing.append("mlp.experts: transformers' experts interface (3D experts)")
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    missing += [f"mlp.experts.{n}={want}" for n, want in flags.items() if getattr(experts, n, want) != want]
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        missing.append("mlp.experts: the default act(gate) * up")
    if not hasattr(gate, "weight") or not hasattr(gate, "top_k"):
        missing.append("mlp.gate (a top-k router)")
    if getattr(mlp, "jitter_noise", 0):
        missing.append("router_jitter_noise=0")
    return missing


def missing_parts(hf_layer: nn.Module, norms: Norms) -> list[str]:
    """What `hf_layer` lacks of the block the FP8 layer takes over (empty: it takes it)."""
    attn, mlp = getattr(hf_layer, "self_attn", None), getattr(hf_layer, "mlp", None)
    missing = [f"self_attn.{n}" for n in _ATTN if not isinstance(getattr(attn, n, None), nn.Linear)]
    if is_sparse(mlp):
        missing += _experts_missing(mlp)
    else:
        missing += [f"mlp.{n}" for n in _MLP if not isinstance(getattr(mlp, n, None), nn.Linear)]
    missing += [n for n in norms.names() if not hasattr(getattr(hf_layer, n, None), "weight")]
    return missing


def _layer_like(model: nn.Module) -> Counter:
    """Class names (with counts) of the model's block-level layers: HF's `_no_split_modules` (the classes a
    device map keeps whole) and any *DecoderLayer."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return Counter(type(m).__name__ for m in model.modules()
                   if type(m).__name__ in names or type(m).__name__.endswith("DecoderLayer"))


def _why(model: nn.Module, cls_name: str) -> str:
    layer = next(m for m in model.modules() if type(m).__name__ == cls_name)
    missing = missing_parts(layer, Norms())
    mlp = getattr(layer, "mlp", None)
    what = f"mlp is {type(mlp).__name__}" if mlp is not None and any(m.startswith("mlp.") for m in missing) else ""
    return "; ".join(filter(None, [what, f"not Llama-shaped: no {', '.join(missing)}" if missing else ""]))


def _listing(model: nn.Module, counts: Counter) -> str:
    return ", ".join(f"{n} x{c}" + (f" ({why})" if (why := _why(model, n)) else "") for n, c in counts.items())


def no_policy_refusal(model: nn.Module, model_type: str, supported: list[str]) -> str:
    """One line: the type has no policy, nothing was swapped, and which layers (why) would stay stock."""
    layers = _layer_like(model)
    stock = _listing(model, layers) if layers else "all of it"
    why = f" ({WHY_NOT[model_type]})" if model_type in WHY_NOT else ""
    return (f"model_type={model_type!r} has no coat_ds injection policy{why}; nothing swapped, stays stock: {stock}; "
            f"supported: {supported}")


def partial_refusal(model: nn.Module, policy: InjectionPolicy) -> str | None:
    """One line refusing a swap that would leave other block-level layers stock (None: the policy covers all)."""
    others = Counter({n: c for n, c in _layer_like(model).items() if n not in policy.layer_class_names})
    if not others:
        return None
    return (f"coat_ds.inject: the {policy.model_type!r} policy swaps {list(policy.layer_class_names)} but this "
            f"{type(model).__name__} also has {_listing(model, others)}, which would stay stock; nothing swapped")


def summary(model: nn.Module, swapped: Counter, mode: str) -> str:
    """One line: what runs FP8 and what stays stock."""
    layers = ", ".join(f"{c} {n}" for n, c in swapped.items())
    return f"coat_ds.inject: {type(model).__name__}: FP8 ({mode}): {layers}; stays stock: {STAYS_STOCK}"
