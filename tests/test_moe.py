"""Mixture-of-experts layers in FP8 (coat_ds/activation/experts.py, the sparse branch of hf/decoder_layer.py).

The grouped FP8 expert GEMMs against a plain-PyTorch reference written here per expert (quantize-dequantize by
coat_ds's quantizers, then fp32 products), every element checked, NaN never passing; the whole-model family contract
(training close to stock, generate, revert) is tests/test_families.py's for qwen3_moe and mixtral; ZeRO-3 on 2 ranks
with tokens that reach different experts: tests/launched/test_families_zero3.py."""
import copy

import pytest
import torch

import coat_ds
from coat_ds.activation import ActivationConfig
from coat_ds.activation.experts import ExpertsFn
from coat_ds.hf import CoatDecoderLayer
from coat_ds.hf.swap import apply
from coat_ds.kernels import quant_reference as R
from family_cases import SEQ, VOCAB, build
from harness import rel_error

CFG = ActivationConfig()
H, T = 64, 40   # family_cases' hidden size; 40 tokens, 2 of 8 experts each


def _experts(seed=0, model_type="qwen3_moe"):
    """A stock sparse block of a one-layer tiny model, and x [T, H] with its router's top-k."""
    torch.manual_seed(seed)
    model = build(model_type, seed, num_hidden_layers=1)
    block = model.model.layers[0].mlp
    x = torch.randn(T, H)
    _, weights, index = block.gate(x)
    return block, x, index, weights.detach()


def _dq(codes, scale):
    return codes.float() * scale


def _ste(x, x_fake):
    """x_fake's value, x's gradient (straight through the quantizer)."""
    return x + (x_fake - x).detach()


def _per_tensor(t, fmt):
    s = R.tensor_scale(R.row_amax(t), fmt)
    return _dq(R.quant_tensor(t, s, fmt)[0], s)


class _GradQuant(torch.autograd.Function):
    """Identity whose gradient is quantize-dequantized per tensor: d[gate | up] in bwd_format."""

    @staticmethod
    def forward(ctx, t, fmt):
        ctx.fmt = fmt
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return _per_tensor(grad, ctx.fmt), None


class _GatedAct(torch.autograd.Function):
    """act(gate) * up of the saved FP8 [gate | up] (q, s), its gradient by quant_reference's own formula (a float
    order of its own would flip a rare E5M2 rounding of d[gate | up] against the FP8 path's)."""

    @staticmethod
    def forward(ctx, gu, q, s, g):
        ctx.save_for_backward(q, s)
        ctx.g = g
        gate, up = R.group_dequant(q, s, g).chunk(2, dim=1)
        return gate * torch.sigmoid(gate) * up

    @staticmethod
    def backward(ctx, da):
        q, s = ctx.saved_tensors
        return R.silu_mul_backward(da, q, s, ctx.g)[0], None, None, None


def _fake_experts(w, fmt):
    """Each expert's weights through quant_reference's per-tensor quantizer (one power-of-two scale an expert)."""
    return _ste(w, torch.stack([_per_tensor(we.detach(), fmt) for we in w]))


def reference(x, index, weights, block, cfg=CFG):
    """The FP8 experts in plain PyTorch, one matmul per expert: every operand the FP8 flow quantizes replaced by its
    dequantized FP8 value (straight through for autograd), d[gate | up] quantized per tensor in bwd_format, products
    in fp32; the pairs in expert order (a stable sort), each token's pairs summed."""
    experts, fwd, g, k = block.experts, cfg.fwd, cfg.group_size, index.shape[1]
    order = torch.sort(index.reshape(-1), stable=True)[1]
    tok, expert = order // k, index.reshape(-1)[order]
    xd = _ste(x, _per_tensor(x.detach(), fwd))
    wgu, wd = _fake_experts(experts.gate_up_proj, fwd), _fake_experts(experts.down_proj, fwd)
    groups = [torch.where(expert == e)[0] for e in range(wgu.shape[0])]
    gu = torch.cat([xd[tok[rows]] @ wgu[e].t() for e, rows in enumerate(groups)])
    gu = _GradQuant.apply(gu, cfg.bwd)
    q, s, _ = R.silu_mul_quant(gu.detach(), fwd, g)
    a = _GatedAct.apply(gu, q, s, g)
    a = _ste(a, _per_tensor(a.detach(), fwd))
    bounds = torch.cumsum(torch.tensor([0] + [len(r) for r in groups]), 0).tolist()
    # each pair's routing weight scales its rows before the down GEMM: the same products, and the gradient reaching
    # act(gate) * up is w (dy W_down) in the FP8 path's float order (another order may flip an E5M2 rounding)
    aw = a * weights.reshape(-1)[order][:, None]
    y = torch.cat([aw[bounds[e]:bounds[e + 1]] @ wd[e].t() for e in range(len(groups))])
    return torch.zeros(x.shape).index_add(0, tok, y)


