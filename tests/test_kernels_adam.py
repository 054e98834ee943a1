"""The compiled FP8 AdamW ops (CPU, and CUDA on `gpu`) against the plain-PyTorch reference.

Fresh random inputs, every element checked. Kernel and reference use different log2/exp2, so one FP8 code
may differ by one step where a value sits on a rounding midpoint, and the exponent k by 1/16 in a group
whose floor(16 log2(R) / span) sits on an integer; everything else must agree."""
from __future__ import annotations


import pytest
import torch

from coat_ds import op_builder
from coat_ds.formats import (E4M3, E5M2, GROUP_SIZES, bf16_weight, cast_to_fp8, dequantize, n_groups, quantize,
                             round_bf16, split_remainder)
from coat_ds.formats.group_quant import K_STEPS
from coat_ds.kernels.adam_reference import adamw_step_reference
from coat_ds.op_builder.builder import gencode_flags, parse_cuda_arch_list

CPU_SIZES = (1, 127, 128, 129, 4099)
GPU_SIZES = (1, 127, 128, 129, 10**6 + 3)
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def cpu_op():
    return op_builder.CPUCoatAdamBuilder().load()


@pytest.fixture(scope="module")
def cuda_op():
    return op_builder.CoatAdamBuilder().load()


# The CPU op has two paths: AVX-512 intrinsics where the build's -march=native has them, portable loops
# everywhere (COAT_CPU_ADAM_PORTABLE=1 forces them, per call). Every CPU test runs on both.
SIMD = ("avx512", "portable")
DEVICES = [pytest.param("cpu", s, id=f"cpu-{s}") for s in SIMD] + [
    pytest.param("cuda", None, id="cuda", marks=pytest.mark.gpu)]


def _op(request, device, simd=None):
    """The op of `device`; on CPU with `simd` set, switched to that path (skipped where the CPU lacks it)."""
    if device == "cuda":
        return request.getfixturevalue("cuda_op")
    op = request.getfixturevalue("cpu_op")
    if simd is not None:
        request.getfixturevalue("monkeypatch").setenv("COAT_CPU_ADAM_PORTABLE", str(int(simd == "portable")))
        if op.simd() != simd:
            cap = torch.backends.cpu.get_cpu_capability()
            assert not cap.startswith("AVX512"), f"torch finds {cap} on this CPU, but the op was built without it"
            pytest.skip(f"this CPU has no AVX-512 (torch's CPU capability: {cap}); its op runs the portable loops")
    return op


def _ordinal(codes: torch.Tensor) -> torch.Tensor:
    """FP8 codes as signed integers monotonic in value (+0 and -0 both 0)."""
    c = codes.view(torch.uint8).reshape(-1).long()
    return torch.where(c >= 128, -(c - 128), c)


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    flat = x.reshape(-1).double()
    pad = n_groups(flat.numel(), g) * g - flat.numel()
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, g)


def _codes_with(x: torch.Tensor, d: torch.Tensor, k: torch.Tensor, fmt, g: int) -> torch.Tensor:
    """The reference's encode formula (group_quant.quantize) applied with the given per-group d and k."""
    xg = _grouped(x, g).float()
    y = torch.exp2(k[:, None] * (torch.log2(xg.abs()) - torch.log2(d)[:, None]))
    y = torch.where(xg == 0, 0.0, y.copysign(xg))
    return cast_to_fp8(y, fmt).reshape(-1)[: x.numel()]


def _no_nan_codes(codes: torch.Tensor, fmt) -> bool:
    mag = codes.view(torch.uint8).long() & 0x7F
    return bool((mag < (0x7C if fmt is E5M2 else 0x7F)).all())


