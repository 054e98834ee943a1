"""The FP8 AdamW step in plain PyTorch: the source of truth the compiled kernels are tested against."""
from __future__ import annotations

import math

import torch

from ..formats import FP8Format, dequantize, join_remainder, quantize, round_bf16, split_remainder

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def skipped(grad_scale: torch.Tensor | float | None) -> torch.Tensor | bool:
    """Whether a step with this grad_scale changes nothing (a non-finite scale: the convention that lets a caller
    skip a step without reading anything on the host): a bool for a float, a 0-dim bool tensor for a tensor."""
    if torch.is_tensor(grad_scale):
        return grad_scale.isfinite().logical_not().reshape(())
    return grad_scale is not None and not math.isfinite(grad_scale)


def unless_skipped(skip: torch.Tensor | bool, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """new, or old bit for bit where the step is skipped (selected on the device)."""
    if isinstance(skip, bool):
        return old if skip else new
    bits = _BITS[new.element_size()]
    return torch.where(skip, old.view(bits), new.view(bits)).view(new.dtype)


@torch.no_grad()
def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, m: tuple, v: tuple, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: int, m_format: FP8Format,
                         v_format: FP8Format, group_size: int, expansion: bool,
                         grad_scale: torch.Tensor | float | None = None, sr_key: tuple[int, int] | None = None,
                         sr_seed: int = 0, remainder: torch.Tensor | None = None) -> tuple[tuple, tuple]:
    """Updates `param` in place; returns the re-quantized (codes, scale, expo) of both moments.

    Same update as torch.optim.AdamW (decoupled decay, bias correction), in fp32, on dequantized moments.
    grad (fp32, bf16 or fp16) is widened to fp32, then multiplied by grad_scale in its own fp32 op (as
    DeepSpeed unscales and clips). A bf16 param is widened, updated in fp32 and rounded back: stochastically
    with sr_key = (stream, offset) (bits of formats.rounding keyed by sr_seed, step, stream, offset + i),
    to nearest even without it. With `remainder` (int16, param's shape) a bf16 param is the high half of an
    fp32 master (formats.remainder): the master is joined, updated as an fp32 param is and split again.
    A non-finite grad_scale changes nothing: param and remainder stay, the moments come back as they went in."""
    skip = skipped(grad_scale)
    g = grad.float().reshape(-1)
    if grad_scale is not None:
        g = g * grad_scale
    if remainder is not None:
        p = join_remainder(param.reshape(-1), remainder.reshape(-1))
    else:
        p = param.reshape(-1).to(torch.float32, copy=True)
    m_new = beta1 * dequantize(*m, group_size).reshape(-1) + (1 - beta1) * g
    v_new = beta2 * dequantize(*v, group_size).reshape(-1) + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    p.mul_(1 - lr * weight_decay)
    p.add_(-(lr / bc1) * m_new / (v_new.sqrt() / bc2_sqrt + eps))
    if remainder is not None:
        hi, lo = split_remainder(p)
        remainder.view(-1).copy_(unless_skipped(skip, remainder.view(-1), lo))
    elif param.dtype != torch.float32:
        hi = round_bf16(p, None if sr_key is None else (sr_seed, step, *sr_key))
    else:
        hi = p
    param.view(-1).copy_(unless_skipped(skip, param.view(-1), hi))
    m_q = quantize(m_new.view_as(m[0]), m_format, group_size, expansion)
    v_q = quantize(v_new.view_as(v[0]), v_format, group_size, expansion)
    return (tuple(unless_skipped(skip, old, new) for old, new in zip(m, m_q)),
            tuple(unless_skipped(skip, old, new) for old, new in zip(v, v_q)))
