"""Renders the measured tables of README.md and docs/*.md from benchmarks/results/*.json.

    python -m benchmarks.render_tables           # rewrite every marked region
    python -m benchmarks.render_tables --check   # exit 1 naming each region that differs (tests/test_render_tables.py)

A region is `<!-- table:NAME -->` ... `<!-- /table -->` in a Markdown file; NAME is a function below decorated
with @table. A new table: one function that reads its JSON with load() and yields its header, then its rows.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGION = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
TABLES: dict[str, Callable[[Path], Iterator[list]]] = {}


def table(fn):
    TABLES[fn.__name__] = fn
    return fn


def load(results: Path, name: str):
    return json.loads((results / name).read_text())


def num(x, digits: int = 1) -> str:
    """A figure as printed: fixed digits, thousands separated; '-' for none."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def render(name: str, results: Path = RESULTS) -> str:
    header, *rows = TABLES[name](results)
    return markdown(header, rows)


# --- cells the tables share -------------------------------------------------------------------------------------------
def gpu(device: str) -> str:
    return device.split("x ")[-1].replace("NVIDIA ", "")   # '2x NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3'


def tokens(rung: dict | None) -> str:
    return num(rung and rung["tokens_per_s"], 0)


def _configs(run: dict) -> dict:
    return {c["name"]: c for c in run["configs"]}


def _spread(s: dict, key: str = "final") -> str:
    return f"{s[key + '_mean']:.4f} +- {s[key + '_std']:.4f}"


def _gap(s: dict) -> list[str]:
    """The gap of the mean to BF16, and whether it lies inside BF16's spread."""
    return [f"{100 * s['gap_rel_mean']:+.2f}%", "yes" if s["within_bf16_spread"] else "no"]


# --- the tables -------------------------------------------------------------------------------------------------------
@table
def presets(res: Path):
    """docs/presets.md: what each preset keeps per parameter and per token, and the measured rows behind it."""
    rows = (  # intent -> (e2e run and config behind its state bytes, the Offload row's config, llama_layer variant)
        ("BF16 + FusedAdam (baseline)", ("e2e_llama-1b.json", "bf16"), "bf16", "bf16_eager", "-"),
        ("`exact`", ("e2e_7b_one_gpu.json", "coat_full_rem"), "coat_full", "coat_full",
         "FP8 optimizer states and activations; an exact fp32 master as bf16 weights + int16 remainders "
         "(Offload: DeepSpeed's fp32 master)"),
        ("`lowest_memory`", ("e2e_7b_one_gpu.json", "coat_full_bf16sr"), "coat_full_bf16sr", "coat_full_attn_fp8",
         "bf16 master with stochastic rounding; attention's q, k, v saved in FP8 ({slower} layer time); "
         "FP8 weights re-quantized each micro-batch"))
    layer = {r["variant"]: r for r in load(res, "llama_layer.json") if r["shape"] == "llama2-7b"}
    offload = {r["config"]: r for r in load(res, "offload.json")["rows"] if r["model"] == "llama-1b"}
    yield ["preset", "training state B/param (GPU, ZeRO-2, 1 GPU)", "host B/param under Offload",
           "activations B/token/hidden", "what it trades", "measured rows"]
    ref = layer[rows[1][3]]  # the exact preset's layer: what lowest_memory's attention_fp8 is timed against
    for label, (file, cfg), host, variant, trades in rows:
        run, act, off = load(res, file), layer[variant], offload.get(host)
        b = _configs(run)[cfg]["breakdown"]
        state = (b["weights_gb"] + b["optimizer_state_gb"] + b["grads_gb"]) * 2 ** 30 / run["params"]
        trades = trades.format(slower=f"{act['fwd_bwd_ms'] / ref['fwd_bwd_ms'] - 1:+.1%}")
        yield [label, num(state), num(off and off["host_optimizer_bytes_per_param"], 2),
               num(act["act_bytes_per_token_hidden"]), trades,
               f"`{file}` {cfg}; `offload.json` {host}; `llama_layer.json` {variant} (7B)"]


