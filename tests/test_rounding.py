"""bf16 rounding (formats.rounding) and the reference AdamW step's grad_scale and bf16 master.

The reference is the source of truth the kernels are tested against (tests/test_kernels_adam.py), so these
check its own promises: the hash is the documented one, stochastic rounding is unbiased and independent of
how a parameter is split, and grad_scale is exactly one separate fp32 multiply."""
from __future__ import annotations

import pytest
import torch

from coat_ds import kernels as ops
from coat_ds.formats import E4M3, E5M2, quantize, round_bf16, sr_bits, stream_key
from coat_ds.formats import rounding
from coat_ds.optim import adamw_step_reference

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _lowbias32_int(x: int) -> int:
    """The mixer on unbounded Python ints (no int64 tricks), to check the tensor version against."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_sr_bits_is_the_documented_hash():
    idx = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 3 * 2**40 + 5]
    for seed, step, stream in ((0, 1, 0), (1234, 77, 2**31 - 1), (2**40 + 3, 2**33, 5)):
        h = rounding.KEY0
        for w in (seed, step, stream):
            h = _lowbias32_int(h ^ (w & 0xFFFFFFFF))
            h = _lowbias32_int(h ^ (w >> 32))
        assert stream_key(seed, step, stream) == h
        want = [_lowbias32_int((h + (i & 0xFFFFFFFF) * rounding.GOLDEN + (i >> 32) * rounding.GOLDEN_HI)
                               & 0xFFFFFFFF) >> 16 for i in idx]
        assert sr_bits(seed, step, stream, torch.tensor(idx)).tolist() == want


def test_sr_bits_look_uniform_and_independent():
    n = 1 << 20
    idx = torch.arange(n)
    a = sr_bits(0, 1, 7, idx)
    assert a.min() >= 0 and a.max() < 1 << 16
    for part in (a >> 8, a & 0xFF):  # chi-square over 256 bins of the high and the low byte
        counts = torch.bincount(part, minlength=256).double()
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
        assert chi2 < 255 + 6 * (2 * 255) ** 0.5, chi2
    # another step, stream or seed: fresh bits (equal about 1 in 2^16 times, uncorrelated)
    for other in (sr_bits(0, 2, 7, idx), sr_bits(0, 1, 8, idx), sr_bits(1, 1, 7, idx)):
        assert (other == a).double().mean() < 1e-4
        assert abs(torch.corrcoef(torch.stack([a.double(), other.double()]))[0, 1]) < 5e-3
    # neighbouring positions uncorrelated too
    assert abs(torch.corrcoef(torch.stack([a[:-1].double(), a[1:].double()]))[0, 1]) < 5e-3


def _neighbours(x: torch.Tensor):
    """The bf16 values just below and just above |x| (toward zero / away), as fp32."""
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


def test_round_bf16_stochastic_picks_a_neighbour_and_keeps_specials():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10000, generator=gen) * torch.exp(10 * torch.randn(10000, generator=gen))
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x[4:8] = torch.tensor([1.0, -3.5, 2.0**-130, torch.finfo(torch.bfloat16).max])  # exact bf16 values
    y = round_bf16(x, (3, 4, 5, 6)).float()
    assert y[0].isnan() and y[1] == float("inf") and y[2] == -float("inf")
    assert y[3] == 0 and y[3].signbit()
    assert torch.equal(y[4:8], x[4:8])
    down, up = _neighbours(x[8:])
    assert ((y[8:] == down) | (y[8:] == up)).all()
    assert same_bits(round_bf16(x), x.to(torch.bfloat16))  # no keys: round to nearest even


def test_round_bf16_stochastic_is_unbiased():
    gen = torch.Generator().manual_seed(1)
    x = 1 + torch.rand(4096, generator=gen)  # [1, 2): ulp 2^-7
    ulp = 2.0**-7
    down, _ = _neighbours(x)
    frac = (x - down) / ulp
    draws = torch.stack([round_bf16(x, (0, step, 11, 0)).float() for step in range(1, 129)])
    err = (draws - x).mean().item() / ulp
    assert abs(err) < 5 * 0.5 / (draws.numel() ** 0.5), err  # truncation would be -0.5, RN +-0
    up_rate = (draws > down).double().mean(0)
    for lo in torch.arange(0, 1, 0.125):  # rounds up as often as the value lies toward the upper neighbour
        sel = (frac >= lo) & (frac < lo + 0.125)
        assert abs(up_rate[sel].mean() - frac[sel].double().mean()) < 0.02


def test_round_bf16_stochastic_is_invariant_to_splitting():
    """Rounding a parameter whole, or in pieces (ZeRO partitions) with their offsets, gives the same bits."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    whole = round_bf16(x, (9, 3, 42, 0))
    for cuts in ((0, 1000), (0, 500, 1000), (0, 1, 333, 334, 999, 1000)):
        pieces = [round_bf16(x[a:b], (9, 3, 42, a)) for a, b in zip(cuts[:-1], cuts[1:])]
        assert same_bits(torch.cat(pieces), whole)
    assert not torch.equal(round_bf16(x, (9, 3, 43, 0)), whole)  # another stream: other bits


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN payloads included), whatever the dtype."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def _state(n, g, v_fmt, gen):
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.randn(n, generator=gen).square() * 1e-6 + 1e-12
    return tuple(quantize(m, E4M3, g, True)), tuple(quantize(v, v_fmt, g, True))


