"""Renders the measured tables of README.md and docs/*.md from benchmarks/results/*.json.

    python -m benchmarks.render_tables           # rewrite every marked region
    python -m benchmarks.render_tables --check   # exit 1 naming each region that differs (tests/test_render_tables.py)

A region is `<!-- table:NAME -->` ... `<!-- /table -->` in a Markdown file; NAME is a function below decorated
with @table. A new table: one function that reads its JSON with load() and returns (header, rows).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGION = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
TABLES: dict[str, Callable[[Path], tuple[list[str], list[list]]]] = {}


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
    return markdown(*TABLES[name](results))


# --- the tables -------------------------------------------------------------------------------------------------------
# (model, its e2e run, the run of torchao beside the lowest-memory preset: a torchao compile takes minutes a shape)
E2E = (("Llama 1.1B", "e2e_llama-1b.json", "e2e_torchao_llama-1b.json"),
       ("Llama-2-7B", "e2e_7b_one_gpu.json", "e2e_torchao_llama2-7b.json"))
E2E_CONFIGS = (("bf16", "BF16 + FusedAdam"),
               ("torchao_fp8", "torchao float8 (compiled) + AdamWFp8, plain loop"),
               ("coat_full", "coat_ds, DeepSpeed's fp32 master"),
               ("coat_full_rem", "coat_ds, fp32 master as bf16 + remainders (exact preset)"),
               ("coat_full_bf16sr", "coat_ds, bf16_sr master (lowest-memory preset without attention_fp8)"))


def _configs(run: dict) -> dict:
    return {c["name"]: c for c in run["configs"]}


@table
def results(res: Path):
    """docs/results.md: peak memory and tokens/s, BF16 vs torchao vs coat, end to end (benchmarks/e2e.py)."""
    header = ["model, GPU (file)", "configuration", "peak GiB at micro-batch N", "tokens/s at N",
              "largest micro-batch that fits", "tokens/s there"]
    rows = []
    for model, name, peer_name in E2E:
        run = load(res, name)
        peer = load(res, peer_name)
        configs = {**_configs(run), "torchao_fp8": _configs(peer)["torchao_fp8"]}
        for key, label in E2E_CONFIGS:
            c = configs.get(key)
            file, src = (peer_name, peer) if key == "torchao_fp8" else (name, run)
            n = src["equal_micro_batch"]
            where = f"{model}, {run['device'].replace('NVIDIA ', '')} (`{file}`)"
            if c is None or (c.get("errors") and not c.get("equal_batch") and c.get("needed_gb_at_1") is None):
                rows.append([where, label, "not run" if c is None else "no result (see the file's errors)", "-", "-",
                             "-"])
                continue
            eq, top = c.get("equal_batch"), c.get("max_batch")
            peak = (f"{num(eq['peak_alloc_gb'])} (N={n})" if eq else
                    f"does not fit at 1 (needs ~{num(c.get('needed_gb_at_1'))})")
            largest = c.get("max_micro_batch", "-")
            if len(c.get("rungs") or ()) == 1 and c.get("smallest_failing_batch") is None:
                largest = f">= {largest} (the one size run)"   # a single size, no search (torchao's compile)
            rows.append([where, label, peak, num(eq and eq["tokens_per_s"], 0), largest,
                         num(top and top["tokens_per_s"], 0)])
    return header, rows


PRESET_ROWS = (  # intent -> (e2e run and config behind its state bytes, the Offload row's config, llama_layer variant)
    ("BF16 + FusedAdam (baseline)", ("e2e_llama-1b.json", "bf16"), "bf16", "bf16_eager", "-"),
    ("`exact`", ("e2e_7b_one_gpu.json", "coat_full_rem"), "coat_full", "coat_full",
     "FP8 optimizer states and activations; an exact fp32 master as bf16 weights + int16 remainders "
     "(Offload: DeepSpeed's fp32 master)"),
    ("`lowest_memory`", ("e2e_7b_one_gpu.json", "coat_full_bf16sr"), "coat_full_bf16sr", "coat_full_attn_fp8",
     "bf16 master with stochastic rounding; attention's q, k, v saved in FP8 ({slower} layer time); "
     "FP8 weights re-quantized each micro-batch"),
)


@table
def presets(res: Path):
    """docs/presets.md: what each preset keeps per parameter and per token, and the measured rows behind it."""
    layer = load(res, "llama_layer.json")
    offload = {r["config"]: r for r in load(res, "offload.json")["rows"] if r["model"] == "llama-1b"}
    header = ["preset", "training state B/param (GPU, ZeRO-2, 1 GPU)", "host B/param under Offload",
              "activations B/token/hidden", "what it trades", "measured rows"]
    rows = []
    cfg_act = PRESET_ROWS[1][3]  # the exact preset's layer: what lowest_memory's attention_fp8 is timed against
    for label, (file, cfg), host, variant, trades in PRESET_ROWS:
        run = load(res, file)
        b = _configs(run)[cfg]["breakdown"]
        state = (b["weights_gb"] + b["optimizer_state_gb"] + b["grads_gb"]) * 2 ** 30 / run["params"]
        act, ref = (next(r for r in layer if r["shape"] == "llama2-7b" and r["variant"] == v)
                    for v in (variant, cfg_act))
        trades = trades.format(slower=f"{act['fwd_bwd_ms'] / ref['fwd_bwd_ms'] - 1:+.1%}")
        off = offload.get(host)
        rows.append([label, num(state), num(off and off["host_optimizer_bytes_per_param"], 2),
                     num(act["act_bytes_per_token_hidden"]), trades,
                     f"`{file}` {cfg}; `offload.json` {host}; `llama_layer.json` {variant} (7B)"])
    return header, rows


@table
def real_shapes(res: Path):
    """README: today's shapes at seq 4096 on one GPU, no offload (benchmarks/e2e_real_shapes.py)."""
    from coat_ds import plan

    run = load(res, "e2e_real_shapes.json")
    header = ["model, GPU", "configuration", "largest micro-batch", "peak GiB there", "tokens/s there",
              "BF16 + FusedAdam at micro-batch 1", "BF16 + FusedAdam: GPUs it needs (planner, ZeRO-2)"]
    rows = []
    bf16_cfg = plan.bf16_baseline(plan.read_config("zero2_bf16")[0])
    for case in run["cases"].values():
        if case["model"] == "tiny":
            continue
        bf16 = next((c for c in case["summary"] if c["name"] == "bf16"), None)
        gpu = next(name for name in plan.GPUS if name.upper() in case["device"].upper())
        if bf16 is None:   # not run beside this case: what the planner says of micro-batch 1
            job = plan.job_from_config(bf16_cfg, plan.resolve_shape(case["model"]), case["seq_len"], 1)
            p = plan.plan(job, 1)
            verdict = "fits" if p.fits(plan.GPUS[gpu] * 2 ** 30) else "does not fit"
            need = f"{verdict} (planner: {num(p.peak / 2 ** 30)} GiB)"
        else:
            need = (f"does not fit (needs >= {num(bf16['needed_gb_at_1'])} GiB)" if bf16["max_micro_batch"] == 0
                    else f"fits up to {bf16['max_micro_batch']}")
        gpus = plan.fewest_gpus(bf16_cfg, case["model"], case["seq_len"], plan.GPUS[gpu] * 2 ** 30)
        where = f"{case['model']}, seq {case['seq_len']}, {case['device'].replace('NVIDIA ', '')}"
        rows += [[where, c["label"], c["max_micro_batch"], num(c["peak_alloc_gb"]), num(c["tokens_per_s"], 0), need,
                  gpus or "more than 64"] for c in case["summary"] if c["name"] != "bf16"]
    return header, rows



