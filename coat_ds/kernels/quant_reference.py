"""Plain-PyTorch reference of every fused activation op: the source of truth and the CPU path.

Scales are powers of two (COAT uses plain absmax; a power of two makes scaling exact, so a kernel and this
reference produce the same FP8 codes from the same input, and a per-group scale fits in one byte).
For an absolute maximum A = m 2^e (m in [0.5, 1)) and a format whose largest value is F = 0.875 2^E, the
scale is 2^p with p = e - E + (m > 0.875): the smallest power of two that maps A into [-F, F].

Per-group tensors (inputs saved by RMSNorm and SiLU*mul): codes [M, N] in FP8 and one uint8 per 1 x G
group, the biased exponent p + 127 (0 for an all-zero group). Per-tensor tensors (GEMM operands): FP8
codes and one fp32 scale 2^p, passed to torch._scaled_mm. All math is fp32."""
from __future__ import annotations

import torch

from ..formats import FP8Format, cast_to_fp8

EXP_BIAS = 127


def _fmt_exp(fmt: FP8Format) -> int:
    """E with F = 0.875 2^E (E4M3: 448 -> 9, E5M2: 57344 -> 16)."""
    m, e = torch.frexp(torch.tensor(fmt.max, dtype=torch.float32))
    assert m.item() == 0.875, fmt
    return int(e.item())


def pow2_exponent(amax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """int32 p with 2^p the scale of a block whose absolute maximum is amax (-127 for 0)."""
    m, e = torch.frexp(amax.float())
    p = e - _fmt_exp(fmt) + (m > 0.875).to(e.dtype)
    return torch.where(amax > 0, p.clamp(-EXP_BIAS, EXP_BIAS), torch.full_like(p, -EXP_BIAS)).to(torch.int32)


def _exp2i(p: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(p, dtype=torch.float32), p.to(torch.int32))


def check_groups(n: int, group_size: int) -> None:
    if n % group_size:
        raise ValueError(f"hidden size {n} is not a multiple of activation.group_size={group_size}")


# ---------------------------------------------------------------- per-group (saved inputs of non-linears)

def group_quant(x: torch.Tensor, fmt: FP8Format, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes [M, N], uint8 biased scale exponents [M, N/G]) of a 2-D tensor."""
    m, n = x.shape
    check_groups(n, group_size)
    g = x.float().reshape(m, n // group_size, group_size)
    p = pow2_exponent(g.abs().amax(dim=2), fmt)
    codes = cast_to_fp8(g * _exp2i(-p)[..., None], fmt).reshape(m, n)
    return codes, (p + EXP_BIAS).to(torch.uint8)


def group_dequant(codes: torch.Tensor, sexp: torch.Tensor, group_size: int) -> torch.Tensor:
    m, n = codes.shape
    s = _exp2i(sexp.to(torch.int32) - EXP_BIAS)
    return (codes.float().reshape(m, n // group_size, group_size) * s[..., None]).reshape(m, n)


# ---------------------------------------------------------------- per-tensor (GEMM operands)

def row_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 [M]: the per-row maxima a producing kernel writes; their max gives the per-tensor scale."""
    return x.float().abs().amax(dim=1)


def tensor_scale(amax_rows: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """fp32 0-d scale 2^p of a tensor from its per-row (or per-group) maxima: the second, small pass."""
    return _exp2i(pow2_exponent(amax_rows.amax(), fmt))


def quant_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, rowmajor: bool = True,
                 transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, N], codes of x^T [N, M]): both layouts from one quantization; one not asked for is an empty
    tensor (as the kernels give it: a custom op cannot return None)."""
    q = cast_to_fp8(x.float() * (1.0 / scale), fmt)
    return (q if rowmajor else q.new_empty(0)), (q.t().contiguous() if transposed else q.new_empty(0))


# ---------------------------------------------------------------- RMSNorm

def rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float, fmt: FP8Format, group_size: int):
    """Forward pass 1 of RMSNorm: (x codes, x scale exps, rstd [M], row max of |y| [M]).

    y is computed from the dequantized x, so the backward pass rebuilds exactly the forward's y."""
    xq, xs = group_quant(x, fmt, group_size)
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=1) + eps)
    y = _norm_out(xq, xs, rstd, w, group_size)
    return xq, xs, rstd, y.abs().amax(dim=1)


def _norm_out(xq, xs, rstd, w, group_size):
    return group_dequant(xq, xs, group_size) * rstd[:, None] * w.float()[None, :]


