"""Time per ZeRO-2 step: CoatAdamW vs DeepSpeed's FusedAdam ("type": "AdamW"), same model, same config.

    deepspeed --num_gpus 2 tests/ds_scripts/bench_zero2.py --opt coat --out r.json

Also measures per-rank optimizer-state bytes, and (with --offload) host memory of the states.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn

import coat_ds  # noqa: F401
from coat_ds.launch.teardown import torn_down


def model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", choices=["coat", "fused"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    deepspeed.init_distributed()
    net = model(args.width, args.depth)
    opt = ({"type": "CoatAdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
           if args.opt == "coat" else {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95],
                                                                   "weight_decay": 0.1}})
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 9, "optimizer": opt, "zero_optimization": {"stage": args.stage}}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    rss0 = rss()
    engine, *_ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(args.batch, args.width, device=engine.device, dtype=dtype)
    cuda = torch.cuda.is_available()
    times = []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if i == 0:
            rss_a = rss()
        engine.step()
        if i == 0:
            rss_b = rss()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in net.parameters())
    sb = state_bytes(engine.basic_optimizer)
    out = {"optimizer": args.opt, "basic_optimizer": type(engine.basic_optimizer).__name__,
           "world_size": dist.get_world_size(), "stage": args.stage, "offload": args.offload, "dtype": args.dtype,
           "n_params": n, "state_bytes_per_rank": sb, "state_bytes_per_param_per_rank": sb / n,
           "step_ms_median": 1000 * sorted(times)[len(times) // 2], "step_ms_mean": 1000 * sum(times) / len(times),
           "host_rss_growth_init_bytes": rss_a - rss0, "host_rss_growth_first_step_bytes": rss_b - rss_a,
           "loss": loss.item(),
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                        "coat_ds": coat_ds.__version__}}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        main()
