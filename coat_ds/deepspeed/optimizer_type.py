"""`"optimizer": {"type": "CoatAdamW", ...}`: the name, its params' checks, and the factory DeepSpeed calls.

DeepSpeed builds an optimizer it does not know by `getattr(torch.optim, name)(params, **params_cfg)`;
registration.py puts `coat_adamw_from_config` there under NAME.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..optim import CoatAdamW
from ..optim.coat_adamw import PARAM_RULES, check_param
from ..keys import unknown_key

NAME = "CoatAdamW"

def validate_params(params: dict | None) -> dict:
    """The optimizer "params" of a DeepSpeed config, checked by CoatAdamW's own rules; a ValueError names
    the key and what is allowed."""
    params = dict(params or {})
    for key, value in params.items():
        if key not in PARAM_RULES:
            raise ValueError(unknown_key("optimizer.params", key, sorted(PARAM_RULES)))
        check_param(key, value, where="optimizer.params.")
    if "betas" in params:
        params["betas"] = tuple(float(b) for b in params["betas"])
    if "v_format" in params:
        params["v_format"] = params["v_format"].lower()
    return params


def coat_adamw_from_config(model_parameters: Iterable, **params: Any) -> CoatAdamW:
    """What DeepSpeed calls for `"type": "CoatAdamW"`: validate the params, then build the optimizer."""
    return CoatAdamW(model_parameters, **validate_params(params))


coat_adamw_from_config.__name__ = coat_adamw_from_config.__qualname__ = NAME