GRADS_RUNS = ("e2e_grads_llama-1b.json", "e2e_grads_llama2-7b.json",   # one H100
              *(f"e2e_grads_nccl_z{z}_{m}.json" for m in ("llama-1b", "llama2-7b") for z in (2, 3)))  # two, NCCL


@table
def gradients(res: Path):
    """docs/deepspeed.md: coat.gradients per_parameter (default) against DeepSpeed's partition buffer (and release
    where a run has it), one H100 and two (NCCL, ZeRO-2 and ZeRO-3), peaks per GPU."""
    header = ["model, seq, micro-batch", "GPUs, ZeRO stage", "coat.gradients", "peak GiB allocated",
              "peak GiB reserved", "tokens/s", "tokens/s against the buffer"]
    rows = []
    for name in GRADS_RUNS:
        run = load(res, name)
        by = {c["name"]: c["rungs"][0] for c in run["configs"] if c["rungs"]}
        base = by["lowest_memory_grad_buffer"]["tokens_per_s"]
        for cfg, key in (("lowest_memory", "per_parameter"), ("lowest_memory_grad_buffer", "partition_buffer"),
                         ("largest_model", "release")):
            r = by.get(cfg)
            if r is None:
                continue
            rows.append([f"{run['model']}, {run['seq_len']}, {r['micro_batch']}",
                         f"{run['world_size']}, {run['zero_stage']}", key, num(r["peak_alloc_gb"]),
                         num(r["peak_reserved_gb"]), num(r["tokens_per_s"], 0), f"{r['tokens_per_s'] / base:.3f}x"])
    return header, rows


