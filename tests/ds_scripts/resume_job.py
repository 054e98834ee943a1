"""A resume measured (tests/launched/test_resume_memory.py): the 70B preset's optimizer settings on a stand-in.

    python tests/ds_scripts/ranks.py --num_gpus 2 --master_port P tests/ds_scripts/resume_job.py --out r.json \
        --ckpt DIR --layers 12 --width 1024

On the CPU accelerator (gloo) or on GPUs, one per rank. A stack of `layers` bf16 Linear layers (width x width, no
bias) under ZeRO-3 with CoatAdamW, `"coat": {"states": "host", "gradients": "release", "master_weights": "bf16_sr"}`
(ds_configs/zero3_offload_largest_model.json's optimizer part) and sub-groups of SUB_GROUP values, trains one step
and saves; a second engine is built the same way and loads it. Around that load_checkpoint each rank records its
host memory: RSS before (the engine built: its partition and its host states held), the peak (VmHWM, restarted by
/proc/self/clear_refs) and RSS after. Then it records what it holds (its host states' bytes, its partition's), its
optimizer file's size and largest tensor, whether masters and states are the saved ones (digests taken before the
first engine went) and its config, and writes r.json.rank<N>."""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import proc_bytes  # noqa: E402
from coat_ds.deepspeed.checkpoint.files import torch_load, zero_files  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

SUB_GROUP = 2_000_000   # values of a rank's ZeRO-3 sub-group: its master (bf16) is the file's largest tensor


def config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "bf16": {"enabled": True},
            "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3, "group_size": 128, "v_format": "e4m3"}},
            "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP, "stage3_param_persistence_threshold": 0,
                                  "reduce_bucket_size": SUB_GROUP},
            "coat": {"states": "host", "gradients": "release", "master_weights": "bf16_sr"}}


def build(layers: int, width: int):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))).to(torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
    return engine


def held(engine) -> list[torch.Tensor]:
    """This rank's masters (the bf16 partition under bf16_sr) and host state blocks."""
    return [*engine.optimizer.fp32_partitioned_groups_flat, *engine.optimizer._coat_home.host]


def tensors(value) -> list[torch.Tensor]:
    """Every tensor in a loaded checkpoint file's nested dicts and lists."""
    if torch.is_tensor(value):
        return [value]
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [t for v in inner for t in tensors(v)]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    engine = build(a.layers, a.width)
    x = torch.randn(2, a.width, generator=torch.Generator().manual_seed(rank)).to(engine.device, torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(a.ckpt, tag="t")
    engine.optimizer._coat_home.sync()
    saved = digest(held(engine))
    del engine
    gc.collect()

    engine = build(a.layers, a.width)
    gc.collect()
    before = proc_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM restarts from the RSS now
    engine.load_checkpoint(a.ckpt, tag="t")
    peak, after = proc_bytes("VmHWM"), proc_bytes("VmRSS")

    path = zero_files(os.path.join(a.ckpt, "t"), dist.get_world_size())[rank]
    home = engine.optimizer._coat_home
    rec = dict(rank=rank, world=dist.get_world_size(), rss_before=before, peak=peak, rss_after=after,
               states_bytes=sum(map(nbytes, home.host)),
               partition_bytes=sum(map(nbytes, engine.optimizer.fp32_partitioned_groups_flat)),
               file_bytes=os.path.getsize(path), largest_tensor=max(map(nbytes, tensors(torch_load(path, mmap=True)))),
               subgroups=len(home.blocks), as_saved=digest(held(engine)) == saved, config=config())
    Path(f"{a.out}.rank{rank}").write_text(json.dumps(rec))
    return 0


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        sys.exit(main())
