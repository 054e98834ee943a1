"""The FP8 layer under torch.compile and other tracers: what the traced graph holds, and its gradients.

Two ways a traced FP8 layer has given wrong gradients, each checked here on the CPU:
  - torch < 2.13 (seen on 2.11, CPU and CUDA): an autograd.Function whose forward adds into its own output
    in place (`out += residual`) gets a compiled backward that ignores the output's gradient (uses zeros),
    so every gradient before it is 0. The forward is right. Torch 2.13 traces it correctly, so on 2.13 the
    check is structural: no autograd.Function forward in the Dynamo graph mutates anything in place.
  - an eager implementation (a CUDA kernel writing into `torch.empty` outputs through raw pointers) run on
    fake/functional tensors while a graph is traced: the graph would hold only the empty outputs. Every
    tracer must see the `coat_act` custom ops instead (quant.tracing()), also make_fx without Dynamo."""
import collections
import copy
import operator

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from coat_ds.activation import gemm
from coat_ds.kernels import quant
from coat_ds.kernels.custom_op import KERNEL_OPS
from coat_ds.hf import CoatDecoderLayer

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402

from coat_ds.formats import E4M3, E5M2  # noqa: E402



@pytest.fixture
def eager_impl_calls(monkeypatch):
    """(name, traced) of every call of an eager implementation (and of the kernels' applicability check);
    traced: a python dispatch mode is active or an argument is a tensor subclass (fake/functional), i.e.
    the call happens while a graph is traced."""
    calls = collections.Counter()
    assert {gemm.fp8_mm, quant.row_amax, quant.rope_qkv_backward} <= set(KERNEL_OPS.values())
    for name, kop in KERNEL_OPS.items():
        def wrapped(*args, _f=kop.impl, _n=name, **kwargs):
            traced = _get_current_dispatch_mode() is not None or any(
                isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter)
                for a in (*args, *kwargs.values()))
            calls[(_n, traced)] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(kop, "impl", wrapped)
    kernels = quant._kernels

    def kernels_check(*tensors, **kwargs):  # reads data pointers: a graph break on CUDA tensors under Dynamo
        calls[("_kernels", quant.tracing(tensors[0]))] += 1
        return kernels(*tensors, **kwargs)
    monkeypatch.setattr(quant, "_kernels", kernels_check)
    return calls


def _layer(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return cfg, layer


def _forward(fn, cfg, x):
    """(input leaf, output) of a layer's forward on a copy of x."""
    b, s, _ = x.shape
    pos = torch.arange(s)[None].expand(b, s)
    xi = x.detach().clone().requires_grad_()
    return xi, fn(xi, attention_mask=None, position_ids=pos, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))


