"""Several GPUs of one host (benchmarks/e2e_scaling.py, e2e.py on 4 GPUs): tokens/s per GPU as GPUs are added,
ZeRO-3's buckets, and Llama-3.1-70B on one node with its FP8 states on the host."""
from __future__ import annotations

import re
from pathlib import Path

from benchmarks.tables import NotYet, gpu, headline, load, num, peaks, table


def _scaling(res: Path) -> list[dict]:
    """The summaries of e2e_scaling*.json (another GPU each), each row with its GPU, but a candidate setting's
    (`zero_set`, `bind_cores`: another configuration's rows, as `--merge` says); NotYet before the first."""
    docs = [d for d in (load(res, path.name) for path in sorted(res.glob("e2e_scaling*.json")))
            if not (d.get("zero_set") or d.get("bind_cores"))]
    if not docs:
        raise NotYet("e2e_scaling", "Scaling")
    return [{**s, "gpu": gpu(d["device"]).split()[0]} for d in docs for s in d["summary"]]


@table
def scaling(res: Path):
    """docs/results.md: coat's presets' tokens/s per GPU as GPUs are added, at one micro-batch, and the efficiency
    there and at each one's largest (three decimals: the targets are 0.95 and 0.90)."""
    yield ["model, ZeRO stage, preset", "GPU", "micro-batch", "tokens/s per GPU on 1 / 2 / 4 / 8 GPUs",
           "at the most GPUs over 1: common / largest micro-batch", "over BF16 there (each at its largest micro-batch)"]
    groups: dict[tuple, list] = {}
    for s in _scaling(res):
        if s["preset"] != "bf16":
            groups.setdefault((s["model"], s["zero_stage"], s["preset"], s["gpu"]), []).append(s)
    for (model, stage, preset, card), ss in groups.items():
        by = {s["world_size"]: s for s in ss}
        top = max((s for s in ss if s.get("largest")), key=lambda s: s["world_size"], default={})
        yield [f"{model}, ZeRO-{stage}, {preset.replace('_', '-')}", card,
               next((s["common"]["micro_batch"] for s in ss if s.get("common")), "-"),
               " / ".join(num((by.get(w, {}).get("common") or {}).get("tokens_per_s_per_gpu"), 0)
                          for w in (1, 2, 4, 8)),
               f"{num(top.get('efficiency_common'), 3)} / {num(top.get('efficiency_largest'), 3)}",
               num(top.get("coat_over_bf16"), 2)]


headline("scaling", "llama3.1-8b, ZeRO-2, lowest-memory", "H100")


ONE_NODE_70B = ("e2e_offload_llama3.1-70b_4gpu_h100.json", "e2e_offload_llama3.1-70b_4gpu.json")   # oldest first


@table
def one_node_70b(res: Path):
    """docs/deepspeed.md: Llama-3.1-70B full-parameter on one node, FP8 states in pinned host memory; each
    row names the GPUs it ran on, and its run's date and coat_ds commit."""
    from coat_ds import plan

    yield ["model", "GPUs (run: date, coat_ds commit)", "configuration", "micro-batch",
           "peak GiB per GPU (allocated / reserved)", "planner's peak GiB (plans a fit on an 80 GB H100)",
           "tokens/s on the node (per GPU)", "step s: forward / backward / engine.step",
           "host GiB of the job (B/param)", "BF16 + DeepSpeedCPUAdam host need (planner)"]
    for name in ONE_NODE_70B:
        doc = load(res, name)
        rungs = [r for r in doc["records"] if r["kind"] == "rung"]
        first = rungs[0]
        host = first["node_used_gb"]
        shape, ds_config = plan.resolve_shape(doc["model"]), next(c for c in doc["configs"])["ds_config"]
        job = plan.job_from_config(ds_config, shape, doc["seq_len"], doc["world_size"])
        need = plan.plan(plan.job_from_config(plan.bf16_baseline(ds_config), shape, doc["seq_len"], doc["world_size"]),
                         1)
        run = f"{doc['world_size']}x {gpu(doc['device'])} ({doc['date'][:10]}, {doc['versions']['coat_ds_commit'][:7]})"
        for r in rungs:
            phases = r.get("phase_s") or first["phase_s"]
            planned = plan.plan(job, r["micro_batch"])
            yield [f"{doc['model']}, seq {doc['seq_len']}", run,
                   "zero3_offload_largest_model (states on the host, each layer recomputed)", r["micro_batch"],
                   peaks(r),
                   f"{num(planned.peak / 2 ** 30)} ({'yes' if planned.fits(plan.GPUS['h100'] * 2 ** 30) else 'no'})",
                   f"{num(r['tokens_per_s'], 0)} ({num(r['tokens_per_s'] / doc['world_size'], 0)})",
                   " / ".join(num(phases[k], 2) for k in ("forward", "backward", "step")) +
                   ("" if "phase_s" in r else " (at micro-batch 1)"),
                   f"{num(host)} ({num(host * 2 ** 30 / doc['params'], 2)})",
                   f"{num(need.host * doc['world_size'] / 2 ** 30, 0)} GiB (4 ranks)"]


