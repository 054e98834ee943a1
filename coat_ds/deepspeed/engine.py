"""What coat_ds does inside `DeepSpeedEngine.__init__`: the one place every route to DeepSpeed passes.

`deepspeed.initialize` (a user's own script, the launcher), HF Trainer and accelerate all build a
DeepSpeedEngine from a config; `import coat_ds` wraps five of its methods (hook()):

- `_configure_distributed_model(model)`, the first step that has both the config and the module, and
  runs before ZeRO builds its optimizer and before ZeRO-3 installs its module hooks: the config's
  `"coat": {"activation": ...}` section swaps in the FP8 decoder layers there (so ZeRO partitions, hooks
  and flattens the model that will run) and cache_weights "when_accumulating" is decided from the
  engine's own gradient_accumulation_steps (which DeepSpeed derives where the config leaves it out);
- `_configure_optimizer`: a CoatAdamW *instance* may run under ZeRO-Offload (it has its own CPU kernel;
  DeepSpeed's `zero_force_ds_cpu_optimizer` check targets slow torch optimizers); with a master that is not
  fp32 (`coat.master_weights`) under ZeRO-1/2, DeepSpeed's `bf16_master_weights_and_grads` is set so that
  ZeRO builds its master (under Offload, its host gradient too) in bf16 from the start: an fp32 partition
  first would take 4 B/param at set-up (13B on one 80 GB GPU did not get past it; under Offload 8 B/param
  of host memory, 16 once pinned); partition layouts are bound and checkpoint hooks installed as soon as
  ZeRO has built its flat partitions;
- `_take_model_step`, the engine's optimizer step (every route's `engine.step()` at a gradient-accumulation
  boundary): the FP8 weight caches are keyed on a step counter that it advances, since DeepSpeed writes
  the updated weights where no autograd version shows it;
- `load_checkpoint`: a CoatAdamW engine checks every file of the tag first and re-partitions to another
  world size (checkpoint/load.py);
- `save_checkpoint`: a CoatAdamW engine's save is refused before anything is written where the filesystem cannot
  hold it (checkpoint/space.py);

and `DeepSpeedConfig._initialize_params`, where deepspeed.initialize starts to parse a config: one that runs coat_ds
has DeepSpeed's keys checked first, one line each (config.check_keys); ZeRO-3's `_setup_for_real_optimizer` does
not allocate the gradient buffer that coat replaces (_zero3_setup); its leaf modules' gradient reduce, for the
leaves coat_ds marks, fires from their input without keeping their output's gradient (zero/leaf_hooks.py);

and one of ZeRO-1/2's: `DeepSpeedZeroOptimizer._configure_master_weights`, whose validator accepts a bf16
master only for DeepSpeedCPUAdam under Offload (its concern: fp32 moments beside a bf16 master); CoatAdamW
keeps FP8 moments and its steps (device and CPU) write a bf16 master themselves (with stochastic rounding),
so for a CoatAdamW that validator is left out.

This module imports DeepSpeed (registration.register() imports it once DeepSpeed is there).
"""
from __future__ import annotations

import functools
import sys
from contextvars import ContextVar
from typing import Any

import torch
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import log_dist

from ..hf.loss import apply as apply_loss
from ..hf.swap import apply as swap_layers
from ..optim import CoatAdamW
from .checkpoint.files import latest_tag
from .checkpoint.load import install as checkpoint_hooks, load as checkpoint_load
from .checkpoint.space import already_checked, refuse_if_short
from .config import SECTION, check_keys, engine_section
from .optimizer_type import NAME
from .zero import leaf_hooks
from .zero.bind import bind
from .zero.master import alias_zero3_masters, bf16_master_from_setup
from .zero.step import replaces_grad_buffer

SECTION_KEY = "coat.activation"


