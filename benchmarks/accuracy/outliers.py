"""How outlier-heavy a trained model is, where coat quantizes: max |x| over the RMS of each decoder layer's input
(the residual stream entering the layer, whose norm's output coat casts to FP8), over a few validation batches.
A trained model's residual stream grows channels far above its RMS, which a per-tensor FP8 scale must cover; the
larger the ratio, the harder the test of coat's forward on that model.

    python -m benchmarks.accuracy.outliers --model EXPORTED --data .data/corpora/kernel --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.common import check_positive


def decoder_layers(model) -> list:
    """The HF causal LM's decoder layers (model.model.layers: Llama, Mistral, Qwen, Gemma)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; allowed: an HF decoder-only causal LM")
    return list(layers)


def measure(model, batches) -> list[dict]:
    """Per decoder layer: max |x|, RMS and their ratio over every element of its input in `batches` (input ids)."""
    layers = decoder_layers(model)
    acc = [{"max_abs": 0.0, "sum_sq": 0.0, "n": 0} for _ in layers]

    def hook(i: int):
        def pre(module, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).detach()
            acc[i]["max_abs"] = max(acc[i]["max_abs"], x.abs().max().item())
            acc[i]["sum_sq"] += x.double().square().sum().item()
            acc[i]["n"] += x.numel()
        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for i, a in enumerate(acc):
        rms = (a["sum_sq"] / a["n"]) ** 0.5 if a["n"] else float("nan")
        rows.append({"layer": i, "max_abs": a["max_abs"], "rms": rms, "ratio": a["max_abs"] / rms if rms else None})
    return rows


def summary(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    top = max(rows, key=lambda r: r["ratio"] or 0.0)
    return {"max_ratio": top["ratio"], "max_ratio_layer": top["layer"], "median_ratio": statistics.median(ratios),
            "max_abs": max(r["max_abs"] for r in rows)}


def of_export(model_dir: str, data: str, batches: int, micro_batch: int, seq_len: int) -> dict:
    """The measure for an exported model on `batches` micro-batches of fixed windows of `data`'s validation split
    (the main job's own windows), on the GPU in bf16 where there is one, else on the CPU in fp32."""
    from transformers import AutoModelForCausalLM

    from coat_ds.workloads import data as data_lib

    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.to("cuda" if on_gpu else "cpu").eval()
    tokens = data_lib.load(data, seq_len)
    windows = data_lib.Batches(tokens, seq_len, micro_batch, 1, 0, 1, 0).val_batches(batches)
    rows = measure(model, (x for x, _ in windows))
    return {"model": model_dir, "data": data, "tokens": batches * micro_batch * seq_len, "seq_len": seq_len,
            "dtype": "bfloat16" if on_gpu else "float32", **summary(rows), "layers": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an HF model folder (the main job's --export)")
    p.add_argument("--data", required=True, help="a token folder, as the main job's --data")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", required=True, help="the JSON to write")
    args = p.parse_args(argv)
    check_positive(p, args, ("batches", "micro_batch", "seq_len"))
    res = of_export(args.model, args.data, args.batches, args.micro_batch, args.seq_len)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"max |x| / RMS at the decoder layers' inputs: up to {res['max_ratio']:.1f} (layer "
          f"{res['max_ratio_layer']}), median {res['median_ratio']:.1f} -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