RELEASE_RUNS = [f"e2e_release_nccl_z{z}_{m}.json" for m in ("llama2-7b", "llama2-13b") for z in (2, 3)]
RELEASE_LABELS = {"bf16": "BF16 + FusedAdam", "largest_model": "largest-model preset (release)"}


@table
def release_nccl(res: Path):
    """docs/deepspeed.md: gradient release on 2 H100s (NCCL) at seq 4096 beside BF16 + FusedAdam, each at its
    largest micro-batch, peaks per GPU."""
    header = ["model, seq", "GPUs, ZeRO stage", "configuration", "largest micro-batch", "peak GiB allocated / reserved",
              "tokens/s"]
    rows = []
    for name in RELEASE_RUNS:
        run = load(res, name)
        by = _configs(run)
        for key in ("bf16", "largest_model"):
            c, top = by[key], by[key].get("max_batch")
            where = [f"{run['model']}, {run['seq_len']}", f"{run['world_size']}, {run['zero_stage']}",
                     RELEASE_LABELS[key]]
            if not top:
                tried = c["rungs"][0] if c.get("rungs") else None
                why = (f"micro-batch 1 ran at {num(tried['peak_reserved_gb'])} GiB reserved (> 95%), "
                       f"{num(tried['tokens_per_s'], 0)} tokens/s" if tried else
                       f"needs >= {num(c['needed_gb_at_1'])} GiB at 1")
                rows.append([*where, f"does not fit ({why})", "-", "-"])
                continue
            rows.append([*where, c["max_micro_batch"], f"{num(top['peak_alloc_gb'])} / {num(top['peak_reserved_gb'])}",
                         num(top["tokens_per_s"], 0)])
    return header, rows


@table
def hf_trainer(res: Path):
    """README / docs/deepspeed.md: HF Trainer beside a plain deepspeed.initialize loop on the same config."""
    run = load(res, "hf_trainer.json")
    by = {r["spec"].removesuffix(":profile"): r for r in run["runs"] if r.get("tokens_per_s")}
    header = ["preset, model, micro-batch, tuning", "HF Trainer tokens/s", "plain loop tokens/s", "Trainer / plain",
              "peak GiB", "measured at"]
    rows = []
    for spec, r in by.items():
        path, rest = spec.split(":", 1)
        if path != "trainer":
            continue
        plain = by.get(f"plain:{rest}")
        same = plain is not None and plain["measured_at"] == r["measured_at"]
        rows.append([rest.replace(":", ", "), num(r["tokens_per_s"], 0), num(plain and plain["tokens_per_s"], 0),
                     f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if same else "-", num(r["peak_alloc_gb"]),
                     r["measured_at"]])
    return header, rows


