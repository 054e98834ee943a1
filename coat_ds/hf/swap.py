"""inject / revert: swap a HF model's decoder layers for coat_ds's FP8 layers in place, and back.

The FP8 layer is built from the stock layer and reuses its submodules under the same names, so the
parameters (and state_dict keys, tied embeddings, ZeRO-3 partitions) are untouched; only the forward
changes. What the model has attached to a layer (training flag, HF gradient checkpointing, hooks)
moves with the swap in both directions."""
from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..activation.sharding import sharding
from . import policies as _builtin_policies  # noqa: F401  (registers the built-in families)
from . import coverage, final_norm
from .contract import has_cache
from .registry import InjectionPolicy, get_policy, supported_model_types

logger = logging.getLogger(__name__)

# Set on the model (a plain attribute: not in state_dict, not in config.json, so saving stays stock).
INJECTED_ATTR = "_coat_injected"
# Forward/backward hook tables of nn.Module; moved so that hooks follow the layer (HF's output capture).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
                "_backward_hooks")
# What transformers' set_gradient_checkpointing puts on each GradientCheckpointingLayer.
_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _decoder_layer() -> type:
    # Imported late: coat_ds.inject must import (and list policies) even where the activation layers fail to.
    from .decoder_layer import CoatDecoderLayer
    return CoatDecoderLayer


def _as_config(config: Any):
    from ..activation import ActivationConfig   # late, as _layer_class: this module imports without the layers
    return ActivationConfig.coerce(config)


def policy_for(model: nn.Module) -> InjectionPolicy:
    """The registered policy for `model.config.model_type` (ValueError listing supported types if none)."""
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    if model_type is None:
        raise ValueError(f"{type(model).__name__} has no config.model_type; coat_ds.inject expects a transformers "
                         "PreTrainedModel (e.g. from AutoModelForCausalLM)")
    if model_type not in supported_model_types():
        raise ValueError(coverage.no_policy_refusal(model, model_type, supported_model_types()))
    return get_policy(model_type)


def _refuse_wrapped(model: nn.Module, what: str) -> None:
    """The FP8 layers go into the model before a framework wraps it or hooks its modules (activation.sharding)."""
    hooks = sharding()
    why = hooks.wrapper_refusal(model, what) or hooks.hooked_refusal(model, what)
    if why:
        raise ValueError(why)


def _serves(have: Any, want: Any) -> bool:
    """Whether layers built with ActivationConfig `have` serve a request for `want`: equal, but for a
    cache_weights decision that one of them leaves to gradient accumulation ("when_accumulating") and for
    the recompute's settings (checkpoint, its store, the MLP's tiles), which apply() sets on the built layers."""
    from ..activation.config import CACHE_WHEN_ACCUMULATING as when
    have = replace(have, checkpoint=want.checkpoint, checkpoint_store=want.checkpoint_store,
                   tile_tokens=want.tile_tokens)
    if when in (have.cache_weights, want.cache_weights):
        have = replace(have, cache_weights=want.cache_weights)
    return have == want


