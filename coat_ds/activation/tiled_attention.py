"""Fp8AttentionFn's backward over query tiles (`activation.tile_tokens` with `attention_fp8`).

Untiled, the backward holds sequence-long bf16 q, k, v, the recomputed output o, the stock call's saved tensors,
o_proj's FP8 operands, do and dq/dk/dv at once (with the backend's own scratch: FlashAttention's fp32 dq
accumulator, its GQA-expanded dk/dv). Tiled, k and v are dequantized once (the small GQA tensors) and each tile of
`tile_tokens` queries [s0, s1) runs alone: its q dequantized from the saved codes, its attention recomputed under
autograd against the keys it sees, o_proj's backward for its rows, its vector-Jacobian product. dq is written into
one tensor in q's layout; dk, dv and o_proj's weight gradient are summed in fp32 over the tiles and returned once (so
ZeRO's gradient hooks fire once a parameter, as for TiledMlpFn).

Which keys a tile sees: with the model's mask (a [b | 1, h | 1, S | 1, keys] tensor: padding, sliding windows,
eager's causal mask) its rows s0..s1 and every key, through the stock call; without a mask under the stock SDPA
function (causal by `is_causal`) keys 0..s1 with the causal diagonal aligned bottom-right
(`torch.nn.attention.bias.causal_lower_right`, what SDPA's FlashAttention kernel runs natively); without a mask
elsewhere (eager, or a non-causal module) every key. Only the stock sdpa and eager functions are tiled: another
function (Ulysses' all-to-all wrapper, flash) keeps the untiled backward.

Causal tiles without a mask on CUDA run as cuDNN attention calls where cuDNN takes them (`CausalParts`): the tile's
queries against its own keys (a square, causal from the top left: the same diagonal) and against the keys before it
(no mask), merged by their log-sum-exps; each part's backward is cuDNN's own, handed the merged output and
log-sum-exp. SDPA runs a bottom-right causal tile only through FlashAttention-2, whose backward took 1.7x cuDNN's on
an H200 (4 layers of 8B at 131,072 tokens: 7.5 s a step untiled, 10.1 s tiled through FlashAttention-2, 7.7 s
through cuDNN: benchmarks/logs/long_context_attention_2026-12-03.log).

Scales: o_proj's output gradient dh takes one E5M2 scale over the whole sequence, as untiled (one row-maxima pass
over dh), so do is the untiled do row for row; the recomputed o takes a per-tile E4M3 scale (a global one would need
every tile's o first: one more attention forward). Scales are powers of two and a tile's is at most the whole
tensor's, so o's codes are the untiled ones except where the whole tensor's scale made them subnormal (here finer).
The weight gradient's tiles are summed in fp32 and rounded once. So gradients equal the untiled ones up to the order
of those sums (tests/test_tiled_attention.py states the measured bound)."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..kernels import quant
from .attention import _ROW, AttentionCall, dequant_heads
from .functions import quant_operand
from .gemm import fp8_mm
from .tiled import held_operands, tiles


class TiledCall:
    """The decoder layer's attention call (call(q, k, v, mask) -> [b, s, h, d]), and how a query tile of it runs."""

    def __init__(self, call: AttentionCall, causal: bool, scaling: float, gqa: bool) -> None:
        self.call, self.causal, self.scaling, self.gqa = call, causal, scaling, gqa

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.call(q, k, v, mask)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple:
        """Fp8AttentionFn's backward over query tiles (attention.py calls a call's own backward where it has one:
        this module imports attention.py, not the other way round)."""
        return backward(ctx, dh)

    def keys(self, s1: int, mask: torch.Tensor | None, seq: int) -> int:
        """How many keys (0..n) the queries before s1 can see: s1 where the call is causal without a mask."""
        return s1 if mask is None and self.causal else seq

    def tile(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             s0: int, s1: int) -> torch.Tensor:
        """The call's output rows s0..s1 ([b, s1 - s0, h, d]) from those queries and keys 0..keys(s1)."""
        if mask is not None:
            return self.call(q, k, v, mask[..., s0:s1, :] if mask.shape[-2] > 1 else mask)
        if not self.causal:
            return self.call(q, k, v, None)
        # what the stock sdpa function runs without a mask (is_causal, enable_gqa), the diagonal at the bottom right
        bias = causal_lower_right(s1 - s0, s1)
        if q.is_cuda and s1 - s0 != s1 and not torch.backends.cuda.can_use_flash_attention(
                torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, self.gqa)):
            # SDPA would materialize the [tile, keys] mask and run its math kernel on it
            raise RuntimeError(f"activation.tile_tokens: a causal query tile needs SDPA's FlashAttention kernel "
                               f"(bf16/fp16, head_dim <= 256), not available for q {tuple(q.shape)} {q.dtype}; "
                               f"allowed: tile_tokens null")
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scaling, enable_gqa=self.gqa)
        return out.transpose(1, 2).contiguous()


