"""coat_ds.workloads.causal_lm's model builders: a public shape keeps its own family (the main job's
--model-size qwen3-30b-a3b builds a Qwen3-MoE, not a Llama of its widths), and weight decay reaches the matrices
of a model ZeRO-3 has partitioned (their data is then a 1-D slice: every parameter fell in the no-decay group)."""
import argparse

import torch

from coat_ds.workloads import causal_lm, shapes


def test_a_public_shape_builds_in_its_own_family(monkeypatch):
    tiny = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, vocab_size=128)
    monkeypatch.setitem(shapes.SHAPES, "tiny-moe", tiny)
    assert "qwen3-30b-a3b" in causal_lm.model_size_names()
    spec = argparse.Namespace(model=None, model_size="tiny-moe", seed=0)
    model = causal_lm.build_model(spec, vocab_size=100, seq_len=32)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    assert shapes.SHAPES["tiny-moe"]["model_type"] == "qwen3_moe"    # the table itself is left as it was


def test_weight_decay_reaches_partitioned_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    for p in model.parameters():         # as zero.Init leaves them: whole shape in ds_shape, the data a 1-D slice
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    decay, no_decay = causal_lm.param_groups(model)
    assert [tuple(p.ds_shape) for p in decay["params"]] == [(8, 8)]
    assert sorted(tuple(p.ds_shape) for p in no_decay["params"]) == [(8,), (8,), (8,)]
