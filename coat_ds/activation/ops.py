"""The fused activation ops: CUDA kernels (CoatQuantBuilder) where they apply, else the reference.

Same signatures and results as `reference`. The kernels take bf16 inputs on CUDA and 1 x 16 groups;
anything else (CPU, fp32 models, other group sizes, a failed build) runs the plain-PyTorch reference.

Each op is also a `torch.library` custom op (namespace `coat_act`, with a fake implementation), which is
what runs wherever a graph is traced (`tracing()`: Dynamo, AOTAutograd, make_fx): the compiler sees
opaque FP8 ops with known output shapes and no graph break. Eager calls on real tensors skip the
dispatcher and call the implementation directly (no per-call overhead)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..formats import FP8Format, get_format
from ..kernels.loader import load_op
from . import reference as R

KERNEL_GROUP = 16
_EMPTY = (0,)
_REAL = (torch.Tensor, torch.nn.Parameter)


def tracing(x: torch.Tensor | None = None) -> bool:
    """Whether a graph is being traced rather than run, so the FP8 ops must be the custom ops.

    True under Dynamo (torch.compile, export) and wherever a python dispatch mode is active (AOTAutograd,
    make_fx: they run the code on fake/functional tensors, and `torch.compiler.is_compiling()` is False
    there when Dynamo is not involved, e.g. aot_function / make_fx, or on torch < 2.13 outside Dynamo's
    own trace). An implementation that writes into `torch.empty` outputs through raw pointers cannot be
    traced: the graph would hold just the empty outputs (or the call fails on a fake tensor's data
    pointer). `x`, an input, is checked for a tensor subclass (a fake/functional tensor outside its mode;
    any other subclass takes the custom op too, which is always correct). Dynamo folds is_compiling() to
    True, so it never traces the dispatch-stack check (a graph break). ~0.1 us per eager call."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or (x is not None and type(x) not in _REAL))


_KERNEL_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _kernels(*tensors: torch.Tensor, group_size: int = KERNEL_GROUP, rows: int | None = None,
             dtypes: tuple = _KERNEL_DTYPES):
    """The compiled module if the kernels apply to these tensors (bf16/FP8 on CUDA, or `dtypes`; 1 x 16
    groups, 16-byte aligned; `rows`, where given, a multiple of 16 for the tile kernels), else None."""
    t = tensors[0]
    if not t.is_cuda or group_size != KERNEL_GROUP or os.environ.get("COAT_ACT_REFERENCE", "0") == "1":
        return None
    if t.dtype not in dtypes:
        return None
    if rows is not None and rows % 16:
        return None
    if any(x.data_ptr() % 16 for x in tensors):
        return None
    return load_op("CoatQuantBuilder")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _pair(m: int, n: int, dtype, rowmajor: bool, transposed: bool, device):
    """Outputs of a quantizer: [m, n] and [n, m], each an empty [0] tensor when not asked for."""
    q = torch.empty((m, n) if rowmajor else _EMPTY, dtype=dtype, device=device)
    qt = torch.empty((n, m) if transposed else _EMPTY, dtype=dtype, device=device)
    return q, qt


def _fill_pair(ref, m, n, dtype, device):
    q, qt = ref
    return (q if q is not None else torch.empty(_EMPTY, dtype=dtype, device=device),
            qt if qt is not None else torch.empty(_EMPTY, dtype=dtype, device=device))


# ---------------------------------------------------------------- implementations (fmt by name)

def _row_amax(x: torch.Tensor) -> torch.Tensor:
    op = _kernels(x)
    if op is None or x.dtype != torch.bfloat16 or x.shape[1] % 8:
        return R.row_amax(x)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    op.row_amax(x.contiguous(), out)
    return out


def _tensor_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """One launch where the reference takes ~13 (amax, frexp, compares, where, ldexp...): 12 calls a
    decoder layer make it the largest share of the FP8 flow's host time at small batches."""
    amax = amax.contiguous()
    op = _kernels(amax, dtypes=(torch.float32,))
    if op is None or amax.numel() == 0:
        return R.tensor_scale(amax, get_format(fmt))
    out = torch.empty((), dtype=torch.float32, device=amax.device)
    op.tensor_scale(amax, out, fmt == "e5m2")
    return out