@table
def real_shapes(res: Path):
    """README: today's shapes at seq 4096 on one GPU, no offload (benchmarks/e2e_real_shapes.py)."""
    from coat_ds import plan

    yield ["model, GPU", "configuration", "largest micro-batch", "peak GiB there", "tokens/s there",
           "BF16 + FusedAdam at micro-batch 1", "BF16 + FusedAdam: GPUs it needs (planner, ZeRO-2)"]
    bf16_cfg = plan.bf16_baseline(plan.read_config("zero2_bf16")[0])
    for case in load(res, "e2e_real_shapes.json")["cases"].values():
        if case["model"] == "tiny":
            continue
        bf16 = next((c for c in case["summary"] if c["name"] == "bf16"), None)
        memory = next(plan.GPUS[name] for name in plan.GPUS if name.upper() in case["device"].upper()) * 2 ** 30
        if bf16 is None:   # not run beside this case: what the planner says of micro-batch 1
            p = plan.plan(plan.job_from_config(bf16_cfg, plan.resolve_shape(case["model"]), case["seq_len"], 1), 1)
            need = f"{'fits' if p.fits(memory) else 'does not fit'} (planner: {num(p.peak / 2 ** 30)} GiB)"
        else:
            need = (f"does not fit (needs >= {num(bf16['needed_gb_at_1'])} GiB)" if bf16["max_micro_batch"] == 0
                    else f"fits up to {bf16['max_micro_batch']}")
        gpus = plan.fewest_gpus(bf16_cfg, case["model"], case["seq_len"], memory) or "more than 64"
        where = f"{case['model']}, seq {case['seq_len']}, {gpu(case['device'])}"
        yield from ([where, c["label"], c["max_micro_batch"], num(c["peak_alloc_gb"]), tokens(c), need, gpus]
                    for c in case["summary"] if c["name"] != "bf16")


@table
def gradients(res: Path):
    """docs/deepspeed.md: coat.gradients against DeepSpeed's partition buffer, 1 and 2 H100s, peaks per GPU."""
    yield ["model, seq, micro-batch", "GPUs, ZeRO stage", "coat.gradients", "peak GiB allocated",
           "peak GiB reserved", "tokens/s", "tokens/s against the buffer"]
    for name in ("e2e_grads_llama-1b.json", "e2e_grads_llama2-7b.json",   # one H100; then two, NCCL
                 *(f"e2e_grads_nccl_z{z}_{m}.json" for m in ("llama-1b", "llama2-7b") for z in (2, 3))):
        run = load(res, name)
        by = {c["name"]: c["rungs"][0] for c in run["configs"] if c["rungs"]}
        base, ranks = by["lowest_memory_grad_buffer"]["tokens_per_s"], f"{run['world_size']}, {run['zero_stage']}"
        for cfg, key in (("lowest_memory", "per_parameter"), ("lowest_memory_grad_buffer", "partition_buffer"),
                         ("largest_model", "release")):
            r = by.get(cfg)
            if r is not None:
                yield [f"{run['model']}, {run['seq_len']}, {r['micro_batch']}", ranks, key, num(r["peak_alloc_gb"]),
                       num(r["peak_reserved_gb"]), tokens(r), f"{r['tokens_per_s'] / base:.3f}x"]