def test_forward_equals_reference_every_element():
    block, x, index, weights = _experts()
    out = ExpertsFn.apply(x, index, weights, CFG, "silu", block.experts, False, block.experts.gate_up_proj,
                          block.experts.down_proj)
    torch.testing.assert_close(out, reference(x, index, weights, block), rtol=1e-5, atol=1e-6)  # NaN fails
    stock = block.experts(x, index, weights)
    assert 1e-3 < rel_error(out, stock) < 0.12   # FP8 really ran, and stays near the stock experts


@pytest.mark.parametrize("model_type,bwd,keep", [("qwen3_moe", "e5m2", False), ("mixtral", "e5m2", False),
                                                ("qwen3_moe", "e4m3", False), ("qwen3_moe", "e5m2", True),
                                                ("qwen3_moe", "e4m3", True)])
def test_gradients_equal_reference_every_element(model_type, bwd, keep):
    """d x, d routing weights, d gate_up_proj, d down_proj: the reference's, element by element (gradients in
    E5M2, the default, and in E4M3, which the FP8 grouped kernel takes on Hopper), with the weights' codes kept
    from forward (a recomputed layer) or quantized again in backward."""
    cfg = ActivationConfig(bwd_format=bwd)
    block, x, index, weights = _experts(1, model_type)
    params = [x.requires_grad_(), weights.requires_grad_(), block.experts.gate_up_proj, block.experts.down_proj]
    out = ExpertsFn.apply(x, index, weights, cfg, "silu", block.experts, keep, *params[2:])
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, params, dout)
    want = torch.autograd.grad(reference(x, index, weights, block, cfg), params, dout)
    for name, g, w in zip(("x", "weights", "gate_up_proj", "down_proj"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * w.abs().max().item(), msg=name)
    stock = torch.autograd.grad(block.experts(x, index, weights), params, dout)
    assert all(rel_error(g, s) < 0.2 for g, s in zip(got, stock))


def test_nan_input_never_passes():
    block, x, index, weights = _experts()
    x[3, 5] = float("nan")
    out = ExpertsFn.apply(x, index, weights, CFG, "silu", block.experts, False, block.experts.gate_up_proj,
                          block.experts.down_proj)
    assert not torch.isfinite(out).all()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_router_sees_the_stock_norm_output_and_runs_stock(model_type):
    """Routing is not FP8: the router module is the stock one, called on exactly the stock post-attention norm of
    the layer's residual stream (fp32 model: bit for bit), so top-k is what stock picks for that stream."""
    model = coat_ds.inject(build(model_type)).train()
    layer = model.model.layers[0]
    seen = {}
    layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.update(x=i[0], out=o))
    norm_in = {}
    orig = layer._norm

    def record(norm, x):
        if norm is layer.post_attention_layernorm:
            norm_in["h"] = x
        return orig(norm, x)

    layer._norm = record
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss.backward()
    with torch.no_grad():
        assert torch.equal(seen["x"], layer.post_attention_layernorm(norm_in["h"]))
        for a, b in zip(seen["out"], layer.mlp.gate(seen["x"])):
            assert torch.equal(a, b)


