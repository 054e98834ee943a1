"""CUDA kernels of the FP8 activation flow vs the plain-PyTorch reference, and the FP8 layer on the GPU.

Bounds: FP8 codes from the same bf16 input and power-of-two scale are bit-identical (exact compare).
Where a kernel computes fp32 values in another order than the reference (rsqrt, exp, sums), a value may
land on the neighbouring FP8 code: each element within one FP8 step (2^-3 relative for E4M3 output,
2^-2 for E5M2) and >= 99% of them identical. bf16 outputs: 2 bf16 ulps (2^-7 relative) + 1e-6 absolute."""
import copy

import pytest
import torch

from coat_ds.hf import CoatDecoderLayer
from coat_ds.kernels import quant
from coat_ds.kernels import quant_reference as R
from coat_ds.formats import E4M3, E5M2

pytestmark = pytest.mark.gpu
FMTS = [E4M3, E5M2]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from coat_ds.kernels.loader import load_op

    op = load_op("CoatQuantBuilder")
    assert op is not None, "CoatQuantBuilder did not build"
    return op


def _rand(m, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, generator=g, device="cuda")
    return (x * torch.exp2(torch.randint(-4, 4, (m, n), generator=g, device="cuda").float())).bfloat16()


def _codes_equal(a, b):
    assert a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _one_step(a, b, fmt, frac=0.99):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    rel = 2.0 ** -(3 if fmt is E4M3 else 2)
    assert ((a - b).abs() <= rel * b.abs() + 1e-30).all(), (a - b).abs().max()
    assert (a == b).float().mean() >= frac


def _close_bf16(a, b):
    assert torch.isfinite(a.float()).all()
    assert ((a.float() - b.float()).abs() <= 2.0 ** -7 * b.float().abs() + 1e-6).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_row_amax_and_quant_tensor(fmt):
    x = _rand(256, 320, 1)
    assert torch.equal(quant.row_amax(x), R.row_amax(x))
    scale = R.tensor_scale(R.row_amax(x), fmt)
    q, qt = quant.quant_tensor(x, scale, fmt, True, True)
    rq, _ = R.quant_tensor(x, scale, fmt, True, False)
    _codes_equal(q, rq)
    _codes_equal(qt, rq.t().contiguous())


# 320 groups: two groups per thread in the backward; 16 and 32 groups: a warp per row (per-head q/k norms)
@pytest.mark.parametrize("m,n", [(192, 4096 + 1024), (1000, 256), (333, 512)])
@pytest.mark.parametrize("fmt", FMTS)
def test_rmsnorm_kernels(fmt, m, n):
    x, w = _rand(m, n, 2), (torch.rand(n, device="cuda") + 0.5).bfloat16()
    k = quant.rmsnorm_quant(x, w, 1e-5, fmt, 16)
    r = R.rmsnorm_quant(x, w, 1e-5, fmt, 16)
    _codes_equal(k[0], r[0])
    assert torch.equal(k[1], r[1])
    assert torch.allclose(k[2], r[2], rtol=1e-5, atol=0) and torch.allclose(k[3], r[3], rtol=1e-5, atol=0)
    y, *saved = quant.rmsnorm_save(x, w, 1e-5, fmt, 16)  # the output of a norm that feeds no GEMM, same pass
    _codes_equal(saved[0], r[0])
    assert torch.equal(saved[1], r[1]) and torch.equal(saved[2], k[2])
    _close_bf16(y, R.rmsnorm_output(x, r[2], w))
    xq, xs, rstd, ymax = r
    scale = R.tensor_scale(ymax, E4M3)
    kq, kqt = quant.rmsnorm_rebuild(xq, xs, rstd, w, scale, E4M3, 16, True, True)
    rq, _ = R.rmsnorm_rebuild(xq, xs, rstd, w, scale, E4M3, 16, True, False)
    _one_step(kq, rq, E4M3)
    _codes_equal(kqt, kq.t().contiguous())
    dy, dres = _rand(m, n, 3), _rand(m, n, 4)
    for res in (None, dres):
        kdx, kdw = quant.rmsnorm_backward(dy, xq, xs, rstd, w, 16, res)
        rdx, rdw = R.rmsnorm_backward(dy, xq, xs, rstd, w, 16, res)
        _close_bf16(kdx, rdx)
        assert torch.allclose(kdw, rdw, rtol=1e-4, atol=1e-4 * rdw.abs().max().item())