@table
def release_nccl(res: Path):
    """docs/deepspeed.md: gradient release on 2 H100s beside BF16, each at its largest micro-batch, peaks per GPU."""
    yield ["model, seq", "GPUs, ZeRO stage", "configuration", "largest micro-batch", "peak GiB allocated / reserved",
           "tokens/s"]
    for name in (f"e2e_release_nccl_z{z}_{m}.json" for m in ("llama2-7b", "llama2-13b") for z in (2, 3)):
        run = load(res, name)
        for key, label in (("bf16", "BF16 + FusedAdam"), ("largest_model", "largest-model preset (release)")):
            c = _configs(run)[key]
            top = c.get("max_batch")
            where = [f"{run['model']}, {run['seq_len']}", f"{run['world_size']}, {run['zero_stage']}", label]
            if top:
                yield [*where, c["max_micro_batch"], f"{num(top['peak_alloc_gb'])} / {num(top['peak_reserved_gb'])}",
                       tokens(top)]
                continue
            tried = c["rungs"][0] if c.get("rungs") else None
            why = (f"micro-batch 1 ran at {num(tried['peak_reserved_gb'])} GiB reserved (> 95%), "
                   f"{tokens(tried)} tokens/s" if tried else f"needs >= {num(c['needed_gb_at_1'])} GiB at 1")
            yield [*where, f"does not fit ({why})", "-", "-"]


def _scaling(res: Path) -> list[dict] | None:
    """The summaries of e2e_scaling.json and its kin (e2e_scaling_h200.json: another GPU), each row with its GPU;
    None before the first device call has written one. A file measured with a candidate setting (`zero_set`,
    `bind_cores`) is another configuration's rows, not the presets': left out, as `--merge` leaves it."""
    docs = [d for d in (load(res, path.name) for path in sorted(res.glob("e2e_scaling*.json")))
            if not (d.get("zero_set") or d.get("bind_cores"))]
    return [{**s, "gpu": gpu(d["device"]).split()[0]} for d in docs for s in d["summary"]] if docs else None


NOT_YET = "not measured yet: `python -m benchmarks.e2e_scaling` (docs/benchmarks.md, \"Scaling\")"


@table
def scaling(res: Path):
    """README: coat's presets' tokens/s per GPU as GPUs are added, at one micro-batch, and the efficiency there and at
    each one's largest (three decimals: the targets are 0.95 and 0.90)."""
    header = ["model, ZeRO stage, preset", "GPU", "micro-batch", "tokens/s per GPU on 1 / 2 / 4 / 8 GPUs",
              "at the most GPUs over 1: common / largest micro-batch",
              "over BF16 there (each at its largest micro-batch)"]
    yield header
    rows = _scaling(res)
    if rows is None:
        yield [NOT_YET, *["-"] * (len(header) - 1)]
        return
    groups: dict[tuple, list] = {}
    for s in rows:
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


ONE_NODE_70B = ("e2e_offload_llama3.1-70b_4gpu_h100.json", "e2e_offload_llama3.1-70b_4gpu.json")   # oldest first