def rmsnorm_rebuild(xq, xs, rstd, w, scale, fmt: FP8Format, group_size: int, rowmajor=True, transposed=False):
    """Pass 2: the norm's output as a per-tensor FP8 GEMM operand (either layout) from the saved FP8 input."""
    return quant_tensor(_norm_out(xq, xs, rstd, w, group_size), scale, fmt, rowmajor, transposed)


def rmsnorm_output(x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The norm's output in x's dtype from x itself, for a norm whose output is no GEMM operand (per-head q/k
    norms, Gemma's post-norms): stock's fp32 math; only backward reads the saved FP8 input."""
    return (x.float() * rstd[:, None] * w.float()[None, :]).to(x.dtype)


def rmsnorm_backward(dy, xq, xs, rstd, w, group_size: int, dres: torch.Tensor | None = None):
    """(dx in dy's dtype, plus dres when given: the residual's gradient; dw fp32) in one pass."""
    xh = group_dequant(xq, xs, group_size) * rstd[:, None]
    g = dy.float() * w.float()[None, :]
    dx = rstd[:, None] * (g - xh * (g * xh).mean(dim=1, keepdim=True))
    if dres is not None:
        dx = dx + dres.float()
    return dx.to(dy.dtype), (dy.float() * xh).sum(dim=0)


# ---------------------------------------------------------------- gated activation: act(gate) * up

GATED_ACTS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Mistral, Qwen) and GeGLU with tanh-GELU (Gemma)
_GELU_C = 0.7978845608028654  # sqrt(2 / pi)


def _act(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return g * torch.sigmoid(g)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(g, approximate="tanh")
    raise ValueError(f"gated activation {act!r} is not one of {GATED_ACTS}")


def _act_grad(g: torch.Tensor, act: str) -> torch.Tensor:
    """d act(g) / dg of the tanh-GELU (SiLU's is written out in silu_mul_backward, in the kernel's order)."""
    t = torch.tanh(_GELU_C * (g + 0.044715 * g ** 3))
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * g * g)


def silu_mul_quant(gu: torch.Tensor, fmt: FP8Format, group_size: int, act: str = "silu"):
    """Pass 1 of act(g) * u on [M, 2I] = [gate | up]: (codes, scale exps, row max of |act(g) u| [M])."""
    q, s = group_quant(gu, fmt, group_size)
    return q, s, _gated(q, s, group_size, act).abs().amax(dim=1)


def _gated(q, s, group_size, act="silu"):
    g, u = group_dequant(q, s, group_size).chunk(2, dim=1)
    return _act(g, act) * u


def silu_mul_rebuild(q, s, scale, fmt: FP8Format, group_size: int, rowmajor=True, transposed=False, act="silu"):
    """Pass 2: act(g) u as a per-tensor FP8 operand of down_proj, from the saved FP8 gate/up."""
    return quant_tensor(_gated(q, s, group_size, act), scale, fmt, rowmajor, transposed)


def silu_mul_backward(da: torch.Tensor, q, s, group_size: int, act: str = "silu"):
    """(d[gate | up] in da's dtype [M, 2I], its row maxima [M]) from the saved FP8 gate/up."""
    g, u = group_dequant(q, s, group_size).chunk(2, dim=1)
    d = da.float()
    if act == "silu":  # the kernel's order of fp32 operations
        sg = torch.sigmoid(g)
        dg, du = d * u * sg * (1 + g * (1 - sg)), d * g * sg
    else:
        dg, du = d * u * _act_grad(g, act), d * _act(g, act)
    out = torch.cat([dg, du], dim=1).to(da.dtype)
    return out, row_amax(out)


def xent_forward(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp of each row, the target's logit), fp32, of logits [m, n]; target [m] in [0, n)."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1), x.gather(1, target[:, None]).squeeze(1)


def xent_backward(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """d loss / d logits, in logits' dtype: (exp(logits - lse) - [column == target]) * scale per row, fp32 math;
    a target outside [0, n) (a vocabulary slice that does not hold it) subtracts nothing."""
    g = logits.float().sub_(lse[:, None]).exp_()
    n = g.shape[1]
    hit = (target >= 0) & (target < n)
    g.scatter_add_(1, target.clamp(0, n - 1)[:, None], -hit.to(g.dtype)[:, None])
    return g.mul_(scale[:, None]).to(logits.dtype)
