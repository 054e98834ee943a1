"""ZeRO-3's set-up under CoatAdamW: DeepSpeed allocates a gradient buffer of the rank's whole partition, which coat
replaces right after by per-parameter gradients (zero/step.py GradPartitions). At world 1 that buffer is the
model's gradients beside its weights: Qwen3-30B-A3B's 57 GiB twice did not fit an 80 GB card (seen on an H200
capped at 79 GiB). Where coat replaces it, it is never allocated: built on the meta device."""
import textwrap

import pytest

from harness import run_one_rank_job

pytest.importorskip("deepspeed")

CASES = [(gradients, before) for gradients in ("per_parameter", "release") for before in (True, False)]
# The four runs in one process (one import of torch and DeepSpeed, not four): each builds its own engine from the
# same seed; a "before" run's stand-in for the fix is put back after it.
JOB = textwrap.dedent("""
    import json, sys
    import torch
    import deepspeed
    import coat_ds
    from coat_ds.deepspeed import engine as coat_engine
    from deepspeed.runtime.zero import stage3

    def run(gradients, before):
        replaces = coat_engine.replaces_grad_buffer
        if before:                       # as before the fix: DeepSpeed builds its buffer, coat replaces it after
            coat_engine.replaces_grad_buffer = lambda *_: False
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        n = sum(p.numel() for p in model.parameters())
        allocated = []   # (numel, device) of every torch.zeros of ZeRO-3's module (sub-groups smaller than the
                         # model: only the gradient buffer is model-sized)
        real_zeros = torch.zeros

        def zeros(*size, **kw):
            t = real_zeros(*size, **kw)
            allocated.append((t.numel(), str(t.device)))
            return t

        stage3.torch.zeros = zeros
        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 10000},
               "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3}},
               "coat": {"gradients": gradients, "master_weights": "bf16_sr"}}
        try:
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
        finally:
            stage3.torch.zeros = real_zeros
            coat_engine.replaces_grad_buffer = replaces
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        losses = []
        for _ in range(3):
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        full = [d for numel, d in allocated if numel >= n]
        return {"full_buffers": full, "losses": losses}

    print("RESULT " + json.dumps({f"{g}:{b}": run(g, b) for g, b in CASES}))
""").replace("CASES", repr(CASES))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_one_rank_job(tmp_path_factory.mktemp("zero3_setup"), JOB)


@pytest.mark.parametrize("gradients", ["per_parameter", "release"])
def test_the_partition_sized_gradient_buffer_is_never_allocated(runs, gradients):
    before, out = runs[f"{gradients}:True"], runs[f"{gradients}:False"]
    assert before["full_buffers"] == ["cpu"], before     # the job sees the buffer where it is allocated
    assert out["full_buffers"] == ["meta"], out          # DeepSpeed's buffer made, on the meta device only
    assert out["losses"] == before["losses"]             # and the steps are the same, bit for bit