@table
def one_node_70b(res: Path):
    """README / docs/deepspeed.md: Llama-3.1-70B full-parameter on one node, FP8 states in pinned host memory; each
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
                   f"{num(r['peak_alloc_gb'])} / {num(r['peak_reserved_gb'])}",
                   f"{num(planned.peak / 2 ** 30)} ({'yes' if planned.fits(plan.GPUS['h100'] * 2 ** 30) else 'no'})",
                   f"{num(r['tokens_per_s'], 0)} ({num(r['tokens_per_s'] / doc['world_size'], 0)})",
                   " / ".join(num(phases[k], 2) for k in ("forward", "backward", "step")) +
                   ("" if "phase_s" in r else " (at micro-batch 1)"),
                   f"{num(host)} ({num(host * 2 ** 30 / doc['params'], 2)})",
                   f"{num(need.host * doc['world_size'] / 2 ** 30, 0)} GiB (4 ranks)"]


@table
def e2e_scaling(res: Path):
    """docs/results.md: every row of e2e_scaling*.json, per GPU: coat's presets and BF16 + FusedAdam on 1 to 8 GPUs."""
    header = ["model, GPUs, ZeRO stage", "GPU", "configuration", "largest micro-batch (planner's)",
              "tokens/s per GPU there",
              "peak GiB per GPU there (planner's)", "tokens/s per GPU at the common micro-batch",
              "over 1 GPU: common / largest", "over BF16 (largest)"]
    yield header
    rows = _scaling(res)
    for s in rows or []:
        where = [f"{s['model']}, {s['world_size']}, ZeRO-{s['zero_stage']}", s["gpu"], s["label"]]
        top, eq = s.get("largest"), s.get("common")
        if top is None:
            yield [*where, s.get("verdict") or f"no size fit ({s['planner_max_micro_batch']})", *["-"] * 5]
            continue
        yield [*where, f"{'' if top['exact'] else '>= '}{top['micro_batch']} ({s['planner_max_micro_batch']})",
               num(top["tokens_per_s_per_gpu"], 0), f"{num(top['peak_alloc_gb'])} ({num(top['planner_peak_gb'])})",
               f"{num(eq and eq['tokens_per_s_per_gpu'], 0)} at {eq['micro_batch']}" if eq else "-",
               f"{num(s['efficiency_common'], 2)} / {num(s['efficiency_largest'], 2)}", num(s["coat_over_bf16"], 2)]
    if rows is None:
        yield [NOT_YET, *["-"] * (len(header) - 1)]


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
               f"{num(four['peak_alloc_gb'])} / {num(four['peak_reserved_gb'])}",
               f"{num(alone['peak_alloc_gb'])} / {num(alone['peak_reserved_gb'])}" if alone else "-",
               runs[4]["date"][:10]]


@table
def hf_trainer(res: Path):
    """README / docs/deepspeed.md: HF Trainer beside a plain deepspeed.initialize loop on the same config."""
    by = {r["spec"].removesuffix(":profile"): r for r in load(res, "hf_trainer.json")["runs"] if r.get("tokens_per_s")}
    yield ["preset, model, micro-batch, tuning", "HF Trainer tokens/s", "plain loop tokens/s", "Trainer / plain",
           "peak GiB", "measured at"]
    for spec, r in by.items():
        path, rest = spec.split(":", 1)
        if path != "trainer":
            continue
        plain = by.get(f"plain:{rest}")
        same = plain is not None and plain["measured_at"] == r["measured_at"]
        yield [rest.replace(":", ", "), tokens(r), tokens(plain),
               f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if same else "-", num(r["peak_alloc_gb"]),
               r["measured_at"]]


@table
def attention_fp8_whole_model(res: Path):
    """docs/activation.md: attention_fp8 through a whole default-config HF model and the engine."""
    yield ["model, GPU (file)", "configuration", "micro-batch", "forward keeps GiB", "B/token/hidden/layer",
           "peak GiB", "tokens/s"]
    for name in ("e2e_attention_fp8_7b.json", "e2e_attention_fp8_1b.json"):
        run = load(res, name)
        for c in run["configs"]:
            eq = c["equal_batch"]
            yield [f"{run['model']}, {gpu(run['device'])} (`{name}`)", c["label"], eq["micro_batch"],
                   num(c["breakdown"]["alloc_forward_delta_gb"], 2),
                   num(run["forward_kept_b_per_token_hidden_layer"][c["name"]], 2), num(eq["peak_alloc_gb"], 2),
                   tokens(eq)]


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
def e2e_runs(res: Path):
    """docs/results.md: every configuration of every committed e2e run, one row each; torchao's runs (a compile
    takes minutes a shape: one size each) beside the one-GPU runs."""
    yield ["run (file)", "configuration", "micro-batch N", "peak GiB at N", "tokens/s at N", "largest micro-batch",
           "tokens/s there"]
    for name in ("e2e_llama-1b.json", "e2e_torchao_llama-1b.json", "e2e_7b_one_gpu.json", "e2e_torchao_llama2-7b.json",
                 "e2e.json", "e2e_grad_accum_fp32.json", "e2e_llama-1b_grad_accum_fp32.json"):
        run = load(res, name)
        zero = "no DeepSpeed" if run["zero_stage"] is None else f"ZeRO-{run['zero_stage']}"
        where = f"{run['model']}, {run['world_size']}x {gpu(run['device'])}, {zero} (`{name}`)"
        for c in run["configs"]:
            eq, top = c.get("equal_batch"), c.get("max_batch")
            peak = num(eq["peak_alloc_gb"]) if eq else f"does not fit (~{num(c.get('needed_gb_at_1'))} at 1)"
            largest = top["micro_batch"] if top else c.get("max_micro_batch", "-")
            yield [where, c["label"], run["equal_micro_batch"], peak, tokens(eq),
                   f"{'' if top is None or top.get('exact') else '>= '}{largest}", tokens(top)]


