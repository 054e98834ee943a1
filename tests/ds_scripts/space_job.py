"""The free-space check of a checkpoint save (coat_ds.deepspeed.checkpoint.space) on real engines, 2 ranks:

    python tests/ds_scripts/ranks.py --num_gpus 2 --master_port P tests/ds_scripts/space_job.py --out r.json --ckpt DIR

For each config (ZeRO stage, dtype, master weights, Offload) it trains one step and saves: each rank's estimate
(space.rank_bytes) beside the bytes the tag really holds on disk. Then the same engine's save is refused where
one rank (rank 1 only: the ranks must agree) sees too little free space: the message on each rank, and what the
save directory holds after it.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import common  # noqa: E402
from coat_ds.deepspeed.checkpoint import space  # noqa: E402
from coat_ds.deepspeed.checkpoint.save import CheckpointSaveError  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

WIDTH = 512   # ~0.8M parameters: the tensors, not the pickled metadata, make most of each file
CONFIGS = {"z1_fp32": (1, "fp32", {}), "z2_bf16": (2, "bf16", {}), "z3_bf16": (3, "bf16", {}),
           "z2_bf16_sr": (2, "bf16", {"coat": {"master_weights": "bf16_sr"}}),
           "z2_offload": (2, "fp32", {"offload": True})}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(common.IN, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, common.OUT))


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def measure(name: str, root: str) -> dict:
    stage, dtype, kw = CONFIGS[name]
    m = model()
    cfg = common.config(stage, dtype, dist.get_world_size(), **kw)
    engine, *_ = deepspeed.initialize(model=m, config=cfg, model_parameters=m.parameters())
    common.train(engine, range(1), dtype)
    save_dir = os.path.join(root, name)
    estimate = space.rank_bytes(engine)
    engine.save_checkpoint(save_dir, tag="t")
    out = {"estimates": gather(estimate), "on_disk": tree_bytes(os.path.join(save_dir, "t")),
           "params": sum(p.numel() for p in engine.module.parameters())}
    if name == "z2_bf16":
        out["refused"] = refuse(engine, save_dir)
    return out


def refuse(engine, save_dir: str) -> dict:
    """Rank 1 sees 1 MiB free: every rank must raise the same one-line error, and nothing may be written."""
    before = sorted(os.listdir(save_dir))
    latest = open(os.path.join(save_dir, "latest")).read()
    real = space.disk
    if dist.get_rank() == 1:
        space.disk = lambda path: (2 ** 20, real(path)[1])
    try:
        engine.save_checkpoint(save_dir, tag="t2")
        error = None
    except CheckpointSaveError as exc:
        error = str(exc)
    finally:
        space.disk = real
    return {"errors": gather(error), "before": before, "after": sorted(os.listdir(save_dir)),
            "latest": open(os.path.join(save_dir, "latest")).read(), "latest_before": latest}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    out = {}
    for name in CONFIGS:
        try:
            out[name] = measure(name, args.ckpt)
        except Exception as exc:  # noqa: BLE001 - recorded; the test shows it
            import traceback

            out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        dist.barrier()
    common.write(args.out, out)
    dist.barrier()


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        main()