def _ref(p, grad, m, v, **kw):
    return adamw_step_reference(p, grad, m, v, step=3, m_format=E4M3, v_format=E5M2, group_size=32, expansion=True,
                                **HP, **kw)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_reference_grad_scale_is_one_separate_fp32_multiply(grad_dtype, scale_kind):
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(300, generator=gen)
    grad = (torch.randn(300, generator=gen) * 100).to(grad_dtype)
    grad[:3] = torch.tensor([float("inf"), float("nan"), 0.0]).to(grad_dtype)
    m, v = _state(300, 32, E5M2, gen)
    scale = 1 / 3.7 if scale_kind == "float" else torch.tensor([1 / 3.7])
    pa, pb = p0.clone(), p0.clone()
    ma, va = _ref(pa, grad, m, v, grad_scale=scale)
    mb, vb = _ref(pb, grad.float() * scale, m, v)
    assert same_bits(pa, pb)
    assert all(same_bits(x, y) for x, y in zip((*ma, *va), (*mb, *vb)))


@pytest.mark.parametrize("sr_key", [None, (17, 5)], ids=["rn", "sr"])
def test_reference_bf16_master_is_the_fp32_update_rounded(sr_key):
    gen = torch.Generator().manual_seed(5)
    p32 = torch.randn(300, generator=gen).bfloat16().float()
    grad = torch.randn(300, generator=gen).bfloat16()
    m, v = _state(300, 32, E5M2, gen)
    p16 = p32.bfloat16()
    m16, v16 = _ref(p16, grad, m, v, sr_key=sr_key, sr_seed=8)
    m32, v32 = _ref(p32, grad, m, v)
    want = round_bf16(p32, None if sr_key is None else (8, 3, *sr_key))
    assert same_bits(p16, want)
    assert all(same_bits(a, b) for a, b in zip((*m16, *v16), (*m32, *v32)))


def tiny_update_run(sr: bool, n: int = 4096, steps: int = 64, device: str = "cpu"):
    """bf16 params at 1.0 (ulp 2^-7) under a constant gradient: Adam moves each by ~lr = 1e-3 a step, a
    quarter of half an ulp. Returns (bf16 master after `steps`, the fp32 master's value)."""
    g = 32
    p16 = torch.ones(n, dtype=torch.bfloat16, device=device)
    p32 = torch.ones(n, device=device)
    grad = torch.full((n,), 1e-2, dtype=torch.bfloat16, device=device)
    ng = n // g
    states = [[(torch.zeros(n, dtype=torch.float8_e4m3fn, device=device), torch.zeros(ng, device=device),
                torch.ones(ng, device=device)) for _ in range(2)] for _ in range(2)]
    for step in range(1, steps + 1):
        for p, (m, v) in zip((p16, p32), states):
            ops.adamw_step([p], [grad], [m], [v], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           step=step, v_format=E4M3, group_size=g, expansion=True,
                           sr_keys=[(123, 0)] if sr else None, sr_seed=1)
    return p16, p32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_stochastic_rounding_keeps_updates_below_half_an_ulp(device):
    """Through ops.adamw_step: the compiled op where it builds (CPU op, CUDA kernel), else the reference."""
    p_sr, p32 = tiny_update_run(sr=True, device=device)
    p_rn, _ = tiny_update_run(sr=False, device=device)
    moved = 1 - p32.mean().item()
    assert 0.05 < moved < 0.08  # ~64 steps of ~1e-3
    assert torch.equal(p_rn.float(), torch.ones_like(p32))  # round to nearest loses every update
    ulp = 2.0**-8  # just below 1.0 the bf16 ulp is 2^-8
    sd = 64**0.5 * ulp / 2 / p_sr.numel() ** 0.5  # the mean's spread: 64 roundings of sd <= ulp/2 per value
    assert abs(p_sr.float().mean().item() - p32.mean().item()) < 5 * sd
