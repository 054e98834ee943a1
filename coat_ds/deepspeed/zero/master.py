"""`"coat": {"master_weights": ...}`: where ZeRO keeps the master copy of the weights for CoatAdamW.

- "fp32" (default): DeepSpeed's fp32 master partition (4 B/param), as with any optimizer; the bf16 weights
  written from it are rounded as "fp32_remainder"'s high halves (ties away from zero: step.py).
- "bf16_sr": the master partition is bf16 and the FP8 step writes it with stochastic rounding (random
  bits keyed by seed, step and the value's position in its parameter: deterministic, world-size
  independent, bit-exact on resume), so updates below a bf16 ulp survive in expectation.
- "bf16_rn": the same with round-to-nearest, an ablation showing what stochastic rounding buys
  (small updates are lost; not meant for training).
- "fp32_remainder": an exact fp32 master for 2 B/param: the bf16 model partition holds its high halves
  (rounded to nearest, ties away from zero: formats.remainder) and an int16 remainder per value, kept by the
  partition's layout, its low halves; the kernel joins, steps and splits them, bit-identical to "fp32".
  Device only (ZeRO-1/2/3): under Offload the host would keep as many bytes as DeepSpeed's fp32 master.

With a bf16 master, ZeRO-1/2/3 on the device use the bf16 model partition itself as the master: the
step updates it in place (master and model copy: 2 B/param instead of 6). Under ZeRO-1/2 the engine hook
turns on DeepSpeed's own `bf16_master_weights_and_grads`, so ZeRO builds its master in bf16 from the start
(no fp32 partition at set-up; on the device its bf16 copy is then dropped for the model partition). Under
ZeRO-1/2 Offload the master lives on the host in bf16, with its gradient, and also serves as DeepSpeed's bf16
staging buffer (2 B/param less; the step copies the master to the device itself). ZeRO-3 with Offload or
NVMe, stage 0 and DeepSpeed's BF16_Optimizer (what ZeRO-1 runs for a bf16 model with `"data_types":
{"grad_accum_dtype": "fp32"}`) keep an fp32 master.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .kind import ZERO12, is_zero3, zero_kind
from ...keys import check_choice

MASTER_WEIGHTS = ("fp32", "bf16_sr", "bf16_rn", "fp32_remainder")
BF16_MASTERS = ("bf16_sr", "bf16_rn")  # the bf16 model partition is the whole master (rounded)
KEY = "coat.master_weights"


def check_master_weights(value) -> str:
    """The value of coat.master_weights, or a one-line ValueError naming the key and the allowed values."""
    return check_choice(KEY, value, MASTER_WEIGHTS)


def _zero3_offload(where: str) -> str:
    return (f"{where} under ZeRO-3 needs parameters and optimizer on the device (no Offload, no NVMe); "
            "allowed there: 'fp32'")


def _remainder_offload(where: str) -> str:
    return (f"{where} keeps bf16 weights + int16 remainders on the device; under Offload the host master would "
            "cost what DeepSpeed's fp32 one does (4 B/param); allowed there: 'fp32' (exact) or 'bf16_sr'")


def _not_bf16(where: str, dtype: object) -> str:
    return f'{where} needs a bf16 model ("bf16": {{"enabled": true}}); this one trains in {dtype}'


def config_refusal(cfg: Mapping, hf_auto: bool = False) -> str | None:
    """Why a config's coat.master_weights cannot run, from the config alone, so that check_config refuses it
    before any model exists (the engine-side _refuse also sees param groups and the optimizer DeepSpeed chose).
    With hf_auto, HF's "auto" precision is left to the Trainer."""
    value = (cfg.get("coat") or {}).get("master_weights", "fp32")
    if value == "fp32":
        return None
    where = f"{KEY}={value!r}"
    bf16 = (cfg.get("bf16") or {}).get("enabled", False)
    if bf16 is not True and not (hf_auto and bf16 == "auto"):
        return _not_bf16(where, "fp16" if (cfg.get("fp16") or {}).get("enabled") is True else "fp32")
    zero = cfg.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    stage = zero.get("stage", 0)
    if stage == 0:
        return f"{where} needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0); allowed there: 'fp32'"
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if str((zero.get(k) or {}).get("device", "none")).lower() != "none"]
    if offloaded and value == "fp32_remainder":
        return _remainder_offload(where)
    if stage == 3 and offloaded:
        return _zero3_offload(where)
    return None


def bf16_master_from_setup(engine, value: str) -> bool:
    """Whether ZeRO-1/2/3 is to build the master of this CoatAdamW engine, whose coat.master_weights is `value`, in
    bf16 from the start (DeepSpeed's bf16_master_weights_and_grads; under Offload its host gradient too): no
    master but "fp32" keeps an fp32 partition, and building one first costs 4 B/param at set-up (48 GiB for a
    13B model on one GPU, beside its bf16 weights: what kept 13B off an 80 GB H100; under Offload 8 B/param of
    host memory, 16 once pinned). A ValueError where the config asks DeepSpeed for that mode with an fp32 coat
    master."""
    zero12 = engine.bfloat16_enabled() and engine.zero_optimization_stage() in (1, 2)
    offload = engine.zero_cpu_offload()
    on_device = str(getattr(engine.zero_offload_param(), "device", "none")).lower().endswith("none")
    if engine.bfloat16_enabled() and engine.zero_optimization_stage() == 3 and not offload \
            and on_device and value != "fp32":
        return True  # ZeRO-3 then aliases its master partitions to the bf16 ones (no fp32 copy: 70B at 4 B/param)
    if value == "fp32" and zero12 and engine.bf16_master_weights_and_gradients():
        allowed = "'bf16_sr' or 'bf16_rn'" if offload else "'bf16_sr', 'bf16_rn' or 'fp32_remainder'"
        raise ValueError(f"bf16.bf16_master_weights_and_grads=true with CoatAdamW needs {KEY} {allowed} "
                         "(CoatAdamW's step writes the bf16 master); this config has 'fp32'")
    return zero12 and (value in BF16_MASTERS or (value == "fp32_remainder" and not offload))


