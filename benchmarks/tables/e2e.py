"""End-to-end runs on one GPU or a pair (benchmarks/e2e.py, e2e_real_shapes.py, offload.py, hf_trainer_speed.py,
train_throughput.sh): memory, speed and what each preset keeps."""
from __future__ import annotations

from pathlib import Path

from benchmarks.tables import configs, gpu, headline, load, num, peaks, table, tokens


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
        b = configs(run)[cfg]["breakdown"]
        state = (b["weights_gb"] + b["optimizer_state_gb"] + b["grads_gb"]) * 2 ** 30 / run["params"]
        trades = trades.format(slower=f"{act['fwd_bwd_ms'] / ref['fwd_bwd_ms'] - 1:+.1%}")
        yield [label, num(state), num(off and off["host_optimizer_bytes_per_param"], 2),
               num(act["act_bytes_per_token_hidden"]), trades,
               f"`{file}` {cfg}; `offload.json` {host}; `llama_layer.json` {variant} (7B)"]


@table
def real_shapes(res: Path):
    """docs/results.md: today's shapes at seq 4096 on one GPU, no offload (benchmarks/e2e_real_shapes.py)."""
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


headline("real_shapes", "llama3.1-8b, seq 4096, H100", "coat_ds largest-model preset")


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
            c = configs(run)[key]
            top = c.get("max_batch")
            where = [f"{run['model']}, {run['seq_len']}", f"{run['world_size']}, {run['zero_stage']}", label]
            if top:
                yield [*where, c["max_micro_batch"], peaks(top), tokens(top)]
                continue
            tried = c["rungs"][0] if c.get("rungs") else None
            why = (f"micro-batch 1 ran at {num(tried['peak_reserved_gb'])} GiB reserved (> 95%), "
                   f"{tokens(tried)} tokens/s" if tried else f"needs >= {num(c['needed_gb_at_1'])} GiB at 1")
            yield [*where, f"does not fit ({why})", "-", "-"]


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
def hf_trainer(res: Path):
    """docs/deepspeed.md: HF Trainer beside a plain deepspeed.initialize loop on the same config."""
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