def apply_section(engine, model: torch.nn.Module) -> None:
    """Apply the engine config's "coat" section to `model`; a ValueError naming coat.activation if it cannot."""
    section = engine_section(engine)
    if section.activation is not None:
        try:
            n = swap_layers(model, section.activation, engine.gradient_accumulation_steps())
        except ValueError as exc:
            raise ValueError(f"{SECTION_KEY} cannot be applied to this model: {exc}") from None
        log_dist(f"coat_ds: {SECTION_KEY}: {n} FP8 decoder layers" if n else f"coat_ds: {SECTION_KEY}: enabled is "
                 "false, the model keeps its stock layers", ranks=[0])
    if SECTION in engine._config._param_dict:   # coat.loss, on by default; after the swap, which must not override it
        log_dist(f"coat_ds: coat.loss: {apply_loss(model, section.loss)}", ranks=[0])


def _client_coat_adamw_offload(engine, client_optimizer: Any, *_: Any) -> None:
    """A CoatAdamW instance passes DeepSpeed's Offload check (unless the config itself sets the key)."""
    if isinstance(client_optimizer, CoatAdamW) and "zero_force_ds_cpu_optimizer" not in engine._config._param_dict:
        engine._config.zero_force_ds_cpu_optimizer = False


def _will_run_coat_adamw(engine, client_optimizer: Any) -> bool:
    if client_optimizer is None:
        return engine._config.optimizer_name == NAME
    return isinstance(client_optimizer, CoatAdamW)  # a callable's optimizer is not known yet: master.py swaps later


def _bf16_master_from_setup(engine, client_optimizer: Any, *_: Any) -> None:
    """A CoatAdamW master that is not fp32, under ZeRO-1/2 (under Offload the host gradient too) and ZeRO-3 on the
    device: ZeRO builds it in bf16 (ZeRO-3: its master partitions are the bf16 ones, never an fp32 copy)."""
    if _will_run_coat_adamw(engine, client_optimizer) and bf16_master_from_setup(
            engine, engine_section(engine).master_weights):
        engine._config.bfloat16_config.bf16_master_weights_and_grads = True


# The "coat" section of the engine whose optimizer is being configured (None: not a CoatAdamW engine): ZeRO-3's
# set-up, which has no engine, reads it.
_SECTION: ContextVar[Any] = ContextVar("coat_section", default=None)


def _configure_optimizer_before(engine, client_optimizer: Any, *args: Any) -> None:
    _client_coat_adamw_offload(engine, client_optimizer)
    _bf16_master_from_setup(engine, client_optimizer)
    _SECTION.set(engine_section(engine) if _will_run_coat_adamw(engine, client_optimizer) else None)


def _zero3_setup(zo, original, *args: Any, **kw: Any):
    """DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer ends by allocating a gradient buffer of the rank's
    whole partition, which Zero3Step replaces right after (GradPartitions): at world 1 the model's gradients
    beside its weights, 57 GiB each at Qwen3-30B-A3B, past an 80 GB card. Where it will be replaced, the buffer
    is built on the meta device: the device is swapped once the optimizer states exist (_meta_after_states)."""
    section = _SECTION.get()
    zo._coat_meta_buffer = bool(section and isinstance(zo.optimizer, CoatAdamW)
                                and replaces_grad_buffer(zo, section.gradients, section.master_weights))
    device = zo.device
    try:
        return original(*args, **kw)
    finally:
        zo.device, zo._coat_meta_buffer = device, False


def _meta_after_states(zo, *_: Any) -> None:
    if getattr(zo, "_coat_meta_buffer", False):
        zo.device = torch.device("meta")


def _coat_master_weights(zo, original, **kw: Any):
    """DeepSpeedZeroOptimizer._configure_master_weights: its check wants DeepSpeedCPUAdam under Offload for a
    bf16 master; a CoatAdamW keeps one anywhere (zero/master.py)."""
    if isinstance(zo.optimizer, CoatAdamW):
        kw["bf16_offload_validator"] = None
    return original(**kw)


