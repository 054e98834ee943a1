"""Host time of a decoder layer's forward+backward: what bounds a training step when the GPU waits on Python.

    python -m benchmarks.host_overhead --out benchmarks/results/host_overhead.json
    python -m benchmarks.host_overhead --dry-run --out /tmp/host.json          # CPU, tiny: the script only

A stack of llama_layer's layers at a tiny token count, where the wall time is the host's; docs/benchmarks.md
says what each row reports.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks import llama_layer as L   # the stack of layers, the variants, the dry-run patches
from benchmarks.common import (RESULTS, check_positive, device_time_attr, is_device_event, profiler, provenance,
                               write_json)

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SHAPES = {name: {k: L.MODELS[name][k] for k in L.LAYER} for name in ("llama-1b", "llama2-7b")}


def profile_counts(stack, x, cos, sin, grad, on_cuda: bool, top: int) -> dict:
    with profiler(on_cuda) as prof:
        L.step(stack, x, cos, sin, grad)
        torch.cuda.synchronize()
    events = prof.key_averages()
    n = L.N_LAYERS
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    kernels = Counter()
    kernel_us = 0.0
    if on_cuda:
        dev_attr = device_time_attr(events)
        for e in events:
            if getattr(e, dev_attr, 0) > 0 and is_device_event(e):
                kernels[e.key[:90]] += e.count
                kernel_us += getattr(e, dev_attr)
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"launches_per_layer": launches / n, "aten_calls_per_layer": aten / n,
            "kernel_ms_per_layer": kernel_us / 1e3 / n,
            "kernels_per_layer": {k: v / n for k, v in kernels.most_common()},
            "host_top_per_layer": [{"name": e.key[:90], "calls": e.count / n,
                                    "self_ms": e.self_cpu_time_total / 1e3 / n} for e in host]}


def measure(name: str, shape: str, base, x, cos, sin, iters: int, warmup: int, on_cuda: bool, top: int) -> dict:
    stack = L.make_variant(name, base)
    grad = torch.randn_like(x) * 1e-3
    L.warm_up(stack, x, cos, sin, grad, warmup)
    times = []
    for _ in range(iters):
        L.clear_cache(stack)         # the first micro-batch of a step: weights are quantized in the forward
        t0 = time.perf_counter()
        L.step(stack, x, cos, sin, grad)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / L.N_LAYERS)
    L.clear_cache(stack)
    row = {"shape": shape, "variant": name, "host_ms_per_layer": statistics.median(times),
           "host_ms_per_layer_min": min(times)}
    row.update(profile_counts(stack, x, cos, sin, grad, on_cuda, top))
    del stack
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "host_overhead.json"))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=["bf16_eager", "coat_linear", "coat_full"],
                    choices=[v for v in L.VARIANTS if not v.endswith("compiled")])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256, help="a multiple of 16 (the FP8 GEMMs' alignment)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="host calls listed per variant")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = ap.parse_args(argv)
    check_positive(ap, args, ("batch", "seq", "iters", "top"))
    if args.seq % 16:
        ap.error(f"--seq={args.seq} is invalid; allowed: a multiple of 16")
    L.SHAPES.update(SHAPES)
    if args.dry_run:
        L.dry_run()
    L.BATCH, L.SEQ = (L.BATCH, L.SEQ) if args.dry_run else (args.batch, args.seq)
    on_cuda = L.DEV == "cuda"
    meta = dict(**provenance(extra=("torchao",)), layers=L.N_LAYERS, batch=L.BATCH, seq=L.SEQ)
    rows = []
    for shape in args.shapes:
        _, base, x, cos, sin = L.build_base(shape)
        for name in args.variants:
            rows.append({**meta, **measure(name, shape, base, x, cos, sin, args.iters, args.warmup, on_cuda,
                                           args.top)})
            r = rows[-1]
            print(f"{shape:10s} {name:12s} host {r['host_ms_per_layer']:6.3f} ms/layer  kernels "
                  f"{r['kernel_ms_per_layer']:6.3f} ms  launches {r['launches_per_layer']:6.1f}  aten "
                  f"{r['aten_calls_per_layer']:6.1f}", flush=True)
        del base
    print(f"-> {write_json(args.out, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
