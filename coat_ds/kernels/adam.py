"""The FP8 AdamW step and group (de)quantization: compiled kernels when they build, else the reference.

All tensors of one call live on one device; moments are lists of (codes, scale, expo) triples with
codes stored as FP8 tensors (the kernels see them as uint8)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..formats import E4M3, FP8Format, bf16_weight, dequantize as ref_dequantize, get_format, quantize as ref_quantize
from .loader import load_op
from .adam_reference import adamw_step_reference, skipped, unless_skipped


def _op(device: torch.device):
    return load_op("CoatAdamBuilder" if device.type == "cuda" else "CPUCoatAdamBuilder")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MASTER_DTYPES = (torch.float32, torch.bfloat16)


def _check_step_args(params, grads, sr_keys, grad_scale, remainders) -> None:
    """One clear ValueError for what the kernels cannot take, before anything is written."""
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.dtype not in MASTER_DTYPES:
            raise ValueError(f"adamw_step: params[{i}] is {p.dtype}; allowed: float32, bfloat16")
        if g.dtype not in GRAD_DTYPES:
            raise ValueError(f"adamw_step: grads[{i}] is {g.dtype}; allowed: float32, bfloat16, float16")
    if len(grads) != len(params) or (sr_keys is not None and len(sr_keys) != len(params)):
        raise ValueError("adamw_step: grads (and sr_keys, when given) need one entry per param")
    if remainders:
        if len(remainders) != len(params) or sr_keys is not None:
            raise ValueError("adamw_step: remainders need one entry per param (None: no remainder) and no sr_keys")
        for i, (p, r) in enumerate(zip(params, remainders)):
            if r is not None and (p.dtype != torch.bfloat16 or r.dtype != torch.int16 or r.shape != p.shape):
                raise ValueError(f"adamw_step: remainders[{i}] must be int16 of params[{i}]'s shape with a bf16 "
                                 f"param; got {r.dtype} {tuple(r.shape)} with {p.dtype} {tuple(p.shape)}")
    if isinstance(grad_scale, torch.Tensor) and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32 or
                                                 grad_scale.device != params[0].device):
        raise ValueError(f"adamw_step: grad_scale must be a 1-element float32 tensor on {params[0].device}, got "
                         f"{grad_scale.numel()} x {grad_scale.dtype} on {grad_scale.device}")


def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], m: Sequence[tuple], v: Sequence[tuple],
               *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
               v_format: FP8Format, group_size: int, expansion: bool, bf16_out: Sequence[torch.Tensor] = (),
               grad_scale: torch.Tensor | float | None = None, sr_keys: Sequence[tuple[int, int]] | None = None,
               sr_seed: int = 0, remainders: Sequence[torch.Tensor | None] = ()) -> None:
    """One fused step over many tensors; params, moments (and the optional bf16 copies) update in place.

    m is always E4M3 (COAT: E4M3 beats E5M2 for the first moment); v is E4M3 or E5M2. grads: fp32, bf16 or
    fp16, multiplied in fp32 by grad_scale (a 1-element fp32 tensor on the params' device, read on the device,
    or a float; None = 1) before anything else. params (the master): fp32, or bf16 updated in fp32 and
    rounded back, stochastically when sr_keys[i] = (stream, offset) is given (stream names the parameter,
    offset is where tensor i starts in it; see formats.rounding), to nearest even otherwise, or with
    remainders[i] (int16) the high half of an exact fp32 master whose low half remainders[i] holds
    (formats.remainder). bf16_out: a bf16 copy of every updated param (of an fp32 one: formats.bf16_weight).

    A non-finite grad_scale (NaN, +-inf) skips the step: nothing is written, params, moments, bf16_out and
    remainders stay bit for bit. A caller that finds a gradient non-finite on the device passes NaN there and
    never reads the verdict on the host (coat.gradients "release" does, per bucket)."""
    if not params:
        return
    _check_step_args(params, grads, sr_keys, grad_scale, remainders)
    op = _op(params[0].device)
    if op is not None:
        scale_t = grad_scale if isinstance(grad_scale, torch.Tensor) else None
        scale = 1.0 if grad_scale is None or scale_t is not None else float(grad_scale)
        keys = [] if sr_keys is None else [int(x) for key in sr_keys for x in key]
        none = torch.empty(0, dtype=torch.int16, device=params[0].device)
        rems = [none if r is None else r for r in remainders]
        op.adam_step(list(params), list(grads), [_u8(x[0]) for x in m], [x[1] for x in m], [x[2] for x in m],
                     [_u8(x[0]) for x in v], [x[1] for x in v], [x[2] for x in v], list(bf16_out), rems,
                     lr, beta1, beta2, eps, weight_decay, step, group_size, v_format.name == "e5m2", expansion,
                     scale_t, scale, keys, sr_seed)
        return
    skip = skipped(grad_scale)
    for i, (p, g, mi, vi) in enumerate(zip(params, grads, m, v)):
        new_m, new_v = adamw_step_reference(p, g, mi, vi, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                            weight_decay=weight_decay, step=step, m_format=E4M3,
                                            v_format=v_format, group_size=group_size, expansion=expansion,
                                            grad_scale=grad_scale, sr_key=None if sr_keys is None else sr_keys[i],
                                            sr_seed=sr_seed, remainder=remainders[i] if remainders else None)
        for dst, src in zip((*mi, *vi), (*new_m, *new_v)):
            dst.copy_(src)
        if bf16_out:  # an fp32 master's copy is its split's high half, as the kernels write it
            bf16_out[i].copy_(unless_skipped(skip, bf16_out[i], bf16_weight(p) if p.dtype == torch.float32 else p))


def quantize(x: torch.Tensor, fmt: str | FP8Format = "e4m3", group_size: int = 128, expansion: bool = True):
    """(codes, scale, expo) of x; same result as formats.quantize, on the kernel when there is one."""
    fmt = get_format(fmt)
    op = _op(x.device)
    if op is None:
        return tuple(ref_quantize(x, fmt, group_size, expansion))
    n = (x.numel() + group_size - 1) // group_size
    codes = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
    scale = torch.empty(n, dtype=torch.float32, device=x.device)
    expo = torch.empty(n, dtype=torch.float32, device=x.device)
    op.quantize(x.float().contiguous(), _u8(codes), scale, expo, group_size, fmt.name == "e5m2", expansion)
    return codes, scale, expo


def dequantize(codes: torch.Tensor, scale: torch.Tensor, expo: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    op = _op(codes.device)
    if op is None:
        return ref_dequantize(codes, scale, expo, group_size)
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    op.dequantize(_u8(codes.contiguous()), scale, expo, out, group_size, codes.dtype == torch.float8_e5m2)
    return out
