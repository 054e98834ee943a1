"""FP8 activation flow: config, reference ops, the FP8 decoder layer vs the bf16 one, what backward keeps.

Error bounds (stated next to each check) come from the formats: E4M3 keeps 3 mantissa bits, so one
rounding moves a normal value by at most 2^-4 of itself; E5M2 (gradients) by at most 2^-3."""
import copy

import pytest
import torch

from coat_ds.activation import ActivationConfig
from coat_ds.hf import CoatDecoderLayer
from coat_ds.kernels import quant_reference as R
from coat_ds.formats import E4M3, E5M2

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Qwen2Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer  # noqa: E402


# ---------------------------------------------------------------- config

def test_config_defaults_and_validation():
    c = ActivationConfig.from_dict({"mode": "linear", "group_size": 32})
    assert (c.mode, c.group_size, c.fwd, c.bwd) == ("linear", 32, E4M3, E5M2)
    with pytest.raises(ValueError, match="coat.activation.grp: unknown key; allowed keys.*group_size"):
        ActivationConfig.from_dict({"grp": 16})
    with pytest.raises(ValueError, match="mode.*allowed.*full"):
        ActivationConfig.from_dict({"mode": "all"})
    with pytest.raises(ValueError, match="group_size.*allowed"):
        ActivationConfig.from_dict({"group_size": 12})
    with pytest.raises(ValueError, match="fwd_format"):
        ActivationConfig.from_dict({"fwd_format": "e3m4"})
    assert ActivationConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="cache_weights.*allowed: true, false, 'when_accumulating'"):
        ActivationConfig.from_dict({"cache_weights": "yes"})
    with pytest.raises(ValueError, match="not 'auto'"):
        ActivationConfig.from_dict({"cache_weights": "auto"})


def test_cache_weights_default_follows_gradient_accumulation():
    auto = ActivationConfig()
    assert auto.cache_weights == "when_accumulating" and not auto.cache_enabled   # unresolved, it caches nothing
    assert auto.resolve(4).cache_enabled and not auto.resolve(1).cache_enabled
    assert not auto.resolve("auto").cache_enabled and not auto.resolve(None).cache_enabled
    off = ActivationConfig(cache_weights=False)
    assert not off.resolve(8).cache_enabled and ActivationConfig(cache_weights=True).resolve(1).cache_enabled


# ---------------------------------------------------------------- reference ops

def _rand(m, n, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over ~6 binades inside a row, as activations are
    return (torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-3, 3, (m, n), generator=g).float())).to(dtype)


def _within_one_step(x, xr, scale, fmt, subnormal_step):
    """|x - Q(x)| <= 2^-(mantissa+1) |x| + half a subnormal step of the group's scale: one rounding."""
    rel = 2.0 ** -(4 if fmt is E4M3 else 3)
    assert torch.isfinite(xr).all()
    assert ((x - xr).abs() <= rel * x.abs() + 0.5 * subnormal_step * scale).all()


@pytest.mark.parametrize("fmt,sub", [(E4M3, 2.0 ** -9), (E5M2, 2.0 ** -16)])
def test_group_quant_round_trip(fmt, sub):
    x = _rand(8, 64).float()
    q, s = R.group_quant(x, fmt, 16)
    assert q.dtype == fmt.dtype and s.dtype == torch.uint8 and s.shape == (8, 4)
    scale = torch.ldexp(torch.ones(s.shape), s.int() - 127).repeat_interleave(16, dim=1)
    assert (q.float().abs().amax(1) > fmt.max / 2).all()  # a power-of-two scale still uses the top binade
    _within_one_step(x, R.group_dequant(q, s, 16), scale, fmt, sub)


def test_zero_group_and_tensor_scale():
    x = torch.zeros(2, 32)
    x[1, 20] = 3.0
    q, s = R.group_quant(x, E4M3, 16)
    assert torch.equal(R.group_dequant(q, s, 16), x)
    assert R.tensor_scale(torch.tensor([0.5, 448.0]), E4M3).item() == 1.0
    assert R.tensor_scale(torch.tensor([449.0]), E4M3).item() == 2.0


