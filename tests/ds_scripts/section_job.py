"""The "coat" section applied by DeepSpeed's engine wherever the config is read (tests/launched/test_coat_section.py).

    deepspeed --num_gpus 2 tests/ds_scripts/section_job.py --out r.json --tmp DIR plain zero3_init ...
    accelerate launch --config_file A.yaml tests/ds_scripts/section_job.py --out r.json --tmp DIR accelerate

Each route trains a tiny Llama a few steps and records its FP8 decoder layer count and this rank's losses,
beside the losses of coat_ds.deepspeed.initialize on the same model, config and batches (the reference).
Results of every rank go to one JSON file, per task {"rank0": ..., "rank1": ...}.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import coat_ds
import common
from coat_ds.activation import ActivationConfig
from coat_ds.hf import CoatDecoderLayer
from coat_ds.hf.swap import apply
from coat_ds.launch.teardown import torn_down

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
SEQ, STEPS = 16, 3


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def fp8_layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, CoatDecoderLayer) for m in model.modules())


def shipped(name: str) -> str:
    return str(ROOT / "ds_configs" / name)


def batches(engine, n: int = STEPS) -> list[torch.Tensor]:
    """This rank's micro-batches for n optimizer steps."""
    rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    count = n * engine.gradient_accumulation_steps()
    return [torch.randint(0, LLAMA["vocab_size"], (micro, SEQ), generator=torch.Generator().manual_seed(100 * k + rank))
            for k in range(count)]


