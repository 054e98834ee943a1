"""The shipped presets and HF configs, trained a few steps on 2 ranks (tests/launched/test_presets.py).

    deepspeed --num_gpus 2 tests/ds_scripts/presets_job.py --out r.json --tmp DIR plain hf

plain: every preset of ds_configs/ (coat_ds/deepspeed/presets.py) through plain deepspeed.initialize, its scheduler
       set to the run's steps as examples/train.py does, on one fixed batch (the loss must fall).
hf:    every config of ds_configs/hf/ through HF Trainer with default TrainingArguments: only the output
       folder, the step count, a small batch, one log line a step; bf16 where the preset needs a bf16 model.
Results of every rank go to one JSON file, per task {"rank0": ..., "rank1": ...} (section_job's format).
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import section_job  # noqa: E402  its launcher harness (main) and tiny Llama
from section_job import LLAMA, ROOT, fp8_layers, tiny  # noqa: E402
from coat_ds.deepspeed import presets  # noqa: E402
from coat_ds.deepspeed.config import engine_section  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

SEQ, PLAIN_STEPS, HF_STEPS = 16, 5, 3


def _facts(engine, model) -> dict:
    """What the engine runs: FP8 layers, attention_fp8, optimizer, master setting and master dtype."""
    zo = engine.optimizer
    flats = getattr(zo, "single_partition_of_fp32_groups", None) or getattr(zo, "fp32_partitioned_groups_flat", [])
    layers = [m for m in model.modules() if hasattr(m, "coat_config")]
    return {"fp8": fp8_layers(model), "attention_fp8": sorted({m.coat_config.attention_fp8 for m in layers}),
            "optimizer": type(engine.basic_optimizer).__name__, "master_weights": engine_section(engine).master_weights,
            "gradients": engine_section(engine).gradients,
            "fp32_master_values": sum(f.numel() for f in flats if f is not None and f.dtype == torch.float32)}


def task_plain(tmp: str) -> dict:
    """Every plain preset, `PLAIN_STEPS` steps on one fixed batch per rank."""
    out = {}
    x = torch.randint(0, LLAMA["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    for layout, intent in presets.shipped():
        name = presets.file_name(layout, intent)
        cfg = json.loads((ROOT / "ds_configs" / name).read_text())
        cfg["scheduler"]["params"].update(total_num_steps=PLAIN_STEPS, warmup_num_steps=1)
        cfg["train_micro_batch_size_per_gpu"] = 2
        model = tiny()
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        losses = []
        for _ in range(PLAIN_STEPS):
            loss = engine(input_ids=x.to(engine.device), labels=x.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = {**_facts(engine, model), "losses": losses}
        del engine, model
        gc.collect()
    return out


def task_hf(tmp: str) -> dict:
    """Every ds_configs/hf/ config through HF Trainer with TrainingArguments' defaults."""
    import transformers
    from deepspeed.accelerator import get_accelerator
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, LLAMA["vocab_size"], (HF_STEPS * 4, SEQ), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": x, "labels": x} for x in ids]
    out = {}
    for path in sorted((ROOT / "ds_configs" / "hf").glob("*.json")):
        bf16 = json.loads(path.read_text()).get("coat", {}).get("master_weights", "fp32") != "fp32"
        args = TrainingArguments(output_dir=os.path.join(tmp, path.stem), deepspeed=str(path), max_steps=HF_STEPS,
                                 per_device_train_batch_size=2, logging_steps=1, report_to="none",
                                 save_strategy="no", disable_tqdm=True, bf16=bf16,
                                 use_cpu=get_accelerator().device_name() == "cpu")
        model = tiny()
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        out[path.name] = {**_facts(trainer.model_wrapped, trainer.model), "bf16": bf16,
                          "losses": [h["loss"] for h in logs], "lr": [h["learning_rate"] for h in logs],
                          "default_lr": TrainingArguments(output_dir=tmp).learning_rate,
                          "transformers": transformers.__version__}
        del trainer, model
        gc.collect()
    return out


if __name__ == "__main__":
    section_job.TASKS = {"plain": task_plain, "hf": task_hf}
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        sys.exit(section_job.main())