def test_quant_tensor_layouts():
    x = _rand(16, 32)
    scale = R.tensor_scale(R.row_amax(x), E5M2)
    q, qt = R.quant_tensor(x, scale, E5M2, True, True)
    assert torch.equal(q.t().float(), qt.float())
    _within_one_step(x.float(), q.float() * scale, scale, E5M2, 2.0 ** -16)


def test_rmsnorm_reference_matches_autograd():
    """Forward: the rebuilt FP8 output is one E4M3 rounding of RMSNorm(dequantized x). Backward: the
    fused formula equals autograd of fp32 RMSNorm on the dequantized input (fp32 round-off, 1e-5)."""
    x, w = _rand(8, 64, 1), (torch.rand(64) + 0.5).to(torch.bfloat16)
    xq, xs, rstd, ymax = R.rmsnorm_quant(x, w, 1e-6, E4M3, 16)
    xd = R.group_dequant(xq, xs, 16).requires_grad_()
    wf = w.float().requires_grad_()
    r = torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6)
    y = xd * r.detach() * wf
    assert torch.allclose(ymax, y.detach().abs().amax(1))
    scale = R.tensor_scale(ymax, E4M3)
    q, qt = R.rmsnorm_rebuild(xq, xs, rstd, w, scale, E4M3, 16, True, True)
    _within_one_step(y.detach(), q.float() * scale, scale, E4M3, 2.0 ** -9)
    assert torch.equal(qt.t().float(), q.float())
    # backward: recompute rstd from the dequantized x so autograd sees the same function
    xd2 = xd.detach().requires_grad_()
    rr = torch.rsqrt(xd2.pow(2).mean(1, keepdim=True) + 1e-6)
    y2 = xd2 * rr * wf
    dy = _rand(8, 64, 2)
    y2.backward(dy.float())
    rstd2 = rr.detach().squeeze(1)
    dres = _rand(8, 64, 3)
    dx, dw = R.rmsnorm_backward(dy.float(), xq, xs, rstd2, w, 16, dres.float())
    assert torch.allclose(dx, xd2.grad + dres.float(), atol=1e-5, rtol=1e-5)
    assert torch.allclose(dw, wf.grad, atol=1e-4, rtol=1e-5)


