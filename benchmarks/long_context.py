"""Long context on ONE GPU capped at an 80 GB card's memory (issue 61): Llama-3.1-8B (or `--model`, or a shallower
stand-in of its width) at one micro-batch of `--seqs` tokens, through ds_configs/zero2_largest_model.json with each
layer recomputed in backward ("coat.activation.checkpoint"). coat's configurations differ in where a recomputed
layer's input waits ("checkpoint_store") and whether the MLP runs over sequence tiles ("tile_tokens"); `alst` is
DeepSpeed's own Arctic Long Sequence Training stack instead, no coat (see ALST). Per row: peak GPU memory from
deepspeed.initialize on (and set-up's and the steps' apart: at 8B set-up's can be the higher), the memory a step
leaves resident, GPU bytes per token of sequence ((peak - resident) / seq), host peak, tokens/s. One worker process
per (configuration, layers, seq), a configuration's lengths rising until the first that does not fit; rows merge
into long_context.json (another --model's: long_context_<model>.json) by that identity. A case over
benchmarks/harness.py.

    python -m benchmarks.long_context --configs gpu,host_fp8_tiled --seqs 32768,131072 --cap-gib 79
    python -m benchmarks.long_context --layers 2 --seqs 524288 --configs host_fp8_tiled --steps 0
    python -m benchmarks.long_context --layers 2 --emulate-layers 32 --seqs 1048576 --configs offload_fp8_tiled \
        --steps 0
    python -m benchmarks.long_context --model llama3.2-3b --configs host_fp8_tiled,alst --seqs 131072
    python -m benchmarks.long_context --smoke --out /tmp/long      # CPU, tiny Llama
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
import types

import torch

from benchmarks import harness
from benchmarks.common import GIB, ROOT, names_of, proc_bytes, worker_cmd, write_json
from benchmarks.configs import MODELS
from coat_ds.workloads import causal_lm as train_lib

NAME, MODEL, SMOKE_MODEL = "long_context", "llama3.1-8b", "tiny"
PRESET = "ds_configs/zero2_largest_model.json"
TILE, LOSS_TILE = 16384, 1024   # tokens an MLP tile; a loss tile (coat.activation.loss's default chunk)
ALST = "alst"
ALST_ZERO = "ds_configs/zero3_offload_largest_model.json"   # whose ZeRO-3 section (buckets, sub-groups) alst runs
CONFIGS = {  # name -> (what it is, the coat.activation keys it sets over the preset's; None: no coat section)
    "gpu": ("recompute, each layer's bf16 input kept on the GPU (torch's checkpoint)", {"checkpoint": True}),
    "gpu_fp8": ("recompute, each layer's input kept on the GPU in FP8 (per 16-group scales)",
                {"checkpoint": True, "checkpoint_store": "gpu_fp8"}),
    "gpu_fp8_tiled": (f"gpu_fp8, and the MLP over tiles of {TILE} tokens: host_fp8_tiled without the copies",
                      {"checkpoint": True, "checkpoint_store": "gpu_fp8", "tile_tokens": TILE}),
    "host_fp8": ("recompute, each layer's input in FP8 in pinned host memory, streamed back a layer ahead",
                 {"checkpoint": True, "checkpoint_store": "host_fp8"}),
    "host_fp8_tiled": (f"host_fp8, and the MLP over tiles of {TILE} tokens in forward and recompute",
                       {"checkpoint": True, "checkpoint_store": "host_fp8", "tile_tokens": TILE}),
    "offload_fp8_tiled": (f"host_fp8_tiled over {ALST_ZERO} in place of the preset: ZeRO-3, CoatAdamW's FP8 "
                          "moments in pinned host memory (coat.states 'host'), the bf16 weights on the GPU",
                          {"checkpoint": True, "checkpoint_store": "host_fp8", "tile_tokens": TILE}),
    ALST: ("DeepSpeed's ALST stack, no coat section: BF16 weights, ZeRO-3 (the zero_optimization of "
           f"{ALST_ZERO}) with parameters and optimizer offloaded to pinned host memory, AdamW (DeepSpeedCPUAdam: "
           "fp32 master, gradients and moments on the host), the preset's bf16, clipping and schedule; HF's "
           "gradient checkpointing (use_reentrant false) of every decoder layer, each layer's input in pinned host "
           "memory (deepspeed...offload_activations.CheckpointHiddenStatesOffload, marked after ZeRO-3's pre-hook); "
           "every MLP through "
           f"ulysses_sp.TiledMLP in tiles of {TILE} tokens, the loss through ulysses_sp.TiledFusedLogitsLoss in "
           f"tiles of {LOSS_TILE} tokens (HF's loss_function per tile)", None),
}
PRESET_OF = {"offload_fp8_tiled": ALST_ZERO}   # a configuration over another preset than PRESET
SETTING = ("model", "preset", "cap_gib")   # what rows of one file share; a file of another is refused
WORKER_FLAGS = ("model", "seq", "steps", "cap_gib", "layers", "emulate_layers")


LLAMAS = [name for name, shape in MODELS.items() if "model_type" not in shape]   # what --model takes


def ds_config(name: str) -> dict:
    """The preset with configuration `name`'s coat.activation keys; alst: no coat section, AdamW, ZeRO-3 with both
    offloads (the preset's bf16, clipping, scheduler and AdamW hyper-parameters kept)."""
    cfg = json.loads((ROOT / PRESET_OF.get(name, PRESET)).read_text())
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    if name != ALST:
        cfg["coat"]["activation"].update(CONFIGS[name][1])
        return cfg
    del cfg["coat"]
    params = {k: cfg["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")}
    cfg["optimizer"] = {"type": "AdamW", "params": params}
    offload = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = dict(json.loads((ROOT / ALST_ZERO).read_text())["zero_optimization"],
                                    offload_param=offload, offload_optimizer=offload)
    return cfg


class AlstCausalLM(torch.nn.Module):
    """An HF causal LM as ALST trains it (DeepSpeed's docs/_tutorials/ulysses-alst-sequence-parallelism.md and its
    tests/unit/ulysses_alst): forward(input_ids, shift_labels) -> the mean next-token loss, the decoder's hidden
    states through TiledFusedLogitsLoss (lm_head + HF's loss_function a tile at a time, each tile's backward run in
    forward, so no full logits), every decoder layer's MLP through TiledMLP (recomputed a tile at a time in
    backward) and HF's non-reentrant gradient checkpointing on. Built before deepspeed.initialize."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm
        lm.config.use_cache = False
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in lm.model.layers:
            layer.mlp.forward = types.MethodType(tiled_mlp_forward, layer.mlp)

    def forward(self, input_ids: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        lm, tokens = self.lm, shift_labels.numel()
        hidden = lm.model(input_ids=input_ids, use_cache=False).last_hidden_state

        def tile_loss(lm: torch.nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # a tile's share of the mean: its sum over all tokens (HF's num_items_in_batch), the tiles then summed
            return lm.loss_function(logits=lm.lm_head(h), labels=None, vocab_size=lm.config.vocab_size,
                                    shift_labels=y, num_items_in_batch=tokens)

        return TiledFusedLogitsLoss.apply(tile_loss, lm, hidden, shift_labels, None,
                                          math.ceil(shift_labels.shape[1] / LOSS_TILE), [lm.lm_head.weight], "sum")


def checkpoint_offload(lm: torch.nn.Module):
    """DeepSpeed's CheckpointHiddenStatesOffload for `lm` (after deepspeed.initialize): in its context each
    checkpointed decoder layer's input waits in pinned host memory (the newest one kept on the GPU), copied on a side
    stream (on the CPU it stays). Its own marker (on GradientCheckpointingLayer.__call__) marks the tensor handed to
    the call, but ZeRO-3's forward pre-hook hands forward a new one (a detached alias carrying its post-backward
    hook), which the checkpoint saves: that mark never matches and nothing would move. So a pre-hook registered
    after ZeRO-3's marks what forward gets, through the manager's own `mark` (its stats: checkpoint_offload)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    offload = CheckpointHiddenStatesOffload()

    def mark(layer: torch.nn.Module, args: tuple) -> None:
        if layer.training and torch.is_grad_enabled() and args and torch.is_tensor(args[0]):
            offload.mark(args[0])

    for layer in lm.model.layers:
        layer.register_forward_pre_hook(mark)
    return offload


