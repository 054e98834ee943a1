"""activation.attention_fp8: attention's q, k, v saved in E4M3 (per token per head), backward recomputed.

Bounds: the forward is the stock call on the bf16 inputs (bit-identical output); the backward runs at
E4M3-rounded q, k, v (3 mantissa bits, <= 2^-4 relative per value), so gradients stay within cosine 0.99
of the stock flow on these tiny shapes (seen: input gradient 0.9999, q/k/v weight gradients >= 0.996)."""
import copy

import pytest
import torch

from coat_ds.activation import ActivationConfig
from coat_ds.activation.attention import Fp8AttentionFn, dequant_heads, quant_heads
from coat_ds.formats import E4M3
from coat_ds.hf import CoatDecoderLayer

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402

B, S, H, NH, NKV, HD, LAYERS = 2, 32, 128, 4, 2, 32, 2


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0).item()


def _stack(attn="sdpa", **coat):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=352, num_attention_heads=NH, num_key_value_heads=NKV,
                      head_dim=HD)
    cfg._attn_implementation = attn
    layers = [LlamaDecoderLayer(cfg, i).to(torch.bfloat16) for i in range(LAYERS)]
    with torch.no_grad():
        for p in (p for l in layers for p in l.parameters()):
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return cfg, torch.nn.ModuleList([CoatDecoderLayer(l, coat) for l in layers])


def _run(cfg, stack, saved=None):
    """(output, input grad, parameter grads by name) of one fwd+bwd; `saved` collects what autograd keeps."""
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).requires_grad_()
    pos = torch.arange(S)[None].expand(B, S)
    pe = LlamaRotaryEmbedding(cfg)(x, pos)
    mask = None if cfg._attn_implementation == "sdpa" else torch.full((S, S), -torch.inf).triu(1)[None, None]
    pack = (lambda t: saved.append(t) or t) if saved is not None else (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x
        for layer in stack:
            y = layer(y, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
    return y, x.grad, {n: p.grad for n, p in stack.named_parameters()}, pe


def _saved_bytes(attention_fp8: bool) -> tuple[float, list]:
    """Bytes autograd keeps per token per hidden unit per layer (parameters and shared cos/sin left out)."""
    cfg, stack = _stack(attention_fp8=attention_fp8)
    saved = []
    *_, pe = _run(cfg, stack, saved)
    skip = {p.untyped_storage().data_ptr() for p in stack.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in pe}
    kept = {t.untyped_storage().data_ptr(): t for t in saved if t.untyped_storage().data_ptr() not in skip}
    total = sum(t.untyped_storage().nbytes() for t in kept.values())
    return total / (B * S * H * LAYERS), list(kept.values())


def test_config_key():
    assert ActivationConfig().attention_fp8 is False
    assert ActivationConfig.from_dict({"attention_fp8": True}).attention_fp8 is True
    with pytest.raises(ValueError, match="activation.attention_fp8='yes' must be true or false"):
        ActivationConfig.from_dict({"attention_fp8": "yes"})


def test_quant_heads_round_trip():
    """One scale per head_dim row: each row within one E4M3 rounding of itself, an outlier row costing
    the others nothing."""
    t = torch.randn(2, 4, 8, HD)
    t[0, 0, 0] *= 1000.0  # an attention-sink-like token
    codes, sexp = quant_heads(t, E4M3)
    assert codes.dtype == E4M3.dtype and sexp.dtype == torch.uint8 and sexp.shape == (2 * 4 * 8, 1)
    back = dequant_heads(codes, sexp, t.shape, torch.float32)
    assert torch.isfinite(back).all()
    assert ((back - t).abs() <= 2.0 ** -4 * t.abs() + 2.0 ** -9 * t.abs().amax(-1, keepdim=True)).all()


def test_function_saves_fp8_and_matches_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, NH, S, HD, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))

    def call(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = Fp8AttentionFn.apply(q, k, v, None, call, E4M3)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = call(*ref_in, None)
    assert torch.equal(out, ref)  # forward: the stock call on the bf16 inputs
    n = q.numel()
    assert sorted((str(t.dtype), t.numel()) for t in saved) == sorted(
        [(str(E4M3.dtype), n)] * 3 + [(str(torch.uint8), n // HD)] * 3)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    out.backward(dout)
    ref.backward(dout)
    for a, b in zip((q, k, v), ref_in):
        assert torch.isfinite(a.grad).all() and _cos(a.grad, b.grad) > 0.99


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_stack_gradients_close(attn):
    cfg, off = _stack(attn)
    on = copy.deepcopy(off)
    for layer in on:
        layer.coat_config = ActivationConfig(attention_fp8=True)
    y0, dx0, g0, _ = _run(cfg, off)
    y1, dx1, g1, _ = _run(cfg, on)
    assert torch.equal(y0, y1)  # the forward is unchanged
    checks = {"dx": (dx1, dx0)}
    checks.update({n: (g1[n], g0[n]) for n in g0 if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")})
    for name, (a, b) in checks.items():
        assert torch.isfinite(a).all(), name
        assert _cos(a, b) > 0.99, (name, _cos(a, b))


def test_saved_bytes_drop():
    """q, k, v are kept as 1 byte per value + 1/head_dim of a byte of exponents, nothing of attention in bf16;
    o_proj then keeps its FP8 input (attention no longer keeps the bf16 output it used to share)."""
    before, _ = _saved_bytes(False)
    after, kept = _saved_bytes(True)
    assert not [t for t in kept if t.dim() == 4 and t.element_size() > 1]  # no bf16 q/k/v/o, no fp32 lse
    tokens = B * S * LAYERS
    qkv = tokens * HD * (NH + 2 * NKV)
    assert sum(t.numel() for t in kept if t.dtype == E4M3.dtype and t.shape[-1] == HD) == qkv
    assert sum(t.numel() for t in kept if t.dtype == torch.uint8 and t.shape[-1] == 1) == qkv // HD
    # per token per hidden: q/k/v/o bf16 + fp32 lse (NH*4/H) replaced by q/k/v/o FP8 + exponents
    bf16_attn, fp8_attn = 2 * (2 * NH + 2 * NKV) * HD / H + NH * 4 / H, (2 * NH + 2 * NKV) * HD / H
    assert after <= before - (bf16_attn - fp8_attn) + 0.1, (before, after)
    print(f"saved B/token/hidden per layer: off {before:.3f}, on {after:.3f}")


def test_off_is_unchanged_and_fallbacks():
    """The flag off is the stock flow exactly; on, eval mode and a KV cache keep the stock attention."""
    cfg, default = _stack()
    _, off = _stack(attention_fp8=False)
    saved0, saved1 = [], []
    r0, r1 = _run(cfg, default, saved0), _run(cfg, off, saved1)
    assert torch.equal(r0[0], r1[0]) and torch.equal(r0[1], r1[1])
    assert all(torch.equal(r0[2][n], r1[2][n]) for n in r0[2])
    assert [(t.dtype, t.shape) for t in saved0] == [(t.dtype, t.shape) for t in saved1]
    _, on = _stack(attention_fp8=True)
    layer, q = on[0], torch.zeros(1, requires_grad=True)
    assert layer._fp8_attention(q, "sdpa", None, 0.0)
    assert not layer._fp8_attention(q, "flash_attention_2", None, 0.0)
    assert not layer._fp8_attention(q, "sdpa", object(), 0.0)
    assert not layer._fp8_attention(q, "sdpa", None, 0.1)
    layer.eval()
    assert not layer._fp8_attention(q, "sdpa", None, 0.0)