_STOCK_ACTS = {"silu": torch.nn.functional.silu,
               "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}


@pytest.mark.parametrize("act", R.GATED_ACTS)
def test_gated_reference_matches_autograd(act):
    """SwiGLU and GeGLU (tanh-GELU): forward, rebuild and backward against autograd of torch's own activation."""
    gu = _rand(8, 64, 4)
    q, s, amax = R.silu_mul_quant(gu, E4M3, 16, act)
    g, u = R.group_dequant(q, s, 16).chunk(2, dim=1)
    g.requires_grad_(), u.requires_grad_()
    a = _STOCK_ACTS[act](g) * u
    assert torch.allclose(amax, a.detach().abs().amax(1))
    scale = R.tensor_scale(amax, E4M3)
    aq, _ = R.silu_mul_rebuild(q, s, scale, E4M3, 16, act=act)
    _within_one_step(a.detach(), aq.float() * scale, scale, E4M3, 2.0 ** -9)
    da = _rand(8, 32, 5).float()
    a.backward(da)
    dgu, dmax = R.silu_mul_backward(da, q, s, 16, act)
    assert torch.allclose(dgu, torch.cat([g.grad, u.grad], 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(dmax, dgu.abs().amax(1))


def test_kernels_name_each_gated_act_by_its_reference_index():
    """quant.py hands the kernels an activation's index in R.GATED_ACTS: coat_quant.h's GatedAct lists them in
    that order (kSilu = 0, kGeluTanh = 1), and a name outside it is refused before any kernel runs."""
    import re
    from pathlib import Path

    from coat_ds.kernels import quant
    from coat_ds.op_builder.builder import CSRC_DIR

    header = (Path(CSRC_DIR) / "quant" / "coat_quant.h").read_text()
    body = re.search(r"enum class GatedAct : int \{([^}]*)\}", header).group(1)
    enum = {name.strip(): int(value) for name, value in (e.split("=") for e in body.split(","))}
    assert enum == {"k" + act.title().replace("_", ""): i for i, act in enumerate(R.GATED_ACTS)}
    assert [quant._act_index(act) for act in R.GATED_ACTS] == list(range(len(R.GATED_ACTS)))
    with pytest.raises(ValueError, match="'relu' is not one of"):
        quant._act_index("relu")


@pytest.mark.parametrize("family,offset", [("qwen3", 0.0), ("gemma3", 1.0)])
def test_rms_norm_fn_is_the_stock_norm_saving_fp8(family, offset):
    """RmsNormFn over rows = tokens x heads (per-head q/k norms) with the norm's weight (+1 for Gemma): stock's
    output; gradients those of the stock norm within E4M3 rounding of the input; only FP8 + rstd saved."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from coat_ds.activation.functions import RmsNormFn
    torch.manual_seed(0)
    norm = (Qwen3RMSNorm if family == "qwen3" else Gemma3RMSNorm)(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    x = _rand(6 * 4, 32, 7).float().requires_grad_()  # 6 tokens x 4 heads, head_dim 32
    cfg = ActivationConfig()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = RmsNormFn.apply(x, norm.weight + offset if offset else norm.weight, 1e-6, cfg)
    assert {t.dtype for t in saved} <= {E4M3.dtype, torch.uint8, torch.float32} and saved[0].dtype == E4M3.dtype
    torch.testing.assert_close(y, norm(x), rtol=1e-6, atol=1e-6)
    dy = _rand(6 * 4, 32, 8).float()
    y.backward(dy)
    xs = x.detach().clone().requires_grad_()
    ref = copy.deepcopy(norm)
    ref(xs).backward(dy)
    # backward reads x rounded to E4M3 (2^-4 relative at most per value): measured 0.02..0.03 relative
    for got, want in ((x.grad, xs.grad), (norm.weight.grad, ref.weight.grad)):
        assert 1e-4 < ((got - want).norm() / want.norm()).item() < 0.06


# ---------------------------------------------------------------- the decoder layer

def _layer(kind="llama", attn="sdpa", seed=0):
    torch.manual_seed(seed)
    common = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    if kind == "llama":
        cfg, cls = LlamaConfig(**common), LlamaDecoderLayer
    else:
        cfg, cls = Qwen2Config(**common), Qwen2DecoderLayer
    cfg._attn_implementation = attn
    layer = cls(cfg, 0).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return cfg, layer


def _run(layer, cfg, x, grad_seed=1):
    b, s, _ = x.shape
    pos = torch.arange(s)[None].expand(b, s)
    pe = LlamaRotaryEmbedding(cfg)(x, pos)
    xi = x.detach().clone().requires_grad_()
    y = layer(xi, attention_mask=None, position_ids=pos, position_embeddings=pe)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y.dtype))
    return [y.float(), xi.grad.float()] + [p.grad.float() for p in layer.parameters()]


# bounds for the tiny shapes here (64 tokens; errors shrink with more tokens): cosine >= 0.99 for every
# tensor; relative L2 error <= 0.05 for the output, 0.06 for the input gradient (E4M3 forward), 0.15 for
# weight gradients (E5M2 output gradients, 2 mantissa bits). Seen: ~0.017, ~0.027, 0.08-0.11.
BOUNDS = {"out": 0.05, "dx": 0.06}


@pytest.mark.parametrize("kind,mode", [("llama", "full"), ("llama", "linear"), ("qwen2", "full")])
def test_fp8_layer_close_to_bf16(kind, mode):
    cfg, ref = _layer(kind)
    fp8 = CoatDecoderLayer(copy.deepcopy(ref), {"mode": mode})
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    names = ["out", "dx"] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, _run(fp8, cfg, x), _run(ref, cfg, x)):
        assert torch.isfinite(a).all(), name
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()
        rel = ((a - b).norm() / b.norm()).item()
        assert cos >= 0.99, (name, cos)
        assert rel <= BOUNDS.get(name, 0.15), (name, rel)


def test_layer_keeps_params_and_reverts():
    _, ref = _layer()
    keys = list(ref.state_dict())
    fp8 = CoatDecoderLayer(ref)
    assert list(fp8.state_dict()) == keys
    assert fp8.self_attn.q_proj is ref.self_attn.q_proj
    assert fp8.to_hf() is ref
    with pytest.raises(ValueError, match="mode"):
        CoatDecoderLayer(ref, {"mode": "fp8"})


def test_weight_cache_reused_until_update():
    cfg, ref = _layer()
    fp8 = CoatDecoderLayer(ref, {"cache_weights": True})
    x = torch.randn(2, 16, 128).to(torch.bfloat16)
    _run(fp8, cfg, x)
    first = fp8._qkv.operand(False)[0]
    assert fp8._qkv.operand(False)[0] is first and fp8.weight_cache_bytes() > 0
    with torch.no_grad():
        ref.self_attn.q_proj.weight.mul_(2)  # an optimizer step: in place, bumps the version
    assert fp8._qkv.operand(False)[0] is not first
    fp8.clear_weight_cache()
    assert fp8.weight_cache_bytes() == 0


def test_weight_cache_off_keeps_nothing():
    cfg, ref = _layer()
    fp8 = CoatDecoderLayer(ref)  # "when_accumulating", unresolved: off
    _run(fp8, cfg, torch.randn(2, 16, 128).to(torch.bfloat16))
    assert fp8.weight_cache_bytes() == 0
    assert fp8._qkv.operand(False)[0] is not fp8._qkv.operand(False)[0]


def test_backward_saves_only_fp8():
    """Everything the FP8 layer's backward keeps is <= 8 bits wide, except documented bookkeeping:
    parameters, the model-wide RoPE cos/sin, per-row fp32 vectors and 0-d scales, and attention's own
    bf16 q, k, v, output and fp32 logsumexp (SDPA saves them; o_proj shares attention's output)."""
    cfg, ref = _layer()
    fp8 = CoatDecoderLayer(ref)
    b, s, h = 2, 32, 128
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(s)[None].expand(b, s)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    params = {p.untyped_storage().data_ptr() for p in fp8.parameters()}
    shared = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8(x, position_ids=pos, position_embeddings=(cos, sin))
    tokens, nh, nkv, hd = b * s, 4, 2, 32
    wide = {}
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if t.element_size() == 1 or ptr in params or ptr in shared:
            continue
        if t.dim() <= 1 and t.numel() <= tokens:  # scales, rstd
            continue
        assert t.dim() == 4 and t.shape[-1] == hd or t.dim() == 3 and t.dtype == torch.float32 or (
            t.dim() == 2 and t.shape == (tokens, nh * hd)), (t.dtype, t.shape)
        wide[ptr] = t.untyped_storage().nbytes()
    attention = tokens * hd * (2 * nh + 2 * nkv) * 2 + tokens * nh * 4  # q, o, k, v in bf16 + lse
    assert sum(wide.values()) <= attention, (sum(wide.values()), attention)


def test_the_qkv_projection_frees_its_gradient_once_quantized():
    """NormLinearFn with owns_grad (the layer's q/k/v projection) frees the bf16 gradient it is handed once its two
    E5M2 copies are made: autograd's engine would hold it to the end of the backward (3 B/token/hidden at
    Llama-8B's peak). Every gradient is bit-identical to the backward that keeps it."""
    from coat_ds.activation.functions import NormLinearFn

    _, ref = _layer()
    fp8 = CoatDecoderLayer(ref)
    norm, group = ref.input_layernorm, fp8._qkv
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    seen, grads = {}, {}
    for owns in (False, True):
        xi = x.clone().requires_grad_()
        out = NormLinearFn.apply(xi, norm.weight, norm.variance_epsilon, fp8.coat_config, group, owns, *group.params())
        out.register_hook(lambda g, owns=owns: seen.__setitem__(owns, g))
        (out.float() * weight).sum().backward()
        grads[owns] = [xi.grad] + [p.grad.clone() for p in (norm.weight, *group.params())]
        for p in (norm.weight, *group.params()):
            p.grad = None
    assert seen[True].untyped_storage().nbytes() == 0 < seen[False].untyped_storage().nbytes()
    assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