def _quant_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: str, rowmajor: bool, transposed: bool):
    f = get_format(fmt)
    op = _kernels(x, rows=x.shape[0])
    if op is None or x.dtype != torch.bfloat16 or x.shape[1] % 16:
        return _fill_pair(R.quant_tensor(x, scale, f, rowmajor, transposed), *x.shape, f.dtype, x.device)
    q, qt = _pair(*x.shape, f.dtype, rowmajor, transposed, x.device)
    op.quant_tensor(x.contiguous(), scale, _u8(q), _u8(qt), fmt == "e5m2", x.shape[0])
    return q, qt


def quant_weights(ws: list[torch.Tensor], scale: torch.Tensor, fmt: FP8Format, transposed: bool):
    """FP8 of the row-wise concatenation of `ws` ([N, K], or its transpose [K, N]) written slice by slice,
    with no bf16 concatenation; None where the kernel does not apply (eager CUDA bf16 only)."""
    if tracing(ws[0]):
        return None
    k = ws[0].shape[1]
    op = _kernels(*ws)
    if op is None or any(w.dtype != torch.bfloat16 or w.shape[0] % 16 or w.shape[1] != k for w in ws) or k % 16:
        return None
    n = sum(w.shape[0] for w in ws)
    out = torch.empty((k, n) if transposed else (n, k), dtype=fmt.dtype, device=ws[0].device)
    none = torch.empty(0, dtype=torch.uint8, device=out.device)
    n0 = 0
    for w in ws:
        rows = w.shape[0]
        if transposed:
            op.quant_tensor(w.contiguous(), scale, none, _u8(out[:, n0:n0 + rows]), fmt.name == "e5m2", n)
        else:
            op.quant_tensor(w.contiguous(), scale, _u8(out[n0:n0 + rows]), none, fmt.name == "e5m2", rows)
        n0 += rows
    return out