@pytest.mark.parametrize("act", R.GATED_ACTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_gated_mul_kernels(fmt, act, monkeypatch):
    """act(g) * u for every gated activation (SwiGLU, GeGLU): the kernels run with the reference made
    unreachable, so a fallback fails instead of passing as its own reference."""
    m, i = 160, 2752  # 11008 / 4: not a multiple of 64, so tiles hang over the edge
    gu, da = _rand(m, 2 * i, 5), _rand(m, i, 6)
    r = R.silu_mul_quant(gu, fmt, 16, act)
    q, s, amax = r
    scale = R.tensor_scale(amax, E4M3)
    ra, _ = R.silu_mul_rebuild(q, s, scale, E4M3, 16, True, False, act)
    rd, _ = R.silu_mul_backward(da, q, s, 16, act)
    for name in ("silu_mul_quant", "silu_mul_rebuild", "silu_mul_backward"):
        monkeypatch.setattr(R, name, lambda *a, _n=name: pytest.fail(f"quant.{_n} fell back to the reference"))
    k = quant.silu_mul_quant(gu, fmt, 16, act)
    _codes_equal(k[0], r[0])
    assert torch.equal(k[1], r[1])
    assert torch.allclose(k[2], r[2], rtol=1e-5, atol=0)
    ka, kat = quant.silu_mul_rebuild(q, s, scale, E4M3, 16, True, True, act)
    _one_step(ka, ra, E4M3)
    _codes_equal(kat, ka.t().contiguous())
    kd, kmax = quant.silu_mul_backward(da, q, s, 16, act)
    _close_bf16(kd, rd)
    assert torch.equal(kmax, R.row_amax(kd))


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_weight_operand(transposed):
    """q/k/v weights quantized slice by slice into one operand == quantizing their concatenation."""
    ws = [_rand(256, 320, 11), _rand(64, 320, 12), _rand(64, 320, 13)]
    scale = R.tensor_scale(torch.cat([R.row_amax(w) for w in ws]), E4M3)
    got = quant.quant_weights(ws, scale, E4M3, transposed)
    want, want_t = R.quant_tensor(torch.cat(ws), scale, E4M3, True, True)
    _codes_equal(got, want_t if transposed else want)


def _tensor_scale_cases():
    g = torch.Generator(device="cuda").manual_seed(11)
    rand = lambda n, lo, hi: torch.exp2(torch.empty(n, device="cuda").uniform_(lo, hi, generator=g))  # noqa: E731
    cases = {"wide": rand(1000, -20, 20), "above_max": rand(5000, 8, 17), "tiny": rand(300, -140, -100),
             "one_row": rand(1, -3, 3), "zeros_but_one": torch.zeros(777, device="cuda")}
    cases["zeros_but_one"][500] = 3.0
    cases["all_zero"] = torch.zeros(64, device="cuda")
    for name, pos in (("nan_first", 0), ("nan_last", 999)):
        cases[name] = rand(1000, -5, 5)
        cases[name][pos] = float("nan")
    cases["inf"] = rand(1000, -5, 5)
    cases["inf"][123] = float("inf")
    return cases


@pytest.mark.parametrize("fmt", FMTS)
def test_tensor_scale_kernel(kernels, fmt, monkeypatch):
    """The kernel itself, then quant.tensor_scale with the reference made unreachable: it must dispatch."""
    cases = _tensor_scale_cases()
    for name, amax in cases.items():
        want = R.tensor_scale(amax, fmt)
        got = torch.empty((), dtype=torch.float32, device="cuda")
        kernels.tensor_scale(amax, got, fmt is E5M2)
        assert torch.equal(got, want), (name, got.item(), want.item())
    reference = R.tensor_scale
    monkeypatch.setattr(R, "tensor_scale", lambda *a: pytest.fail("quant.tensor_scale fell back to the reference"))
    for name, amax in cases.items():
        assert torch.equal(quant.tensor_scale(amax, fmt), reference(amax, fmt)), name


@pytest.mark.parametrize("nkv,cs_batch", [(8, 1), (2, 2)])
def test_rope_kernel_vs_hf(nkv, cs_batch):
    """Forward vs HF's apply_rotary_pos_emb (which rounds to bf16 three times, the kernel once): within 2^-7
    of |x cos| + |rot(x) sin|. Backward vs autograd through HF's function, same bound."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s, nh, hd = 2, 64, 8, 64
    qkv = _rand(b * s, (nh + 2 * nkv) * hd, 8).requires_grad_()
    ang = torch.rand(cs_batch, s, hd // 2, device="cuda") * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
    from coat_ds.activation.functions import RopeFn

    q, k, v = RopeFn.apply(qkv, cos, sin, b, nh, nkv, hd)
    x = qkv.detach().clone().requires_grad_()
    rq, rk, rv = (t.view(b, s, -1, hd).transpose(1, 2) for t in x.split([nh * hd, nkv * hd, nkv * hd], -1))
    rq, rk = apply_rotary_pos_emb(rq, rk, cos, sin)
    for a, r, src in ((q, rq, None), (k, rk, None), (v, rv, None)):
        bound = 2.0 ** -7 * 2 * r.detach().float().abs().amax() + 1e-6
        assert ((a.float() - r.detach().float()).abs() <= bound).all()
    assert torch.equal(v, rv.detach())
    g = [_rand(b * t.shape[1] * s, hd, 9 + i).view(b, s, t.shape[1], hd).transpose(1, 2).contiguous()
         for i, t in enumerate((q, k, v))]
    torch.autograd.backward((q, k, v), g)
    torch.autograd.backward((rq, rk, rv), g)
    bound = 2.0 ** -7 * 2 * x.grad.float().abs().amax() + 1e-6
    assert torch.isfinite(qkv.grad.float()).all()
    assert ((qkv.grad.float() - x.grad.float()).abs() <= bound).all()


def _layer(kind="llama", seed=0):
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    torch.manual_seed(seed)
    common = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    cfg, cls = (LlamaConfig(**common), LlamaDecoderLayer) if kind == "llama" else (Qwen2Config(**common),
                                                                                     Qwen2DecoderLayer)
    cfg._attn_implementation = "sdpa"
    layer = cls(cfg, 0).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.03) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return cfg, layer


def _run(layer, cfg, x, compiled=False):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    b, s, _ = x.shape
    pos = torch.arange(s, device="cuda")[None].expand(b, s)
    pe = LlamaRotaryEmbedding(cfg).cuda()(x, pos)
    xi = x.detach().clone().requires_grad_()
    fn = torch.compile(layer) if compiled else layer
    y = fn(xi, attention_mask=None, position_ids=pos, position_embeddings=pe)
    y.backward(torch.randn(y.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").to(y.dtype))
    out = [y.float(), xi.grad.float()] + [p.grad.float() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return out


# 4 x 256 tokens: cosine >= 0.99 everywhere; relative L2 error <= 0.05 (output), 0.06 (input grad),
# 0.15 (weight and norm grads: E5M2 output gradients, 2 mantissa bits; seen ~0.09-0.12).
@pytest.mark.parametrize("kind,mode,compiled", [("llama", "full", False), ("llama", "linear", False),
                                                ("qwen2", "full", False), ("llama", "full", True)])
def test_fp8_layer_close_to_bf16_on_gpu(kind, mode, compiled):
    cfg, ref = _layer(kind)
    fp8 = CoatDecoderLayer(copy.deepcopy(ref), {"mode": mode})
    x = torch.randn(4, 256, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    got, want = _run(fp8, cfg, x, compiled), _run(ref, cfg, x)
    names = ["out", "dx"] + [n for n, _ in ref.named_parameters()]
    bad = []
    for name, a, b in zip(names, got, want):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()
        rel = ((a - b).norm() / b.norm()).item()
        if not (torch.isfinite(a).all() and cos >= 0.99 and rel <= {"out": 0.05, "dx": 0.06}.get(name, 0.15)):
            bad.append((name, round(cos, 4), round(rel, 4)))
    assert not bad, bad


@pytest.mark.parametrize("mode", ["full", "linear"])
def test_compiled_layer_matches_eager_on_gpu(mode):
    """torch.compile (inductor) of the FP8 layer against the same layer run eagerly, CUDA kernels both ways:
    every tensor finite and not all zero, cosine >= 0.99 (torch 2.11 gave all-zero compiled gradients with
    a correct forward while a Function's forward added into its output in place)."""
    cfg, ref = _layer()
    fp8 = CoatDecoderLayer(ref, {"mode": mode})
    x = torch.randn(4, 256, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    want = _run(fp8, cfg, x)
    torch._dynamo.reset()
    got = _run(fp8, cfg, x, compiled=True)
    names = ["out", "dx"] + [n for n, _ in ref.named_parameters()]
    bad = []
    for name, a, b in zip(names, got, want):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()
        if not (torch.isfinite(a).all() and a.abs().max() > 0 and cos >= 0.99):
            bad.append((name, round(cos, 4)))
    assert not bad, bad


def test_kernel_layer_matches_reference_layer(monkeypatch):
    """The whole FP8 layer with kernels vs with the reference ops on the GPU: same math, so only the
    one-FP8-step differences above remain: cosine >= 0.999 for the output and input gradient; weight
    gradients >= 0.99 (a changed forward code moves E5M2-rounded output gradients by a step, 2^-2)."""
    cfg, ref = _layer()
    fp8 = CoatDecoderLayer(ref)
    x = torch.randn(2, 128, 512, device="cuda").bfloat16()
    got = _run(fp8, cfg, x)
    monkeypatch.setenv("COAT_ACT_REFERENCE", "1")
    fp8.clear_weight_cache()
    want = _run(fp8, cfg, x)
    for i, (a, b) in enumerate(zip(got, want)):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()
        assert cos >= (0.999 if i < 2 else 0.99), (i, cos)


def test_gemma3_geglu_runs_the_kernels(monkeypatch):
    """A default-config Gemma 3 (GeGLU) injected on the GPU: its MLPs run the gated-activation kernels (the
    reference made unreachable for that run), and its logits and gradients match the same model on the
    reference ops within the bounds of test_kernel_layer_matches_reference_layer."""
    import coat_ds
    from family_cases import SEQ, VOCAB, build

    model = coat_ds.inject(build("gemma3_text").to("cuda", torch.bfloat16))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3)).cuda()

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        return [out.logits.float()] + [p.grad.float() for p in model.parameters()]

    with monkeypatch.context() as m:
        for name in ("silu_mul_quant", "silu_mul_rebuild", "silu_mul_backward"):
            m.setattr(R, name, lambda *a, _n=name: pytest.fail(f"quant.{_n} fell back to the reference"))
        got = run()
    monkeypatch.setenv("COAT_ACT_REFERENCE", "1")
    for layer in model.model.layers:
        layer.clear_weight_cache()
    want = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), i
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()
        assert cos >= (0.999 if i == 0 else 0.99), (i, cos)


