"""Shared pieces of the scripts the DeepSpeed tests launch: a tiny model, its data, a config, a train loop."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import coat_ds  # noqa: F401  (registers "CoatAdamW" with DeepSpeed)

GLOBAL_BATCH = 8  # samples per optimizer step, whatever the world size
MICRO_BATCHES = 2
IN, HID, OUT = 24, 72, 10  # 24*72+72 + 72*72+72 + 72*10+10 = 7,786 params: partition cuts fall inside groups


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, HID), nn.GELU(), nn.Linear(HID, OUT))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (GLOBAL_BATCH,), generator=g)
    return x, y


def config(stage: int, dtype: str, world: int, *, group_size: int = 32, offload: bool = False, **extra) -> dict:
    # two micro-batches of 4 per step: both on one rank (accumulated) or one per rank (averaged). Either way
    # the gradient is g0/2 + g1/2 with the same rounding, so runs differ only by what the optimizer does.
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // MICRO_BATCHES,
        "gradient_accumulation_steps": MICRO_BATCHES // world,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "CoatAdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                      "group_size": group_size, "v_format": "e4m3"}},
        "zero_optimization": {"stage": stage},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 0:  # DeepSpeed's stage-0 bf16 path (DDP_BFLOAT16) accumulates in the model dtype only
            cfg.pop("data_types")
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 4, "hysteresis": 1}
        cfg.pop("data_types")
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg.update(extra)
    return cfg


def dtype_of(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def train(engine, steps: range, dtype: str, poison: set[int] = frozenset()) -> list[float]:
    """Mean loss over the global batch for each step. Step numbers in `poison` get an inf loss scale."""
    rank, world = engine.global_rank, engine.world_size
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in steps:
        x, y = batch(step)
        total = torch.zeros((), dtype=torch.float32)
        for k in range(MICRO_BATCHES // world):
            lo = (k * world + rank) * micro  # micro-batch k of rank r: the same samples at any world size
            xb, yb = x[lo:lo + micro].to(engine.device, dtype_of(dtype)), y[lo:lo + micro].to(engine.device)
            loss = nn.functional.cross_entropy(engine(xb).float(), yb)
            if step in poison and k == MICRO_BATCHES // world - 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        if world > 1:  # on the engine's device: NCCL has no CPU backend
            total = total.to(engine.device)
            dist.all_reduce(total)
        losses.append(total.item() / MICRO_BATCHES)
    return losses


def mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """A step's loss averaged over the ranks, each of which computed it on its own micro-batch."""
    total = loss.detach().float()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / world


def write(path: str, obj) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


@contextlib.contextmanager
def timed(task: str):
    """Where COAT_TASK_TIMES names a file, rank 0 appends `script task wall_s cpu_s` of the block to it (what a
    launched job's time goes to: tests/ds_scripts' tasks, timed without changing their results)."""
    path, t0, c0 = os.environ.get("COAT_TASK_TIMES"), time.perf_counter(), time.process_time()
    yield
    if path and int(os.environ.get("RANK", "0")) == 0:
        with open(path, "a") as f:
            f.write(f"{os.path.basename(sys.argv[0])} {task} {time.perf_counter() - t0:.1f} "
                    f"{time.process_time() - c0:.1f}\n")
