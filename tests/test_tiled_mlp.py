"""TiledMlpFn: MlpFn over row tiles, saving only its input; its gradients arrive once per backward."""
import copy

import pytest
import torch
from torch import nn

from coat_ds.activation.config import ActivationConfig
from coat_ds.activation.config import TILE_MULTIPLE, check_tile_tokens
from coat_ds.activation.tiled import mlp, tiles
from coat_ds.activation.weight_cache import WeightGroup

HIDDEN, INTER, TOKENS = 64, 160, 88  # 88 rows: tiles of 32 leave a last tile of 24
DT = torch.bfloat16


class _Mlp:
    """A gated MLP's weights as the decoder layer hands them to the FP8 Functions, with fixed inputs."""

    def __init__(self, bias: bool = False, seed: int = 0, shape: tuple[int, int, int] = (HIDDEN, INTER, TOKENS),
                 device: str = "cpu"):
        torch.manual_seed(seed)
        hidden, inter, tokens = shape
        self.cfg = ActivationConfig()
        kw = dict(bias=bias, dtype=DT, device=device)
        lins = [nn.Linear(hidden, inter, **kw), nn.Linear(hidden, inter, **kw), nn.Linear(inter, hidden, **kw)]
        # no FP8 weight cache: the decoder layer's groups at one micro-batch a step
        self.gu, self.down = (WeightGroup(ws, self.cfg.fwd, cache=False) for ws in (lins[:2], lins[2:]))
        self.norm_w = nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=DT, device=device))
        self.params = [self.norm_w, *self.gu.params(), *self.down.params()]
        # rows of different magnitudes: tiles take different per-tensor scales
        rows = torch.linspace(0.05, 4, tokens, dtype=DT, device=device)[:, None]
        self.h = torch.randn(tokens, hidden, dtype=DT, device=device) * rows
        self.dout = torch.randn(tokens, hidden, dtype=DT, device=device)

    def run(self, tile_tokens, act="silu", add_residual=True):
        """(output, dh, every parameter's gradient) of one forward and backward."""
        for p in self.params:
            p.grad = None
        h = self.h.clone().requires_grad_()
        out = mlp(h, self.norm_w, 1e-6, self.cfg, self.gu, self.down, act, add_residual, tile_tokens)
        out.backward(self.dout)
        return [out.detach(), h.grad, *(p.grad for p in self.params)]


def _assert_rounding_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Every element within two bf16 ulps of the tensor's largest magnitude (what summing bf16 partial
    results in another order moves); NaN or inf fails."""
    assert torch.isfinite(got).all() and torch.isfinite(ref).all(), what
    tol = 2.0 ** -7 * ref.float().abs().max().item()
    diff = (got.float() - ref.float()).abs()
    assert diff.max().item() <= tol, f"{what}: max |diff| {diff.max().item():.3g} > {tol:.3g}"


def _assert_tiled_like_untiled(m: _Mlp, tile_tokens: int, act: str = "silu", add_residual: bool = True) -> None:
    ref = m.run(None, act, add_residual)
    got = m.run(tile_tokens, act, add_residual)
    names = ["output", "dh"] + [f"grad {i}" for i in range(len(m.params))]
    assert len(got) == len(ref) == 2 + len(m.params)
    for g, r, name in zip(got, ref, names):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        _assert_rounding_close(g, r, name)


@pytest.mark.parametrize("tile_tokens", [16, 32, 48])
@pytest.mark.parametrize("act,add_residual,bias", [("silu", True, False), ("gelu_tanh", False, True)])
def test_tiled_equals_untiled_within_rounding(tile_tokens, act, add_residual, bias):
    m = _Mlp(bias=bias)
    assert len(m.params) == (7 if bias else 4)
    _assert_tiled_like_untiled(m, tile_tokens, act, add_residual)


@pytest.mark.gpu
def test_tiled_equals_untiled_on_gpu():
    """The kernels and FP8 GEMMs (cuBLAS may sum a tile's GEMM in another order than the whole one's), at a
    width the kernels take two groups a thread at, in 3 tiles and a short fourth."""
    _assert_tiled_like_untiled(_Mlp(shape=(1024, 2816, 3 * 1024 + 512), device="cuda"), 1024)


def test_one_tile_is_mlp_fn_exactly():
    m = _Mlp()
    for g, r in zip(m.run(8 * TILE_MULTIPLE), m.run(None)):
        assert torch.equal(g, r)


def test_a_dropped_tile_gradient_is_caught():
    """The tolerance above is far below one tile's share: a tiling that lost a tile would fail it."""
    m = _Mlp()
    ref = m.run(None)
    half = TOKENS // 2
    m.dout[half:] = 0  # the same as losing the gradients of the second half's tiles
    lost = m.run(32)
    with pytest.raises(AssertionError):
        _assert_rounding_close(lost[3], ref[3], "gate weight")


