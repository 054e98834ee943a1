"""The main job, examples/train.py, run unchanged up to its model load, measured (tests/launched/test_model_load.py):

    python tests/ds_scripts/ranks.py --num_gpus 2 --master_port P tests/ds_scripts/load_job.py --out r.json \
        --deepspeed ds_configs/zero3_largest_model.json --model DIR ...

Each rank runs train.main with the given flags. Around its `load_inputs` (the data, then the model: under ZeRO-3
built partitioned and loaded from DIR) it records the rank's host memory: RSS before, the peak (VmHWM, restarted
by /proc/self/clear_refs) and RSS after, and what it holds of the model (its ZeRO-3 partition). Then every
parameter is gathered and compared with the checkpoint's tensor, each rank writes r.json.rank<N>, and the job ends
there (Loaded)."""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM  # noqa: F401  (imported before the baseline, as the load needs it)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import proc_bytes  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402
_spec = importlib.util.spec_from_file_location("train", ROOT / "examples" / "train.py")
train = sys.modules["train"] = importlib.util.module_from_spec(_spec)   # its dataclass looks itself up
_spec.loader.exec_module(train)


def checkpoint_tensors(model_dir: Path) -> dict[str, Path]:
    """Each tensor name of a save_pretrained safetensors checkpoint -> the file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: model_dir / "model.safetensors" for k in f.keys()}


def compare(model, model_dir: Path) -> dict:
    """Every parameter gathered (one at a time) against the checkpoint's tensor, in the model's dtype."""
    where = checkpoint_tensors(model_dir)
    checked, differ, absent = 0, [], []
    for name, p in model.named_parameters():
        if name not in where:
            absent.append(name)
            continue
        with safe_open(str(where[name]), "pt") as f:
            saved = f.get_tensor(name)
        with deepspeed.zero.GatheredParameters([p]):
            if p.shape != saved.shape or not torch.equal(p.data, saved.to(p.dtype)):
                differ.append(name)
        checked += 1
    return {"checked": checked, "differ": differ, "absent": absent}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a, rest = ap.parse_known_args()
    train.set_single_process_env()
    deepspeed.init_distributed()   # the process group's memory belongs to the baseline, not to the load
    rank = deepspeed.comm.get_rank()
    real_load = train.load_inputs

    def measured_load(args, ds_config):
        gc.collect()
        before = proc_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM restarts from the RSS now
        t0 = time.perf_counter()
        tokens, model = real_load(args, ds_config)
        peak, after, load_s = proc_bytes("VmHWM"), proc_bytes("VmRSS"), time.perf_counter() - t0
        params = list(model.parameters())
        held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() if hasattr(p, "ds_tensor") else
                   p.numel() * p.element_size() for p in params)
        rec = dict(rank=rank, world=deepspeed.comm.get_world_size(), rss_before=before, peak=peak, rss_after=after,
                   partition_bytes=held, dtype=str(params[0].dtype), load_s=load_s,
                   model_bytes=sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params),
                   **compare(model, Path(args.model)))
        rec["compare_s"] = time.perf_counter() - t0 - load_s
        Path(f"{a.out}.rank{rank}").write_text(json.dumps(rec))
        raise Loaded

    train.load_inputs = measured_load   # main() looks it up when it runs
    try:
        train.main(rest)
    except Loaded:
        return 0
    raise SystemExit("the main job never loaded its inputs")


class Loaded(Exception):
    """Raised once the load is measured and checked: a training step of a few hundred million parameters takes
    minutes on the CPU accelerator, and after the load the job's memory no longer depends on how it was loaded."""


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        sys.exit(main())