def assert_quantized_like_reference(x, codes, scale, expo, fmt, g, expansion, noisy=None):
    """(codes, scale, expo) from a kernel quantise x the way formats.quantize does; x is the reference's input.

    k may be one step (1/16) off in a few groups: where floor(16 log2(R) / span) sits near an integer, or, in
    the fused step, where the group's smallest moment is a near-cancellation whose low bits differ. `noisy`
    marks values that are such cancellations (their codes are not compared; finiteness still is)."""
    x, codes, scale, expo = (t.detach().cpu() for t in (x, codes, scale, expo))
    keep = torch.ones(x.numel(), dtype=torch.bool) if noisy is None else ~noisy.detach().cpu().reshape(-1)
    assert torch.isfinite(scale).all() and torch.isfinite(expo).all() and _no_nan_codes(codes, fmt)
    ref = quantize(x, fmt, g, expansion)
    k_off = (expo - ref.expo).abs()
    assert (k_off <= (1.0 / K_STEPS + 1e-6 if expansion else 0.0)).all(), "exponent k differs"
    assert (k_off > 0).sum() <= 2 + ref.expo.numel() // 100, f"{(k_off > 0).sum().item()} groups with another k"
    # d follows from the group's max (well conditioned) and the kernel's own k
    big = _grouped(x, g).abs().amax(1).float()
    want_d = torch.where(big > 0, torch.exp2(torch.log2(big) - fmt.log2_max / expo), 0.0)
    torch.testing.assert_close(scale, want_d, rtol=2e-5, atol=0)
    zero = ref.scale == 0  # all-zero groups: d = 0, k = 1, codes exactly zero
    assert (scale[zero] == 0).all() and (expo[zero] == 1).all()
    assert (_ordinal(codes).view(-1)[_grouped(x, g).eq(0).all(1).repeat_interleave(g)[: x.numel()]] == 0).all()
    # every code within one FP8 step of the reference formula under the kernel's own (d, k)
    diff = (_ordinal(codes) - _ordinal(_codes_with(x, scale, expo, fmt, g))).abs()[keep]
    assert diff.max().item() <= 1, f"{(diff > 1).sum().item()} codes off by more than one step"
    # and of the reference's own codes wherever k agrees
    in_same = (k_off == 0).repeat_interleave(g)[: x.numel()] & keep
    assert (_ordinal(codes) - _ordinal(ref.codes))[in_same].abs().max().item() <= 1 if in_same.any() else True


def _random_moments(numel, g, v_fmt, expansion, gen, device, zero_group=False):
    """Quantised (m, v) of plausible Adam states, spread over several decades, as the reference stores them."""
    m = torch.randn(numel, generator=gen) * 1e-3 * torch.exp(torch.randn(numel, generator=gen))
    v = (torch.randn(numel, generator=gen) * 1e-3) ** 2 * torch.exp(torch.randn(numel, generator=gen)) + 1e-12
    if zero_group:
        m[:g] = 0
        v[:g] = 0
    mq, vq = quantize(m, E4M3, g, expansion), quantize(v, v_fmt, g, expansion)
    return [t.to(device) for t in mq], [t.to(device) for t in vq]


