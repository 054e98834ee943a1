"""The reference group quantizer: round trips, edge cases, and that range expansion pays off."""
import sys
from pathlib import Path

import pytest
import torch

from coat_ds.formats import (GROUP_SIZES, K_MAX, check_group_size, dequantize, get_format, quantize,
                             relative_error)

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


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
    from quant_error import adam_moments

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