def tiled_call(call: AttentionCall, attn: Any, mask: Any, q: torch.Tensor, tile_tokens: int | None,
               kwargs: dict, stock: bool) -> AttentionCall:
    """`call` as a TiledCall where attention's backward runs over query tiles: tile_tokens set, the sequence longer
    than a tile, `stock` (the layer's function is transformers' own eager or sdpa one, not a wrapper such as
    Ulysses'); a mask that cannot be sliced by query rows is one line."""
    seq = q.shape[2]
    if tile_tokens is None or seq <= tile_tokens or quant.tracing(q) or not stock:
        return call
    impl = attn.config._attn_implementation
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2] in (1, seq)):
        raise ValueError(f"activation.tile_tokens: attention's mask ({type(mask).__name__} of shape "
                         f"{tuple(getattr(mask, 'shape', ()))}) cannot be tiled by query rows; allowed: none or a "
                         f"4-D tensor [batch, heads, {seq} or 1, keys]")
    causal = impl == "sdpa" and bool(kwargs.get("is_causal", getattr(attn, "is_causal", True)))
    return TiledCall(call, causal, attn.scaling, getattr(attn, "num_key_value_groups", 1) > 1)


def dequant_rows(codes: torch.Tensor, sexp: torch.Tensor, layout: tuple, s0: int, s1: int) -> torch.Tensor:
    """`dequant_heads(codes, sexp, layout)[:, :, s0:s1]` of a [b, h, s, d] tensor, dequantizing only those rows
    (bit for bit the same values: each group carries its own exponent), in the same memory order."""
    shape, order, dtype = layout
    assert order[-1] == len(shape) - 1, "quant_heads keeps head_dim innermost"
    dim = order.index(2)    # the sequence's place in memory order
    group = codes.shape[1] // sexp.shape[1]
    c = codes.view(shape).narrow(dim, s0, s1 - s0).contiguous()
    e = sexp.view(*shape[:-1], shape[-1] // group).narrow(dim, s0, s1 - s0).contiguous()
    rows = math.gcd(c.numel(), _ROW)
    out = quant.group_dequant(c.view(-1, rows), e.view(-1, rows // group), group, dtype)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return out.view(c.shape).permute(inverse)


def _like(layout: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor with the shape and strides of the one `quant_heads` saw."""
    shape, order, _ = layout
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return torch.empty(shape, dtype=dtype, device=device).permute(inverse)


def head_groups(heads: int, kv_heads: int) -> list[tuple[slice, slice]]:
    """(query heads, kv heads) of each call a tile makes: under GQA one per kv head with its query heads (heads are
    independent: the same values), since a backend's GQA backward expands dk, dv to every query head over all the
    tile's keys (FlashAttention's dk/dv_expanded: sequence-long at the last tile); without GQA one call."""
    if kv_heads == heads:
        return [(slice(0, heads), slice(0, kv_heads))]
    r = heads // kv_heads
    return [(slice(g * r, (g + 1) * r), slice(g, g + 1)) for g in range(kv_heads)]


def cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether cuDNN's attention takes a causal tile's parts: CUDA, cuDNN's SDPA enabled and able for these
    tensors (dtype, head_dim, GQA heads)."""
    if not (q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
    return torch.backends.cuda.can_use_cudnn_attention(params)


class CausalParts:
    """Queries s0..s1 against keys 0..s1, causal from the bottom right, as cuDNN calls: keys s0..s1 (a square: causal
    from the top left is the same diagonal) and, past the first tile, keys 0..s0 unmasked; the outputs merged by
    their log-sum-exps. `backward` runs each part's cuDNN backward with the merged output and log-sum-exp: the
    gradient of one softmax over all the tile's keys, each part's keys getting their own columns of it."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s0: int, scale: float) -> None:
        s1 = s0 + q.shape[2]
        self.q, self.scale = q, scale
        own, before = slice(s0, s1), slice(0, s0)
        self.parts = [(keys, k[:, :, keys], v[:, :, keys], causal) for keys, causal in ((own, True), (before, False))
                      if keys.stop > keys.start]
        runs = [torch.ops.aten._scaled_dot_product_cudnn_attention(q, pk, pv, None, True, 0.0, causal, False,
                                                                     scale=scale)
                for _, pk, pv, causal in self.parts]
        self.runs = [r[2:8] for r in runs]   # what a part's backward takes besides tensors (not its output)
        if len(runs) == 1:
            self.out, self.lse = runs[0][0], runs[0][1]
            return
        (oa, la), (ob, lb) = ((r[0], r[1]) for r in runs)
        del runs
        self.lse = torch.logaddexp(la, lb)
        wa, wb = ((x - self.lse).exp() for x in (la, lb))
        if wa.dim() < oa.dim():
            wa, wb = wa.unsqueeze(-1), wb.unsqueeze(-1)
        self.out = torch.empty_like(oa).copy_(oa.float() * wa + ob.float() * wb)   # oa's strides, cuDNN's layout

    @property
    def rows(self) -> torch.Tensor:
        """The output as [b, tile, heads, d]."""
        return self.out.transpose(1, 2)

    def backward(self, do: torch.Tensor) -> tuple[torch.Tensor, list[tuple[slice, torch.Tensor, torch.Tensor]]]:
        """do ([b, tile, heads, d]) -> (dq, [(keys, dk, dv) of each part])."""
        do = torch.empty_like(self.out).copy_(do.transpose(1, 2))   # the output's strides, as cuDNN's backward takes
        dq, parts = None, []
        for (keys, pk, pv, causal), r in zip(self.parts, self.runs):
            gq, gk, gv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, self.q, pk, pv, self.out, self.lse, r[4], r[5], None, r[0], r[1], r[2], r[3], 0.0, causal,
                scale=self.scale)
            dq = gq.float() if dq is None else dq.add_(gq)
            parts.append((keys, gk, gv))
        return dq.to(self.q.dtype), parts


class AutogradTile:
    """One head group's tile through the layer's call under autograd (a mask, eager, or no cuDNN), the same
    interface as CausalParts."""

    def __init__(self, tc: TiledCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 s0: int, s1: int) -> None:
        self.leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            self.o = tc.tile(*self.leaves, mask, s0, s1)
        self.rows = self.o.detach()

    def backward(self, do: torch.Tensor) -> tuple[torch.Tensor, list[tuple[slice, torch.Tensor, torch.Tensor]]]:
        gq, gk, gv = torch.autograd.grad(self.o, self.leaves, do)
        return gq, [(slice(0, gk.shape[2]), gk, gv)]


def tile_calls(tc: TiledCall, q_t: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               s0: int, s1: int, fused: bool) -> list:
    """The tile's attention, one call per kv head under GQA (see head_groups): CausalParts where `fused` (causal,
    no mask, cuDNN takes it), else AutogradTile against the keys the tile sees."""
    n, nh, nkv = tc.keys(s1, mask, k.shape[2]), q_t.shape[1], k.shape[1]
    if fused:
        return [CausalParts(q_t[:, qh], k[:, kh], v[:, kh], s0, tc.scaling) for qh, kh in head_groups(nh, nkv)]
    return [AutogradTile(tc, q_t[:, qh], k[:, kh, :n], v[:, kh, :n],
                         mask[:, qh] if mask is not None and mask.shape[1] > 1 else mask, s0, s1)
            for qh, kh in head_groups(nh, nkv)]


def backward(ctx: Any, dh: torch.Tensor) -> tuple:
    """Fp8AttentionFn.backward over query tiles of ctx.cfg.tile_tokens (ctx.call a TiledCall); the same gradients."""
    qc, qe, kc, ke, vc, ve, mask = ctx.saved_tensors
    cfg, group, tc = ctx.cfg, ctx.group, ctx.call
    ql, kl, vl = ctx.layouts
    k, v = dequant_heads(kc, ke, kl), dequant_heads(vc, ve, vl)
    del kc, ke, vc, ve
    b, nh, nkv, seq, hd = k.shape[0], ql[0][ql[1].index(1)], k.shape[1], k.shape[2], k.shape[3]
    dh = dh.contiguous()
    ds = quant.tensor_scale(quant.row_amax(dh), cfg.bwd)    # the whole dh's scale, as linear_backward takes it
    rows_of = dh.view(b, seq, dh.shape[-1])
    dq = _like(ql, k.dtype, k.device)
    dk, dv = (_like(layout, torch.float32, k.device).zero_() for layout in (kl, vl))   # k's and v's layouts
    dw = None
    fused = mask is None and tc.causal and cudnn_causal(dequant_rows(qc, qe, ql, 0, 1)[:, :nh // nkv], k[:, :1],
                                                        v[:, :1])
    with held_operands(group):
        wt, ws = group.operand(transposed=True)
        for r in tiles(seq, cfg.tile_tokens):
            s0, s1 = r.start, r.stop
            calls = tile_calls(tc, dequant_rows(qc, qe, ql, s0, s1), k, v, mask, s0, s1, fused)
            out = torch.cat([c.rows for c in calls], dim=2)
            _, ot, o_s = quant_operand(out.reshape(-1, nh * hd), cfg.fwd, rowmajor=False, transposed=True)
            d8, d8t = quant.quant_tensor(rows_of[:, s0:s1].reshape(-1, dh.shape[-1]), ds, cfg.bwd, True, True)
            part = fp8_mm(d8t, ds, ot, o_s, torch.float32)
            dw = part if dw is None else dw.add_(part)
            do = fp8_mm(d8, ds, wt, ws, dh.dtype)
            del ot, d8, d8t, part, out
            dos = do.view(b, s1 - s0, nh, hd).split([c.rows.shape[2] for c in calls], dim=2)
            del do
            for (qh, kh), c, d in zip(head_groups(nh, nkv), calls, dos):
                # one call's backward at a time: its dk, dv summed before the next call's exist
                gq, parts = c.backward(d)
                dq[:, qh, s0:s1] = gq
                for keys, gk, gv in parts:
                    dk[:, kh, keys] += gk
                    dv[:, kh, keys] += gv
                del gq, parts
            del calls, dos, c, d
    w = group.weights[0]
    db = dh.sum(dim=0).to(w.dtype) if group.has_bias else None
    pgrads = group.split_grad(dw.to(w.dtype), db)
    return dq, dk.to(k.dtype), dv.to(v.dtype), None, (dh if ctx.has_res else None), None, None, None, *pgrads