def test_gradients_arrive_once_per_parameter():
    """Each parameter's gradient accumulates once per backward whatever the tile count (ZeRO's reduction
    hooks fire on it); its input gets one gradient tensor."""
    m = _Mlp()
    counts = {id(p): 0 for p in m.params}
    handles = [p.register_post_accumulate_grad_hook(lambda p: counts.__setitem__(id(p), counts[id(p)] + 1))
               for p in m.params]
    m.run(16)  # 6 tiles
    for hd in handles:
        hd.remove()
    assert list(counts.values()) == [1] * len(m.params)


def test_weights_quantized_once_a_pass_and_not_kept(monkeypatch):
    """Each group's FP8 weights are made once for all tiles of a pass (forward: row-major; backward: both
    layouts), then dropped: the groups keep no cache."""
    m = _Mlp()
    made = []
    quantize = WeightGroup._quantize
    monkeypatch.setattr(WeightGroup, "_quantize", lambda g, t, s: made.append((id(g), t)) or quantize(g, t, s))
    m.run(16)  # 6 tiles
    gu, down = id(m.gu), id(m.down)
    assert sorted(made[:2]) == sorted([(gu, False), (down, False)])
    assert sorted(made[2:]) == sorted([(gu, False), (down, False), (gu, True), (down, True)])
    assert m.gu.nbytes() == m.down.nbytes() == 0 and not m.gu.cache and not m.down.cache


def test_forward_saves_only_its_input():
    m = _Mlp()
    saved = []
    h = m.h.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mlp(h, m.norm_w, 1e-6, m.cfg, m.gu, m.down, "silu", True, 32)
    params = {p.data_ptr() for p in m.params}
    activations = [t for t in saved if t.data_ptr() not in params]
    assert len(activations) == 1 and activations[0].data_ptr() == h.data_ptr()
    assert len(saved) == 2  # h and the norm's weight


def test_tiles_cover_the_rows_once():
    assert tiles(88, 32) == [slice(0, 32), slice(32, 64), slice(64, 88)]
    assert tiles(64, 32) == [slice(0, 32), slice(32, 64)]
    assert tiles(10, 32) == [slice(0, 10)]


@pytest.mark.parametrize("bad", [0, -16, 24, 16.0, True, "32"])
def test_bad_tile_tokens_is_one_line(bad):
    allowed = r"allowed: null \(the MLP untiled\) or a positive multiple of 16$"
    with pytest.raises(ValueError, match=r"^activation.tile_tokens=.* is invalid; " + allowed):
        check_tile_tokens(bad)


@pytest.mark.gpu
def test_tiled_peak_memory_on_gpu():
    """At Llama-8B's width, 64k tokens in tiles of 8k: the forward + backward's peak above its inputs is under half
    the untiled one's (estimated ~3 GiB against ~10: the untiled flow holds [tokens, 2I] bf16 transients and 35 KB
    a token of FP8 saves; the tiled one a tile's transients, h, dh and the fp32 weight-gradient sums)."""
    m = _Mlp(shape=(4096, 14336, 65536), device="cuda")
    peaks = {}
    for tile in (None, 8192):
        m.run(tile)  # warm: kernels built, FP8 GEMMs chosen
        for p in m.params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m.run(tile)
        peaks[tile] = torch.cuda.max_memory_allocated() - base
    assert peaks[8192] < 0.5 * peaks[None], {k: v / 2 ** 30 for k, v in peaks.items()}