def run(engine, xs: list[torch.Tensor]) -> list[float]:
    losses = []
    for x in xs:
        x = x.to(engine.device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def reference(config, xs: list[torch.Tensor], model: torch.nn.Module | None = None) -> list[float]:
    """The same training through coat_ds.deepspeed.initialize."""
    engine, *_ = coat_ds.deepspeed.initialize(model if model is not None else tiny(), config=copy.deepcopy(config))
    return run(engine, xs)


def summary(engine, model: torch.nn.Module, losses: list[float]) -> dict:
    layers = [m for m in model.modules() if isinstance(m, CoatDecoderLayer)]
    return {"fp8": len(layers), "optimizer": type(engine.basic_optimizer).__name__, "losses": losses,
            "cache": sorted({g.cache for m in layers for g in m.weight_groups})}


# ------------------------------------------------------------------------------------------------ tasks
def task_plain(tmp: str) -> dict:
    """A user's own train.py: plain deepspeed.initialize with a shipped config file, as it is."""
    path = shipped("zero2_coat.json")
    model = tiny()
    engine, *_ = deepspeed.initialize(model=model, config=path)
    xs = batches(engine)
    out = summary(engine, model, run(engine, xs))
    out["reference"] = reference(path, xs)
    hand = coat_ds.inject(tiny())                                 # injected by the user with the same section
    engine, *_ = deepspeed.initialize(model=hand, config=path)
    out["injected_by_user"] = run(engine, xs)
    return out


def _partitions(model: torch.nn.Module) -> list:
    return [(id(p), p.ds_tensor.data_ptr(), p.data.numel(), p.ds_status.name) for p in model.parameters()]


def task_zero3_init(tmp: str) -> dict:
    """ZeRO-3 with the model built under zero.Init by HF (HfDeepSpeedConfig alive during from_pretrained)."""
    from transformers.integrations import HfDeepSpeedConfig

    saved = os.path.join(tmp, "tiny_llama")
    if dist.get_rank() == 0:
        tiny().save_pretrained(saved)
    dist.barrier()
    config = json.loads(Path(shipped("zero3_coat.json")).read_text())
    keep = HfDeepSpeedConfig(copy.deepcopy(config))  # noqa: F841 - alive: from_pretrained builds under zero.Init
    probe = LlamaForCausalLM.from_pretrained(saved)
    before = _partitions(probe)
    apply(probe, ActivationConfig(), 1)                          # the engine's swap on partitioned parameters
    out = {"probe_fp8": fp8_layers(probe), "probe_untouched": before == _partitions(probe),
           "partitioned": all(n == 0 and s == "NOT_AVAILABLE" for _, _, n, s in before)}
    model = LlamaForCausalLM.from_pretrained(saved)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    xs = batches(engine)
    out.update(summary(engine, model, run(engine, xs)))
    out["leaf"] = all(getattr(m, "_z3_leaf", False) for m in model.modules() if isinstance(m, CoatDecoderLayer))
    del keep, probe
    gc.collect()
    out["reference"] = reference(config, xs, LlamaForCausalLM.from_pretrained(saved))  # built whole
    return out


def _as_shipped(path: Path) -> str | dict:
    """The file as it is, but for DeepSpeedCPUAdam (bf16 Offload baseline), a JIT build of minutes on 2 cores:
    DeepSpeed's own "torch_adam" runs torch's AdamW on the offloaded partition instead."""
    cfg = json.loads(path.read_text())
    offload = cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none"
    if not offload or cfg["optimizer"]["type"] == "CoatAdamW":
        return str(path)
    cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


def not_presets() -> list[Path]:
    """ds_configs/ but the presets (test_presets trains those, checking more; their other keys are their layout
    file's, which runs here)."""
    from coat_ds.deepspeed import presets

    return sorted(p for p in (ROOT / "ds_configs").glob("*.json") if p.name not in presets.file_names())


def task_configs(tmp: str) -> dict:
    """Every shipped config file but the presets through plain deepspeed.initialize, as it is: two steps each."""
    out = {}
    for path in not_presets():
        model = tiny()
        engine, *_ = deepspeed.initialize(model=model, config=_as_shipped(path))
        out[path.name] = summary(engine, model, run(engine, batches(engine, 2)))
        out[path.name]["lr"] = engine.get_lr()
        del engine, model
        gc.collect()
    return out


def _section(stage: int = 2, optimizer: bool = True, **activation) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": stage}, "coat": {"activation": activation}}
    if optimizer:
        cfg["optimizer"] = {"type": "CoatAdamW", "params": {"lr": 1e-3}}
    return cfg


def _error(model, config, **kw) -> str | None:
    """"ValueError: ..." (any exception, by its type and message), or None when the engine was built."""
    try:
        deepspeed.initialize(model=model, config=config, **kw)
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        return f"{type(exc).__name__}: {exc}"
    return None


def task_refusals(tmp: str) -> dict:
    """What the section cannot apply to is a ValueError; enabled: false, client and no optimizers, the cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = {"gpt2": _error(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)), _section()),
           "sequential": _error(torch.nn.Sequential(torch.nn.Linear(4, 4)), _section()),
           "other_config": _error(coat_ds.inject(tiny(), {"mode": "linear"}), _section(mode="full")),
           "disabled_but_injected": _error(coat_ds.inject(tiny()), _section(enabled=False)),
           "bad_value": _error(tiny(), _section(mode="half"))}
    stock = tiny()
    engine, *_ = deepspeed.initialize(model=stock, config={**_section(stage=3), "coat": {}})
    out["wrapped"] = _error(stock, _section(stage=3))            # ZeRO-3 hooks of another engine
    out["engine"] = _error(engine, _section())                   # an engine handed over as the model
    model = tiny()
    deepspeed.initialize(model=model, config=_section(enabled=False))
    out["disabled_fp8"] = fp8_layers(model)
    model = tiny()
    deepspeed.initialize(model=model, config=_section(optimizer=False), optimizer=torch.optim.AdamW(model.parameters()))
    out["client_optimizer_fp8"] = fp8_layers(model)
    model = tiny()
    deepspeed.initialize(model=model, config=_section(stage=0, optimizer=False))  # an evaluation-only engine
    out["no_optimizer_fp8"] = fp8_layers(model)
    for name, over in (("cache_gas1", {}), ("cache_derived_gas2", {"train_batch_size": 8})):
        cfg = {**_section(), **over}
        if over:
            cfg.pop("gradient_accumulation_steps")           # DeepSpeed derives 8 / (2 x 2 ranks) = 2
        model = tiny()
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        out[name] = summary(engine, model, [])["cache"] + [engine.gradient_accumulation_steps()]
    return out


def task_hf_trainer(tmp: str) -> dict:
    """HF Trainer with the HF-style config (ds_configs/hf/: "auto" values the Trainer fills), its arguments
    made as examples/hf_trainer.py makes them."""
    from transformers import Trainer

    sys.path.insert(0, str(ROOT / "examples"))
    from hf_trainer import training_arguments

    class Recording(Trainer):
        seen: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            x = inputs["input_ids"].clone()
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.seen.append((x, loss.item()))
            return loss

    ids = torch.randint(0, LLAMA["vocab_size"], (STEPS * 8, SEQ), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": x, "labels": x} for x in ids]
    config = json.loads(Path(shipped("hf/zero2_coat.json")).read_text())
    args = training_arguments(config, argparse.Namespace(output_dir=os.path.join(tmp, "hf"), steps=STEPS, seed=0))
    args.disable_tqdm = True
    model = tiny()
    trainer = Recording(model=model, args=args, train_dataset=data)
    trainer.model_accepts_loss_kwargs = False          # the model's own mean loss, as the reference computes it
    trainer.train()
    out = summary(trainer.model_wrapped, trainer.model, [loss for _, loss in trainer.seen])
    out["reference"] = reference(trainer.accelerator.deepspeed_config, [x for x, _ in trainer.seen])
    return out


def task_accelerate(tmp: str) -> dict:
    """accelerate launch with a DeepSpeed config file (the accelerate config's deepspeed_config_file)."""
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler

    acc = Accelerator()
    model = tiny()
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    data = torch.randint(0, LLAMA["vocab_size"], (STEPS * 4, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    opt = DummyOptim(list(model.parameters()))
    engine, opt, loader, sched = acc.prepare(model, opt, loader, DummyScheduler(opt))
    seen = []
    for x in loader:
        loss = engine(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        seen.append((x.clone(), loss.item()))
    out = summary(engine, engine.module, [loss for _, loss in seen])
    out["config_file"] = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")   # set by accelerate launch
    out["reference"] = reference(acc.deepspeed_config, [x for x, _ in seen])
    return out


TASKS = {name[len("task_"):]: fn for name, fn in dict(globals()).items() if name.startswith("task_")}


def task_of(name: str):
    """A task of this script (TASKS), or `SCRIPT.TASK`: the task_TASK of another job script in this folder that takes
    this main (checkpoint_job.py, presets_job.py), so that one launch runs the tasks of several (harness.section_launch:
    one import of torch, DeepSpeed and transformers per rank, not one per script)."""
    if name in TASKS:
        return TASKS[name]
    script, _, task = name.partition(".")
    fn = getattr(importlib.import_module(script), f"task_{task}", None) if task else None
    if fn is None:
        raise SystemExit(f"unknown task {name!r}; allowed: {sorted(TASKS)} or SCRIPT.TASK")
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tmp", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("tasks", nargs="+")
    args = ap.parse_args()
    tasks = {name: task_of(name) for name in args.tasks}
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("COAT_JOB_TIMEOUT", "300")), exit=True)
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    out = {}
    for task in args.tasks:
        with common.timed(task):
            try:
                res = tasks[task](args.tmp)
            except Exception as exc:  # noqa: BLE001 - recorded; the test shows it
                res = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, res)
        out[task] = {f"rank{r}": v for r, v in enumerate(everyone)}
        if dist.get_rank() == 0:  # after every task: a job that dies later still shows what passed
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        sys.exit(main())
