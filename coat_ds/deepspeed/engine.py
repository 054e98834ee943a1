"""coat_ds.deepspeed.initialize: deepspeed.initialize plus what the "coat" section asks for."""
from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from ..optim import CoatAdamW
from .config import coat_section
from .registry import register


def _load_config(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    return copy.deepcopy(dict(config))


def _offloads_optimizer(cfg: dict) -> bool:
    device = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return str(device).lower() in ("cpu", "nvme")


def initialize(model: torch.nn.Module, config: Any = None, optimizer: Any = None, **kw: Any):
    """Same arguments and return value as deepspeed.initialize (config: dict or path).

    - "coat": {"activation": {...}} injects the FP8 activation layers first (coat_ds.inject); cache_weights
      "when_accumulating" is decided afterwards from the engine's gradient_accumulation_steps (DeepSpeed
      derives it from train_batch_size where the config leaves it out);
    - a CoatAdamW instance with ZeRO-Offload needs no "zero_force_ds_cpu_optimizer": false: it runs
      its CPU kernel on the offloaded partition (DeepSpeed's check targets slow torch optimizers).
    """
    import deepspeed

    register()
    cfg = _load_config(config if config is not None else kw.pop("config_params", None))
    section = coat_section(cfg)
    if section.activation is not None:
        from .. import inject

        inject(model, section.activation)
    if isinstance(optimizer, CoatAdamW) and _offloads_optimizer(cfg):
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    if optimizer is None and "model_parameters" not in kw and (cfg.get("optimizer") or {}).get("type") == "CoatAdamW":
        kw["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    result = deepspeed.initialize(model=model, config=cfg, optimizer=optimizer, **kw)
    if section.activation is not None:
        gas = result[0].gradient_accumulation_steps()
        for m in model.modules():
            if hasattr(m, "resolve_weight_cache"):
                m.resolve_weight_cache(gas)
    return result
