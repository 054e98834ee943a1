"""FP8 experts of a mixture-of-experts block: transformers 5's 3D expert weights (gate_up [E, 2I, H], down
[E, H, I]) in grouped GEMMs, one call per projection for all experts (no Python loop over experts on the GPU).

ExpertsFn computes what HF's experts (eager / batched_mm / grouped_mm) compute from the stock router's top-k
indices and weights (routing itself stays bf16/fp32, outside), with COAT's FP8 flow:
  input     E4M3 per tensor (one power-of-two scale); backward keeps its FP8 codes [T, H], not the k gathered copies
  weights   E4M3 per expert (one power-of-two scale each), quantized in forward and kept for backward only where
            the layer is recomputed (keep_codes: gradient checkpointing, where the first forward keeps nothing and
            the codes live from a layer's recompute to its backward, 0.6 GB at Qwen3-30B-A3B); else quantized
            again in backward (kept, 48 layers' codes would be 29 GB)
  gate/up   its output saved in FP8 per 1 x G group (as MlpFn); act(gate) * up rebuilt from it as the down
            GEMM's E4M3 per-tensor operand
  gradients d[gate | up] in bwd_format (E5M2) per tensor; the output gradient stays bf16 in the down projection's
            backward GEMMs, which read the routing weights' gradient <act(gate) up, dy W_down> per (token, expert)
            pair (no extra GEMM) from it; those GEMMs run on bf16 operands anyway (torch's FP8 grouped kernel takes
            E4M3 only), so E5M2 there would add error and save nothing

grouped_mm: CUDA with FP8 grouped GEMMs (Hopper) and E4M3 operands: torch._scaled_grouped_mm with row-wise
scales; other CUDA calls (backward's E5M2, other GPUs, fp32 models): torch._grouped_mm on the dequantized
operands (FP8 values times powers of two are exact in bf16, accumulation fp32: the same products; with
bwd_format "e4m3" the gate/up input-gradient GEMM takes the FP8 kernel too); the CPU:
the plain-PyTorch reference below, per group in fp32, which is the source of truth the GPU paths are tested
against."""
from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor
from torch.autograd import Function

from ..formats import FP8Format
from ..kernels import quant
from ..kernels.quant_reference import pow2_exponent
from .config import ActivationConfig

SCALED_GROUPED_CAPABILITIES = ((9, 0), (10, 0))   # torch._scaled_grouped_mm's devices (row-wise FP8)


# ---------------------------------------------------------------------------------------------- routing and GEMMs