headline("one_node_70b", "llama3.1-70b", "4x H100", "zero3", 2)


@table
def e2e_scaling(res: Path):
    """docs/results.md: every row of e2e_scaling*.json, per GPU: coat's presets and BF16 + FusedAdam on 1 to 8 GPUs."""
    yield ["model, GPUs, ZeRO stage", "GPU", "configuration", "largest micro-batch (planner's)",
           "tokens/s per GPU there", "peak GiB per GPU there (planner's)", "tokens/s per GPU at the common micro-batch",
           "over 1 GPU: common / largest", "over BF16 (largest)"]
    for s in _scaling(res):
        where = [f"{s['model']}, {s['world_size']}, ZeRO-{s['zero_stage']}", s["gpu"], s["label"]]
        top, eq = s.get("largest"), s.get("common")
        if top is None:
            yield [*where, s.get("verdict") or f"no size fit ({s['planner_max_micro_batch']})", *["-"] * 5]
            continue
        yield [*where, f"{'' if top['exact'] else '>= '}{top['micro_batch']} ({s['planner_max_micro_batch']})",
               num(top["tokens_per_s_per_gpu"], 0), f"{num(top['peak_alloc_gb'])} ({num(top['planner_peak_gb'])})",
               f"{num(eq and eq['tokens_per_s_per_gpu'], 0)} at {eq['micro_batch']}" if eq else "-",
               f"{num(s['efficiency_common'], 2)} / {num(s['efficiency_largest'], 2)}", num(s["coat_over_bf16"], 2)]


ZERO3_SETS = ("bucket5e7", "bucket5e8", "prefetch2e8", "prefetch2e8_bucket5e8")  # e2e_{set}_z3_llama2-13b_{n}gpu.json


def _zero_set(run: dict) -> str:
    """The run's --zero-set as its command says, or the preset's own buckets."""
    found = re.search(r"--zero-set (\S+)", run["command"])
    return f"`{found.group(1)}`" if found else "none (the preset)"


@table
def zero3_buckets(res: Path):
    """docs/deepspeed.md: 13B ZeRO-3 at micro-batch 2, seq 4096, on 4 GPUs and on 1 with each bucket setting tried
    (e2e.py --zero-set); where one GPU was not run at that setting, the preset's scaling row (e2e_scaling_h200.json)."""
    yield ["`--zero-set`", "tokens/s on 4 GPUs (per GPU)", "on 1 GPU", "4 over 1",
           "peak GiB, 4 GPUs: allocated / reserved", "1 GPU", "date"]
    one = next(s["common"] for s in load(res, "e2e_scaling_h200.json")["summary"]
               if (s["model"], s["zero_stage"], s["world_size"]) == ("llama2-13b", 3, 1))
    for tag in ZERO3_SETS:
        names = {n: f"e2e_{tag}_z3_llama2-13b_{n}gpu.json" for n in (1, 4)}
        runs = {n: load(res, name) for n, name in names.items() if (res / name).exists()}
        four = runs[4]["configs"][0]["equal_batch"]
        alone = runs[1]["configs"][0]["equal_batch"] if 1 in runs else None
        base = alone["tokens_per_s"] if alone else one["tokens_per_s_per_gpu"]
        yield [_zero_set(runs[4]), f"{num(four['tokens_per_s'], 0)} ({num(four['tokens_per_s'] / 4, 0)})",
               num(base, 0) + ("" if alone else " (the scaling row)"), num(four["tokens_per_s"] / 4 / base, 3),
               peaks(four), peaks(alone) if alone else "-", runs[4]["date"][:10]]
