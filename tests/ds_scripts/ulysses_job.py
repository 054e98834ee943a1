"""Ulysses sequence parallelism with coat's FP8 decoder layers (tests/launched/test_ulysses.py), on 2 ranks.

    python tests/ds_scripts/ranks.py --num_gpus 2 --master_port P tests/ds_scripts/ulysses_job.py --out r.json \
        llama:zero2 qwen3:release ...

TASK is FAMILY:CONFIG. FAMILY: llama or qwen3 (tests/family_cases.py's sizes: 4 query heads of 16 on 2 kv heads,
the same for both, since DeepSpeed's Ulysses registration is one per process and fixes the head counts). CONFIG,
every one bf16 with CoatAdamW, clipping at 1.0, the FP8 layers (mode full) and coat's chunked loss:
  zero2    ZeRO-2, activation.attention_fp8: the Ulysses call inside Fp8AttentionFn, run again in its backward
  release  ZeRO-2, coat.gradients "release", the stock attention call in the FP8 layer
  host     ZeRO-3, coat.gradients "release", coat.states "host" (FP8 moments in host blocks)
  long     ZeRO-2, attention_fp8, each layer recomputed (checkpoint_store "host_fp8"), tile_tokens 16 (one GPU's
           32-token samples tiled, SP's 16-token shards not)
Each task runs twice, on the same samples: first without SP, both ranks on the whole samples (the same batch on
both, so the averaged gradient is one rank's and the run is one GPU's), then, with Ulysses registered once for the
process after every run without SP, over both ranks, each on its half of every sample's tokens
(coat_ds.deepspeed.sequence_parallel: shard, mean_loss, the mpu given to deepspeed.initialize). Per run and step:
the loss (with SP the group's mean), the gradient norm; the attention calls per step; each rank's results in r.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import deepspeed
import torch
import torch.distributed as dist
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import coat_ds  # noqa: F401  (registers CoatAdamW and the "coat" section with DeepSpeed)
from coat_ds.deepspeed import sequence_parallel as sp
from coat_ds.hf import CoatDecoderLayer
from coat_ds.launch.teardown import torn_down

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from family_cases import VOCAB, build  # noqa: E402

SEQ, MICRO, STEPS, LR = 32, 2, 6, 1e-2


def config(kind: str, micro: int = MICRO) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
           "optimizer": {"type": "CoatAdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                         "group_size": 32}},
           "zero_optimization": {"stage": 3 if kind == "host" else 2},
           "coat": {"activation": {"mode": "full", "attention_fp8": kind == "zero2"}}}
    if kind in ("release", "host"):
        cfg["coat"]["gradients"] = "release"
        cfg["zero_optimization"]["reduce_bucket_size"] = 4000   # several buckets: release steps during backward
    if kind == "long":   # the long-context settings: each layer recomputed from its FP8 input on the host, tiles
        cfg["coat"]["activation"].update(attention_fp8=True, checkpoint=True, checkpoint_store="host_fp8",
                                         tile_tokens=16)
    if kind == "host":
        cfg["coat"]["states"] = "host"
        cfg["zero_optimization"].update(sub_group_size=20000, stage3_param_persistence_threshold=0)
    return cfg


def samples(step: int) -> torch.Tensor:
    """The step's MICRO samples of SEQ + 1 tokens, the same on every rank."""
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))


def counted_attention():
    """(calls, the function counted): counts the calls of the sdpa entry of ALL_ATTENTION_FUNCTIONS (Ulysses'
    wrapper once registered) until restore_attention(that function)."""
    calls, inner = [0], ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counting(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = counting
    return calls, inner


def train(family: str, kind: str, mode: str, mpu) -> dict:
    """One run of MODE: "one" (both ranks on the whole samples), "dp" (each rank on one sample: data parallelism,
    whose reduction rounds as SP's does), "sp" (each rank on half of every sample's tokens)."""
    model = build(family)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    dp = mode == "dp"
    engine, *_ = deepspeed.initialize(model=model, config=config(kind, 1 if dp else MICRO),
                                      model_parameters=model.parameters(), mpu=mpu)
    calls, inner = counted_attention()
    out = {"losses": [], "norms": [], "calls": [], "fp8": sum(isinstance(m, CoatDecoderLayer) for m in model.modules()),
           "attention": inner.__name__}
    try:
        for step in range(STEPS):
            tokens = samples(step).to(engine.device)
            tokens = tokens[dist.get_rank():dist.get_rank() + 1] if dp else tokens
            x, y = tokens[:, :-1], tokens[:, 1:].contiguous()
            calls[0] = 0
            if mpu is None:   # HF's own position ids, the whole samples
                loss = engine(input_ids=x, labels=y, shift_labels=y).loss
            else:             # this rank's shard, its position ids, the group's mean
                loss = sp.lm_loss(engine, mpu, x, y)
            engine.backward(loss)
            engine.step()
            if dp:   # the mean over both samples, as the other runs' loss
                loss = loss.detach().reshape(1)
                dist.all_reduce(loss)
                loss = loss / 2
            out["losses"].append(loss.item())
            out["norms"].append(float(engine.get_global_grad_norm()))
            out["calls"].append(calls[0])
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = inner
    return out


def run_all(tasks: list[str]) -> dict:
    """Every task without SP, then Ulysses registered (once: DeepSpeed's groups are the process's), every task with
    SP; {task: {"one": ..., "dp": ... (a task FAMILY:CONFIG:dp), "sp": ...}}, or the error a run raised."""
    out: dict = {t: {} for t in tasks}
    mpu = None
    for mode in ("one", "dp", "sp"):
        for task in tasks:
            family, kind, *dp = task.split(":")
            if "error" in out[task] or (mode == "dp" and not dp):
                continue
            try:
                if mode == "sp" and mpu is None:
                    mpu = sp.register(build(family), 2, MICRO)
                out[task][mode] = train(family, kind, mode, mpu)
            except Exception as exc:  # noqa: BLE001 - recorded; the test shows it
                out[task] = {"error": f"{mode}: {type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("tasks", nargs="+")
    args = ap.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("COAT_JOB_TIMEOUT", "300")), exit=True)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    mine = run_all(args.tasks)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({t: {f"rank{r}": res[t] for r, res in enumerate(everyone)} for t in args.tasks}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        sys.exit(main())