def tiled_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's MLP (gate, up, down) over tiles of TILE tokens, through DeepSpeed's TiledMLP: each tile's
    output in forward under no_grad, each tile recomputed and back-propagated alone in backward."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    return TiledMLP.apply(type(self).forward, self, x, math.ceil(x.shape[-2] / TILE),
                          [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight])


def identity(row: dict) -> tuple:
    return row["config"], row["layers"], row["seq"], row.get("emulated_layers")


def ballast_bytes(config: str, shape: dict, seq: int, layers: int) -> int:
    """GPU bytes that `layers` layers of `shape` hold beyond its own depth under `config` at the step's peak besides
    the activations (weights, gradients, master, optimizer states, DeepSpeed's buffers: coat_ds.plan's figures at
    the full depth's peak moment), so that a stand-in holding them beside its own runs its activations against the
    full depth's GPU memory (--emulate-layers)."""
    from coat_ds import plan as P

    def job(n: int) -> P.Job:
        return P.job_from_config(ds_config(config), P.shape_from_hf(dict(shape, num_hidden_layers=n), NAME), seq, 1)

    def fixed(parts: dict[str, float]) -> float:
        return sum(v for k, v in parts.items() if k not in ("activations", "logits/loss"))

    full = P.plan(job(layers), 1)
    return int(fixed(full.parts) - fixed(P.phases(job(shape["num_hidden_layers"]), 1)[full.phase]))


