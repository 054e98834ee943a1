"""Activation memory and step time of one Llama decoder layer: bf16 / torchao float8 / coat_ds FP8 flow.

Each variant runs a stack of 4 identical layers on the same weights and input (docs/benchmarks.md: how each figure
is measured); --dry-run: the script alone, CPU, tiny shapes."""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import traceback

import torch
from torch import nn

from benchmarks.common import RESULTS, call_ms, check_positive, parser, provenance, write_json
from coat_ds.workloads.shapes import ALIASES, SHAPES as MODELS

LAYER = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")   # a layer's shape fields
SHAPES = {name: {k: MODELS[ALIASES.get(name, name)][k] for k in LAYER} for name in ("llama2-7b", "llama3-8b")}
VARIANTS = ["bf16_eager", "bf16_compiled", "torchao_fp8_compiled", "coat_linear", "coat_full", "coat_full_compiled",
            "coat_full_attn_fp8", "coat_full_attn_fp8_compiled"]
N_LAYERS, BATCH, SEQ = 4, 4, 2048
DEV = "cuda"


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, cos, sin):
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_embeddings=(cos, sin))
        return x


def build_base(shape: str, seed: int = 0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=SEQ)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layers = []
    for i in range(N_LAYERS):
        layer = LlamaDecoderLayer(cfg, i).to(DEV, torch.bfloat16)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.uniform_(0.8, 1.2)
        layers.append(layer)
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(SEQ, device=DEV)[None].expand(BATCH, SEQ)
    cos, sin = LlamaRotaryEmbedding(cfg).to(DEV)(x, pos)
    return cfg, layers, x, cos, sin


def make_variant(name: str, layers):
    layers = [copy.deepcopy(layer) for layer in layers]
    if name.startswith("coat"):
        from coat_ds.hf import CoatDecoderLayer

        cfg = {"mode": "linear" if name == "coat_linear" else "full", "attention_fp8": "attn_fp8" in name}
        layers = [CoatDecoderLayer(layer, cfg) for layer in layers]
    if name.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        layers = [convert_to_float8_training(layer, config=Float8LinearConfig()) for layer in layers]  # tensorwise
    if name.endswith("compiled"):  # one compiled graph, reused by the 4 layers
        layers = [torch.compile(layer) for layer in layers]
    return Stack(layers)


def coat_layers(stack):
    from coat_ds.hf import CoatDecoderLayer

    return [m for m in stack.modules() if isinstance(m, CoatDecoderLayer)]   # not their torch.compile wrappers


def clear_cache(stack):
    for layer in coat_layers(stack):
        layer.clear_weight_cache()


def cache_bytes(stack):
    return sum(layer.weight_cache_bytes() for layer in coat_layers(stack))


def step(stack, x, cos, sin, grad, keep=()):
    """The input gradient (and fp32 copies of the gradients of the parameters named in `keep`)."""
    xi = x.detach().requires_grad_()
    stack(xi, cos, sin).backward(grad)
    grads = {n.replace("._orig_mod", ""): p.grad.float() for n, p in stack.named_parameters()
             if n.replace("._orig_mod", "") in keep}
    stack.zero_grad(set_to_none=True)
    return (xi.grad, grads) if keep else xi.grad


REF_GRAD = {}  # shape -> the stack's gradients under bf16_eager: the gradient quality of every variant
# the first layer's (its gradients went through all 4 layers' backward): q_proj and o_proj around attention
GRAD_PARAMS = ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight")


def grad_quality(name, shape, stack, x, cos, sin, grad) -> dict:
    """Cosine of the input gradient and of GRAD_PARAMS' gradients to bf16_eager's (which runs first)."""
    clear_cache(stack)
    dx, grads = step(stack, x, cos, sin, grad, keep=GRAD_PARAMS)
    grads["input"] = dx.float()
    if name == "bf16_eager":
        REF_GRAD[shape] = grads
    ref = REF_GRAD.get(shape, {})
    return {k.split(".")[-2] if "." in k else k: torch.nn.functional.cosine_similarity(
        g.flatten(), ref[k].flatten(), 0).item() for k, g in grads.items() if k in ref}