@pytest.mark.parametrize("m,n", [(64, 262208), (200, 4104), (3, 8)])
def test_xent_kernels_match_the_reference(m, n):
    """The LM head's cross-entropy kernels on fresh logits (peaked rows, a -inf column, targets anywhere in the
    vocabulary slice or outside it): logsumexp and picked logit in fp32 to 1e-6 relative, the in-place gradient
    within 2 bf16 ulps of the reference, every element."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = (torch.randn(m, n, generator=g, device="cuda") * 4).bfloat16()
    x[0, 1] = 60.0  # one peaked row
    x[-1, 0] = float("-inf")
    target = torch.randint(0, n, (m,), generator=g, device="cuda")
    lse, picked = quant.xent_forward(x, target)
    rlse, rpicked = R.xent_forward(x, target)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse, rlse, rtol=1e-6, atol=1e-6)
    assert torch.equal(picked, rpicked)
    local = target - torch.randint(-n // 2, n // 2, (m,), generator=g, device="cuda")  # in the slice or not
    scale = torch.rand(m, generator=g, device="cuda") / m
    ref = R.xent_backward(x, rlse, local, scale)
    ours = quant.xent_backward_(x.clone(), rlse, local, scale)
    _close_bf16(ours, ref)
    assert (ours == ref).float().mean() > 0.99