@table
def attention_fp8_whole_model(res: Path):
    """docs/activation.md: attention_fp8 through a whole default-config HF model and the engine."""
    header = ["model, GPU (file)", "configuration", "micro-batch", "forward keeps GiB", "B/token/hidden/layer",
              "peak GiB", "tokens/s"]
    rows = []
    for name in ("e2e_attention_fp8_7b.json", "e2e_attention_fp8_1b.json"):
        run = load(res, name)
        per = run["forward_kept_b_per_token_hidden_layer"]
        for c in run["configs"]:
            eq, b = c["equal_batch"], c["breakdown"]
            rows.append([f"{run['model']}, {run['device'].replace('NVIDIA ', '')} (`{name}`)", c["label"],
                         eq["micro_batch"], num(b["alloc_forward_delta_gb"], 2), num(per[c["name"]], 2),
                         num(eq["peak_alloc_gb"], 2), num(eq["tokens_per_s"], 0)])
    return header, rows


LAYER_VARIANTS = (("bf16_eager", "HF `LlamaDecoderLayer`, bf16 eager"), ("bf16_compiled", "same, `torch.compile`"),
                  ("torchao_fp8_compiled", "torchao float8 (tensorwise), `torch.compile`"),
                  ("coat_linear", "coat_ds FP8 linears only, eager"), ("coat_full", "coat_ds full FP8 flow, eager"),
                  ("coat_full_compiled", "coat_ds full FP8 flow, `torch.compile`"),
                  ("coat_full_attn_fp8", "coat_ds full FP8 flow + `attention_fp8`, eager"),
                  ("coat_full_attn_fp8_compiled", "same, `torch.compile`"))


@table
def llama_layer(res: Path):
    """docs/activation.md: a stack of 4 decoder layers: activation bytes kept for backward, time, peak, gradient."""
    rows = {(r["shape"], r["variant"]): r for r in load(res, "llama_layer.json")}
    header = ["variant", "7B B/tok/h", "7B fwd+bwd ms", "7B peak GB", "8B (GQA) B/tok/h", "8B fwd+bwd ms",
              "input-grad cosine vs bf16 (7B)"]
    out = []
    for key, label in LAYER_VARIANTS:
        a, b = rows.get(("llama2-7b", key)), rows.get(("llama3-8b", key))
        out.append([label, num(a and a["act_bytes_per_token_hidden"], 2), num(a and a["fwd_bwd_ms"], 2),
                    num(a and a["peak_mem_bytes"] / 1e9), num(b and b["act_bytes_per_token_hidden"], 2),
                    num(b and b["fwd_bwd_ms"], 2), num(a and a["dx_cos_vs_bf16_eager"], 3)])
    return header, out


E2E_RUNS = ("e2e_7b_one_gpu.json", "e2e.json", "e2e_grad_accum_fp32.json", "e2e_llama-1b.json",
            "e2e_llama-1b_grad_accum_fp32.json")


@table
def e2e_runs(res: Path):
    """docs/results.md: every configuration of every committed e2e run, one row each."""
    header = ["run (file)", "configuration", "micro-batch N", "peak GiB at N", "tokens/s at N",
              "largest micro-batch", "tokens/s there"]
    rows = []
    for name in E2E_RUNS:
        run = load(res, name)
        where = f"{run['model']}, {run['world_size']}x {run['device'].split('x ')[-1].replace('NVIDIA ', '')}, " \
                f"ZeRO-{run['zero_stage']} (`{name}`)"
        for c in run["configs"]:
            eq, top = c.get("equal_batch"), c.get("max_batch")
            peak = num(eq and eq["peak_alloc_gb"]) if eq else f"does not fit (~{num(c.get('needed_gb_at_1'))} at 1)"
            best = top["micro_batch"] if top else c.get("max_micro_batch", "-")
            rows.append([where, c["label"], run["equal_micro_batch"], peak, num(eq and eq["tokens_per_s"], 0),
                         f"{'' if top is None or top.get('exact') else '>= '}{best}",
                         num(top and top["tokens_per_s"], 0)])
    return header, rows


SEED_CONFIGS = (("bf16", "BF16 + FusedAdam"), ("coat_opt", "coat_ds optimizer-only"), ("coat_full", "coat_ds full"),
                ("coat_full_bf16sr", "coat_ds full, bf16 master (`bf16_sr`)"),
                ("coat_full_attn_fp8", "coat_ds full + `attention_fp8`"),
                ("largest_model", "coat_ds largest-model preset (gradient release, clipping one step late)"))


