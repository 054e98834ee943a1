"""One optimizer step over one flat master tensor (as ZeRO hands it over): CoatAdamW against its peers.

docs/benchmarks.md has the commands, which rows and contenders run and what each row reports."""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import traceback

import torch

from benchmarks.common import RESULTS, call_ms, cpu_info, device_name, parser, provenance, write_json
from coat_ds import kernels as ops
from coat_ds.formats import E4M3, get_format, n_groups

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# (grad dtype, master): the fp32 master with fp32 or bf16 grads, a bf16 master (stochastic rounding), and the
# exact fp32 master held as bf16 + int16 remainder (coat.master_weights 'fp32_remainder')
CASES = ((torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.bfloat16, "bfloat16_sr"),
         (torch.bfloat16, "float32_remainder"))
PEERS_NEED = "needs grads and master in fp32 (the param's dtype)"


# --- measuring --------------------------------------------------------------------------------------------------------
def timings(fns: dict, device: str, warmup: int, runs: int) -> dict[str, list[float]]:
    """Each contender's timed calls (ms) in interleaved rounds, so a shared host's changing load falls on all alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + runs):
        for name, fn in fns.items():
            ms = call_ms(fn, device)
            if i >= warmup:
                times[name].append(ms)
    return times


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of t; a tensor subclass (torchao's quantised states) counts its inner tensors."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def copy_gbps(numel: int, device: str, runs: int) -> float:
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(timings({"copy": lambda: dst.copy_(src)}, device, 3, runs)["copy"])
    return 2 * numel * 4 / (ms * 1e6)


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def moved_bytes(master: torch.Tensor, g: torch.Tensor, state_bytes: int, remainder: bool = False) -> int:
    """What one step moves: master read + write (a remainder's 2 bytes too), grad read, state read + write."""
    per = master.element_size() + (2 if remainder else 0)
    return master.numel() * (2 * per + g.element_size()) + 2 * state_bytes


# --- contenders -------------------------------------------------------------------------------------------------------
def coat_kernel(p: torch.Tensor, g: torch.Tensor, group_size: int = 128, v_format: str = "e4m3",
                remainder: bool = False):
    """ops.adamw_step on one flat tensor with states laid out as CoatAdamW's: the step alone (a bf16 p is a
    bf16 master, written by stochastic rounding, or with `remainder` the high halves of an exact fp32 one)."""
    ng = n_groups(p.numel(), group_size)
    vf = get_format(v_format)
    m, v = ((torch.zeros(p.shape, dtype=fmt.dtype, device=p.device), torch.zeros(ng, device=p.device),
             torch.ones(ng, device=p.device)) for fmt in (E4M3, vf))
    state = {"step": 0}
    rem = [torch.zeros(p.shape, dtype=torch.int16, device=p.device)] if remainder else ()
    sr = [(0, 0)] if p.dtype == torch.bfloat16 and not remainder else None

    def step():
        state["step"] += 1
        ops.adamw_step([p], [g], [m], [v], lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"],
                       weight_decay=HP["weight_decay"], step=state["step"], v_format=vf, group_size=group_size,
                       expansion=True, sr_keys=sr, remainders=rem)

    return step, sum(t.numel() * t.element_size() for t in (*m, *v))


# name: (module, class, keyword arguments beside HP); each imported only when it runs (a missing one: its row's error)
PEERS = {"coat_step": ("coat_ds.optim", "CoatAdamW", {}),
         "fused_adam": ("deepspeed.ops.adam", "FusedAdam", {"adam_w_mode": True}),
         "torch_adamw": ("torch.optim", "AdamW", {"fused": True}),
         "torchao_fp8": ("torchao.optim", "AdamWFp8", {}), "torchao_8bit": ("torchao.optim", "AdamW8bit", {}),
         "bnb_8bit": ("bitsandbytes.optim", "AdamW8bit", {}),
         "cpu_adam": ("deepspeed.ops.adam", "DeepSpeedCPUAdam", {"adamw_mode": True})}


def make_optimizer(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    module, cls, kw = PEERS[name]
    return getattr(importlib.import_module(module), cls)([p], **kw, **HP)


# --- runs -------------------------------------------------------------------------------------------------------------
def attempt(row: dict, name: str, fn):
    """fn(), or None with the error in the row: a peer that fails is reported, the run goes on."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        row[f"{name}_ms"] = None
        row["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
        traceback.print_exc()
        return None


def time_peers(p, peers: list[str], row: dict, fns: dict, device: str, warmup: int, runs: int):
    """(timings, state bytes) of the coat step in `fns` and each peer: on the CPU all built first, interleaved; on the
    GPU each built, timed and freed in turn (its state is GBs)."""
    if device == "cpu":
        opts = {n: o for n in peers if (o := attempt(row, n, lambda n=n: make_optimizer(n, p))) is not None}
        times = timings({**fns, **{n: o.step for n, o in opts.items()}}, device, warmup, runs)
        return times, {n: state_bytes(o) for n, o in opts.items()}
    times, states = timings(fns, device, warmup, runs), {}
    for name in peers:
        def run(name=name):
            opt = make_optimizer(name, p)
            return timings({name: opt.step}, device, warmup, runs), state_bytes(opt)
        got = attempt(row, name, run)
        free(device)
        if got is not None:
            times.update(got[0])
            states[name] = got[1]
    return times, states


def peer_fields(name: str, times: dict, moved: int, state_per_param: float, paired: bool) -> dict:
    """A peer's row fields; `paired` (interleaved timings) adds its fastest step and the per-round ratios' median."""
    pms, coat = statistics.median(times[name]), statistics.median(times["coat"])
    fields = {f"{name}_ms": round(pms, 4), f"{name}_gbps": round(moved / (pms * 1e6), 1),
              f"{name}_state_bytes_per_param": round(state_per_param, 4), f"speedup_vs_{name}": round(pms / coat, 2)}
    if paired:
        per_round = statistics.median(a / b for a, b in zip(times[name], times["coat"]))
        fields.update({f"{name}_min_ms": round(min(times[name]), 4), f"speedup_vs_{name}_paired": round(per_round, 2)})
    return fields


def bench_case(p, g32, grad_dtype, master: str, peers: list[str], device: str, warmup: int, runs: int,
               copy_bw: float) -> dict:
    """One case's row: CoatAdamW's kernel step and each peer that takes the case."""
    numel, rem = p.numel(), master == "float32_remainder"
    g = g32 if grad_dtype == torch.float32 else g32.to(grad_dtype)
    pm = p.data if master == "float32" else p.data.to(torch.bfloat16)   # a bf16 master: a remainder's high halves
    row = dict(device=device_name(device), numel=numel, grad_dtype=str(grad_dtype).replace("torch.", ""),
               master=master, copy_gbps=round(copy_bw, 1), errors={})
    step, sbytes = coat_kernel(pm, g, remainder=rem)
    fp32 = grad_dtype == torch.float32 and master == "float32"
    for name in ([] if fp32 else peers):
        row[f"{name}_ms"] = None
        row["errors"][name] = PEERS_NEED
    p.grad = g if fp32 else None
    times, states = time_peers(p, peers if fp32 else [], row, {"coat": step}, device, warmup, runs)
    p.grad = None
    ms, moved = statistics.median(times["coat"]), moved_bytes(pm, g, sbytes, rem)
    gbps = moved / (ms * 1e6)
    row.update(coat_ms=round(ms, 4), coat_bytes=moved, coat_bytes_per_param=round(moved / numel, 3),
               coat_gbps=round(gbps, 1), coat_frac_of_copy=round(gbps / copy_bw, 3),
               state_bytes_per_param=round(sbytes / numel, 4))
    if device == "cpu":
        row["coat_min_ms"] = round(min(times["coat"]), 4)
    for name, sb in states.items():
        row.update(peer_fields(name, times, moved_bytes(p.data, g, sb), sb / numel, paired=device == "cpu"))
    print(json.dumps(row), flush=True)
    return row


def bench_size(numel: int, device: str, peers: list[str], warmup: int, runs: int, copy_bw: float) -> list[dict]:
    p = torch.nn.Parameter(torch.randn(numel, device=device) * 0.02)
    g32 = torch.randn(numel, device=device) * 1e-3
    rows = []
    for grad_dtype, master in CASES:
        rows.append(bench_case(p, g32, grad_dtype, master, peers, device, warmup, runs, copy_bw))
        free(device)
    return rows


def host_info() -> dict:
    """What a CPU figure depends on: the CPU model and its SIMD, threads, the compiler, and the load."""
    cpu = cpu_info()
    flags = set(cpu.get("flags", "").split())
    info = {"threads": torch.get_num_threads(), "cores": os.cpu_count(), "nproc": len(os.sched_getaffinity(0)),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_model": cpu.get("model name") or None,
            "simd": [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                 "avx512_fp16", "amx_bf16") if f in flags], "cxx": None}
    with contextlib.suppress(OSError, IndexError):
        info["cxx"] = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    try:  # which kernels the CPU op takes on this build: 'avx512' or 'portable'
        from coat_ds import op_builder

        info["coat_cpu_kernels"] = op_builder.CPUCoatAdamBuilder().load().simd()
    except Exception as exc:  # noqa: BLE001 - an op without simd() (older prebuilt) is noted, the run goes on
        info["coat_cpu_kernels"] = f"unknown ({type(exc).__name__})"
    return {**info, "loadavg_start": list(os.getloadavg())}


def main() -> None:
    ap = parser(__doc__, smoke="tiny sizes on CPU in seconds; prints, writes only --out",
                out=(None, "output JSON path (default: benchmarks/results/optimizer_step[_cpu].json)"))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--sizes", type=float, nargs="+", help="numels (default: 1e8 1e9 on cuda, 1e7 on cpu)")
    ap.add_argument("--runs", type=int, default=None, help="timed steps per contender")
    args = ap.parse_args()
    device = "cpu" if args.smoke else args.device
    if device == "cuda":
        sizes = args.sizes or [1e8, 1e9]
        peers = [name for name in PEERS if name != "cpu_adam"]
        out = args.out or str(RESULTS / "optimizer_step.json")
    else:
        sizes = args.sizes or ([1e5] if args.smoke else [1e7])
        peers = ["coat_step"] + ([] if args.smoke else ["cpu_adam"])
        out = args.out or (None if args.smoke else str(RESULTS / "optimizer_step_cpu.json"))
    runs = args.runs or (3 if args.smoke else 20)
    torch.manual_seed(0)
    copy_bw = copy_gbps(int(max(sizes)), device, runs)
    host = host_info() if device == "cpu" else None
    rows = [row for n in sizes for row in bench_size(int(n), device, peers, 2 if args.smoke else 3, runs, copy_bw)]
    result = dict(provenance(("torchao", "bitsandbytes")), device=device_name(device), hyperparams=HP, group_size=128,
                  v_format="e4m3", copy_gbps=round(copy_bw, 1), rows=rows)
    if host is not None:
        host["loadavg_end"] = list(os.getloadavg())
        result["host"] = host
    if out:
        print(f"wrote {write_json(out, result)}")
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