def worker(args: argparse.Namespace) -> int:
    """Build (bf16 on the GPU, capped at --cap-gib; fp32 on the CPU), one step, then `--steps` timed ones (0: the
    first step's memory only, its time not a speed); the row written to --result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_lib.set_single_process_env()
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    shape = dict(MODELS[args.model], max_position_embeddings=args.seq,
                 **({"num_hidden_layers": args.layers} if args.layers else {}))
    cfg, alst = ds_config(args.config), args.config == ALST
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mem = (lambda f: f() / GIB) if device == "cuda" else (lambda f: None)
    ballast = args.emulate_layers and ballast_bytes(args.config, shape, args.seq, args.emulate_layers)
    held = torch.empty(ballast or 0, dtype=torch.uint8, device=device)   # the missing layers' bytes, to the end
    model = train_lib.from_shape(shape, seed=0, device=device,   # alst too: ZeRO-3 partitions it at initialize
                                 dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    engine = train_lib.initialize(AlstCausalLM(model) if alst else model, cfg)
    setup_peak = mem(torch.cuda.max_memory_allocated)   # deepspeed.initialize's own, apart from the step's
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    offload = checkpoint_offload(model) if alst else contextlib.nullcontext()   # one, around forward + backward
    tokens = torch.randint(0, shape["vocab_size"], (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step() -> float:
        with offload:
            loss = engine(x, y) if alst else train_lib.lm_loss(engine, x, y)
            engine.backward(loss)
        engine.step()
        return loss.item()

    t0 = time.perf_counter()
    losses = [step()]
    sync()
    first_s, resident = time.perf_counter() - t0, mem(torch.cuda.memory_allocated)
    t0 = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    sync()
    step_s = (time.perf_counter() - t0) / args.steps if args.steps else None
    step_peak = mem(torch.cuda.max_memory_allocated)
    peak = max(setup_peak, step_peak) if step_peak is not None else None   # from initialize on, as every row
    write_json(args.result, {
        "config": args.config, "layers": shape["num_hidden_layers"], "seq": args.seq, "fits": True,
        "tokens_per_s": args.seq / step_s if step_s else None, "step_time_s": step_s, "first_step_s": first_s,
        "peak_alloc_gib": peak, "setup_peak_gib": setup_peak, "step_peak_gib": step_peak,
        "peak_reserved_gib": mem(torch.cuda.max_memory_reserved), "resident_gib": resident,
        "gpu_bytes_per_token": (peak - resident) * GIB / args.seq if peak is not None else None,
        "host_peak_rss_gib": proc_bytes("VmHWM") / GIB, "losses": losses,
        **({"emulated_layers": args.emulate_layers, "ballast_gib": held.numel() / GIB} if ballast else {}),
        **({"checkpoint_offload": vars(offload.stats)} if alst else {})})   # the last step's
    return 0


def run_one(args: argparse.Namespace, name: str, seq: int) -> dict:
    """A worker process's row; one that fails says how (out of memory: fits false)."""
    return harness.worker_row(lambda result: worker_cmd(f"benchmarks.{NAME}", args, WORKER_FLAGS, config=name,
                                                        seq=seq, result=result),
                              args.timeout, config=name, seq=seq,
                              layers=args.layers or MODELS[args.model]["num_hidden_layers"],
                              **({"emulated_layers": args.emulate_layers} if args.emulate_layers else {}))


