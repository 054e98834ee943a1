"""Kernels and layers (benchmarks/llama_layer.py, optimizer_step.py, quant_error.py): a decoder-layer stack's
activations and time, one optimizer step, the moments' quantization error."""
from __future__ import annotations

from pathlib import Path

from benchmarks.tables import load, num, table


@table
def llama_layer(res: Path):
    """docs/activation.md: a stack of 4 decoder layers: activation bytes kept for backward, time, peak, gradient."""
    variants = (("bf16_eager", "HF `LlamaDecoderLayer`, bf16 eager"), ("bf16_compiled", "same, `torch.compile`"),
                ("torchao_fp8_compiled", "torchao float8 (tensorwise), `torch.compile`"),
                ("coat_linear", "coat_ds FP8 linears only, eager"), ("coat_full", "coat_ds full FP8 flow, eager"),
                ("coat_full_compiled", "coat_ds full FP8 flow, `torch.compile`"),
                ("coat_full_attn_fp8", "coat_ds full FP8 flow + `attention_fp8`, eager"),
                ("coat_full_attn_fp8_compiled", "same, `torch.compile`"))
    rows = {(r["shape"], r["variant"]): r for r in load(res, "llama_layer.json")}
    yield ["variant", "7B B/tok/h", "7B fwd+bwd ms", "7B peak GB", "8B (GQA) B/tok/h", "8B fwd+bwd ms",
           "input-grad cosine vs bf16 (7B)"]
    for key, label in variants:
        a, b = rows.get(("llama2-7b", key)), rows.get(("llama3-8b", key))
        yield [label, num(a and a["act_bytes_per_token_hidden"], 2), num(a and a["fwd_bwd_ms"], 2),
               num(a and a["peak_mem_bytes"] / 1e9), num(b and b["act_bytes_per_token_hidden"], 2),
               num(b and b["fwd_bwd_ms"], 2), num(a and a["dx_cos_vs_bf16_eager"], 3)]


@table
def quant_error(res: Path):
    """docs/optimizer.md: mean relative error of Adam's moments after one quantization."""
    yield ["scheme", "m", "v"]
    for r in load(res, "quant_error.json")["rows"]:
        yield [r["scheme"], f"{100 * r['m_rel_err']:.2f}%", f"{100 * r['v_rel_err']:.2f}%"]


@table
def optimizer_step(res: Path):
    """docs/results.md: one optimizer step over a flat fp32 tensor (fp32 grads), ms."""
    optimizers = (("coat", "CoatAdamW kernel"), ("coat_step", "CoatAdamW.step"), ("fused_adam", "DeepSpeed FusedAdam"),
                  ("torch_adamw", "torch fused AdamW"), ("torchao_fp8", "torchao AdamWFp8"),
                  ("torchao_8bit", "torchao AdamW8bit"), ("bnb_8bit", "bnb AdamW8bit"))
    rows = [r for r in load(res, "optimizer_step.json")["rows"]
            if r["grad_dtype"] == "float32" and r["master"] == "float32"]
    yield ["values", *[label for _, label in optimizers]]
    for r in sorted(rows, key=lambda r: -r["numel"]):
        yield [f"{r['numel']:.0e}", *[num(r.get(f"{k}_ms"), 3) for k, _ in optimizers]]


@table
def optimizer_step_masters(res: Path):
    """docs/results.md: CoatAdamW's kernel at 1e9 values by gradient dtype and master weights."""
    masters = {"float32": "fp32 (`fp32`)", "float32_remainder": "fp32 as bf16 + int16 remainder (`fp32_remainder`)",
               "bfloat16_sr": "bf16, stochastic rounding (`bf16_sr`)"}
    rows = [r for r in load(res, "optimizer_step.json")["rows"] if r["numel"] == 1e9]
    fused = next(r["fused_adam_ms"] for r in rows if r.get("fused_adam_ms"))
    yield ["gradients", "master", "ms", "bytes moved / param", "GB/s", "share of copy bandwidth", "vs FusedAdam (fp32)"]
    for r in rows:
        yield [r["grad_dtype"], masters[r["master"]], num(r["coat_ms"], 3), num(r["coat_bytes_per_param"], 2),
               num(r["coat_gbps"], 0), f"{r['coat_frac_of_copy']:.1%}", f"{fused / r['coat_ms']:.2f}x"]