def _run(fn, layer, cfg, x):
    xi, y = _forward(fn, cfg, x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
    out = {"out": y.detach(), "dx": xi.grad} | {n: p.grad for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out


def _in_place_ops_in_function_forwards(gm: torch.fx.GraphModule) -> list[str]:
    """In-place ops in the forward subgraphs of the autograd.Functions that Dynamo traced."""
    bodies = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and "autograd_function_apply" in str(node.target):
            bodies.update(a.target for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr")
    found = []
    for name in bodies:
        body = getattr(gm, name)
        if not isinstance(body, torch.fx.GraphModule) or "bwd" in name:
            continue
        for node in body.graph.nodes:
            t = node.target
            in_place = t in (operator.iadd, operator.isub, operator.imul, operator.itruediv) or (
                node.op == "call_method" and isinstance(t, str) and t.endswith("_") and not t.startswith("_")) or (
                isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable)
            if node.op in ("call_function", "call_method") and in_place:
                found.append(f"{name}: {t}")
    return found


@pytest.mark.parametrize("options", [{"mode": "full"}, {"mode": "linear"}, {"mode": "full", "attention_fp8": True}],
                         ids=["full", "linear", "full-attention_fp8"])
def test_compiled_grads_equal_eager(options, eager_impl_calls):
    """torch.compile (fullgraph, AOTAutograd without inductor): output and every gradient bit-identical to
    eager (same ops, same order; NaN never equal); no eager implementation runs while tracing; no Function
    forward mutates in place (the torch < 2.13 zero-gradient trigger)."""
    cfg, ref = _layer()
    eager_layer = CoatDecoderLayer(copy.deepcopy(ref), options)
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = _run(eager_layer, eager_layer, cfg, x)
    assert not any(traced for _, traced in eager_impl_calls)
    eager_impl_calls.clear()

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    layer = CoatDecoderLayer(copy.deepcopy(ref), options)
    got = _run(torch.compile(layer, backend=backend, fullgraph=True), layer, cfg, x)
    assert len(graphs) == 1
    assert _in_place_ops_in_function_forwards(graphs[0]) == []
    traced = sorted(name for (name, t) in eager_impl_calls if t)
    assert traced == [], f"eager implementations ran on traced tensors: {traced}"
    assert want.keys() == got.keys()
    for name in want:
        assert torch.isfinite(want[name]).all() and want[name].abs().max() > 0, name
        assert torch.equal(got[name], want[name]), (name, (got[name].float() - want[name].float()).abs().max())


def _saved_bytes(fn, cfg, x) -> tuple[int, set]:
    """Bytes (distinct storages) and shapes of what one forward saves for backward, 0-d tensors (the 4-byte
    per-tensor scales, which a graph may save as copies of its own) left out."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _forward(fn, cfg, x)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved if t.dim()}
    return sum(storages.values()), {tuple(t.shape) for t in saved}


def test_compiled_layer_saves_what_eager_saves():
    """The compiled layer keeps no FP8 weight copy across the step: every weight operand is quantized where
    it is used, from the parameter itself (a detached view of it, or a bf16 concatenation shared by forward
    and backward, made the partitioner keep the backward's FP8 transposed weights: +4.2 B/token/hidden
    at 7B on the H100). With attention_fp8 it saves exactly what eager saves; without, eager's o_proj keeps
    a reference to attention's own saved output where the graph keeps an FP8 copy (1 B/token/hidden)."""
    cfg, ref = _layer()
    x = torch.randn(2, 48, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # 96 tokens
    weights = {tuple(p.shape) for p in ref.parameters() if p.dim() == 2}
    weights |= {(k, n) for n, k in weights} | {(128, 384), (384, 128), (128, 704), (704, 128)}  # fused q/k/v, gate/up
    for options, extra in (({"mode": "full", "attention_fp8": True}, 0), ({"mode": "full"}, 96 * 128)):
        layer = CoatDecoderLayer(copy.deepcopy(ref), options)
        eager, _ = _saved_bytes(layer, cfg, x)
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        _run(compiled, layer, cfg, x)  # compiles, outside hooks: torch.func (attention_fp8's traced vjp) refuses them
        got, shapes = _saved_bytes(compiled, cfg, x)
        assert not shapes & weights, (options, shapes & weights)
        assert got == eager + extra, (options, got, eager)


@pytest.mark.slow
@pytest.mark.one_core   # ~40 s of inductor compiling in a fresh clone (a cold inductor cache), on one core
@pytest.mark.parametrize("options", [{}, {"attention_fp8": True}], ids=["full", "full-attention_fp8"])
def test_inductor_grads_match_eager(options):
    """Default backend (inductor, CPU), as users compile the layer: fullgraph=True traces it whole (custom ops
    with fake kernels, no graph break); inductor fuses the bf16 element-wise math around the custom ops, so
    results move by bf16 roundings: cosine >= 0.998 for every tensor, none all-zero, all finite."""
    cfg, ref = _layer()
    eager_layer = CoatDecoderLayer(copy.deepcopy(ref), options)
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = _run(eager_layer, eager_layer, cfg, x)
    torch._dynamo.reset()
    layer = CoatDecoderLayer(copy.deepcopy(ref), options)
    got = _run(torch.compile(layer, fullgraph=True), layer, cfg, x)
    for name in want:
        a, b = got[name].float(), want[name].float()
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item() >= 0.998, name


def test_make_fx_traces_custom_ops(eager_impl_calls):
    """make_fx (no Dynamo: torch.compiler.is_compiling() is False) of the ops, forward and backward kinds:
    the graph holds the opaque coat_act ops, never an eager implementation's insides."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, dy, wt):
        xq, xs, rstd, ymax = quant.rmsnorm_quant(x, w, 1e-6, E4M3, 16)
        ys = quant.tensor_scale(ymax, E4M3)
        y, yt = quant.rmsnorm_rebuild(xq, xs, rstd, w, ys, E4M3, 16, True, True)
        ws = quant.tensor_scale(quant.row_amax(wt), E4M3)
        wq, _ = quant.quant_tensor(wt, ws, E4M3)
        out = gemm.fp8_mm(y, ys, wq, ws, x.dtype)
        q, s, amax = quant.silu_mul_quant(torch.cat([out, out], 1), E4M3, 16)
        dgu, _ = quant.silu_mul_backward(dy, q, s, 16)
        dx, dw = quant.rmsnorm_backward(dgu[:, :128], xq, xs, rstd, w, 16, dres=dy)
        return out, dx, dw, yt, quant.silu_mul_rebuild(q, s, quant.tensor_scale(amax, E5M2), E5M2, 16)[0]

    x, dy = torch.randn(32, 128).bfloat16(), torch.randn(32, 128).bfloat16()
    w, wt = (torch.rand(128) + 0.5).bfloat16(), torch.randn(128, 128).bfloat16()
    for mode in ("fake", "real"):
        eager_impl_calls.clear()
        gm = make_fx(f, tracing_mode=mode)(x, w, dy, wt)
        targets = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        ours = {t.split(".")[1] for t in targets if t.startswith("coat_act.")}
        assert ours == {"rmsnorm_quant", "tensor_scale", "rmsnorm_rebuild", "row_amax", "quant_tensor", "fp8_mm",
                        "silu_mul_quant", "silu_mul_backward", "rmsnorm_backward", "silu_mul_rebuild"}, targets
        assert not any(traced for _, traced in eager_impl_calls), eager_impl_calls
        for a, b in zip(gm(x, w, dy, wt), f(x, w, dy, wt)):
            assert torch.equal(a, b)


def test_eager_path_skips_the_dispatcher(eager_impl_calls):
    """On real tensors with no dispatch mode, the ops call their implementation directly."""
    assert not quant.tracing(torch.ones(2)) and not quant.tracing()
    x = torch.randn(32, 64).bfloat16()
    quant.row_amax(x)
    assert eager_impl_calls == {("row_amax", False): 1, ("_kernels", False): 1}


def test_fakes_match_implementations():
    """torch.library.opcheck (fake tensor check) of every op but RoPE (CUDA only) on the CPU path: each
    fake gives its implementation's shapes, dtypes and strides, for every optional layout and argument."""
    x, w, s = torch.randn(32, 64).bfloat16(), (torch.rand(64) + 0.5).bfloat16(), torch.tensor(0.5)
    xq, xs, rstd, ymax = quant.rmsnorm_quant(x, w, 1e-6, E4M3, 16)
    q, qs, _ = quant.silu_mul_quant(x, E5M2, 16)
    cases = [(quant.row_amax, (x,)), (quant.tensor_scale, (ymax, "e5m2")),
             (quant.quant_tensor, (x, s, "e4m3", False, True)), (quant.quant_tensor, (x, s, "e5m2")),
             (quant.rmsnorm_quant, (x, w, 1e-6, "e4m3", 16)), (quant.rmsnorm_save, (x, w, 1e-6, "e5m2", 16)),
             (quant.rmsnorm_rebuild, (xq, xs, rstd, w, s, "e5m2", 16, True, True)),
             (quant.rmsnorm_backward, (x, xq, xs, rstd, w, 16, x)), (quant.rmsnorm_backward, (x, xq, xs, rstd, w, 16)),
             (quant.silu_mul_quant, (x, "e4m3", 16)), (quant.silu_mul_rebuild, (q, qs, s, "e4m3", 16, False, True)),
             (quant.silu_mul_backward, (x[:, :32], q, qs, 16)), (quant.group_dequant, (q, qs, 16, torch.bfloat16)),
             (gemm.fp8_mm, (xq, s, xq, s, torch.bfloat16, None))]
    assert {k for k, _ in cases} == set(KERNEL_OPS.values()) - {quant.rope_qkv, quant.rope_qkv_backward}
    for kop, args in cases:
        torch.library.opcheck(kop.op, args, test_utils="test_faketensor")