@table
def seed_spread(res: Path):
    """docs/results.md: validation loss at the last step, mean +- sample std over three seeds per config."""
    summary = load(res, "seed_spread.json")["default"]["summary"]
    yield ["config", "final", "best", "gap of the mean to BF16 (final)", "inside BF16's spread"]
    for key, label in (("bf16", "BF16 + FusedAdam"), ("coat_opt", "coat_ds optimizer-only"),
                       ("coat_full", "coat_ds full"), ("coat_full_bf16sr", "coat_ds full, bf16 master (`bf16_sr`)"),
                       ("coat_full_attn_fp8", "coat_ds full + `attention_fp8`"),
                       ("largest_model", "coat_ds largest-model preset (gradient release, clipping one step late)")):
        s = summary[key]
        yield [label, _spread(s), _spread(s, "best"), *(["-", "-"] if key == "bf16" else _gap(s))]


@table
def seed_spread_families(res: Path):
    """docs/results.md: the other families' seed spreads (125M, 3 seeds, bf16 against coat full)."""
    run = load(res, "seed_spread.json")
    yield ["family", "compared at step", "BF16 + FusedAdam", "coat_ds full", "gap of the mean", "inside BF16's spread"]
    for family in ("qwen3", "gemma3_text"):
        sec = run[family]
        b, c = sec["summary"]["bf16"], sec["summary"]["coat_full"]
        yield [family, sec["steps_compared"], _spread(b), _spread(c), *_gap(c)]


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


@table
def offload(res: Path):
    """docs/deepspeed.md: ZeRO-2 Offload on one H100 node (benchmarks/offload.py); rows predicted not to fit say so."""
    yield ["model, micro-batch", "configuration", "pinned", "host optimizer B/param (master + states)",
           "host RSS steady / peak GiB", "GPU peak GB", "tokens/s"]
    runs = load(res, "offload.json")["rows"]
    micro = {r["model"]: r["micro_batch"] for r in runs if "micro_batch" in r}
    models = {"llama-1b": "Llama 1.1B", "llama2-7b": "Llama-2-7B", "llama2-13b": "Llama-2-13B"}
    last = None
    for r in runs:
        where = f"{models.get(r['model'], r['model'])}, {micro.get(r['model'], '-')}" if r["model"] != last else ""
        last = r["model"]
        if not r["fits"]:
            why = r["why_not"].split(": peak ")[-1].split(" GiB")[0]
            yield [where, r["label"], "no", "-", f"not run: predicted {why} GiB peak", "-", "-"]
            continue
        yield [where, r["label"], "yes" if r["pinned"] else "no", num(r["host_optimizer_bytes_per_param"], 2),
               f"{num(r['host_rss_gb'])} / {num(r['host_rss_peak_gb'])}", num(r["gpu_peak_gb"]), tokens(r)]


