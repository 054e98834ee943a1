"""The FP8 AdamW step in plain PyTorch: the source of truth the kernels are tested against."""
from __future__ import annotations

import torch

from ..formats import FP8Format, dequantize, quantize


@torch.no_grad()
def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, m: tuple, v: tuple, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, step: int, m_format: FP8Format,
                         v_format: FP8Format, group_size: int, expansion: bool) -> tuple[tuple, tuple]:
    """Updates `param` in place; returns the re-quantized (codes, scale, expo) of both moments.

    Same update as torch.optim.AdamW (decoupled decay, bias correction), in fp32, on dequantized moments."""
    g = grad.float().reshape(-1)
    p = param.view(-1)
    m_new = beta1 * dequantize(*m, group_size).reshape(-1) + (1 - beta1) * g
    v_new = beta2 * dequantize(*v, group_size).reshape(-1) + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    p.mul_(1 - lr * weight_decay)
    p.add_(-(lr / bc1) * m_new / (v_new.sqrt() / bc2_sqrt + eps))
    return (tuple(quantize(m_new.view_as(m[0]), m_format, group_size, expansion)),
            tuple(quantize(v_new.view_as(v[0]), v_format, group_size, expansion)))