def _graph_names(fn) -> set[str]:
    """The names of every node of an autograd graph below fn."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        todo += [g for g, _ in f.next_functions]
    return {type(f).__name__ for f in seen}


def test_decoder_layer_tiles_its_mlp_by_the_config():
    """activation.tile_tokens reaches the decoder layer: its MLP is a TiledMlpFn, and the layer's output and every
    gradient equal the untiled layer's within rounding."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from coat_ds.hf import CoatDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32)
    cfg._attn_implementation = "sdpa"
    hf = LlamaDecoderLayer(cfg, 0).to(DT)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    x, dy = torch.randn(2, 40, 128, dtype=DT), torch.randn(2, 40, 128, dtype=DT)  # 80 rows: 32, 32, 16
    pos = torch.arange(40)[None].expand(2, 40)
    pe = LlamaRotaryEmbedding(cfg)(x, pos)

    def run(tile_tokens):
        layer = CoatDecoderLayer(copy.deepcopy(hf), {"tile_tokens": tile_tokens})
        xi = x.clone().requires_grad_()
        y = layer(xi, attention_mask=None, position_ids=pos, position_embeddings=pe)
        y.backward(dy)
        return _graph_names(y.grad_fn), [y.detach(), xi.grad, *(p.grad for p in layer.parameters())]

    tiled_graph, got = run(32)
    graph, ref = run(None)
    assert "TiledMlpFnBackward" in tiled_graph and "MlpFnBackward" not in tiled_graph
    assert "MlpFnBackward" in graph and "TiledMlpFnBackward" not in graph
    for i, (g, r) in enumerate(zip(got, ref)):
        _assert_rounding_close(g, r, f"tensor {i}")


def test_tiled_rows_are_the_stock_norm_bit_for_bit():
    """TiledRowsFn over HF's RMSNorm (tiles of 32 rows, the last shorter): output and input gradient equal the
    stock module's bit for bit, the weight's gradient within one bf16 step of its largest value (per-tile sums)."""
    from torch.func import functional_call
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from coat_ds.activation.tiled import TiledRowsFn

    torch.manual_seed(3)
    norm = LlamaRMSNorm(64).to(torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(2, 100, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    norm(x).backward(dy)
    want = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    y = TiledRowsFn.apply(x, 32, lambda t, w: functional_call(norm, {"weight": w}, (t,)), norm.weight)
    assert torch.equal(y, norm(x))
    y.backward(dy)
    assert torch.equal(x.grad, want[0])
    assert (norm.weight.grad.float() - want[1].float()).abs().max() <= want[1].abs().max() * 2 ** -8


def test_tile_tokens_tiles_the_final_norm_and_revert_puts_it_back():
    """inject with tile_tokens: the decoder's final norm over tiles, holding the stock parameter under the same
    state_dict key; its output and input gradient equal the stock norm's; no_grad and one tile run the stock
    forward; revert restores the same module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import coat_ds
    from coat_ds.hf.final_norm import TiledFinalNorm

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(cfg)
    stock, keys = model.model.norm, list(model.state_dict())
    coat_ds.inject(model, {"enabled": True, "tile_tokens": 16})
    tiled = model.model.norm
    assert isinstance(tiled, TiledFinalNorm) and tiled.weight is stock.weight and list(model.state_dict()) == keys
    x = torch.randn(1, 40, 64, requires_grad=True)
    dy = torch.randn_like(x)
    stock(x).backward(dy)
    want = x.grad.clone()
    x.grad = None
    tiled(x).backward(dy)
    assert torch.equal(x.grad, want)
    with torch.no_grad():
        assert torch.equal(tiled(x), stock(x))
    coat_ds.revert(model)
    assert model.model.norm is stock and list(model.state_dict()) == keys


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_recomputed_layer_skips_its_tiled_mlp_forward(monkeypatch, early_stop):
    """Under coat.activation.checkpoint a recomputed layer's TiledMlpFn computes nothing (its output is thrown away;
    its backward recomputes each tile anyway): a step runs the MLP's tiles once forward and once in backward, where
    it ran them twice in backward, and the loss and every gradient are bit for bit those of the layer that does
    (torch's early stop on or off: without it the recompute runs past the MLP on the skipped output)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from transformers import AutoConfig, AutoModelForCausalLM

    import coat_ds
    from coat_ds.activation import checkpoint_store
    from coat_ds.activation.functions import MlpFn

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(cfg).train()
    coat_ds.inject(model, {"checkpoint": True, "tile_tokens": 16})
    x = torch.randint(0, 64, (1, 40))
    calls = []
    forward = MlpFn.forward
    monkeypatch.setattr(MlpFn, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))

    def step() -> tuple[int, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        calls.clear()
        with set_checkpoint_early_stop(early_stop):
            model(input_ids=x, labels=x).loss.backward()
        return len(calls), [p.grad for p in model.parameters()]

    skipped, got = step()
    monkeypatch.setattr(checkpoint_store, "recomputing", lambda: False)
    full, want = step()
    tiles_a_pass = 2 * 3   # 2 layers, 40 rows in tiles of 16
    assert (skipped, full) == (2 * tiles_a_pass, 3 * tiles_a_pass)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
