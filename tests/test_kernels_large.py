"""The FP8 activation kernels past 2^31 and 2^32 elements (issue 61: a million-token MLP passes 2^32).

Each kernel runs on a tensor of 2^32 + 2^16 elements or more (rows and row width multiples of 16, as the tile
kernels and FP8 GEMMs take them) with the reference made unreachable, then rows at the start, across element
2^31 and at the end (past 2^32) are compared with quant_reference, every element of them. The kernels are
row-wise, so a slice's reference is the whole tensor's. Bounds as tests/test_activation_gpu.py: FP8 codes
from the same input and scale bit-identical; a value the kernel computes in another fp32 order within one
FP8 step; bf16 outputs within 2 bf16 ulps. The tile kernel's row tiles past gridDim.y's 65535 are checked
whole. About 40 GiB of GPU memory at most."""
import pytest
import torch

from coat_ds.formats import E4M3
from coat_ds.kernels import quant
from coat_ds.kernels import quant_reference as R

pytestmark = pytest.mark.gpu
BIG = 2 ** 32
WIDTH = 4096  # row width: Llama-8B's hidden size


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from coat_ds.kernels.loader import load_op

    assert load_op("CoatQuantBuilder") is not None, "CoatQuantBuilder did not build"


class _NoFallback:
    """What the dispatch module sees as the reference: its checks and constants only. A kernel that fell back
    would pass as its own reference (and at this size run out of memory in fp32)."""

    def __getattr__(self, name):
        if name in ("check_groups", "GATED_ACTS"):
            return getattr(R, name)
        pytest.fail(f"quant fell back to the reference's {name}")


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    monkeypatch.setattr(quant, "R", _NoFallback())
    yield
    torch.cuda.empty_cache()


def _need_gib(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2 ** 30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2 ** 30:.1f} free")


def _rows(width: int) -> int:
    """Rows of `width` holding more than 2^32 elements: 16 rows past it."""
    return BIG // width + 16


def _slices(rows: int, width: int) -> list[slice]:
    """Row slices at the start, across element 2^31 and at the end (across 2^32)."""
    mid, end = BIG // 2 // width, slice(rows - 32, rows)
    assert end.start * width <= BIG < rows * width
    return [slice(0, 16), slice(mid - 8, mid + 8), end]


def _randn(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, n, generator=g, device="cuda", dtype=torch.bfloat16)


