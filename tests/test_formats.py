"""The reference group quantizer: round trips, edge cases, and that range expansion pays off."""
import sys
from pathlib import Path

import pytest
import torch

from coat_ds.formats import (GROUP_SIZES, K_MAX, Fp8Moment, check_group_size, dequantize, get_format, quantize,
                             relative_error, state_keys)

sys.path.insert(0, str(Path(__file__).parents[1]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expansion", [True, False])
@pytest.mark.parametrize("numel", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_round_trip_bounds(fmt, expansion, numel, group_size):
    torch.manual_seed(numel + group_size)
    x = torch.randn(numel) * torch.exp(torch.randn(numel))  # magnitudes spread over a few decades
    codes, scale, expo = quantize(x, fmt, group_size, expansion)
    assert codes.dtype == get_format(fmt).dtype and codes.shape == x.shape
    assert scale.shape == expo.shape == ((numel + group_size - 1) // group_size,)
    xr = dequantize(codes, scale, expo, group_size)
    assert torch.isfinite(xr).all()
    rel = (xr - x).abs() / x.abs()
    # the largest value of each group maps to the format's max and comes back almost exactly
    big = x.abs() == x.abs().max() if numel <= group_size else torch.zeros_like(x, dtype=torch.bool)
    assert (rel[big] < 1e-5).all()
    if not expansion and fmt == "e5m2":
        # plain absmax E5M2: 2 mantissa bits; small values of a group drop into subnormals
        assert rel.mean() < 0.08
    else:
        assert rel.mean() < 0.04
    assert torch.equal(torch.sign(xr), torch.sign(x))
    assert (torch.frac(expo * 16) == 0).all() and (expo > 0).all() and (expo <= K_MAX).all()


def test_zero_groups_and_tail_are_exact():
    x = torch.zeros(300)
    x[256:] = torch.randn(44)  # two zero groups and a short non-zero tail
    codes, scale, expo = quantize(x)
    xr = dequantize(codes, scale, expo)
    assert torch.equal(xr[:256], torch.zeros(256))
    assert (scale[:2] == 0).all() and (expo[:2] == 1).all()
    assert ((xr[256:] - x[256:]).abs() <= 0.1 * x[256:].abs()).all()


@pytest.mark.parametrize("value", [3.0, -1e-30, 3e-40])  # 3e-40 is an fp32 denormal
def test_one_magnitude_gives_finite_k(value):
    x = torch.full((130,), value)
    x[::3] *= -1
    codes, scale, expo = quantize(x)
    assert torch.equal(expo, torch.full_like(expo, K_MAX))
    xr = dequantize(codes, scale, expo)
    assert torch.isfinite(xr).all()
    assert ((xr - x).abs() <= 1e-5 * abs(value)).all()


def test_nan_is_not_hidden():
    x = torch.randn(256)
    x[5] = float("nan")
    xr = dequantize(*quantize(x))
    assert torch.isnan(xr[:128]).any()


def test_expansion_cuts_error_on_real_adam_moments():
    from benchmarks.quant_error import adam_moments

    m, v = adam_moments(steps=60)
    for fmt in ("e4m3", "e5m2"):
        for moment in (m, v):
            assert relative_error(moment, fmt, 128, True) < 0.8 * relative_error(moment, fmt, 128, False)
    # and beats torchao AdamWFp8's block-wise absmax E4M3 (block 256)
    assert relative_error(m, "e4m3", 128, True) < relative_error(m, "e4m3", 256, False)
    assert relative_error(v, "e4m3", 128, True) < relative_error(v, "e4m3", 256, False)


@pytest.mark.parametrize("bad", ["e3m4", "fp8", ""])
def test_bad_format_names_the_key(bad):
    with pytest.raises(ValueError, match=r"v_format=.*allowed: \['e4m3', 'e5m2'\]"):
        get_format(bad, "v_format")


@pytest.mark.parametrize("bad", [0, 16, 100, 512])
def test_bad_group_size(bad):
    with pytest.raises(ValueError, match="group_size"):
        check_group_size(bad)


# ------------------------------------------------------------------ Fp8Moment
def _moment(numel: int, fmt: str = "e4m3", group_size: int = 32, seed: int = 0) -> tuple[Fp8Moment, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(numel) * torch.exp(torch.randn(numel))
    return Fp8Moment(*quantize(x, fmt, group_size), group_size, get_format(fmt)), x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_moment_zeros_decode_to_zeros(fmt):
    m = Fp8Moment.zeros((3, 50), fmt, 32)
    assert m.codes.dtype == get_format(fmt).dtype and m.codes.shape == (3, 50) and m.numel == 150
    assert m.scale.dtype == m.expo.dtype == torch.float32 and m.scale.shape == m.expo.shape == (5,)
    assert torch.equal(m.scale, torch.zeros(5)) and torch.equal(m.expo, torch.ones(5))
    assert torch.equal(m.dequantize(), torch.zeros(3, 50))
    assert Fp8Moment.zeros(150, fmt, 32, groups=7).scale.shape == (7,)  # a partition's metadata count


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_moment_dequantize_is_the_reference(fmt):
    m, x = _moment(300, fmt)
    ref = dequantize(m.codes, m.scale, m.expo, 32)
    got = m.dequantize()
    assert torch.equal(got, ref) and not got.isnan().any()
    assert ((got - x).abs() <= 0.1 * x.abs()).all()


@pytest.mark.parametrize("start,stop", [(0, 300), (0, 32), (32, 96), (5, 6), (31, 33), (17, 300), (100, 100)])
def test_moment_slice_keeps_its_groups(start, stop):
    m, _ = _moment(300)
    whole = m.dequantize()
    s = m.slice(start, stop)
    assert s.numel == stop - start and s.offset == start % 32
    g0, g1 = start // 32, ((stop - 1) // 32 + 1 if stop > start else start // 32)
    assert torch.equal(s.scale, m.scale[g0:g1]) and torch.equal(s.expo, m.expo[g0:g1])
    assert torch.equal(s.codes.view(torch.uint8), m.codes[start:stop].view(torch.uint8))
    assert torch.equal(s.dequantize(), whole[start:stop])  # every element, against the reference
    inner = s.slice(1, stop - start) if stop - start > 1 else s  # a slice of a slice: offsets add up
    assert torch.equal(inner.dequantize(), whole[start + (stop - start > 1):stop])


def test_moment_slices_are_views_copy_writes_through():
    src, _ = _moment(300, seed=1)
    dst = Fp8Moment.zeros(300, "e4m3", 32)
    for a, b in [(0, 70), (70, 200), (200, 300)]:  # pieces cut inside groups; shared groups written twice
        dst.slice(a, b).copy_(src.slice(a, b))
    assert torch.equal(dst.dequantize(), src.dequantize())
    with pytest.raises(ValueError, match="do not match"):
        dst.slice(0, 64).copy_(src.slice(1, 65))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_moment_state_round_trip_repairs_dtypes(fmt):
    m, _ = _moment(200, fmt)
    state = m.to_state("exp_avg_sq")
    assert list(state) == list(state_keys("exp_avg_sq")) == ["exp_avg_sq_q", "exp_avg_sq_scale", "exp_avg_sq_expo"]
    back = Fp8Moment.from_state(state, "exp_avg_sq", fmt, 32)
    assert back.codes is m.codes and back.scale is m.scale  # right dtypes: no copy
    widened = {k: v.to(torch.bfloat16 if k.endswith("_q") else torch.float64) for k, v in state.items()}
    as_bits = dict(state, exp_avg_sq_q=m.codes.view(torch.uint8))
    for saved in (widened, as_bits):  # a cast by torch's optimizer load; a tool storing uint8 bits
        got = Fp8Moment.from_state(saved, "exp_avg_sq", fmt, 32)
        assert got.codes.dtype == get_format(fmt).dtype and got.scale.dtype == got.expo.dtype == torch.float32
        assert torch.equal(got.codes.view(torch.uint8), m.codes.view(torch.uint8))
        assert torch.equal(got.dequantize(), m.dequantize())
