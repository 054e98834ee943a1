"""Models past one GPU's reach on ONE capped GPU (benchmarks/moe_one_gpu.py, long_context.py): a mixture of experts
full-parameter, and long sequences."""
from __future__ import annotations

from pathlib import Path

from benchmarks.tables import gpu, headline, load, num, table


def _where(doc: dict) -> str:
    return f"{gpu(doc['device'])} capped at {num(doc['cap_gib'], 0)} GiB"


@table
def moe_one_gpu(res: Path):
    """docs/results.md: Qwen3-30B-A3B at seq 4096, full-parameter, on one GPU capped at an 80 GB card's memory, and
    6 of its layers, where BF16 + DeepSpeedCPUAdam's host states fit the device's host."""
    yield ["GPU", "configuration", "layers", "micro-batch", "tokens/s", "step s (forward / backward / step)",
           "GiB allocated / reserved", "host B/param"]
    docs = [load(res, "moe_one_gpu.json", "Qwen3-30B-A3B on one GPU"), load(res, "moe_one_gpu_6_layers.json")]
    for doc in docs:
        for r in sorted(doc["rows"], key=lambda r: (r["config"], r["micro_batch"])):
            if not r["fits"]:
                yield [_where(doc), r["config"], doc["shape"]["num_hidden_layers"], r["micro_batch"],
                       "does not fit", "-", "out of memory", "-"]
                continue
            split = (f" ({num(r['forward_s'], 2)} / {num(r['backward_s'], 2)} / {num(r['step_s'], 2)})"
                     if "forward_s" in r else "")
            yield [_where(doc), r["config"], r["layers"], r["micro_batch"], num(r["tokens_per_s"], 0),
                   num(r["step_time_s"], 2) + split, f"{num(r['peak_alloc_gib'])} / {num(r['peak_reserved_gib'])}",
                   num(r["host_bytes_per_param"], 2)]


def _long_rows(doc: dict):
    yield ["GPU", "configuration", "layers", "tokens", "tokens/s", "GiB allocated (peak / resident)",
           "GPU KB a token", "host GiB"]
    for r in sorted(doc["rows"], key=lambda r: (-r["layers"], r["config"], r["seq"])):
        if r["fits"]:
            layers = f"{r['layers']} (+ {r['emulated_layers'] - r['layers']} as ballast)" if r.get("emulated_layers") \
                else r["layers"]
            yield [_where(doc), r["config"], layers, f"{r['seq']:,}", num(r["tokens_per_s"], 0),
                   f"{num(r['peak_alloc_gib'])} / {num(r['resident_gib'])}", num(r["gpu_bytes_per_token"] / 1024, 0),
                   num(r["host_peak_rss_gib"])]


@table
def long_context(res: Path):
    """docs/results.md: Llama-3.1-8B's width at one micro-batch of a long sequence on one GPU capped at 79 GiB."""
    yield from _long_rows(load(res, "long_context.json", "Long context on one GPU"))


@table
def long_context_alst(res: Path):
    """docs/results.md: coat beside DeepSpeed's ALST stack on an untied Llama-3.2-3B, one capped GPU."""
    yield from _long_rows(load(res, "long_context_llama3.2-3b-untied.json", "coat beside ALST"))


headline("moe_one_gpu", "H200", "coat", 48, 8)
headline("long_context", "H200", "host_fp8_tiled", 32, "131,072")