def _install_output_capture(model: nn.Module) -> None:
    """Install transformers' output_hidden_states hooks now, while the layers are still stock classes
    (they match by class), so that the swap can carry them to the FP8 layers. Private API: best effort."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    for module in model.modules():  # the outermost call reaches nested models; later calls are no-ops
        if isinstance(module, PreTrainedModel):
            try:
                maybe_install_capturing_hooks(module)
            except Exception:  # noqa: BLE001 - a model this helper does not understand keeps its old behaviour
                pass


def _move_attached_state(src: nn.Module, dst: nn.Module) -> None:
    """Give `dst` what the model attached to `src`: train/eval flag, gradient checkpointing, hooks."""
    dst.training = src.training
    # HF's checkpointing moves; where coat.activation.checkpoint set it (either side), the FP8 layer keeps its own
    from ..activation.checkpoint_store import owned
    if not any(owned(m.__dict__.get(_CHECKPOINT_ATTRS[1])) for m in (src, dst)):
        for attr in _CHECKPOINT_ATTRS:
            if attr in src.__dict__:
                setattr(dst, attr, src.__dict__[attr])
    for table in _HOOK_TABLES:
        moved = getattr(src, table, None)
        if moved is None or not moved:
            continue
        # Same dict object: RemovableHandles created on `src` keep working on `dst`.
        moved.update(getattr(dst, table))
        setattr(dst, table, moved)
        setattr(src, table, type(moved)())


def _drop_stale_sharded_weights(layer: nn.Module, args: Any) -> None:
    """Forward pre-hook: a partitioned weight (ZeRO-3) is re-gathered into whatever buffer is free and the
    optimizer updates its partition through `.data`, so neither data_ptr nor _version tells a new step
    from an old one: a cached FP8 weight or scale would outlive its step. Clear the layer's cache once
    per forward. The weight is looked at through parameters(), not the attribute: this hook may run before
    ZeRO-3's own gathers the layer, and ZeRO-3's attribute getter, seeing a forward, would gather the weight
    for the parent module and keep it until the parent's backward ends (every layer's q_proj at once)."""
    if any(sharding().is_partitioned(w) for w in layer.self_attn.q_proj.parameters(recurse=False)):
        layer.clear_weight_cache()


def _cacheless_training(model: nn.Module, args: Any, kwargs: dict[str, Any]):
    """Forward pre-hook: a training forward (grad enabled) runs with use_cache=False, as HF's own models do
    under gradient checkpointing. HF's default use_cache=True builds a KV cache even in a training forward;
    the cache keeps a second bf16 copy of every layer's K and V alive with the output, and attention_fp8
    must decline a cached call (what attention saves would not be what the cache returns). A cache the
    caller passes in is kept, and so is every forward without grad (generate, evaluation)."""
    if not (model.training and torch.is_grad_enabled()) or has_cache(kwargs):
        return None
    if kwargs.get("use_cache"):
        _warn_cacheless_once()
    return args, {**kwargs, "use_cache": False}


@functools.lru_cache(maxsize=None)
def _warn_cacheless_once() -> None:
    """Said once per process: a loop that asks for use_cache=True every step would otherwise log every step."""
    logger.warning("coat_ds: a training forward runs with use_cache=False (no KV cache is built with grad "
                   "enabled; pass a cache object to keep one)")


def _takes_use_cache(module: nn.Module) -> bool:
    from transformers import PreTrainedModel
    return isinstance(module, PreTrainedModel) and "use_cache" in inspect.signature(module.forward).parameters


def _install_cacheless_training(model: nn.Module) -> None:
    """Put _cacheless_training on `model` and on every HF model inside it whose forward takes use_cache (a user
    may call the base model directly); once each."""
    for module in model.modules():
        if _takes_use_cache(module) and _cacheless_training not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_cacheless_training, with_kwargs=True)


def _remove_hook(module: nn.Module, hook: Any) -> None:
    """Found by identity rather than by a stored handle, so deepcopy / pickle of the model cannot confuse it."""
    for key, h in list(module._forward_pre_hooks.items()):
        if h is hook:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _attention_kwargs(policy: InjectionPolicy, layer: nn.Module) -> dict[str, Any]:
    kwargs = policy.attention_kwargs(layer) if policy.attention_kwargs else {}
    # None means "not set" to HF's attention functions; dropping it keeps the call identical to stock.
    return {k: v for k, v in kwargs.items() if v is not None}


def mark_sparse_blocks(model: nn.Module) -> int:
    """Make the model's mixture-of-experts blocks (its policy's sparse_blocks) ZeRO-3 leaf modules, as DeepSpeed's
    `zero_optimization.leaf_module` does (DeepSpeed #7461: ranks whose tokens reach different experts would
    otherwise gather different parameters and wait on each other); returns how many. Where coat_ds swaps a layer,
    the FP8 layer is the leaf (inject). A type without a policy marks nothing."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in supported_model_types():
        return 0
    blocks = [m for m in model.modules() if type(m).__name__ in get_policy(model_type).sparse_blocks]
    for block in blocks:
        sharding().mark_leaf(block)
    return len(blocks)