def _zero3_masters(zo, original, *args: Any, **kw: Any):
    """DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions: a CoatAdamW's bf16 master aliases the bf16 partitions."""
    if not (isinstance(zo.optimizer, CoatAdamW) and alias_zero3_masters(zo)):
        return original(*args, **kw)
    return None


def _wrap(engine_cls, name: str, before=None, after=None, around=None) -> None:
    """engine_cls.name calls before(self, ...), then around(self, bound original, ...) or the original, then
    after(self, ...)."""
    original = getattr(engine_cls, name)
    if getattr(original, "_coat_wrapped", False):
        return

    @functools.wraps(original)
    def wrapped(self, *args, **kw):
        if before is not None:
            before(self, *args, **kw)
        if around is not None:
            out = around(self, functools.partial(original, self), *args, **kw)
        else:
            out = original(self, *args, **kw)
        if after is not None:
            after(self, *args, **kw)
        return out

    wrapped._coat_wrapped = True
    setattr(engine_cls, name, wrapped)


def _bind_partitions(engine, *_: Any) -> None:
    if isinstance(getattr(engine, "basic_optimizer", None), CoatAdamW):
        section = engine_section(engine)
        bind(engine, section.master_weights, section.gradients, section.states)
        checkpoint_hooks(engine)


_LOAD_ARGS = ("tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states", "load_module_only",
              "custom_load_fn")


def _load_checkpoint(engine, original, load_dir: str, *args: Any, **kw: Any):
    """A CoatAdamW engine's checkpoints are checked before loading and re-partition (checkpoint/load.py)."""
    if not isinstance(getattr(engine, "basic_optimizer", None), CoatAdamW):
        return original(load_dir, *args, **kw)
    kw.update(zip(_LOAD_ARGS, args))
    return checkpoint_load(engine, original, load_dir, **kw)


def _save_checkpoint(engine, original, save_dir: str, tag: Any = None, *args: Any, **kw: Any):
    """A CoatAdamW engine's save checks the free space first (checkpoint/space.py), unless save_atomically did."""
    if isinstance(getattr(engine, "basic_optimizer", None), CoatAdamW) and save_dir and not already_checked():
        shown = str(tag) if tag is not None else f"global_step{engine.global_steps}"   # DeepSpeed's default tag
        refuse_if_short(engine, save_dir, shown, latest_tag(save_dir))
    return original(save_dir, tag, *args, **kw)


def _new_weight_step(engine, *_: Any) -> None:
    # No FP8 weight cache exists unless its module was imported (a stock model never imports it).
    weight_cache = sys.modules.get(f"{__package__.rpartition('.')[0]}.activation.weight_cache")
    if weight_cache is not None:
        weight_cache.new_step()


def hook(engine_cls) -> None:
    """Idempotent; registration.register() calls it with DeepSpeedEngine."""
    _wrap(engine_cls, "_configure_distributed_model", before=apply_section)
    _wrap(engine_cls, "_configure_optimizer", before=_configure_optimizer_before, after=_bind_partitions)
    _wrap(engine_cls, "_take_model_step", after=_new_weight_step)
    _wrap(engine_cls, "load_checkpoint", around=_load_checkpoint)
    _wrap(engine_cls, "save_checkpoint", around=_save_checkpoint)
    _wrap(DeepSpeedZeroOptimizer, "_configure_master_weights", around=_coat_master_weights)
    _wrap(DeepSpeedZeroOptimizer_Stage3, "_configure_master_weights", around=_coat_master_weights)
    _wrap(DeepSpeedZeroOptimizer_Stage3, "_create_fp32_partitions", around=_zero3_masters)
    _wrap(DeepSpeedZeroOptimizer_Stage3, "_setup_for_real_optimizer", around=_zero3_setup)
    _wrap(DeepSpeedConfig, "_initialize_params", before=check_keys)
    _wrap(DeepSpeedZeroOptimizer_Stage3, "initialize_optimizer_states", after=_meta_after_states)
    _wrap(DeepSpeedZeroOptimizer_Stage3, "create_reduce_and_remove_grad_hooks", after=leaf_hooks.replace)