@table
def seed_spread(res: Path):
    """docs/results.md: validation loss at the last step, mean +- sample std over three seeds per config."""
    summary = load(res, "seed_spread.json")["default"]["summary"]
    header = ["config", "final", "best", "gap of the mean to BF16 (final)", "inside BF16's spread"]
    rows = []
    for key, label in SEED_CONFIGS:
        s = summary[key]
        rows.append([label, f"{s['final_mean']:.4f} +- {s['final_std']:.4f}",
                     f"{s['best_mean']:.4f} +- {s['best_std']:.4f}",
                     "-" if key == "bf16" else f"{100 * s['gap_rel_mean']:+.2f}%",
                     "-" if key == "bf16" else ("yes" if s["within_bf16_spread"] else "no")])
    return header, rows


@table
def seed_spread_families(res: Path):
    """docs/results.md: the other families' seed spreads (125M, 3 seeds, bf16 against coat full)."""
    run = load(res, "seed_spread.json")
    header = ["family", "compared at step", "BF16 + FusedAdam", "coat_ds full", "gap of the mean",
              "inside BF16's spread"]
    rows = []
    for family in ("qwen3", "gemma3_text"):
        sec = run[family]
        b, c = sec["summary"]["bf16"], sec["summary"]["coat_full"]
        rows.append([family, sec["steps_compared"], f"{b['final_mean']:.4f} +- {b['final_std']:.4f}",
                     f"{c['final_mean']:.4f} +- {c['final_std']:.4f}", f"{100 * c['gap_rel_mean']:+.2f}%",
                     "yes" if c["within_bf16_spread"] else "no"])
    return header, rows


@table
def quant_error(res: Path):
    """docs/optimizer.md: mean relative error of Adam's moments after one quantization."""
    return ["scheme", "m", "v"], [[r["scheme"], f"{100 * r['m_rel_err']:.2f}%", f"{100 * r['v_rel_err']:.2f}%"]
                                  for r in load(res, "quant_error.json")["rows"]]


OPTIMIZERS = (("coat", "CoatAdamW kernel"), ("coat_step", "CoatAdamW.step"), ("fused_adam", "DeepSpeed FusedAdam"),
              ("torch_adamw", "torch fused AdamW"), ("torchao_fp8", "torchao AdamWFp8"),
              ("torchao_8bit", "torchao AdamW8bit"), ("bnb_8bit", "bnb AdamW8bit"))


@table
def optimizer_step(res: Path):
    """docs/results.md: one optimizer step over a flat fp32 tensor (fp32 grads), ms."""
    rows = [r for r in load(res, "optimizer_step.json")["rows"]
            if r["grad_dtype"] == "float32" and r["master"] == "float32"]
    header = ["values", *[label for _, label in OPTIMIZERS]]
    return header, [[f"{r['numel']:.0e}", *[num(r.get(f"{k}_ms"), 3) for k, _ in OPTIMIZERS]]
                    for r in sorted(rows, key=lambda r: -r["numel"])]


MASTERS = {"float32": "fp32 (`fp32`)", "float32_remainder": "fp32 as bf16 + int16 remainder (`fp32_remainder`)",
           "bfloat16_sr": "bf16, stochastic rounding (`bf16_sr`)"}


@table
def optimizer_step_masters(res: Path):
    """docs/results.md: CoatAdamW's kernel at 1e9 values by gradient dtype and master weights."""
    rows = [r for r in load(res, "optimizer_step.json")["rows"] if r["numel"] == 1e9]
    header = ["gradients", "master", "ms", "bytes moved / param", "GB/s", "share of copy bandwidth",
              "vs FusedAdam (fp32)"]
    fused = next(r["fused_adam_ms"] for r in rows if r.get("fused_adam_ms"))
    return header, [[r["grad_dtype"], MASTERS[r["master"]], num(r["coat_ms"], 3), num(r["coat_bytes_per_param"], 2),
                     num(r["coat_gbps"], 0), f"{r['coat_frac_of_copy']:.1%}", f"{fused / r['coat_ms']:.2f}x"]
                    for r in rows]