def measure(name, shape, cfg, base, x, cos, sin, iters, warmup):
    stack = make_variant(name, base)
    grad = torch.randn(x.shape, device=x.device, generator=torch.Generator(x.device).manual_seed(5)).to(x.dtype)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(warmup):   # the cache emptied each time: coat's first steps tune GEMMs, compiled ones compile
        clear_cache(stack)
        step(stack, x, cos, sin, grad)
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    # activation memory: first micro-batch (cache emptied)
    clear_cache(stack)
    xi = x.detach().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = stack(xi, cos, sin)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    cache_fwd = cache_bytes(stack)
    out.backward(grad)
    cache_full = cache_bytes(stack)
    del out, xi
    stack.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    def timed(keep_cache):
        times = []
        for _ in range(iters):
            if not keep_cache:
                clear_cache(stack)
            times.append(call_ms(lambda: step(stack, x, cos, sin, grad), DEV) / N_LAYERS)
        return statistics.median(times)

    grad_cos = grad_quality(name, shape, stack, x, cos, sin, grad)
    ms = timed(keep_cache=False)
    ms_cached = timed(keep_cache=True) if name.startswith("coat") else ms
    tokens = BATCH * SEQ
    act, act_excl = (after - before) / N_LAYERS, (after - before - cache_fwd) / N_LAYERS
    row = dict(shape=shape, variant=name, act_bytes=int(act), act_bytes_per_token_hidden=act / tokens / cfg.hidden_size,
               weight_cache_bytes=int(cache_full / N_LAYERS), weight_cache_bytes_in_act=int(cache_fwd / N_LAYERS),
               act_bytes_excl_cache=int(act_excl),
               act_bytes_per_token_hidden_excl_cache=act_excl / tokens / cfg.hidden_size,
               fwd_bwd_ms=ms, fwd_bwd_ms_cached=ms_cached, warmup_s=warm_s, dx_cos_vs_bf16_eager=grad_cos.get("input"),
               grad_cos_vs_bf16=grad_cos, peak_mem_bytes=torch.cuda.max_memory_allocated())
    return row


def account(shapes, variants, seq: int = 64):
    """CPU, full-size shapes, a short sequence: each tensor autograd keeps for one layer's backward, in B/token/hidden
    (shape-proportional: the GPU run's figures but for the stack's output, 2 / N_LAYERS, and allocator rounding)."""
    global DEV, BATCH, SEQ, N_LAYERS
    stack_output = 2 / N_LAYERS   # the GPU stack's bf16 output, per layer
    DEV, BATCH, SEQ, N_LAYERS = "cpu", 1, seq, 1
    rows = []
    for shape in shapes:
        cfg, base, x, cos, sin = build_base(shape)
        for name in (v for v in variants if not v.endswith("compiled")):
            stack, saved = make_variant(name, base), []
            skip = {t.untyped_storage().data_ptr() for t in (*stack.parameters(), cos, sin)}
            # noqa below: ruff's false positive on a name deleted after the closure ran
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):  # noqa: F821
                out = stack(x.detach().requires_grad_(), cos, sin)
            kept = {t.untyped_storage().data_ptr(): t for t in saved if t.untyped_storage().data_ptr() not in skip}
            per = BATCH * SEQ * cfg.hidden_size
            tensors = sorted(((str(t.dtype).replace("torch.", ""), list(t.shape), t.untyped_storage().nbytes() / per)
                              for t in kept.values()), key=lambda r: -r[2])
            total = sum(r[2] for r in tensors)
            rows.append(dict(shape=shape, variant=name, kept_per_layer=total, with_stack_output=total + stack_output,
                             tensors=tensors))
            print(f"{shape} {name}: {total:.3f} B/token/hidden kept per layer (+{stack_output} stack output = "
                  f"{total + stack_output:.3f})")
            for dtype, shp, b in tensors:
                print(f"    {b:7.4f}  {dtype:14s} {shp}")
            del out, saved, kept, stack
    return rows


def dry_run():
    """Swap CUDA for the CPU (timed by the clock, memory read as 0) and the shapes for tiny ones."""
    global DEV, BATCH, SEQ
    DEV, BATCH, SEQ = "cpu", 2, 32
    for s in SHAPES.values():
        s.update(hidden_size=64, intermediate_size=160 if s["num_key_value_heads"] == 32 else 224,
                 num_attention_heads=4, num_key_value_heads=4 if s["num_key_value_heads"] == 32 else 2)
    for fn in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        setattr(torch.cuda, fn, lambda *a, **k: None)
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a, **k: 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser(__doc__, out=(None, "default: benchmarks/results/llama_layer.json (--account: none)"),
                warmup=(3, "untimed iterations"))
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["llama2-7b", "llama3-8b"])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    ap.add_argument("--iters", type=int, default=8, help="timed iterations")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ap.add_argument("--account", action="store_true", help="CPU, full shapes: the kept tensors of each variant")
    args = ap.parse_args(argv)
    check_positive(ap, args, ("iters",))
    if not args.account:   # --account prints; it writes only to an --out named (not over llama_layer.json)
        args.out = args.out or str(RESULTS / "llama_layer.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.account:
        rows = account(args.shapes, args.variants)
        if args.out:
            write_json(args.out, rows)
        return
    if args.dry_run:
        dry_run()
    meta = dict(**provenance(extra=("torchao",)), layers=N_LAYERS, batch=BATCH, seq=SEQ)
    rows = []
    for shape in args.shapes:
        cfg, base, x, cos, sin = build_base(shape)
        for name in args.variants:
            try:
                row = measure(name, shape, cfg, base, x, cos, sin, args.iters, args.warmup)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                traceback.print_exc()
                row = dict(shape=shape, variant=name, error=f"{type(exc).__name__}: {exc}"[:500])
            torch.cuda.empty_cache()   # the variant's stack is gone with measure's frame
            rows.append({**meta, **row})
            print(json.dumps(rows[-1]), flush=True)
            write_json(args.out, rows)
        del base
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