def test_aux_loss_and_dense_layers_of_a_qwen3_moe():
    """output_router_logits: HF's load-balancing loss reads the stock router's logits (its capture hooks fire in
    the FP8 layer); a Qwen3-MoE layer listed in mlp_only_layers keeps the dense FP8 flow."""
    stock = build("qwen3_moe", output_router_logits=True, mlp_only_layers=[1])
    injected = coat_ds.inject(copy.deepcopy(stock)).train()
    assert type(injected.model.layers[1].mlp).__name__ == "Qwen3MoeMLP" and injected.model.layers[1]._gu is not None
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ref, out = stock.train()(input_ids=x, labels=x), injected(input_ids=x, labels=x)
    assert out.aux_loss is not None and len(out.router_logits) == 1
    assert abs(out.aux_loss.item() - ref.aux_loss.item()) / ref.aux_loss.item() < 0.02
    out.loss.backward()
    assert injected.model.layers[0].mlp.gate.weight.grad is not None


def test_refusals_in_one_line():
    jitter = build("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise=0") as err:
        coat_ds.inject(jitter)
    assert "\n" not in str(err.value) and not any(isinstance(m, CoatDecoderLayer) for m in jitter.modules())
    relu = build("qwen3_moe", hidden_act="relu")
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        coat_ds.inject(relu, {"mode": "linear"})


def test_sparse_blocks_become_zero3_leaves_even_when_kept_stock():
    """The engine's "coat": {"activation": {"enabled": false}} keeps the stock layers; their sparse blocks are
    still ZeRO-3 leaf modules (DeepSpeed's _z3_leaf), so ranks whose tokens skip an expert gather the same."""
    pytest.importorskip("deepspeed")
    model = build("mixtral")
    assert apply(model, {"enabled": False}, 1) == 0
    blocks = [m.mlp for m in model.model.layers]
    assert all(type(b).__name__ == "MixtralSparseMoeBlock" and getattr(b, "_z3_leaf", False) for b in blocks)
    dense = build("qwen3")
    apply(dense, {"enabled": False}, 1)
    assert not any(getattr(m, "_z3_leaf", False) for m in dense.modules())




def test_aligned_groups_pad_each_group_and_keep_every_product():
    """torch._grouped_mm wants each group's contracted rows a multiple of 16 bytes (a device assert otherwise, seen
    on an H200 with 512 tokens on 8 experts): aligned_groups pads each group with zero rows; every group's a^T b
    is unchanged, empty groups included, and every group starts aligned."""
    from coat_ds.activation.experts import GROUP_ALIGN, aligned_groups
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 16, 1, 0, 33])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a, b = torch.randn(int(offs[-1]), 6), torch.randn(int(offs[-1]), 4)
    pa, pb, poffs = aligned_groups(a, b, offs)
    ends, pends = [0] + offs.tolist(), [0] + poffs.tolist()
    assert pends[-1] == pa.shape[0] == pb.shape[0] and all(e % GROUP_ALIGN == 0 for e in pends)
    for g in range(len(counts)):
        want = a[ends[g]:ends[g + 1]].t() @ b[ends[g]:ends[g + 1]]
        got = pa[pends[g]:pends[g + 1]].t() @ pb[pends[g]:pends[g + 1]]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert pa.abs().sum() == a.abs().sum() and pb.abs().sum() == b.abs().sum()   # every row kept, the rest zero


def _codes(device: str = "cpu"):
    """FP8 codes [8, 64, 32] of random weights and their power-of-two scale per expert, on `device`."""
    from coat_ds.activation.experts import expert_codes
    from coat_ds.formats import get_format
    w = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    return expert_codes(w, get_format("e4m3"))