def _make_case(sizes, g, v_fmt, expansion, grad_dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    params, grads, ms, vs = [], [], [], []
    for i, n in enumerate(sizes):
        params.append(torch.randn(n, generator=gen).to(device))
        grad = torch.randn(n, generator=gen) * 1e-3 * torch.exp(torch.randn(n, generator=gen))
        zero_group = n >= 2 * g and i % 2 == 0
        if zero_group:
            grad[:g] = 0
        grads.append(grad.to(grad_dtype).to(device))
        m, v = _random_moments(n, g, v_fmt, expansion, gen, device, zero_group)
        ms.append(m)
        vs.append(v)
    return params, grads, ms, vs


def _u8(t):
    return t.view(torch.uint8)


def _misaligned_copy(p: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of p that starts 4 bytes into its buffer (no 16-byte alignment)."""
    buf = torch.empty(p.numel() + 1, dtype=p.dtype, device=p.device)
    return buf[1:].copy_(p)


SR_SEED = 1234


def kernel_step(op, params, grads, ms, vs, out, g, v_fmt, expansion, step, grad_scale=None, sr_keys=None,
                remainders=(), **hp):
    """The compiled op's adam_step as ops.adamw_step calls it (grad_scale: None, a float or a tensor)."""
    hp = {**HP, **hp}
    scale_t = grad_scale if isinstance(grad_scale, torch.Tensor) else None
    scale = 1.0 if grad_scale is None or scale_t is not None else grad_scale
    keys = [] if sr_keys is None else [x for key in sr_keys for x in key]
    op.adam_step(params, list(grads), [_u8(m[0]) for m in ms], [m[1] for m in ms], [m[2] for m in ms],
                 [_u8(v[0]) for v in vs], [v[1] for v in vs], [v[2] for v in vs], out, list(remainders), hp["lr"],
                 hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], step, g, v_fmt is E5M2, expansion, scale_t,
                 scale, keys, SR_SEED)


def _check_master(got, want32, tol, step, sr_key):
    """An fp32 master within tol of the reference's; a bf16 one between the roundings of want32 -+ tol with the
    reference's own rounding (the same random bits: rounding is monotone in the value)."""
    if got.dtype == torch.float32:
        err = (got - want32).abs()
        assert (err <= tol).all(), f"param off by {(err / tol).max().item():.2f}x the tolerance"
        return
    sr = None if sr_key is None else (SR_SEED, step, *sr_key)
    lo, hi = (round_bf16(want32 + d, sr).float() for d in (-tol, tol))
    ok = (lo <= got.float()) & (got.float() <= hi)
    assert ok.all(), f"{(~ok).sum().item()} bf16 params outside their rounding interval"


def _run_and_check(op, params, grads, ms, vs, g, v_fmt, expansion, step, bf16_copy, misaligned=False,
                   grad_scale=None, sr_keys=None):
    """One kernel step on copies, one reference step per tensor; every output compared."""
    kp = [_misaligned_copy(p) if misaligned else p.clone() for p in params]
    km = [tuple(t.clone() for t in m) for m in ms]
    kv = [tuple(t.clone() for t in v) for v in vs]
    out = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in params] if bf16_copy else []
    kernel_step(op, kp, grads, km, kv, out, g, v_fmt, expansion, step, grad_scale, sr_keys)
    for i, (p, grad, m, v) in enumerate(zip(params, grads, ms, vs)):
        rp = p.to(torch.float32, copy=True)  # the reference's fp32 update, before any rounding to a bf16 master
        adamw_step_reference(rp, grad, m, v, step=step, m_format=E4M3, v_format=v_fmt, group_size=g,
                             expansion=expansion, grad_scale=grad_scale, **HP)
        # the reference's pre-quantisation moments (reference.py, first lines)
        gf = grad.float() if grad_scale is None else grad.float() * grad_scale
        m_old = dequantize(*m, g)
        m_new = HP["beta1"] * m_old + (1 - HP["beta1"]) * gf
        v_new = HP["beta2"] * dequantize(*v, g) + (1 - HP["beta2"]) * gf * gf
        assert torch.isfinite(kp[i]).all()
        # params: a few ulp, plus 1e-4 of the update's operand scale (exp2/log2 round differently, and
        # m_new = beta1 m + (1 - beta1) g can cancel, so its own size is no measure)
        bc1, bc2 = 1 - HP["beta1"] ** step, 1 - HP["beta2"] ** step
        scale = HP["lr"] / bc1 * (HP["beta1"] * m_old.abs() + (1 - HP["beta1"]) * gf.abs()) / (
            v_new.sqrt() / bc2 ** 0.5 + HP["eps"])
        _check_master(kp[i], rp, 2e-6 * rp.abs() + 1e-4 * scale + 1e-30, step,
                      None if sr_keys is None else sr_keys[i])
        # m_new values that cancel 1000x carry the inputs' rounding noise in their leading bits
        noisy = m_new.abs() < 1e-3 * (HP["beta1"] * m_old.abs() + (1 - HP["beta1"]) * gf.abs())
        assert_quantized_like_reference(m_new, *km[i], E4M3, g, expansion, noisy)
        assert_quantized_like_reference(v_new, *kv[i], v_fmt, g, expansion)
        if bf16_copy:  # of an fp32 master: the split's high half; of a bf16 one: itself
            assert torch.equal(out[i].view(torch.int16), bf16_weight(kp[i]).view(torch.int16))
    return kp, km, kv


def _adam_case(request, device, sizes, g, v_fmt, expansion, grad_dtype, simd=None):
    op = _op(request, device, simd)
    params, grads, ms, vs = _make_case(sizes, g, v_fmt, expansion, grad_dtype, device, seed=g + 7 * expansion)
    # two steps: the second reuses the CUDA op's cached tensor table and continues from the kernel's state
    kp, km, kv = _run_and_check(op, params, grads, ms, vs, g, v_fmt, expansion, step=3, bf16_copy=True)
    _run_and_check(op, kp, grads, km, kv, g, v_fmt, expansion, step=4, bf16_copy=False)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("expansion", [True, False], ids=["exp", "noexp"])
@pytest.mark.parametrize("v_fmt", [E4M3, E5M2], ids=["v_e4m3", "v_e5m2"])
@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("simd", SIMD)
def test_cpu_adam_step_matches_reference(request, simd, g, v_fmt, expansion, grad_dtype):
    _adam_case(request, "cpu", CPU_SIZES, g, v_fmt, expansion, grad_dtype, simd)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("expansion", [True, False], ids=["exp", "noexp"])