@table
def offload_host_cpu(res: Path):
    """docs/deepspeed.md: host memory of the optimizer states under Offload, one CPU rank (bench_zero2.py)."""
    run = load(res, "offload_host_memory_cpu.json")
    yield ["optimizer", "state tensors on the host", "host RSS growth over the first step",
           f"training step ({run['device']})"]
    for name, label in (("CoatAdamW", "CoatAdamW (CPU kernel)"), ("DeepSpeedCPUAdam", "DeepSpeedCPUAdam")):
        r = run[name]
        yield [label, f"{num(r['state_bytes_per_rank'] / 1e6)} MB = {r['state_bytes_per_param_per_rank']:g} B/param",
               f"{num(r['host_rss_growth_first_step_bytes'] / 1e6)} MB", f"{num(r['step_ms_median'])} ms"]


@table
def train_throughput(res: Path):
    """docs/train.md: the main job on one H100, BF16 against coat (benchmarks/train_throughput.sh)."""
    runs = load(res, "train_throughput.json")["runs"]
    base = runs["zero2_bf16"]
    yield ["config", "tokens/s (median step)", "peak GPU memory", "train loss at the last step", "val loss"]
    for name, what in (("zero2_bf16", "BF16, FusedAdam"), ("zero2_coat", "CoatAdamW + FP8 activations")):
        r = runs[name]
        vs = {k: "" if r is base else f" ({r[k] / base[k]:.2f}x)" for k in ("tokens_per_s", "peak_mem_gb")}
        yield [f"`{name}.json` ({what})", tokens(r) + vs["tokens_per_s"],
               f"{r['peak_mem_gb']:.2f} GiB" + vs["peak_mem_gb"], f"{r['last_loss']:.2f}", f"{r['last_val_loss']:.2f}"]


def _accuracy(res: Path) -> dict | None:
    """accuracy_scale.json; None before the first device call has written it."""
    return load(res, "accuracy_scale.json") if (res / "accuracy_scale.json").is_file() else None


ACCURACY_NOT_YET = "not measured yet: `python -m benchmarks.accuracy_scale` (docs/benchmarks.md, \"Accuracy at scale\")"


def _not_yet(header: list[str]) -> list[str]:
    """The one row of an accuracy table before its JSON exists."""
    return [ACCURACY_NOT_YET, *["-"] * (len(header) - 1)]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _yes(x) -> str:
    return "-" if x is None else "yes" if x else "no"


def _bf16_first(names) -> list[str]:
    """BF16, then the presets by name: one order whichever ran first."""
    return sorted(set(names), key=lambda n: (n != "bf16", n))


@table
def accuracy(res: Path):
    """README: issue 46's verdicts, a preset a row: pretraining's final validation loss against BF16's seed band, and
    no spike (BF16's seeds judged too), fine-tuning BF16's model before the first step and at the end."""
    header = ["configuration", "pretraining: final val loss (seeds)", "gap to BF16's mean", "inside BF16's band, "
              "no spike", "fine-tuning: gap before the first step / at the end", "targets met"]
    yield header
    doc = _accuracy(res)
    if doc is None:
        yield _not_yet(header)
        return
    pre, ft = doc["verdicts"]["pretrain"]["configs"], doc["verdicts"]["finetune"]
    labels = {e["config"]: e["label"] for e in doc["runs"].values()}
    for name in _bf16_first([*pre, *ft]):
        p, f = pre.get(name, {}), ft.get(name, {})
        yield [labels[name],
               f"{num(p.get('final_mean'), 4)} ({len(p.get('seeds', []))})", _pct(p.get("gap_rel")),
               f"{'-' if name == 'bf16' else _yes(p.get('within_band'))}, {_yes(p.get('spike_ok'))}",
               "-" if name == "bf16" else f"{_pct(f.get('gap_before_rel'))} / {_pct(f.get('gap_end_rel'))}",
               "-" if name == "bf16" else _targets_met(p, f)]