MODELS = {"llama-1b": "Llama 1.1B", "llama2-7b": "Llama-2-7B", "llama2-13b": "Llama-2-13B"}


@table
def offload(res: Path):
    """docs/deepspeed.md: ZeRO-2 Offload on one H100 node (benchmarks/offload.py); rows predicted not to fit say so."""
    header = ["model, micro-batch", "configuration", "pinned", "host optimizer B/param (master + states)",
              "host RSS steady / peak GiB", "GPU peak GB", "tokens/s"]
    runs = load(res, "offload.json")["rows"]
    micro = {r["model"]: r["micro_batch"] for r in runs if "micro_batch" in r}
    rows, last = [], None
    for r in runs:
        where = f"{MODELS.get(r['model'], r['model'])}, {micro.get(r['model'], '-')}" if r["model"] != last else ""
        last = r["model"]
        if not r["fits"]:
            why = r["why_not"].split(": peak ")[-1].split(" GiB")[0]
            rows.append([where, r["label"], "no", "-", f"not run: predicted {why} GiB peak", "-", "-"])
            continue
        rows.append([where, r["label"], "yes" if r["pinned"] else "no", num(r["host_optimizer_bytes_per_param"], 2),
                     f"{num(r['host_rss_gb'])} / {num(r['host_rss_peak_gb'])}", num(r["gpu_peak_gb"]),
                     num(r["tokens_per_s"], 0)])
    return header, rows


@table
def offload_host_cpu(res: Path):
    """docs/deepspeed.md: host memory of the optimizer states under Offload, one CPU rank (bench_zero2.py)."""
    run = load(res, "offload_host_memory_cpu.json")
    header = ["optimizer", "state tensors on the host", "host RSS growth over the first step",
              f"training step ({run['device']})"]
    rows = []
    for name, label in (("CoatAdamW", "CoatAdamW (CPU kernel)"), ("DeepSpeedCPUAdam", "DeepSpeedCPUAdam")):
        r = run[name]
        state = f"{num(r['state_bytes_per_rank'] / 1e6)} MB = {r['state_bytes_per_param_per_rank']:g} B/param"
        rows.append([label, state,
                     f"{num(r['host_rss_growth_first_step_bytes'] / 1e6)} MB", f"{num(r['step_ms_median'])} ms"])
    return header, rows


@table
def train_throughput(res: Path):
    """docs/train.md: the main job on one H100, BF16 against coat (benchmarks/train_throughput.sh)."""
    runs = load(res, "train_throughput.json")["runs"]
    base = runs["zero2_bf16"]
    header = ["config", "tokens/s (median step)", "peak GPU memory", "train loss at the last step", "val loss"]
    rows = []
    for name, what in (("zero2_bf16", "BF16, FusedAdam"), ("zero2_coat", "CoatAdamW + FP8 activations")):
        r = runs[name]
        ratio = "" if r is base else (f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)",
                                      f" ({r['peak_mem_gb'] / base['peak_mem_gb']:.2f}x)")
        rows.append([f"`{name}.json` ({what})", num(r["tokens_per_s"], 0) + (ratio[0] if ratio else ""),
                     f"{r['peak_mem_gb']:.2f} GiB" + (ratio[1] if ratio else ""), f"{r['last_loss']:.2f}",
                     f"{r['last_val_loss']:.2f}"])
    return header, rows


# --- regions ----------------------------------------------------------------------------------------------------------
def regions(text: str) -> list[tuple[str, str]]:
    """(name, current body) of every marked region of a Markdown text."""
    return [(m.group(2), m.group(3)) for m in REGION.finditer(text)]


def rewrite(text: str, results: Path = RESULTS) -> str:
    return REGION.sub(lambda m: m.group(1) + render(m.group(2), results) + m.group(4), text)


def stale(results: Path = RESULTS, files: list[Path] = DOCS) -> list[str]:
    """'file: table' for every region whose text is not what its JSON renders (or names no table)."""
    bad = []
    for path in files:
        for name, body in regions(path.read_text()):
            if name not in TABLES or body != render(name, results):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    return bad


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