def route(top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(order, offs): the flattened (token, slot) pairs sorted by expert (stable), and the int32 cumulative pair
    count per expert (the grouped GEMMs' group ends). Token of pair order[i]: order[i] // k."""
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    return order, offs


def expert_codes(w: Tensor, fmt: FP8Format) -> tuple[Tensor, Tensor]:
    """(FP8 codes [E, N, K], fp32 power-of-two scale per expert [E]) of 3D expert weights. Multiplying by a power
    of two is exact in w's dtype, so the codes equal a cast of w / scale computed in fp32."""
    w = w.detach()
    lo, hi = w.reshape(w.shape[0], -1).aminmax(dim=1)   # one pass, no |w| copy (0.8 GB a layer at 30B)
    scale = torch.ldexp(torch.ones(w.shape[0], device=w.device), pow2_exponent(torch.maximum(hi, lo.neg()), fmt))
    # no clamp: a power-of-two scale from the amax puts every |w| / scale within the format's max (pow2_exponent)
    return (w * (1.0 / scale).to(w.dtype)[:, None, None]).to(fmt.dtype), scale


def _dequant(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """codes * scale in `dtype` (exact for FP8 codes and power-of-two scales); scale 0-d or per leading index. Scaled
    in place: one copy of the weights' size, not two (a layer's gate_up at Qwen3-30B-A3B: 0.75 GiB in bf16, backward's
    peak)."""
    s = scale.reshape(-1, *([1] * (codes.dim() - 1))) if scale.dim() else scale
    return codes.to(dtype, copy=True).mul_(s.to(dtype))


def _work_dtype(x: Tensor, dtype: torch.dtype) -> torch.dtype:
    """What dequantized GEMM operands are held in: fp32 on the CPU (the reference), the output dtype on CUDA."""
    return torch.float32 if x.device.type == "cpu" else dtype


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Rows of `a` [S, K] grouped by `offs` times b[g] [K, N] -> [S, N]: torch._grouped_mm on CUDA, the reference
    (per group, fp32) elsewhere."""
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    return _reference_mm(a, b, offs)


GROUP_ALIGN = 16   # rows: torch._grouped_mm's contracted (dynamic) dimension per group, a multiple of 16 bytes


def padded_rows(offs: Tensor, rows: int, align: int = GROUP_ALIGN) -> tuple[Tensor, Tensor, Tensor]:
    """(src, pad, ends) of `rows` rows grouped by `offs`, each group padded by zero rows to a multiple of `align`
    rows: for each padded row the row it copies (src; a pad row any row, zeroed after), the pad rows (pad) and the
    padded groups' int32 ends. Sizes fixed by rows and G alone, so no device-to-host sync."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + align - 1) // align * align
    pad_ends = torch.cumsum(padded, 0)
    total = -(-rows // align) * align + align * offs.numel()           # >= pad_ends[-1], a multiple of align
    pad_ends[-1] = total                                               # the last group takes the spare zero rows
    r = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(offs, r, right=True)
    dest = r - (offs - counts)[group] + (pad_ends - padded)[group]
    src = torch.zeros(total, dtype=torch.long, device=offs.device).index_put_((dest,), r)
    keep = torch.zeros(total, dtype=torch.bool, device=offs.device).index_fill_(0, dest, True)
    return src, torch.nonzero_static(~keep, size=total - rows).flatten(), pad_ends.to(torch.int32)


def aligned_groups(a: Tensor, b: Tensor, offs: Tensor, align: int = GROUP_ALIGN) -> tuple[Tensor, Tensor, Tensor]:
    """(a', b', offs') with every row group of a [S, M] and b [S, N] padded by zero rows to a multiple of `align`
    rows (zero rows add nothing to a[g]^T b[g]): gathers (a scatter into zeros took 0.7 s of a 5.8 s step at
    Qwen3-30B-A3B)."""
    src, pad, ends = padded_rows(offs, a.shape[0], align)
    return a.index_select(0, src).index_fill_(0, pad, 0), b.index_select(0, src).index_fill_(0, pad, 0), ends


def grouped_mm_t(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """a[g]^T b[g] for the row groups of a [S, M] and b [S, N] -> [G, M, N] (the weight gradients)."""
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        a, b, offs = aligned_groups(a, b, offs)
        # K-contiguous copies: the transposed views measured 4x faster on an H200 and bit-identical at Qwen3-30B-A3B's
        # shapes (benchmarks/logs/moe_step_mb8_2026-12-02.log) but need both widths 16-byte aligned; not yet switched.
        # Each padded operand goes as its copy is made: at most one of them beside both copies (2.2 GiB less at
        # Qwen3-30B-A3B's micro-batch 10, where both padded operands beside both copies were the step's peak)
        at = a.t().contiguous()
        del a
        bt = b.t().contiguous().t()
        del b
        return torch._grouped_mm(at, bt, offs=offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    out = a.new_zeros(len(ends), a.shape[1], b.shape[1], dtype=torch.float32)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            out[g] = a[s:e].float().t() @ b[s:e].float()
    return out


def _reference_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    out = a.new_zeros(a.shape[0], b.shape[2], dtype=torch.float32)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            out[s:e] = a[s:e].float() @ b[g].float()
    return out


@functools.lru_cache(maxsize=None)
def _scaled_grouped_device(index: int) -> bool:
    capability = torch.cuda.get_device_capability(index)
    return hasattr(torch, "_scaled_grouped_mm") and capability in SCALED_GROUPED_CAPABILITIES


_SCALED_FAILED: list[str] = []   # the first failure of torch._scaled_grouped_mm: the fallback from then on


def _scaled_ok(a: Tensor, w: Tensor, out_dtype: torch.dtype) -> bool:
    return (a.is_cuda and not _SCALED_FAILED and _scaled_grouped_device(a.device.index or 0)
            and a.dtype == w.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
            and a.shape[1] % 16 == 0 and w.shape[1] % 16 == 0)


def fp8_grouped_linear(a: Tensor, sa: Tensor, w: Tensor, sw: Tensor, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(a sa)_g (w[g] sw[g])^T: FP8 rows a [S, K] with a 0-d scale, FP8 weights w [G, N, K] with per-group scales
    sw [G] -> [S, N] in out_dtype."""
    if _scaled_ok(a, w, out_dtype):
        try:
            return torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa.expand(a.shape[0]).contiguous(),
                                            sw[:, None].expand(w.shape[0], w.shape[1]).contiguous(), offs=offs,
                                            out_dtype=out_dtype)
        except RuntimeError as exc:   # a build without the kernel: say so once, then take the fallback
            _SCALED_FAILED.append(str(exc))
            warnings.warn(f"coat_ds: torch._scaled_grouped_mm failed ({str(exc).splitlines()[0]}); the experts' "
                          "GEMMs run on dequantized FP8 operands in bf16", RuntimeWarning, stacklevel=2)
    dt = _work_dtype(a, out_dtype)
    return grouped_mm(_dequant(a, sa, dt), _dequant(w, sw, dt).transpose(-2, -1), offs).to(out_dtype)


def _rows(codes: Tensor, index: Tensor) -> Tensor:
    """codes[index] of FP8 codes, gathered as bytes (not every device indexes FP8 dtypes)."""
    return codes.view(torch.uint8)[index].view(codes.dtype)


def _per_tensor(x: Tensor, fmt: FP8Format) -> tuple[Tensor, Tensor]:
    scale = quant.tensor_scale(quant.row_amax(x), fmt)
    return quant.quant_tensor(x, scale, fmt)[0], scale


def _unsort_sum(rows: Tensor, order: Tensor, k: int) -> Tensor:
    """Per token, the sum of its k pair rows (sorted by expert), accumulated in fp32: deterministic (no atomics),
    as HF sums; the rows stay in their dtype (an fp32 copy of [tokens x k, hidden] would be 2 GB at 32k tokens)."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out.view(-1, k, rows.shape[-1]).sum(dim=1, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- the Function

class ExpertsFn(Function):
    """out [T, H] = sum over each token's k experts e of w * down_e(act(gate_e x) * up_e x), FP8 as the module
    docstring says. x [T, H]; top_k_index, top_k_weights [T, k] from the router; experts: the HF experts module
    (its gate_up_proj, down_proj read in forward and backward, also passed as inputs for their gradients);
    keep_codes: save the weights' FP8 codes for backward (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, cfg: ActivationConfig, act: str,
                experts: torch.nn.Module, keep_codes: bool, gate_up: Tensor, down: Tensor) -> Tensor:
        fwd, g, k = cfg.fwd, cfg.group_size, top_k_index.shape[1]
        order, offs = route(top_k_index, gate_up.shape[0])
        xq, xs = _per_tensor(x, fwd)
        gu_codes, down_codes = expert_codes(gate_up, fwd), expert_codes(down, fwd)
        gu = fp8_grouped_linear(_rows(xq, order // k), xs, *gu_codes, offs, x.dtype)
        q, s, amax = quant.silu_mul_quant(gu, fwd, g, act)
        del gu
        a_s = quant.tensor_scale(amax, fwd)
        a = quant.silu_mul_rebuild(q, s, a_s, fwd, g, act=act)[0]
        y = fp8_grouped_linear(a, a_s, *down_codes, offs, x.dtype)
        w = top_k_weights.reshape(-1)[order]
        out = _unsort_sum(y * w.to(y.dtype)[:, None], order, k).to(x.dtype)
        codes = (*gu_codes, *down_codes) if keep_codes else ()
        ctx.save_for_backward(xq, xs, q, s, a_s, order, offs, w, *codes)
        ctx.cfg, ctx.act, ctx.k, ctx.experts = cfg, act, k, experts
        ctx.dtypes = x.dtype, top_k_weights.dtype
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        xq, xs, q, s, a_s, order, offs, w, *codes = ctx.saved_tensors
        cfg, k, (dtype, w_dtype) = ctx.cfg, ctx.k, ctx.dtypes
        fwd, bwd, g = cfg.fwd, cfg.bwd, cfg.group_size
        gate_up, down = ctx.experts.gate_up_proj, ctx.experts.down_proj
        if not codes:
            codes = (*expert_codes(gate_up, fwd), *expert_codes(down, fwd))
        gu_q, gu_s, down_q, down_s = codes
        del codes
        dt = _work_dtype(xq, dtype)
        tok = order // k
        dy = dout.to(dt)[tok]                         # [S, H]: each pair's output gradient, bf16 (module docstring)
        a = _dequant(quant.silu_mul_rebuild(q, s, a_s, fwd, g, act=ctx.act)[0], a_s, dt)
        gd = grouped_mm(dy, _dequant(down_q, down_s, dt), offs)           # dy @ down_e: [S, I]
        del down_q
        dw = (a.float() * gd.float()).sum(dim=1)                         # d routing weight of each pair
        ddown = grouped_mm_t(dy, a * w.to(dt)[:, None], offs)            # [E, H, I]; w on the narrower operand
        del dy, a
        dgu, amax = quant.silu_mul_backward((gd * w.to(gd.dtype)[:, None]).to(dtype), q, s, g, ctx.act)
        del gd
        dgs = quant.tensor_scale(amax, bwd)
        dgq = quant.quant_tensor(dgu, dgs, bwd)[0]
        del dgu
        dx_pairs = _input_grad(dgq, dgs, gu_q, gu_s, offs, dtype)         # dgu @ gate_up_e: [S, H]
        del gu_q
        dgate_up = grouped_mm_t(_dequant(dgq, dgs, dt), _dequant(_rows(xq, tok), xs, dt), offs)   # [E, 2I, H]
        dx = _unsort_sum(dx_pairs, order, k).to(dtype)
        dweights = torch.empty_like(dw)
        dweights[order] = dw
        return (dx, None, dweights.view(-1, k).to(w_dtype), None, None, None, None, dgate_up.to(gate_up.dtype),
                ddown.to(down.dtype))


def _input_grad(dgq: Tensor, dgs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor, dtype: torch.dtype) -> Tensor:
    """(dgq dgs)_g (wq[g] ws[g]): the FP8 grouped kernel where both are E4M3 (bwd_format "e4m3"; it takes the
    weight transposed, a copy), else one grouped GEMM on the dequantized operands as they lie (no transpose)."""
    wt = wq.transpose(1, 2)
    if _scaled_ok(dgq, wt, dtype):
        return fp8_grouped_linear(dgq, dgs, wt.contiguous(), ws, offs, dtype)
    dt = _work_dtype(dgq, dtype)
    return grouped_mm(_dequant(dgq, dgs, dt), _dequant(wq, ws, dt), offs).to(dtype)
