"""The `"coat"` section of a DeepSpeed config: what the DeepSpeed engine does to the model (engine.py).

    "coat": {"activation": {...}}     FP8 activation flow (keys: coat_ds.activation.ActivationConfig)
    "coat": {"loss": {...}}           the causal-LM loss without full logits (keys: coat_ds.activation.loss.LossConfig;
                                      on by default wherever a "coat" section is present)
    "coat": {"master_weights": ...}   where ZeRO keeps the master weights (coat_ds.deepspeed.zero.master)
    "coat": {"gradients": ...}        where ZeRO keeps reduced gradients for the step (coat_ds.deepspeed.zero.gradients)
    "coat": {"states": ...}           where CoatAdamW's FP8 moments live between steps (coat_ds.deepspeed.zero.states)

DeepSpeed ignores top-level keys it does not know; after `import coat_ds` its engine applies this one.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Mapping

from ..activation import ActivationConfig
from ..activation.loss import LossConfig
from ..keys import unknown_key
from . import deepspeed_keys
from .optimizer_type import NAME
from .zero import gradients as _gradients
from .zero import states as _states
from .zero.master import check_master_weights

SECTION = "coat"
_KEYS = ("activation", "master_weights", "loss", "gradients", "states")


@dataclass(frozen=True)
class CoatSection:
    activation: Any = None  # ActivationConfig, or None when the section has no "activation"
    master_weights: str = "fp32"  # "fp32" | "bf16_sr" | "bf16_rn": coat_ds.deepspeed.zero.master
    loss: Any = None  # LossConfig (its defaults when the section has no "loss"): coat_ds.hf.loss
    gradients: str = _gradients.DEFAULT  # coat_ds.deepspeed.zero.gradients.GRADIENTS
    states: str = _states.DEFAULT  # coat_ds.deepspeed.zero.states.STATES

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "CoatSection":
        d = dict(d or {})
        for key in d:
            if key not in _KEYS:
                raise ValueError(unknown_key("coat", key, _KEYS))
        activation = None
        if "activation" in d:
            if not isinstance(d["activation"], Mapping):
                raise ValueError(f"coat.activation={d['activation']!r} is invalid; allowed: an object of "
                                 "ActivationConfig keys")
            try:
                activation = ActivationConfig.from_dict(d["activation"])
            except ValueError as exc:  # ActivationConfig names its keys "activation.<key>": give the full path
                msg = str(exc)
                raise ValueError("coat." + msg if msg.startswith("activation.") else msg) from None
        return cls(activation=activation, master_weights=check_master_weights(d.get("master_weights", "fp32")),
                   loss=LossConfig.from_dict(d.get("loss")),
                   gradients=_gradients.check_gradients(d.get("gradients", _gradients.DEFAULT)),
                   states=_states.check_states(d.get("states", _states.DEFAULT)))


def coat_section(config: Mapping[str, Any] | None) -> CoatSection:
    return CoatSection.from_dict((config or {}).get(SECTION))


_CHECKED: "weakref.WeakSet" = weakref.WeakSet()   # the DeepSpeedConfigs whose keys were checked


def check_keys(ds_config, param_dict: Mapping) -> None:
    """DeepSpeed's keys of a config that runs coat_ds (a "coat" section or CoatAdamW), checked once per
    DeepSpeedConfig (deepspeed_keys.check, one line): engine.py runs this as DeepSpeed starts to parse it, so that
    `deepspeed.initialize` (a user's script, HF Trainer) refuses a bad value ("bf16": {"enable": true}, a
    micro-batch of 0) in one line before building anything, where DeepSpeed's parser would raise tracebacks; and a
    top-level key DeepSpeed would ignore ("zero_optimzation") as well."""
    if ds_config in _CHECKED or deepspeed_keys.parsing():
        return
    _CHECKED.add(ds_config)
    opt = param_dict.get("optimizer")
    if SECTION in param_dict or (isinstance(opt, Mapping) and opt.get("type") == NAME):
        deepspeed_keys.check(param_dict, hf_auto=True, world_size=ds_config.world_size, ours=(SECTION,))


def engine_section(engine) -> CoatSection:
    """The "coat" section of a DeepSpeed engine's config, whose keys were checked as DeepSpeed parsed it
    (check_keys; here too for an engine built from a DeepSpeedConfig made before `import coat_ds`)."""
    check_keys(engine._config, engine._config._param_dict)
    return coat_section(engine._config._param_dict)
