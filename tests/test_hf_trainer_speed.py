"""What coat_ds does for HF Trainer's step time (docs/deepspeed.md, "HF Trainer speed").

HF Trainer reads the gradient norm after every optimizer step (`_get_grad_norm`: accelerate's
DeepSpeedEngineWrapper.get_global_grad_norm calls `.item()` on whatever the engine returns): a tensor there
makes the host wait for the whole optimizer step before it prepares the next batch. coat_ds's ZeRO-1/2 step
has waited for the norm anyway (its finiteness check), so it hands DeepSpeed the norm as the float DeepSpeed
documents (`get_global_grad_norm() -> Optional[float]`), with DeepSpeed's own value."""
from __future__ import annotations

import pytest

from harness import run_one_rank_job

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

JOB = """
import json, torch, deepspeed, coat_ds
from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
from coat_ds.deepspeed.zero import step as zero_step
from transformers import LlamaConfig, LlamaForCausalLM

def norms(coat_step):
    zero_step.ENABLED = coat_step
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(engine.device)
    out = []
    for _ in range(3):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        seen = engine.get_global_grad_norm()
        out.append([type(seen).__name__, float(seen), DeepSpeedEngineWrapper(engine).get_global_grad_norm()])
    return out

print("RESULT " + json.dumps({"coat": norms(True), "deepspeed": norms(False)}))
"""


def test_zero2_grad_norm_is_a_float_equal_to_deepspeeds(tmp_path):
    out = run_one_rank_job(tmp_path, JOB)
    assert [t for t, _, _ in out["coat"]] == ["float"] * 3           # nothing for HF's .item() to wait on
    assert [t for t, _, _ in out["deepspeed"]] == ["Tensor"] * 3     # DeepSpeed's own step keeps a device tensor
    assert [v for _, v, _ in out["coat"]] == [v for _, v, _ in out["deepspeed"]]   # the same norm, step by step
    assert all(v > 0.5 for _, v, _ in out["coat"])                   # clipping was active: the norm is real
    assert [w for _, _, w in out["coat"]] == [v for _, v, _ in out["coat"]]      # what HF Trainer logs