def stem(args: argparse.Namespace) -> str:
    """The results file's name: long_context.json for the default model (and the smoke's), another model's
    long_context_<model>.json (a file's rows share one model)."""
    return NAME if args.model in (MODEL, SMOKE_MODEL) else f"{NAME}_{args.model}"


def results(args: argparse.Namespace, rows: list[dict], call: dict) -> dict:
    """This call's rows merged into --out's file by identity (a file of another model, preset or cap refused)."""
    ours = {"model": args.model, "shape": MODELS[args.model], "preset": PRESET, "cap_gib": args.cap_gib,
            "configs": {k: v[0] for k, v in CONFIGS.items()}}
    rows = [dict(r, date=call.get("date")) for r in rows]   # each row its call's date: the code it ran
    return harness.into_file(args.out / f"{stem(args)}.json", rows, identity, ours, call, SETTING)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                conflict_handler="resolve")   # --model below replaces one_gpu_options' hidden one
    p.add_argument("--configs", default="gpu,host_fp8_tiled", help=f"comma-separated, of {list(CONFIGS)}")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the first (0: memory only)")
    harness.one_gpu_options(p, NAME, "seqs", "default 32768,131072; --smoke 64,128",
                            MODELS[MODEL]["num_hidden_layers"])
    p.add_argument("--model", help=f"a Llama shape of benchmarks/configs.py (default {MODEL}; --smoke "
                                   f"{SMOKE_MODEL}); another model's rows go to {NAME}_<model>.json")
    p.add_argument("--emulate-layers", type=int, help="with --layers: also hold on the GPU what the model at this "
                   "depth holds beyond the stand-in's layers besides activations (ballast_bytes; the row's peak is "
                   "then the deeper model's, its host the stand-in's)")
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model is not None and args.model not in LLAMAS:
        p.error(f"--model {args.model!r} is unknown; allowed: {LLAMAS}")
    args.config_names = names_of(p, "configs", args.configs, CONFIGS)
    if ALST in args.config_names and MODELS[args.model or MODEL].get("tie_word_embeddings"):
        p.error(f"--configs {ALST}: --model {args.model} ties its embeddings, which TiledFusedLogitsLoss under ZeRO-3 "
                "cannot train (DeepSpeed 0.19.8 reduces the tied weight twice a step); allowed: an untied Llama, "
                "e.g. llama3.2-3b-untied")
    if args.steps < 0:
        p.error(f"--steps={args.steps} is invalid; allowed: an integer >= 0")
    if args.emulate_layers is not None and not (args.layers or args.emulate_layers) < args.emulate_layers:
        p.error(f"--emulate-layers={args.emulate_layers} is invalid; allowed: with --layers, an integer above it")
    args.seq_list = harness.one_gpu_checked(p, args, NAME, "seqs", "64,128" if args.smoke else "32768,131072",
                                            (MODEL, SMOKE_MODEL))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return harness.one_gpu_case(args, stem(args), worker, lambda name, seq: run_one(args, name, seq),
                                args.config_names, args.seq_list, lambda rows, call: results(args, rows, call))


if __name__ == "__main__":
    sys.exit(main())