def _refuse(engine, value: str) -> str | None:
    """Why this engine cannot keep a bf16 master, or None."""
    zo = engine.optimizer
    where = f"{KEY}={value!r}"
    if value == "fp32_remainder" and (getattr(zo, "cpu_offload", False) or getattr(zo, "offload_optimizer", False)
                                      or getattr(zo, "offload_param", False)):
        return _remainder_offload(where)
    if is_zero3(zo):
        if zo.offload_optimizer or zo.offload_param or any(f is None for f in zo.fp16_partitioned_groups_flat):
            return _zero3_offload(where)
    elif zero_kind(zo) != ZERO12:
        return (f"{where} needs DeepSpeed's ZeRO-1/2/3 optimizer; this engine runs {type(zo).__name__} "
                f"(ZeRO stage {engine.zero_optimization_stage()}); allowed there: 'fp32'")
    if zo.dtype != torch.bfloat16:
        return _not_bf16(where, zo.dtype)
    if any(not g["fp8_state"] for g in engine.basic_optimizer.param_groups):
        return f"{where} needs fp8_state=true in every CoatAdamW param group (fp32 moments keep an fp32 master)"
    return None


def alias_zero3_masters(zo) -> bool:
    """ZeRO-3's `_create_fp32_partitions` for a bf16 master built from set-up (bf16_master_from_setup): the master
    partitions *are* the bf16 model partitions, DeepSpeed 0.19.8's own branch for equal dtypes, which it never takes
    on the device (it compares the partition's torch.device with its device name, a str). Otherwise it would copy
    every partition (2 B/param at set-up, 33 GiB a GPU at 70B on 4). False: not that case, DeepSpeed's runs."""
    flats = zo.fp16_partitioned_groups_flat
    if zo.master_weights_and_grads_dtype != torch.bfloat16 or zo.offload_optimizer or zo.offload_param or \
            getattr(zo, "use_muon", False) or any(f is None or f.dtype != torch.bfloat16 for f in flats):
        return False
    for i, flat in enumerate(flats):
        ids = zo.fp16_partitioned_groups_flat_id[i]
        flat.ds_id, flat.requires_grad = f"{ids[0]}_{ids[-1]}", True
        zo.fp32_partitioned_groups_flat.append(flat)
    for group in zo.optimizer.param_groups:  # populated per step (DeepSpeed's own end of the method)
        group["params"] = []
    return True


@torch.no_grad()
def use_bf16_master(engine, value: str) -> None:
    """Make ZeRO's master partitions bf16 for coat.master_weights `value` (the model partition itself on the
    device; under ZeRO-1/2 Offload the host one ZeRO built in bf16, or its pinned bf16 staging buffer where it
    built an fp32 one) and free what they replace. Call before anything has stepped."""
    reason = _refuse(engine, value)
    if reason is not None:
        raise ValueError(reason)
    from deepspeed.accelerator import get_accelerator

    zo = engine.optimizer
    if is_zero3(zo):  # ZeRO-3: as DeepSpeed itself does when the dtypes agree
        for i, old in enumerate(zo.fp32_partitioned_groups_flat):
            new = zo.fp16_partitioned_groups_flat[i]
            new.ds_id, new.requires_grad = old.ds_id, True
            zo.fp32_partitioned_groups_flat[i] = new
    else:
        _zero12_bf16_master(zo, engine.basic_optimizer)
    zo._coat_bf16_master = True
    zo._coat_remainder = value == "fp32_remainder"
    get_accelerator().empty_cache()  # hand the fp32 partitions' blocks back, not just to the allocator's cache
    if getattr(zo, "cpu_offload", False):
        _release_pinned_cache()


def _release_pinned_cache() -> None:
    """Hand the pinned host blocks of the freed fp32 partitions back to the OS. torch's pinned allocator keeps
    every freed block cached (rounded up to a power of two): without this the fp32 master and gradient that a
    bf16 master replaces under Offload stay resident, 8 B/param before rounding."""
    release = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds; DeepSpeed's accelerator has no call for it
    if release is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        release()


def _zero12_bf16_master(zo, opt) -> None:
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    if zo.cpu_offload and zo.master_weights_and_grads_dtype == torch.bfloat16:  # built in bf16 (from set-up)
        zo.param_buffer_of_bit16_for_cpu_offload_groups[:] = zo.single_partition_of_fp32_groups
        return
    for i, old in enumerate(zo.single_partition_of_fp32_groups):
        if zo.cpu_offload:
            new = zo.param_buffer_of_bit16_for_cpu_offload_groups[i]
            new.copy_(old)  # the fp32 master was copied from the bf16 weights: exact
            grad = torch.zeros_like(new)
            new.grad = get_accelerator().pin_memory(grad) if zo.cpu_offload_pin_memory else grad
        else:
            new = zo.parallel_partitioned_bit16_groups[i][dist.get_rank(group=zo.real_dp_process_group[i])]
        zo.single_partition_of_fp32_groups[i] = new
        opt.param_groups[i]["params"] = [new]
        old.grad = None
    if zo.cpu_offload:  # DeepSpeed's own bf16-master mode of its offload buffers
        zo.master_weights_and_grads_dtype = torch.bfloat16
        zo.low_precision_master_weights_and_grads = True
    zo._link_all_hp_params()  # the lp -> hp fragment views pointed into the fp32 partitions