def inject(model: nn.Module, config: Any = None) -> nn.Module:
    """Swap every decoder layer of `model` for coat_ds's FP8 layer, in place; returns `model`.

    config: an ActivationConfig, the dict of the `"coat": {"activation": ...}` section, or None for the
    defaults (`enabled: false`: nothing is swapped). Call it before deepspeed.initialize (ZeRO-3
    included: parameters created under zero.Init stay partitioned; the swap never touches their data).
    Injecting again with the same config is a no-op, with another one a ValueError (revert first)."""
    _refuse_wrapped(model, "inject")
    cfg = _as_config(config)
    policy = policy_for(model)
    mark_sparse_blocks(model)
    if not cfg.enabled:  # "enabled": false in the JSON section: swap nothing
        return model
    coat_cls = _decoder_layer()
    targets = [(name, m) for name, m in model.named_modules()
               if type(m).__name__ in policy.layer_class_names and not isinstance(m, coat_cls)]
    injected = [m for m in model.modules() if isinstance(m, coat_cls)]
    other = {repr(m.coat_config) for m in injected if not _serves(m.coat_config, cfg)}
    if other:
        raise ValueError(f"coat_ds.inject: this model is already injected with {sorted(other)}; "
                         f"call coat_ds.revert(model) first to inject {cfg!r}")
    if not targets:
        if injected:
            return model
        raise ValueError(f"coat_ds.inject found no {list(policy.layer_class_names)} in {type(model).__name__}")
    partial = coverage.partial_refusal(model, policy)
    if partial:
        raise ValueError(partial)
    # Build every new layer before swapping any: a layer the FP8 flow cannot take (ValueError from
    # CoatDecoderLayer) then leaves the model untouched.
    built = [(name, layer, coat_cls(layer, cfg, attention_kwargs=_attention_kwargs(policy, layer), norms=policy.norms))
             for name, layer in targets]
    _install_output_capture(model)
    for name, layer, new in built:
        _move_attached_state(layer, new)
        # ZeRO-3: gather all of the layer's parameters when it is entered (the FP8 Functions read the
        # children's weights directly instead of calling the children).
        sharding().mark_leaf(new)
        new.register_forward_pre_hook(_drop_stale_sharded_weights)
        _set_submodule(model, name, new)
    if cfg.tile_tokens is not None:
        final_norm.tile(model, cfg.tile_tokens)
    _install_cacheless_training(model)
    object.__setattr__(model, INJECTED_ATTR, policy.model_type)
    logger.info(coverage.summary(model, Counter(type(layer).__name__ for _, layer, _ in built), cfg.mode))
    return model


def apply(model: nn.Module, config: Any, gradient_accumulation_steps: int) -> int:
    """What a DeepSpeed engine does with a `"coat": {"activation": ...}` section; returns the FP8 layer count.

    Injects, unless the model already runs FP8 layers that serve `config` (injected by the user, or by an
    earlier engine: HF Trainer may build one for evaluation first), then decides cache_weights
    "when_accumulating" by `gradient_accumulation_steps`. `enabled: false` leaves the model as it is and
    refuses one that already runs FP8 layers (the section and the model disagree)."""
    why = sharding().wrapper_refusal(model, "inject")  # a hooked model may still be served as it is
    if why:
        raise ValueError(why)
    cfg = _as_config(config)
    coat_cls = _decoder_layer()
    layers = [m for m in model.modules() if isinstance(m, coat_cls)]
    mark_sparse_blocks(model)   # stock sparse blocks too: enabled false keeps them, ZeRO-3 still needs them whole
    if not cfg.enabled:
        if layers:
            raise ValueError(f"enabled is false but the model already runs {len(layers)} FP8 decoder layers "
                             "(coat_ds.inject was called on it); call coat_ds.revert(model) or drop enabled: false")
        return 0
    if not layers or not all(_serves(m.coat_config, cfg) for m in layers):
        inject(model, cfg)
        layers = [m for m in model.modules() if isinstance(m, coat_cls)]
    for layer in layers:
        layer.coat_config = cfg  # the request; resolve_weight_cache decides "when_accumulating" from it
        layer.resolve_weight_cache(gradient_accumulation_steps)
        layer.checkpoint_if_configured()
    return len(layers)


def revert(model: nn.Module) -> nn.Module:
    """Put the stock HF decoder layers back (same parameter tensors), in place; returns `model`."""
    _refuse_wrapped(model, "revert")
    coat_cls = _decoder_layer()
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, coat_cls)]
    for name, layer in targets:
        _remove_hook(layer, _drop_stale_sharded_weights)
        original = layer.to_hf()
        _move_attached_state(layer, original)
        _set_submodule(model, name, original)
    final_norm.untile(model)
    for module in model.modules():
        _remove_hook(module, _cacheless_training)
    if INJECTED_ATTR in model.__dict__:
        object.__delattr__(model, INJECTED_ATTR)
    return model


def is_injected(model: nn.Module) -> bool:
    return bool(getattr(model, INJECTED_ATTR, None))
