"""The FP8 weight cache follows optimizer steps, also when weights are written behind autograd's back."""
import pytest
import torch
from harness import run_one_rank_job

from coat_ds.activation.weight_cache import WeightGroup
from coat_ds.formats import E4M3


def test_cache_is_reused_until_an_optimizer_step_even_for_data_writes():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    group = WeightGroup([lin], E4M3)
    codes, scale = group.operand(transposed=False)
    again, _ = group.operand(transposed=False)
    assert again is codes  # reused across micro-batches

    # DeepSpeed ZeRO-1/2 write the updated bf16 weights through .data: no version bump
    version = lin.weight._version
    lin.weight.data.copy_(torch.randn_like(lin.weight) * 3)
    assert lin.weight._version == version
    assert group.operand(transposed=False)[0] is codes  # nothing has told the cache yet

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()  # any optimizer's step
    fresh, fresh_scale = group.operand(transposed=False)
    assert fresh is not codes
    want, want_scale = WeightGroup([lin], E4M3).operand(transposed=False)  # a cache that never saw the old weights
    assert torch.equal(fresh.view(torch.uint8), want.view(torch.uint8)) and torch.equal(fresh_scale, want_scale)


def test_in_place_autograd_update_invalidates_without_a_step():
    lin = torch.nn.Linear(16, 16, bias=False)
    group = WeightGroup([lin], E4M3)
    codes, _ = group.operand(transposed=False)
    with torch.no_grad():
        lin.weight.mul_(2)  # load_state_dict and manual edits bump the version
    assert group.operand(transposed=False)[0] is not codes


ENGINE_JOB = """
import json, torch, deepspeed, coat_ds
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2}, "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-2}},
          "coat": {"activation": {"cache_weights": True}}}
engine, *_ = deepspeed.initialize(model=model, config=config)
group = engine.module.model.layers[0]._qkv
x = torch.randint(0, 64, (2, 8)).to(engine.device)
fresh, reused = [], []
for step in range(2):
    for micro in range(2):
        codes = group.operand(False)[0] if group._codes else None   # what this micro-batch's forward reads
        if codes is not None:
            fresh.append(torch.equal(codes.view(torch.uint8), group._quantize(False, None)[0].view(torch.uint8)))
        engine.backward(engine(input_ids=x, labels=x).loss)
        if micro:
            reused.append(group._codes.get(False) is codes)   # the second micro-batch read the first one's copy
        engine.step()
print("RESULT " + json.dumps({"fresh": fresh, "reused": reused}))
"""


def test_engine_step_invalidates_the_cache_under_zero2_coat_adamw(tmp_path):
    """ZeRO-2 writes the updated bf16 weights through .data and CoatAdamW's ZeRO step calls no torch
    optimizer's step: the engine's own step (coat_ds/deepspeed/engine.py) is what tells the cache."""
    pytest.importorskip("deepspeed")
    out = run_one_rank_job(tmp_path, ENGINE_JOB)
    assert out["fresh"] == [True] * 3 and out["reused"] == [True, True], out
