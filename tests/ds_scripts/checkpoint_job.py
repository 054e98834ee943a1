"""coat.activation.checkpoint under ZeRO-3 through plain deepspeed.initialize
(tests/launched/test_activation_checkpoint_zero3.py).

    deepspeed --num_gpus 2 tests/ds_scripts/checkpoint_job.py --out r.json --tmp DIR release grads

Each task trains a default-config HF Llama (use_cache=True; tests/family_cases.py) twice from the same weights on
the same per-rank batches, the coat section's `checkpoint` false then true, every parameter partitioned
(stage3_param_persistence_threshold 0: the recompute must re-gather them), and records what the two runs share:
  release  ds_configs/zero3_largest_model.json (CoatAdamW, bf16_sr master, gradients released in backward,
           attention_fp8): the losses of STEPS steps and whether the final weights are equal, bit for bit
  grads    ZeRO-3 in fp32 with torch AdamW: whether every parameter's full gradient after the first backward is
           equal, bit for bit
and, per run, what each decoder layer saved in the first forward (B per token per hidden unit) and how often a
layer's forward ran per step (2 with the recompute). Per task {"rank0": ..., "rank1": ...} (section_job's format).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import section_job  # noqa: E402  its launcher harness (main)
from family_cases import SEQ, VOCAB, build  # noqa: E402
from layer_probe import counting_forwards, saved_per_layer  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, MICRO = 3, 2


def _batches() -> list[torch.Tensor]:
    rank = dist.get_rank()
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * k + rank))
            for k in range(STEPS)]


def _train(cfg: dict, checkpoint: bool, optimizer=None, grads: bool = False) -> dict:
    """STEPS steps of a fresh model under `cfg` with coat.activation.checkpoint = `checkpoint`."""
    cfg = json.loads(json.dumps(cfg))
    cfg.setdefault("coat", {}).setdefault("activation", {})["checkpoint"] = checkpoint
    model = build("llama")
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=optimizer(model.parameters()) if optimizer else None)
    out = {"full_grads": None, "losses": []}
    with counting_forwards() as calls:
        for step, x in enumerate(_batches()):
            _step(engine, model, x.to(engine.device), out, calls, first=step == 0, grads=grads)
    out["checkpointed"] = [bool(m.gradient_checkpointing) for m in model.model.layers]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def _step(engine, model, x: torch.Tensor, out: dict, calls: list[int], first: bool, grads: bool) -> None:
    """One step; the first records what the layers saved, the forwards backward ran and (`grads`) full gradients."""
    losses = []
    forward = lambda: losses.append(engine(input_ids=x, labels=x).loss)  # noqa: E731
    if first:
        out["saved_per_layer"] = saved_per_layer(model, forward, x.numel())
    else:
        forward()
    before = calls[0]
    engine.backward(losses[0])
    out.setdefault("backward_forwards", calls[0] - before)
    if grads and first:
        out["full_grads"] = [safe_get_full_grad(p).clone() for p in model.parameters()]
    engine.step()
    out["losses"].append(losses[0].item())


def _compare(off: dict, on: dict, key: str) -> bool:
    return all(torch.equal(a, b) for a, b in zip(off[key], on[key], strict=True))


def _summary(off: dict, on: dict) -> dict:
    facts = ("losses", "saved_per_layer", "backward_forwards", "checkpointed")
    return {"off": {k: off[k] for k in facts}, "on": {k: on[k] for k in facts},
            "weights_equal": _compare(off, on, "weights")}


def task_release(tmp: str) -> dict:
    """The ZeRO-3 largest-model preset, checkpoint off and on."""
    cfg = json.loads((ROOT / "ds_configs" / "zero3_largest_model.json").read_text())
    cfg["scheduler"]["params"].update(total_num_steps=STEPS, warmup_num_steps=1)
    cfg["train_micro_batch_size_per_gpu"] = MICRO
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, reduce_bucket_size=1000,
                                    stage3_prefetch_bucket_size=1000)
    runs = [_train(cfg, checkpoint) for checkpoint in (False, True)]
    return _summary(*runs)


def task_grads(tmp: str) -> dict:
    """ZeRO-3 in fp32 with torch AdamW: the full gradients after the first backward."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "coat": {}}
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    off, on = (_train(cfg, checkpoint, adamw, grads=True) for checkpoint in (False, True))
    return {**_summary(off, on), "grads_equal": _compare(off, on, "full_grads")}


if __name__ == "__main__":
    section_job.TASKS = {"release": task_release, "grads": task_grads}
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        sys.exit(section_job.main())