def _targets_met(pre: dict, ft: dict) -> str:
    """A preset's verdict over both phases: "so far" while one of them has no verdict yet."""
    met = [x for x in (pre.get("meets_targets"), ft.get("meets_targets")) if x is not None]
    if not met:
        return "-"
    if not all(met):
        return "no"
    return "yes" if pre and ft else f"so far (no {'pretraining' if ft else 'fine-tuning'} yet)"


@table
def accuracy_scale(res: Path):
    """docs/results.md: every pretraining configuration's seeds, BF16's band, and each seed's largest rise of the
    validation loss over its running minimum, against the band's half-width (verdicts.py: a spike)."""
    header = ["configuration", "seeds: final val loss", "mean +- std", "gap to BF16's mean", "BF16's band",
              "inside", "largest val-loss rise over its running minimum, per seed: within the band's half-width"]
    yield header
    doc = _accuracy(res)
    if doc is None:
        yield _not_yet(header)
        return
    v = doc["verdicts"]["pretrain"]
    b = v["bf16_band"]
    band = "-" if b is None else f"{b['low']:.4f} - {b['high']:.4f} ({b['set_by']}, {b['seeds']} seeds)"
    for name in _bf16_first(v["configs"]):
        c = v["configs"][name]
        yield [name, ", ".join(f"{s}: {x:.4f}" for s, x in zip(c["seeds"], c["finals"])),
               f"{c['final_mean']:.4f} +- {num(c['final_std'], 4)}", _pct(c["gap_rel"]), band if name == "bf16" else "",
               _yes(c.get("within_band")) if name != "bf16" else "-",
               ", ".join(f"{s}: {num(r, 4)}" for s, r in zip(c["seeds"], c["rises"])) + f": {_yes(c.get('spike_ok'))}"]


@table
def accuracy_scale_finetune(res: Path):
    """docs/results.md: fine-tuning BF16's pretrained model with each configuration, from the same weights."""
    header = ["configuration", "val loss before the first step", "gap to BF16", "val loss at the end", "gap to BF16",
              "both within 0.5%"]
    yield header
    finetune = ((_accuracy(res) or {}).get("verdicts") or {}).get("finetune")
    if not finetune:
        yield _not_yet(header)
        return
    for name in _bf16_first(finetune):
        f = finetune[name]
        yield [name, num(f["before"], 4), _pct(f["gap_before_rel"]), num(f["end"], 4), _pct(f["gap_end_rel"]),
               _yes(f.get("meets_targets"))]


@table
def accuracy_scale_outliers(res: Path):
    """docs/results.md: max |x| over RMS at BF16's pretrained model's decoder-layer inputs, per layer."""
    header = ["decoder layer", "max abs of its input", "RMS", "max abs / RMS"]
    yield header
    rows = ((_accuracy(res) or {}).get("outliers") or {}).get("layers")
    if not rows:
        yield _not_yet(header)
        return
    for r in rows:
        yield [r["layer"], num(r["max_abs"], 2), num(r["rms"], 3), num(r["ratio"], 1)]


# --- regions ----------------------------------------------------------------------------------------------------------
def regions(text: str) -> list[tuple[str, str]]:
    """(name, current body) of every marked region of a Markdown text."""
    return [(m.group(2), m.group(3)) for m in REGION.finditer(text)]


def rewrite(text: str, results: Path = RESULTS) -> str:
    return REGION.sub(lambda m: m.group(1) + render(m.group(2), results) + m.group(4), text)


def stale(results: Path = RESULTS, files: list[Path] = DOCS) -> list[str]:
    """'file: table' for every region whose text is not what its JSON renders (or names no table)."""
    return [f"{path.relative_to(ROOT)}: {name}" for path in files for name, body in regions(path.read_text())
            if name not in TABLES or body != render(name, results)]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        for line in bad:
            print(f"{line}: differs from benchmarks/results; run python -m benchmarks.render_tables")
        return 1 if bad else 0
    for path in DOCS:
        text = path.read_text()
        if REGION.search(text):
            path.write_text(rewrite(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