def test_dequant_is_exact_and_leaves_the_codes_as_they_were():
    """experts._dequant (scaled in place since one trace showed two bf16 copies of a layer's gate_up at backward's
    peak): every element codes x scale, computed apart in fp32 (exact: FP8 codes times a power of two), in the asked
    dtype; the codes unchanged; a 0-d scale too."""
    from coat_ds.activation.experts import _dequant
    codes, scale = _codes()
    before = codes.clone()
    want = codes.float() * scale[:, None, None]
    for dtype in (torch.float32, torch.bfloat16):
        got = _dequant(codes, scale, dtype)
        assert got.dtype == dtype and torch.equal(got.float(), want)
    assert torch.equal(codes.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(_dequant(codes, scale[3], torch.float32), codes.float() * scale[3])


@pytest.mark.gpu
def test_gpu_dequant_holds_one_copy_of_the_weights():
    """On the GPU _dequant's peak is its result's size (one copy), not two (a cast, then a product beside it)."""
    from coat_ds.activation.experts import _dequant
    codes, scale = _codes("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = _dequant(codes, scale, torch.bfloat16)
    assert torch.cuda.max_memory_allocated() - base < 1.5 * out.untyped_storage().nbytes()   # the scale's bytes


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [True, False])
def test_gpu_grouped_fp8_matches_the_cpu_reference(scaled):
    """The CUDA paths (torch._scaled_grouped_mm's FP8 grouped GEMM on Hopper, or torch._grouped_mm on dequantized
    operands; bf16 work tensors) against the CPU reference path (fp32 work tensors) on the same bf16 inputs, every
    element, NaN never passing. The two differ by more than rounding: a bf16 rounding that moves a value across an
    FP8 rounding boundary of a later quantization (the act's E4M3 groups, the gradient's E5M2 tensor) moves it by
    one FP8 step (1/8 or 1/4 of it). Measured on an H200 (benchmarks/logs/moe_grouped_gpu_2026-12-02.log): every
    element within 4% of the tensor's max and 1.8% in norm on both paths; FP8 itself is 6-8% from the stock bf16
    experts in norm. Bounds: twice that, and half of FP8's own distance from stock."""
    from coat_ds.activation import experts as X
    torch.manual_seed(0)
    n_exp, top_k, hid, inter, tokens = 8, 2, 256, 128, 512
    model = build("qwen3_moe", hidden_size=hid, moe_intermediate_size=inter, num_experts=n_exp,
                  num_experts_per_tok=top_k, num_hidden_layers=1).to(torch.bfloat16)
    block = model.model.layers[0].mlp
    x = torch.randn(tokens, hid, dtype=torch.bfloat16)
    _, weights, index = block.gate(x)
    results = {}
    for device in ("cpu", "cuda", "stock"):
        X._SCALED_FAILED[:] = [] if scaled else ["the test's dequantized path"]
        dev = "cpu" if device == "stock" else device
        blk = copy.deepcopy(block).to(dev)
        xd, wd = x.to(dev).requires_grad_(), weights.detach().to(dev).requires_grad_()
        params = [xd, wd, blk.experts.gate_up_proj, blk.experts.down_proj]
        out = (blk.experts(xd, index, wd) if device == "stock" else
               ExpertsFn.apply(xd, index.to(dev), wd, CFG, "silu", blk.experts, False, *params[2:]))
        grads = torch.autograd.grad(out, params, torch.ones_like(out))
        results[device] = [t.float().cpu() for t in (out, *grads)]
    if scaled and torch.cuda.get_device_capability() in X.SCALED_GROUPED_CAPABILITIES \
            and hasattr(torch, "_scaled_grouped_mm"):
        assert not X._SCALED_FAILED, X._SCALED_FAILED   # the FP8 grouped GEMM really ran
    X._SCALED_FAILED.clear()
    for name, got, want, stock in zip(("out", "x", "weights", "gate_up_proj", "down_proj"), results["cuda"],
                                      results["cpu"], results["stock"]):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=0, atol=0.08 * want.abs().max().item(), msg=name)
        assert rel_error(got, want) < min(0.036, 0.5 * rel_error(stock, want)), name


