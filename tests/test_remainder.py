"""The split of an fp32 master into a bf16 high half and an int16 remainder (formats.remainder), the reference the
kernels are held to (tests/test_kernels_adam.py), and the reference step with a remainder master."""
from __future__ import annotations

import pytest
import torch

from coat_ds.formats import E4M3, E5M2, join_remainder, quantize, split_remainder
from coat_ds.formats.remainder import check_finite
from coat_ds.kernels.adam_reference import adamw_step_reference


def _f32(bits: list[int]) -> torch.Tensor:
    b = torch.tensor(bits, dtype=torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _bits(x: torch.Tensor) -> list[int]:
    return [v & (0xFFFFFFFF if x.element_size() == 4 else 0xFFFF) for v in
            x.view({2: torch.int16, 4: torch.int32}[x.element_size()]).tolist()]


def test_join_undoes_split_for_every_high_half_and_the_low_halves_around_the_tie():
    """Every 16-bit high half (NaN patterns aside) with low halves 0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF and
    random ones: join(split(x)) has x's bits; subnormals, +-0, +-inf and power-of-two carries included."""
    high = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    rand = torch.randint(0, 1 << 16, (1 << 16,), generator=torch.Generator().manual_seed(0))
    u = torch.cat([((high[:, None] << 16) | lows).reshape(-1), (high << 16) | rand])
    x = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)
    x = x[~x.isnan()]
    hi, lo = split_remainder(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join_remainder(hi, lo).view(torch.int32), x.view(torch.int32))


def test_bf16_weight_is_the_high_half_piece_by_piece(monkeypatch):
    """bf16_weight (an fp32 master's bf16 model weight) is split's high half, whole or written into `out` across
    piece boundaries; a bf16 input comes back as it is."""
    from coat_ds.formats import bf16_weight
    from coat_ds.formats import remainder

    u = torch.randint(-2**31, 2**31 - 1, (1000,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    x = ((u & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32).reshape(10, 100)  # ties, every other one even
    want = split_remainder(x)[0]
    monkeypatch.setattr(remainder, "CHUNK", 64)
    out = torch.full((10, 100), float("nan"), dtype=torch.bfloat16)
    assert bf16_weight(x, out=out) is out and torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(bf16_weight(x).view(torch.int16), want.view(torch.int16))
    assert torch.equal(bf16_weight(want).view(torch.int16), want.view(torch.int16))


def test_high_half_is_nearest_rounding_ties_away_from_zero():
    """hi is torch's round-to-nearest-even except on exact ties with an even high half, where it is one bf16 ulp
    larger in magnitude (what no 16-bit remainder could undo otherwise)."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)) * 1e-2
    hi, _ = split_remainder(x)
    u = x.view(torch.int32).long() & 0xFFFFFFFF
    even_tie = ((u & 0xFFFF) == 0x8000) & (((u >> 16) & 1) == 0)
    rne = x.to(torch.bfloat16)
    assert torch.equal(hi[~even_tie].view(torch.int16), rne[~even_tie].view(torch.int16))
    ties = _f32([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000])  # even, odd, even, odd, subnormal
    hi, lo = split_remainder(ties)
    assert _bits(hi) == [0x3F81, 0x3F82, 0xBF81, 0xBF82, 0x0001]
    assert _bits(ties.to(torch.bfloat16)) == [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x0000]
    assert _bits(join_remainder(hi, lo)) == _bits(ties)


def test_edges_carry_into_the_exponent_and_keep_signs():
    x = _f32([0x3F7FFFFF, 0x3F7F8000, 0x007FFFFF, 0x80008000, 0x80007FFF, 0x00000000, 0x80000000, 0x7F7FFFFF,
              0x7F800000, 0xFF800000])
    hi, lo = split_remainder(x)
    # below 1.0 -> 1.0; largest subnormal -> smallest normal; -0 kept; largest finite -> inf (as torch's cast)
    assert _bits(hi) == [0x3F80, 0x3F80, 0x0080, 0x8001, 0x8000, 0x0000, 0x8000, 0x7F80, 0x7F80, 0xFF80]
    assert _bits(lo) == [0xFFFF, 0x8000, 0xFFFF, 0x8000, 0x7FFF, 0, 0, 0xFFFF, 0, 0]
    assert _bits(join_remainder(hi, lo)) == _bits(x)


def test_nan_splits_into_the_canonical_nan_and_non_finite_masters_are_refused():
    x = _f32([0x7FC00000, 0x7FFF8000, 0xFFFFFFFF, 0x7F800001])
    hi, lo = split_remainder(x)
    assert _bits(hi) == [0x7FC0] * 4 and join_remainder(hi, lo).isnan().all()
    check_finite(torch.tensor([1.0, -0.0, 1e-45]), "here")
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="here: 1 non-finite master value"):
            check_finite(torch.tensor([1.0, bad]), "here")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_reference_step_with_a_remainder_is_the_fp32_step(grad_dtype):
    """The reference step of (hi, remainder) joins, steps and splits: bit-identical to stepping the fp32 master."""
    gen = torch.Generator().manual_seed(2)
    n, g = 1000, 64
    master = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
    m = quantize(torch.randn(n, generator=gen) * 1e-3, E4M3, g, True)
    v = quantize(torch.rand(n, generator=gen) * 1e-6, E5M2, g, True)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3, m_format=E4M3, v_format=E5M2,
              group_size=g, expansion=True, grad_scale=0.5)
    hi, lo = split_remainder(master)
    fp32 = master.clone()
    want = adamw_step_reference(fp32, grad, m, v, **kw)
    got = adamw_step_reference(hi, grad, m, v, remainder=lo, **kw)
    assert torch.equal(join_remainder(hi, lo).view(torch.int32), fp32.view(torch.int32))
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b) for x, y in zip(got, want) for a, b in zip(x, y))