def _rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float, fmt: str, group_size: int):
    f = get_format(fmt)
    op = _kernels(x, w, group_size=group_size)
    if op is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return R.rmsnorm_quant(x, w, eps, f, group_size)
    m, n = x.shape
    R.check_groups(n, group_size)
    xq = torch.empty(m, n, dtype=f.dtype, device=x.device)
    xs = torch.empty(m, n // group_size, dtype=torch.uint8, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    ymax = torch.empty(m, dtype=torch.float32, device=x.device)
    op.rmsnorm_quant(x.contiguous(), w.contiguous(), float(eps), _u8(xq), xs, rstd, ymax, fmt == "e5m2")
    return xq, xs, rstd, ymax


def _rmsnorm_rebuild(xq: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     fmt: str, group_size: int, rowmajor: bool, transposed: bool):
    f = get_format(fmt)
    op = _kernels(xq, w, group_size=group_size, rows=xq.shape[0])
    if op is None or w.dtype != torch.bfloat16:
        return _fill_pair(R.rmsnorm_rebuild(xq, xs, rstd, w, scale, f, group_size, rowmajor, transposed),
                          *xq.shape, f.dtype, xq.device)
    q, qt = _pair(*xq.shape, f.dtype, rowmajor, transposed, xq.device)
    op.rmsnorm_rebuild(_u8(xq), xs, rstd, w.contiguous(), scale, _u8(q), _u8(qt), xq.dtype == torch.float8_e5m2,
                       fmt == "e5m2")
    return q, qt


def _rmsnorm_backward(dy: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor,
                      group_size: int, dres: Optional[torch.Tensor]):
    op = _kernels(dy, w, xq, *([] if dres is None else [dres]), group_size=group_size)
    if op is None or dy.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or dy.shape[1] > 16384 or (
            dres is not None and dres.dtype != torch.bfloat16):
        return R.rmsnorm_backward(dy, xq, xs, rstd, w, group_size, dres)
    dx = torch.empty_like(dy)
    dw = torch.zeros(w.shape[0], dtype=torch.float32, device=dy.device)
    empty = torch.empty(0, dtype=torch.bfloat16, device=dy.device)
    op.rmsnorm_backward(dy.contiguous(), _u8(xq), xs, rstd, w.contiguous(),
                        empty if dres is None else dres.contiguous(), dx, dw, xq.dtype == torch.float8_e5m2)
    return dx, dw


def _silu_mul_quant(gu: torch.Tensor, fmt: str, group_size: int):
    f = get_format(fmt)
    op = _kernels(gu, group_size=group_size)
    if op is None or gu.dtype != torch.bfloat16:
        return R.silu_mul_quant(gu, f, group_size)
    m, n = gu.shape
    R.check_groups(n // 2, group_size)
    q = torch.empty(m, n, dtype=f.dtype, device=gu.device)
    s = torch.empty(m, n // group_size, dtype=torch.uint8, device=gu.device)
    amax = torch.empty(m, dtype=torch.float32, device=gu.device)
    op.silu_mul_quant(gu.contiguous(), _u8(q), s, amax, fmt == "e5m2")
    return q, s, amax


def _silu_mul_rebuild(q: torch.Tensor, s: torch.Tensor, scale: torch.Tensor, fmt: str, group_size: int,
                      rowmajor: bool, transposed: bool):
    f = get_format(fmt)
    op = _kernels(q, group_size=group_size, rows=q.shape[0])
    if op is None:
        return _fill_pair(R.silu_mul_rebuild(q, s, scale, f, group_size, rowmajor, transposed),
                          q.shape[0], q.shape[1] // 2, f.dtype, q.device)
    out, out_t = _pair(q.shape[0], q.shape[1] // 2, f.dtype, rowmajor, transposed, q.device)
    op.silu_mul_rebuild(_u8(q), s, scale, _u8(out), _u8(out_t), q.dtype == torch.float8_e5m2, fmt == "e5m2")
    return out, out_t


def _silu_mul_backward(da: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group_size: int):
    op = _kernels(da, q, group_size=group_size)
    if op is None or da.dtype != torch.bfloat16:
        return R.silu_mul_backward(da, q, s, group_size)
    dgu = torch.empty(q.shape, dtype=da.dtype, device=da.device)
    amax = torch.empty(q.shape[0], dtype=torch.float32, device=da.device)
    op.silu_mul_backward(da.contiguous(), _u8(q), s, dgu, amax, q.dtype == torch.float8_e5m2)
    return dgu, amax


def rope_available(qkv: torch.Tensor, cos: torch.Tensor, head_dim: int) -> bool:
    """Whether the fused RoPE kernel applies (bf16 on CUDA, head_dim % 16 == 0, HF's [b or 1, s, d] cos/sin)."""
    if tracing(qkv):  # traced graphs use HF's RoPE, which the compiler fuses itself
        return False
    return (qkv.is_cuda and qkv.dtype == torch.bfloat16 and cos.dtype == torch.bfloat16 and head_dim % 16 == 0
            and cos.dim() == 3 and os.environ.get("COAT_ACT_REFERENCE", "0") != "1"
            and load_op("CoatQuantBuilder") is not None)


def _bshd(qkv: torch.Tensor, batch: int, heads: int, hd: int) -> torch.Tensor:
    """[b, s, h, d] memory seen as [b, h, s, d]: HF's q/k/v strides."""
    return qkv.new_empty(batch, qkv.shape[0] // batch, heads, hd).transpose(1, 2)


def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int, nh: int, nkv: int, hd: int):
    q, k, v = _bshd(qkv, batch, nh, hd), _bshd(qkv, batch, nkv, hd), _bshd(qkv, batch, nkv, hd)
    load_op("CoatQuantBuilder").rope_qkv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), q.transpose(1, 2),
                                         k.transpose(1, 2), v.transpose(1, 2), nh, nkv, hd)
    return q, k, v


def _rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       nh: int, nkv: int, hd: int):
    b, _, s, _ = dq.shape
    dqkv = dq.new_empty(b * s, (nh + 2 * nkv) * hd)
    dq, dk, dv = (g.transpose(1, 2).contiguous() for g in (dq, dk, dv))  # [b, s, h, d]
    load_op("CoatQuantBuilder").rope_qkv_backward(dq, dk, dv, cos.contiguous(), sin.contiguous(), dqkv, nh, nkv, hd)
    return dqkv


# ---------------------------------------------------------------- torch.library registration

SCHEMAS = {
    "row_amax": "(Tensor x) -> Tensor",
    "tensor_scale": "(Tensor amax, str fmt) -> Tensor",
    "quant_tensor": "(Tensor x, Tensor scale, str fmt, bool rowmajor, bool transposed) -> (Tensor, Tensor)",
    "rmsnorm_quant": "(Tensor x, Tensor w, float eps, str fmt, int g) -> (Tensor, Tensor, Tensor, Tensor)",
    "rmsnorm_rebuild": "(Tensor xq, Tensor xs, Tensor rstd, Tensor w, Tensor scale, str fmt, int g, bool rowmajor, "
                       "bool transposed) -> (Tensor, Tensor)",
    "rmsnorm_backward": "(Tensor dy, Tensor xq, Tensor xs, Tensor rstd, Tensor w, int g, Tensor? dres) "
                        "-> (Tensor, Tensor)",
    "silu_mul_quant": "(Tensor gu, str fmt, int g) -> (Tensor, Tensor, Tensor)",
    "silu_mul_rebuild": "(Tensor q, Tensor s, Tensor scale, str fmt, int g, bool rowmajor, bool transposed) "
                        "-> (Tensor, Tensor)",
    "silu_mul_backward": "(Tensor da, Tensor q, Tensor s, int g) -> (Tensor, Tensor)",
    "rope_qkv": "(Tensor qkv, Tensor cos, Tensor sin, int b, int nh, int nkv, int hd) -> (Tensor, Tensor, Tensor)",
    "rope_qkv_backward": "(Tensor dq, Tensor dk, Tensor dv, Tensor cos, Tensor sin, int nh, int nkv, int hd) "
                         "-> Tensor",
}


def _register():
    lib = "coat_act"
    ops = {}

    def reg(name, fn, fake):
        op = torch.library.custom_op(f"{lib}::{name}", mutates_args=(), schema=SCHEMAS[name])(fn)
        op.register_fake(fake)
        ops[name] = op

    f32 = torch.float32

    def fmt_dtype(fmt):
        return get_format(fmt).dtype

    reg("row_amax", _row_amax, lambda x: x.new_empty(x.shape[0], dtype=f32))
    reg("tensor_scale", _tensor_scale, lambda amax, fmt: amax.new_empty((), dtype=f32))
    reg("quant_tensor", _quant_tensor,
        lambda x, scale, fmt, rowmajor, transposed: _pair(*x.shape, fmt_dtype(fmt), rowmajor, transposed, x.device))
    reg("rmsnorm_quant", _rmsnorm_quant,
        lambda x, w, eps, fmt, g: (x.new_empty(x.shape, dtype=fmt_dtype(fmt)),
                                   x.new_empty(x.shape[0], x.shape[1] // g, dtype=torch.uint8),
                                   x.new_empty(x.shape[0], dtype=f32), x.new_empty(x.shape[0], dtype=f32)))
    reg("rmsnorm_rebuild", _rmsnorm_rebuild,
        lambda xq, xs, rstd, w, scale, fmt, g, rowmajor, transposed: _pair(*xq.shape, fmt_dtype(fmt), rowmajor,
                                                                           transposed, xq.device))
    reg("rmsnorm_backward", _rmsnorm_backward,
        lambda dy, xq, xs, rstd, w, g, dres: (torch.empty_like(dy), dy.new_empty(w.shape[0], dtype=f32)))
    reg("silu_mul_quant", _silu_mul_quant,
        lambda gu, fmt, g: (gu.new_empty(gu.shape, dtype=fmt_dtype(fmt)),
                            gu.new_empty(gu.shape[0], gu.shape[1] // g, dtype=torch.uint8),
                            gu.new_empty(gu.shape[0], dtype=f32)))
    reg("silu_mul_rebuild", _silu_mul_rebuild,
        lambda q, s, scale, fmt, g, rowmajor, transposed: _pair(q.shape[0], q.shape[1] // 2, fmt_dtype(fmt),
                                                                rowmajor, transposed, q.device))
    reg("silu_mul_backward", _silu_mul_backward,
        lambda da, q, s, g: (da.new_empty(q.shape), da.new_empty(q.shape[0], dtype=f32)))
    reg("rope_qkv", _rope_qkv,
        lambda qkv, cos, sin, b, nh, nkv, hd: (_bshd(qkv, b, nh, hd), _bshd(qkv, b, nkv, hd), _bshd(qkv, b, nkv, hd)))
    reg("rope_qkv_backward", _rope_qkv_backward,
        lambda dq, dk, dv, cos, sin, nh, nkv, hd: dq.new_empty(dq.shape[0] * dq.shape[2], (nh + 2 * nkv) * hd))
    return ops


CUSTOM_OPS = _register()


def _call(name: str, impl, *args):
    """The custom op wherever a graph is traced, the plain implementation on real tensors."""
    if tracing(args[0]):
        return CUSTOM_OPS[name](*args)
    return impl(*args)


def _none_if_empty(pair, rowmajor: bool, transposed: bool):
    q, qt = pair
    return (q if rowmajor else None), (qt if transposed else None)


# ---------------------------------------------------------------- public API (FP8Format arguments)

def row_amax(x: torch.Tensor) -> torch.Tensor:
    return _call("row_amax", _row_amax, x)


def tensor_scale(amax_rows: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return _call("tensor_scale", _tensor_scale, amax_rows, fmt.name)


def quant_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, rowmajor: bool = True,
                 transposed: bool = False):
    return _none_if_empty(_call("quant_tensor", _quant_tensor, x, scale, fmt.name, rowmajor, transposed),
                          rowmajor, transposed)


def rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float, fmt: FP8Format, group_size: int):
    return _call("rmsnorm_quant", _rmsnorm_quant, x, w, float(eps), fmt.name, group_size)


def rmsnorm_rebuild(xq, xs, rstd, w, scale, fmt: FP8Format, group_size: int, rowmajor=True, transposed=False):
    return _none_if_empty(_call("rmsnorm_rebuild", _rmsnorm_rebuild, xq, xs, rstd, w, scale, fmt.name, group_size,
                                rowmajor, transposed), rowmajor, transposed)


def rmsnorm_backward(dy, xq, xs, rstd, w, group_size: int, dres: torch.Tensor | None = None):
    return _call("rmsnorm_backward", _rmsnorm_backward, dy, xq, xs, rstd, w, group_size, dres)


def silu_mul_quant(gu: torch.Tensor, fmt: FP8Format, group_size: int):
    return _call("silu_mul_quant", _silu_mul_quant, gu, fmt.name, group_size)


def silu_mul_rebuild(q, s, scale, fmt: FP8Format, group_size: int, rowmajor=True, transposed=False):
    return _none_if_empty(_call("silu_mul_rebuild", _silu_mul_rebuild, q, s, scale, fmt.name, group_size, rowmajor,
                                transposed), rowmajor, transposed)


def silu_mul_backward(da: torch.Tensor, q, s, group_size: int):
    return _call("silu_mul_backward", _silu_mul_backward, da, q, s, group_size)


def rope_qkv(qkv, cos, sin, batch: int, nh: int, nkv: int, hd: int):
    return _call("rope_qkv", _rope_qkv, qkv, cos, sin, batch, nh, nkv, hd)


def rope_qkv_backward(dq, dk, dv, cos, sin, nh: int, nkv: int, hd: int):
    return _call("rope_qkv_backward", _rope_qkv_backward, dq, dk, dv, cos, sin, nh, nkv, hd)
