"""The FP8 AdamW step in plain PyTorch: the source of truth the compiled kernels are tested against."""
from __future__ import annotations

import torch

from ..formats import FP8Format, dequantize, join_remainder, quantize, round_bf16, split_remainder


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
    fp32 master (formats.remainder): the master is joined, updated as an fp32 param is and split again."""
    g = grad.float().reshape(-1)
    if grad_scale is not None:
        g = g * grad_scale
    if remainder is not None:
        p = join_remainder(param.reshape(-1), remainder.reshape(-1)).clone()
    else:
        p = param.view(-1) if param.dtype == torch.float32 else param.float().reshape(-1)
    m_new = beta1 * dequantize(*m, group_size).reshape(-1) + (1 - beta1) * g
    v_new = beta2 * dequantize(*v, group_size).reshape(-1) + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    p.mul_(1 - lr * weight_decay)
    p.add_(-(lr / bc1) * m_new / (v_new.sqrt() / bc2_sqrt + eps))
    if remainder is not None:
        hi, lo = split_remainder(p)
        param.view(-1).copy_(hi)
        remainder.view(-1).copy_(lo)
    elif param.dtype != torch.float32:
        sr = None if sr_key is None else (sr_seed, step, *sr_key)
        param.view(-1).copy_(round_bf16(p, sr))
    return (tuple(quantize(m_new.view_as(m[0]), m_format, group_size, expansion)),
            tuple(quantize(v_new.view_as(v[0]), v_format, group_size, expansion)))