@pytest.mark.parametrize("v_fmt", [E4M3, E5M2], ids=["v_e4m3", "v_e5m2"])
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_cuda_adam_step_matches_reference(request, g, v_fmt, expansion, grad_dtype):
    _adam_case(request, "cuda", GPU_SIZES, g, v_fmt, expansion, grad_dtype)


# ---- issue 16: fp16 grads, grad_scale, bf16 master (round to nearest / stochastic)

MASTERS = ("fp32", "bf16_rn", "bf16_sr")
# (stream, offset) of each tensor of a case: offsets near and past 2^32 check the index's high word
SR_KEYS = ((1, 0), (2**31 - 1, 5), (77, 2**32 - 100), (5, 2**40 + 3), (0, 123456789))


def _master_case(device, sizes, g, grad_dtype, master, seed):
    """_make_case with loss-scaled grads (x37.5, undone by grad_scale) and the master in its dtype."""
    params, grads, ms, vs = _make_case(sizes, g, E5M2, True, torch.float32, device, seed)
    grads = [(x * 37.5).to(grad_dtype) for x in grads]
    if master != "fp32":
        params = [p.to(torch.bfloat16) for p in params]
    keys = list(SR_KEYS[: len(sizes)]) if master == "bf16_sr" else None
    return params, grads, ms, vs, keys


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "gf16"])
@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_grad_scale_and_master_dtypes_match_reference(request, device, simd, grad_dtype, master):
    """Every (grad dtype, master) pair against the reference, every element; two steps (the second continues
    from the kernel's own state), with grad_scale as a device tensor, then as a float."""
    op = _op(request, device, simd)
    g = 64
    sizes = CPU_SIZES if device == "cpu" else GPU_SIZES
    params, grads, ms, vs, keys = _master_case(device, sizes, g, grad_dtype, master, seed=11)
    scale = torch.tensor([1 / 37.5], device=device)
    kp, km, kv = _run_and_check(op, params, grads, ms, vs, g, E5M2, True, step=3, bf16_copy=True, grad_scale=scale,
                                sr_keys=keys)
    _run_and_check(op, kp, grads, km, kv, g, E5M2, True, step=4, bf16_copy=False, grad_scale=1 / 37.5, sr_keys=keys)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def _kernel_run(op, params, grads, ms, vs, g, step, **kw):
    """A kernel step on copies; returns every output field (params, bf16 copies, then each of m's and v's codes,
    scales and exponents), each a list over the tensors."""
    kp = [p.clone() for p in params]
    km = [tuple(t.clone() for t in m) for m in ms]
    kv = [tuple(t.clone() for t in v) for v in vs]
    out = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    kernel_step(op, kp, grads, km, kv, out, g, E5M2, True, step, **kw)
    return [kp, out, *(list(f) for f in zip(*km)), *(list(f) for f in zip(*kv))]