def test_moe_benchmark_refuses_bad_flags_before_any_model(capsys):
    """benchmarks/moe_one_gpu.py: a bad flag fails in one line naming it and the allowed values; its stock rows are the
    preset with coat.activation off, its coat rows the preset as written."""
    from benchmarks import moe_one_gpu as bench
    for argv, key in ((["--configs", "coat,fp4"], "--configs"), (["--micro-batches", "1,x"], "--micro-batches"),
                      (["--seq", "0"], "--seq")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert key in capsys.readouterr().err.splitlines()[-1]
    assert bench.ds_config("stock", 2)["coat"]["activation"] == {"enabled": False}
    coat = bench.ds_config("coat", 2)
    assert coat["coat"]["activation"]["enabled"] and coat["train_micro_batch_size_per_gpu"] == 2
    assert bench.SHAPES[bench.MODEL]["model_type"] == "qwen3_moe"


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_gpu_bf16_moe_close_to_stock(model_type):
    """Whole tiny MoE models in bf16 on the GPU (grouped FP8 experts, FP8 attention path of the dense families):
    loss, logits and gradients near stock's (test_inject's bf16 bounds, gradients as family_cases' MoE bounds:
    routing flips of near-tied tokens), and a cached greedy continuation equal to a full recompute's."""
    from harness import assert_close_to_stock
    shape = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=8,
                 head_dim=32, max_position_embeddings=256)
    stock = build(model_type, **shape).to("cuda", torch.bfloat16)
    injected = coat_ds.inject(copy.deepcopy(stock))
    x = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    assert_close_to_stock(stock.train(), injected.train(), x, loss_tol=1e-2, logits_tol=0.1, grad_max=0.6,
                          grad_mean=0.3)
    model = injected.eval()
    prompt = x[:1, :16]
    gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        full = model(input_ids=gen.sequences).logits
    # a cached step's experts quantize its one token with a scale of its own where the full pass shares one over all
    # tokens, and a near-tied router flips with that: measured on an H200 0.03-0.05 (qwen3_moe) and 0.03-0.15
    # (mixtral) over seeds 0-3, 0.053 / 0.035 at this one; stock's own 0-0.005. Bounded by the FP8 flow's logits
    # bound against stock (logits_tol above): the cache adds no more than FP8 itself
    assert max(rel_error(logits[0], full[0, 15 + i]) for i, logits in enumerate(gen.logits)) < 0.1


def test_qwen3_30b_a3b_shape_builds_and_injects():
    """coat_ds.workloads.shapes' Qwen3-30B-A3B (what the benchmark and the planner mean by it), built as the main job
    builds shapes (from_shape; on the meta device: no memory): 30.53B parameters as published, every layer swapped."""
    from coat_ds.workloads.causal_lm import from_shape
    from coat_ds.workloads.shapes import SHAPES
    model = from_shape(SHAPES["qwen3-30b-a3b"], 0, device="meta")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (128, 2 * 768, 2048)
    coat_ds.inject(model)
    assert all(isinstance(layer, CoatDecoderLayer) for layer in model.model.layers)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_mode_linear_and_recompute(model_type):
    """Mode linear (stock norms; the experts as in mode full) stays near stock; coat.activation.checkpoint's
    recompute replays the router and the grouped FP8 GEMMs exactly: the same gradients, bit for bit."""
    from family_cases import BOUNDS
    from harness import assert_close_to_stock
    stock = build(model_type).train()
    assert_close_to_stock(stock, coat_ds.inject(copy.deepcopy(stock), {"mode": "linear"}).train(),
                          torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1)),
                          **BOUNDS[model_type])
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    grads = []
    for checkpoint in (False, True):
        model = coat_ds.inject(build(model_type), {"checkpoint": checkpoint}).train()
        model(input_ids=x, labels=x).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_recomputed_layers_keep_the_weights_codes_only_from_recompute_to_backward():
    """With coat.activation.checkpoint the experts' FP8 weight codes are saved for backward, but the first forward
    keeps nothing of a recomputed layer (only its input): no saved tensor of the codes' shape outlives it. Without
    checkpointing nothing keeps them (backward quantizes again)."""
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for checkpoint in (False, True):
        model = coat_ds.inject(build("qwen3_moe"), {"checkpoint": checkpoint}).train()
        experts = model.model.layers[0].mlp.experts
        weight_shapes = {tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)}
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            loss = model(input_ids=x, labels=x).loss
        assert not [t for t in kept if t.dtype == torch.float8_e4m3fn and tuple(t.shape) in weight_shapes]
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters())