def _codes_equal(a, b):
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _one_step(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert ((a - b).abs() <= 2.0 ** -3 * b.abs() + 1e-30).all(), (a - b).abs().max()


def _close_bf16(a, b):
    assert torch.isfinite(a.float()).all()
    assert ((a.float() - b.float()).abs() <= 2.0 ** -7 * b.float().abs() + 1e-6).all()


def test_row_amax_and_quant_tensor():
    _need_gib(20)
    m = _rows(WIDTH)
    x = _randn(m, WIDTH, 1)
    amax = quant.row_amax(x)
    scale = quant.tensor_scale(amax, E4M3)
    q, qt = quant.quant_tensor(x, scale, E4M3, True, True)
    for s in _slices(m, WIDTH):
        assert torch.equal(amax[s], R.row_amax(x[s]))
        rq, _ = R.quant_tensor(x[s], scale, E4M3, True, False)
        _codes_equal(q[s], rq)
        _codes_equal(qt[:, s], rq.t())


def test_rmsnorm_kernels():
    _need_gib(40)
    m = _rows(WIDTH)
    x, w = _randn(m, WIDTH, 2), (torch.rand(WIDTH, device="cuda") + 0.5).bfloat16()
    xq, xs, rstd, ymax = quant.rmsnorm_quant(x, w, 1e-5, E4M3, 16)
    y, xq2, _, _ = quant.rmsnorm_save(x, w, 1e-5, E4M3, 16)
    for s in _slices(m, WIDTH):
        rq, rs, rr, rmax = R.rmsnorm_quant(x[s], w, 1e-5, E4M3, 16)
        _codes_equal(xq[s], rq)
        _codes_equal(xq2[s], rq)
        assert torch.equal(xs[s], rs)
        assert torch.allclose(rstd[s], rr, rtol=1e-5, atol=0) and torch.allclose(ymax[s], rmax, rtol=1e-5, atol=0)
        _close_bf16(y[s], R.rmsnorm_output(x[s], rr, w))
    del x, y, xq2
    scale = quant.tensor_scale(ymax, E4M3)
    yq, yqt = quant.rmsnorm_rebuild(xq, xs, rstd, w, scale, E4M3, 16, True, True)
    for s in _slices(m, WIDTH):
        rq, _ = R.rmsnorm_rebuild(xq[s], xs[s], rstd[s], w, scale, E4M3, 16, True, False)
        _one_step(yq[s], rq)
        _codes_equal(yqt[:, s], yq[s].t())
    del yq, yqt
    dy, dres = _randn(m, WIDTH, 3), _randn(m, WIDTH, 4)
    dx, dw = quant.rmsnorm_backward(dy, xq, xs, rstd, w, 16, dres)
    for s in _slices(m, WIDTH):
        _close_bf16(dx[s], R.rmsnorm_backward(dy[s], xq[s], xs[s], rstd[s], w, 16, dres[s])[0])
    del dx, dres
    rdw = sum(R.rmsnorm_backward(dy[r], xq[r], xs[r], rstd[r], w, 16)[1] for r in _chunks(m, 2 ** 16))
    assert torch.allclose(dw, rdw, rtol=1e-4, atol=1e-4 * rdw.abs().max().item())


def _chunks(rows: int, size: int) -> list[slice]:
    return [slice(r, min(r + size, rows)) for r in range(0, rows, size)]


def test_gated_kernels():
    """act(g) * u on [gate | up] of 2 x 4096 columns: the saved codes hold 2^32 + 2^17 elements."""
    _need_gib(24)
    i = WIDTH
    m = _rows(2 * i)
    gu = _randn(m, 2 * i, 5)
    q, s, amax = quant.silu_mul_quant(gu, E4M3, 16)
    for r in _slices(m, 2 * i):
        rq, rs, ramax = R.silu_mul_quant(gu[r], E4M3, 16)
        _codes_equal(q[r], rq)
        assert torch.equal(s[r], rs) and torch.allclose(amax[r], ramax, rtol=1e-5, atol=0)
    del gu
    deq = quant.group_dequant(q, s, 16, torch.bfloat16)
    for r in _slices(m, 2 * i):
        assert torch.equal(deq[r], R.group_dequant(q[r], s[r], 16).bfloat16())
    del deq
    scale = quant.tensor_scale(amax, E4M3)
    a, at = quant.silu_mul_rebuild(q, s, scale, E4M3, 16, True, True)
    for r in _slices(m, 2 * i):
        ra, _ = R.silu_mul_rebuild(q[r], s[r], scale, E4M3, 16, True, False)
        _one_step(a[r], ra)
        _codes_equal(at[:, r], a[r].t())
    del a, at
    da = _randn(m, i, 6)
    dgu, dmax = quant.silu_mul_backward(da, q, s, 16)
    for r in _slices(m, 2 * i):
        rd, _ = R.silu_mul_backward(da[r], q[r], s[r], 16)
        _close_bf16(dgu[r], rd)
        assert torch.equal(dmax[r], R.row_amax(dgu[r]))


def test_xent_kernels():
    """Logits of a 128k vocabulary, 2^32 + 2^21 of them; the gradient is written over them."""
    _need_gib(20)
    n = 2 ** 17
    m = _rows(n)
    x = _randn(m, n, 7).mul_(4)
    target = torch.randint(0, n, (m,), device="cuda")
    lse, picked = quant.xent_forward(x, target)
    slices = _slices(m, n)
    want = []
    for r in slices:
        rlse, rpicked = R.xent_forward(x[r], target[r])
        torch.testing.assert_close(lse[r], rlse, rtol=1e-6, atol=1e-6)
        assert torch.equal(picked[r], rpicked)
        scale = torch.full((r.stop - r.start,), 1.0 / m, device="cuda")
        want.append(R.xent_backward(x[r], lse[r], target[r], scale))
    grad = quant.xent_backward_(x, lse, target, torch.full((m,), 1.0 / m, device="cuda"))
    assert grad.data_ptr() == x.data_ptr()
    for r, w in zip(slices, want):
        _close_bf16(grad[r], w)


def test_rope_kernels():
    """RoPE of a fused q/k/v output of Llama-8B's heads with 2^32 + elements, both ways, against its formula
    in fp32 (one bf16 rounding, as the kernel)."""
    _need_gib(30)
    nh, nkv, hd = 32, 8, 128
    width = (nh + 2 * nkv) * hd
    seq = -(-_rows(width) // 16) * 16
    qkv = _randn(seq, width, 8)
    ang = torch.rand(1, seq, hd // 2, device="cuda") * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
    del ang
    q, k, v = quant.rope_qkv(qkv, cos, sin, 1, nh, nkv, hd)
    dqkv = quant.rope_qkv_backward(q, k, v, cos, sin, nh, nkv, hd)  # the transpose of a rotation: qkv again
    for r in _slices(seq, width):
        c, sn = cos[0, r, None].float(), sin[0, r, None].float()
        x = qkv[r].float().view(-1, nh + 2 * nkv, hd)
        want = torch.cat([_rotate(x[:, :nh + nkv], c, sn), x[:, nh + nkv:]], 1)
        got = torch.cat([t.transpose(1, 2)[0, r] for t in (q, k, v)], 1)
        bound = 2.0 ** -7 * 2 * want.abs().amax() + 1e-6
        assert torch.isfinite(got.float()).all() and ((got.float() - want).abs() <= bound).all()
        back = _rotate(got.float()[:, :nh + nkv], c, -sn)
        assert ((dqkv[r].float().view_as(x)[:, :nh + nkv] - back).abs() <= bound).all()
        assert torch.equal(dqkv[r].view_as(x)[:, nh + nkv:], v.transpose(1, 2)[0, r])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin over the last dimension (HF's formula), fp32."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_tile_kernel_past_65535_row_tiles():
    """4,194,368 rows of 16: 65,537 row tiles of 64, more than gridDim.y takes; every element, both layouts."""
    m = 65537 * 64
    x = _randn(m, 16, 9)
    scale = quant.tensor_scale(quant.row_amax(x), E4M3)
    q, qt = quant.quant_tensor(x, scale, E4M3, True, True)
    rq, rqt = R.quant_tensor(x, scale, E4M3, True, True)
    _codes_equal(q, rq)
    _codes_equal(qt, rqt)
    w = (torch.rand(16, device="cuda") + 0.5).bfloat16()
    xq, xs, rstd, ymax = quant.rmsnorm_quant(x, w, 1e-5, E4M3, 16)
    yq, yqt = quant.rmsnorm_rebuild(xq, xs, rstd, w, scale, E4M3, 16, True, True)
    want, _ = R.rmsnorm_rebuild(xq, xs, rstd, w, scale, E4M3, 16, True, False)
    _one_step(yq, want)
    _codes_equal(yqt, yq.t().contiguous())