@pytest.mark.parametrize("master", ["fp32", "bf16_sr"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["gbf16", "gf16"])
@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_grad_scale_is_bit_exact(request, device, simd, grad_dtype, master):
    """grad_scale = widening the grad to fp32, one separate fp32 multiply, stepping unscaled (DeepSpeed's
    unscale_and_clip_grads): every output bit-identical, specials included, tensor or float scale."""
    op = _op(request, device, simd)
    g = 128
    params, grads, ms, vs, keys = _master_case(device, (4099, 1000), g, grad_dtype, master, seed=12)
    grads[0][:4] = torch.tensor([float("inf"), float("nan"), -0.0, 6e4]).to(grad_dtype)  # an overflowed group
    for scale in (1 / 37.5, torch.tensor([0.3], device=device)):
        want = _kernel_run(op, params, [x.float() * scale for x in grads], ms, vs, g, 5, sr_keys=keys)
        got = _kernel_run(op, params, grads, ms, vs, g, 5, grad_scale=scale, sr_keys=keys)
        assert all(_same_bits(a, b) for fa, fb in zip(got, want) for a, b in zip(fa, fb))


@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_stochastic_rounding_bits_are_the_reference_bits(request, device, simd):
    """Zero grads and moments leave the update p * (1 - lr wd), exact in kernel and reference alike, so the
    bf16 master must equal the reference's stochastic rounding bit for bit (wrap of the index's low word
    included)."""
    op = _op(request, device, simd)
    g = 128
    sizes = (4099, 1000, 1, 129, 300)
    gen = torch.Generator().manual_seed(13)
    params = [torch.randn(n, generator=gen).to(torch.bfloat16).to(device) for n in sizes]
    zero = [(torch.zeros(n, dtype=torch.float8_e4m3fn, device=device), torch.zeros(n_groups(n, g), device=device),
             torch.ones(n_groups(n, g), device=device)) for n in sizes]
    hp = dict(HP, weight_decay=0.5)
    kp = [p.clone() for p in params]
    km = [tuple(t.clone() for t in m) for m in zero]
    kv = [(m[0].view(torch.float8_e5m2).clone(), m[1].clone(), m[2].clone()) for m in zero]
    kernel_step(op, kp, [torch.zeros_like(p) for p in params], km, kv, [], g, E5M2, True, 7, sr_keys=SR_KEYS, **hp)
    for p, got, key, m in zip(params, kp, SR_KEYS, zero):
        want = p.clone()
        adamw_step_reference(want, torch.zeros_like(p), m, (m[0].view(torch.float8_e5m2), m[1], m[2]), step=7,
                             m_format=E4M3, v_format=E5M2, group_size=g, expansion=True, sr_key=key, sr_seed=SR_SEED,
                             **hp)
        assert _same_bits(got, want)
        assert p.numel() < 100 or not _same_bits(got, p.float().mul(1 - 0.5 * HP["lr"]).bfloat16())  # not nearest


@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_stochastic_rounding_ignores_partitioning(request, device, simd):
    """One tensor stepped whole, or as pieces (ZeRO partitions cut at group boundaries) each with its offset in
    the parameter: bit-identical results."""
    op = _op(request, device, simd)
    g = 128
    n = 4099 if device == "cpu" else 10**6 + 3
    params, grads, ms, vs, _ = _master_case(device, (n,), g, torch.bfloat16, "bf16_sr", seed=14)
    whole = _kernel_run(op, params, grads, ms, vs, g, 2, sr_keys=[(99, 1000)])
    cuts = [0, 8 * g, 9 * g, n // g * g, n]
    pieces = [(a, b) for a, b in zip(cuts[:-1], cuts[1:])]

    def part(t, a, b):
        return t[a:b] if t.numel() == n else t[a // g: (b + g - 1) // g]

    parts = _kernel_run(op, [params[0][a:b] for a, b in pieces], [grads[0][a:b] for a, b in pieces],
                        [tuple(part(t, a, b) for t in ms[0]) for a, b in pieces],
                        [tuple(part(t, a, b) for t in vs[0]) for a, b in pieces], g, 2,
                        sr_keys=[(99, 1000 + a) for a, _ in pieces])
    for i, (w, p) in enumerate(zip(whole, parts)):
        assert _same_bits(torch.cat(p), w[0]), i


# ---- issue 31: an exact fp32 master as bf16 high halves + int16 remainders

def _edge_masters(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 masters with the split's edge cases in front: low halves at and around the tie 0x8000 (even and odd
    high halves), high halves whose rounding carries across a power of two (0x3F7FFFFF -> 1.0), subnormals,
    +-0, the largest finite value (its high half rounds to inf), then plain random values."""
    pats = [0x3F7FFFFF, 0x3F7F8000, 0x3F7F7FFF, 0xBF7FFFFF, 0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,
            0x3F807FFF, 0x3F808001, 0x00000001, 0x00008000, 0x0000FFFF, 0x007FFFFF, 0x80008000, 0x807FFFFF,
            0x00000000, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00018000, 0x3C23D70A]
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    special = torch.tensor(pats, dtype=torch.int64)
    special = torch.where(special >= 2**31, special - 2**32, special).to(torch.int32).view(torch.float32)
    x[:len(pats)] = special[:n]
    return x


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_remainder_master_is_the_fp32_master_bit_for_bit(request, device, simd, grad_dtype):
    """The same kernel with an fp32 master and with (bf16 high half, int16 remainder): the joined master, the
    moments' codes, scales and exponents are bit-identical every element, two steps; the high half is the
    reference's split of the fp32 master (so also the bf16 copy), and the fp32 master stays within the
    reference step's tolerance (_run_and_check). Zero grads on the edge values keep them near their edges."""
    from coat_ds.formats import join_remainder, split_remainder

    op = _op(request, device, simd)
    g = 64
    sizes = CPU_SIZES if device == "cpu" else GPU_SIZES
    params, grads, ms, vs = _make_case(sizes, g, E5M2, True, grad_dtype, device, seed=31)
    gen = torch.Generator().manual_seed(32)
    params = [_edge_masters(p.numel(), gen).to(device) for p in params]
    grads[-1][:32] = 0
    kp, km, kv = _run_and_check(op, params, grads, ms, vs, g, E5M2, True, step=3, bf16_copy=False)
    split = [split_remainder(p) for p in params]
    hi, lo = [h.clone() for h, _ in split], [r.clone() for _, r in split]
    rm, rv = [tuple(t.clone() for t in m) for m in ms], [tuple(t.clone() for t in v) for v in vs]
    out = [torch.empty_like(h) for h in hi]
    kernel_step(op, hi, grads, rm, rv, out, g, E5M2, True, 3, remainders=lo)
    for step in (3, 4):
        if step == 4:  # continue both from their own state
            kp, km, kv = _run_and_check(op, kp, grads, km, kv, g, E5M2, True, step=4, bf16_copy=False)
            kernel_step(op, hi, grads, rm, rv, [], g, E5M2, True, 4, remainders=lo)
        for i, p in enumerate(kp):
            assert _same_bits(join_remainder(hi[i], lo[i]), p), (step, i)
            want_hi, want_lo = split_remainder(p)
            assert _same_bits(hi[i], want_hi) and _same_bits(lo[i], want_lo), (step, i)
            if step == 3:
                assert _same_bits(out[i], hi[i])
            for a, b in zip((*rm[i], *rv[i]), (*km[i], *kv[i])):
                assert _same_bits(a, b), (step, i)


@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_remainder_keeps_inf_and_nan(request, device, simd):
    """A master that is already +-inf stays exactly +-inf; a NaN stays a NaN (high half 0x7FC0); the values
    beside them in the group are those of the fp32 master."""
    from coat_ds.formats import join_remainder, split_remainder

    op = _op(request, device, simd)
    g = 32
    params, grads, ms, vs = _make_case((4099,), g, E4M3, True, torch.float32, device, seed=33)
    params[0][:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    fp32 = [params[0].clone()]
    kernel_step(op, fp32, grads, [tuple(t.clone() for t in ms[0])], [tuple(t.clone() for t in vs[0])], [], g, E4M3,
                True, 2)
    hi, lo = (t.clone() for t in split_remainder(params[0]))
    kernel_step(op, [hi], grads, [tuple(t.clone() for t in ms[0])], [tuple(t.clone() for t in vs[0])], [], g, E4M3,
                True, 2, remainders=[lo])
    got = join_remainder(hi, lo)
    assert _same_bits(got[:2], fp32[0][:2]) and got[2].isnan() and hi[2].view(torch.int16).item() == 0x7FC0
    assert _same_bits(got[3:], fp32[0][3:])


def _with_ties(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x with the low half of every 4th value set to 0x8000 (an exact tie; high halves even and odd alike)."""
    u = x.view(torch.int32).clone()
    at = torch.randperm(x.numel(), generator=gen)[: x.numel() // 4]
    u[at] = (u[at] & ~0xFFFF) | 0x8000
    return u.view(torch.float32)


@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_bf16_copy_of_an_fp32_master_is_the_splits_high_half(request, device, simd):
    """The bf16 copy of an fp32 master is formats.remainder's high half (nearest, ties away from zero: what an
    fp32_remainder master's weight is), every element, not the nearest-even cast. lr = 0 keeps the masters as
    they went in: random ones with exact ties (even and odd high halves), the split's edge values (subnormals,
    +-0, carries across a power of two), +-inf and NaN; then an ordinary step."""
    op = _op(request, device, simd)
    g = 64
    sizes = CPU_SIZES if device == "cpu" else GPU_SIZES
    params, grads, ms, vs = _make_case(sizes, g, E5M2, True, torch.bfloat16, device, seed=36)
    gen = torch.Generator().manual_seed(37)
    params = [_with_ties(_edge_masters(p.numel(), gen), gen) for p in params]
    params[-1][-3:] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    params = [p.to(device) for p in params]
    for hp in (dict(lr=0.0), {}):
        kp = [p.clone() for p in params]
        out = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in params]
        kernel_step(op, kp, grads, [tuple(t.clone() for t in m) for m in ms], [tuple(t.clone() for t in v) for v in vs],
                    out, g, E5M2, True, 3, **hp)
        for i, (p, o) in enumerate(zip(kp, out)):
            assert _same_bits(o, split_remainder(p)[0]), (hp, i)
        if hp:  # the masters came out as they went in, so the even ties were there to tell the roundings apart
            u = torch.cat(kp).view(torch.int32).cpu()
            assert (((u & 0xFFFF) == 0x8000) & ((u >> 16) & 1 == 0)).sum() > 100
            assert not _same_bits(torch.cat(out), torch.cat(kp).to(torch.bfloat16))


@pytest.mark.gpu
def test_adamw_step_with_a_device_grad_scale_does_not_sync():
    """The glue hands a device tensor (DeepSpeed's 1 / combined scale): reading it must not stall the host."""
    from coat_ds import kernels as ops

    params, grads, ms, vs, keys = _master_case("cuda", (4099, 1000), 128, torch.bfloat16, "bf16_sr", seed=15)
    scale = torch.tensor([0.5], device="cuda")

    def step(t):
        ops.adamw_step(params, grads, ms, vs, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=t,
                       v_format=E5M2, group_size=128, expansion=True, grad_scale=scale, sr_keys=keys, sr_seed=3)

    step(1)  # builds / loads the op
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("master", ["fp32", "bf16_sr", "fp32_remainder"])
@pytest.mark.parametrize("device,simd", DEVICES + [pytest.param("cpu", "reference", id="reference")])
def test_adam_step_with_a_non_finite_grad_scale_changes_nothing(request, monkeypatch, device, simd, master):
    """A non-finite grad_scale (NaN, +-inf; tensor or float) skips the step, the convention that lets release skip
    a bucket without a host read: params, remainders, bf16 copies, moments' codes, scales and exponents all keep
    their bits (fresh random inputs, bf16 copies holding random bits). A finite scale then steps as the
    reference does. `reference`: kernels.adamw_step without a compiled op (adam_reference)."""
    from coat_ds import kernels as ops

    if simd == "reference":
        monkeypatch.setattr("coat_ds.kernels.adam._op", lambda device: None)
    else:
        op = _op(request, device, simd)
    g = 64
    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    params, grads, ms, vs, keys = _master_case(device, sizes, g, torch.bfloat16,
                                               "bf16_sr" if master == "bf16_sr" else "fp32", seed=41)
    rems = []
    if master == "fp32_remainder":
        params, rems = (list(t) for t in zip(*(split_remainder(p) for p in params)))
    gen = torch.Generator().manual_seed(42)
    out = [torch.randint(-2**15, 2**15, p.shape, dtype=torch.int16, generator=gen).view(torch.bfloat16).to(device)
           for p in params]

    def fields():
        return [*params, *rems, *out, *(t for x in ms for t in x), *(t for x in vs for t in x)]

    def step(scale):
        ops.adamw_step(params, grads, ms, vs, **HP, step=5, v_format=E5M2, group_size=g, expansion=True,
                       bf16_out=out, grad_scale=scale, sr_keys=keys, sr_seed=SR_SEED, remainders=rems)

    before = [t.clone() for t in fields()]
    for scale in (torch.tensor([NAN], device=device), torch.tensor([INF], device=device),
                  torch.tensor([-INF], device=device), NAN, INF):
        step(scale)
        assert all(_same_bits(a, b) for a, b in zip(fields(), before)), scale
    if simd != "reference" and master != "fp32_remainder":  # (remainders: the fp32 master's test above)
        _run_and_check(op, params, grads, ms, vs, g, E5M2, True, step=5, bf16_copy=True,
                       grad_scale=torch.tensor([1 / 37.5], device=device), sr_keys=keys)
    step(torch.tensor([1 / 37.5], device=device))  # and the comparison above would have seen a step
    changed = [not _same_bits(a, b) for a, b in zip(fields(), before)]
    assert any(changed[:len(params)]) and any(changed[len(params):])


def test_adamw_step_rejects_bad_inputs():
    from coat_ds import kernels as ops

    p, m = torch.zeros(4), (torch.zeros(4, dtype=torch.float8_e4m3fn), torch.zeros(1), torch.ones(1))
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, v_format=E4M3, group_size=32,
              expansion=True)
    with pytest.raises(ValueError, match=r"grads\[0\] is torch.float64; allowed"):
        ops.adamw_step([p], [torch.zeros(4, dtype=torch.float64)], [m], [m], **kw)
    with pytest.raises(ValueError, match=r"params\[0\] is torch.float16; allowed"):
        ops.adamw_step([p.half()], [p], [m], [m], **kw)
    with pytest.raises(ValueError, match="grad_scale must be a 1-element float32 tensor"):
        ops.adamw_step([p], [p], [m], [m], grad_scale=torch.ones(2), **kw)
    with pytest.raises(ValueError, match="sr_keys"):
        ops.adamw_step([p], [p], [m], [m], sr_keys=[(1, 0), (2, 0)], **kw)
    with pytest.raises(ValueError, match=r"remainders\[0\] must be int16 of params\[0\]'s shape with a bf16 param"):
        ops.adamw_step([p], [p], [m], [m], remainders=[torch.zeros(4, dtype=torch.int16)], **kw)
    with pytest.raises(ValueError, match="no sr_keys"):
        ops.adamw_step([p.bfloat16()], [p], [m], [m], remainders=[torch.zeros(4, dtype=torch.int16)],
                       sr_keys=[(1, 0)], **kw)


@pytest.mark.parametrize("device,simd", DEVICES)
def test_adam_step_misaligned_views(request, device, simd):
    """Params 4 bytes off 16-byte alignment (the CUDA kernel's scalar path); results must not change."""
    g = 128
    params, grads, ms, vs = _make_case((1000, 777), g, E4M3, True, torch.float32, device, seed=3)
    _run_and_check(_op(request, device, simd), params, grads, ms, vs, g, E4M3, True, step=2, bf16_copy=True,
                   misaligned=True)


def _quantize_inputs(numel, gen):
    x = torch.randn(numel, generator=gen) * torch.exp(3 * torch.randn(numel, generator=gen))
    if numel >= 1024:
        x[:256] = 0  # all-zero groups
        x[256:512] = 0.5  # one magnitude: k stays finite (K_MAX)
        x[512:768] = torch.randn(256, generator=gen) * 1e-39  # fp32 subnormals
    return x


@pytest.mark.parametrize("device,simd", DEVICES)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_quantize_dequantize_match_reference(request, device, simd, fmt, g):
    op = _op(request, device, simd)
    gen = torch.Generator().manual_seed(g)
    for numel in (1, 127, 128, 129, 5000) + ((10**6 + 3,) if device == "cuda" else ()):
        x = _quantize_inputs(numel, gen).to(device)
        for expansion in (True, False):
            ng = n_groups(numel, g)
            codes = torch.full((numel,), 0x7F, dtype=torch.uint8, device=device)  # poison
            scale = torch.full((ng,), float("nan"), device=device)
            expo = torch.full((ng,), float("nan"), device=device)
            op.quantize(x, codes, scale, expo, g, fmt is E5M2, expansion)
            assert_quantized_like_reference(x, codes.view(fmt.dtype), scale, expo, fmt, g, expansion)
            # dequantize the reference's own state: decoded values within a few ulp, zeros exact
            ref = quantize(x.cpu(), fmt, g, expansion)
            out = torch.full((numel,), float("nan"), device=device)
            op.dequantize(_u8(ref.codes).to(device), ref.scale.to(device), ref.expo.to(device), out, g, fmt is E5M2)
            want = dequantize(*ref, g)
            out = out.cpu()
            assert torch.isfinite(out).all()
            assert torch.equal(out == 0, want == 0)
            torch.testing.assert_close(out, want, rtol=4e-5, atol=2.0**-140)  # atol: fp32 subnormal ulps


def test_bad_group_size_is_a_value_error(cpu_op):
    x = torch.randn(64)
    with pytest.raises(ValueError, match="group_size"):
        cpu_op.quantize(x, torch.empty(64, dtype=torch.uint8), torch.empty(1), torch.empty(1), 48, False, True)


def test_arch_list_accepts_arch_specific_and_ptx(monkeypatch):
    assert parse_cuda_arch_list("9.0a;8.0 9.0+PTX") == [(8, 0, "", False), (9, 0, "", True), (9, 0, "a", False)]
    assert gencode_flags([(9, 0, "a", True)]) == ["-gencode=arch=compute_90a,code=sm_90a",
                                                  "-gencode=arch=compute_90a,code=compute_90a"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    flags = op_builder.CoatAdamBuilder().compute_capability_args()
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        parse_cuda_arch_list("sm90x")


def test_builders_use_absolute_sources():
    import os

    for builder in (op_builder.CoatAdamBuilder(), op_builder.CPUCoatAdamBuilder()):
        for path in builder.sources() + builder.include_paths():
            assert os.path.isabs(path) and os.path.exists(path), path
