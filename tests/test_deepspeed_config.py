"""In-process checks of the DeepSpeed glue: registration, optimizer-param validation, the "coat" section,
and the partition layout's bookkeeping (which groups a partition cuts, where their metadata lives)."""
import pytest
import torch

import coat_ds  # noqa: F401  (registers)
from coat_ds import CoatAdamW
from coat_ds.deepspeed import coat_section, validate_params
from coat_ds.deepspeed.check import check_config
from coat_ds.deepspeed.zero.layout import Segment, ShardLayout, local_cut_keys
from coat_ds.deepspeed.optimizer_type import coat_adamw_from_config

deepspeed = pytest.importorskip("deepspeed")


def test_registered_with_deepspeed():
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    assert getattr(torch.optim, "CoatAdamW") is coat_adamw_from_config
    assert CoatAdamW in ZERO_SUPPORTED_OPTIMIZERS
    opt = torch.optim.CoatAdamW([torch.nn.Parameter(torch.randn(4))], lr=1e-3, betas=[0.9, 0.95], v_format="E5M2")
    assert type(opt) is CoatAdamW and opt.param_groups[0]["v_format"] == "e5m2"


@pytest.mark.parametrize("key,value,allowed", [
    ("group_size", 100, "[32, 64, 128, 256]"), ("v_format", "e3m4", "['e4m3', 'e5m2']"),
    ("betas", [0.9], "two numbers"), ("lr", -1.0, ">= 0"), ("expansion", "yes", "true or false"),
    ("weight_decay", True, ">= 0"), ("eps", float("nan"), ">= 0"),
])
def test_bad_param_names_key_and_allowed(key, value, allowed):
    with pytest.raises(ValueError) as e:
        validate_params({key: value})
    assert f"optimizer.params.{key}" in str(e.value) and allowed in str(e.value)


def test_unknown_param_is_an_error():
    with pytest.raises(ValueError, match=r"optimizer.params.momentum: unknown key.*allowed keys: \['betas'"):
        validate_params({"lr": 1e-3, "momentum": 0.9})


def test_coat_section():
    assert coat_section({}).activation is None
    with pytest.raises(ValueError, match=r"coat.optim: unknown key; allowed keys: "
                                         r"\['activation', 'master_weights', 'loss', 'gradients', 'states'\]"):
        coat_section({"coat": {"optim": {}}})
    assert coat_section({}).gradients == coat_section({"coat": {}}).gradients == "per_parameter"
    with pytest.raises(ValueError, match=r"^coat.gradients='flat' is invalid; allowed: "
                                         r"\['per_parameter', 'partition_buffer', 'release'\]$"):
        check_config({"coat": {"gradients": "flat"}})
    with pytest.raises(ValueError, match="coat.activation"):
        coat_section({"coat": {"activation": {"no_such_key": 1}}})


def _layout(segments, g, flat_numel):
    cuts = sorted(set(local_cut_keys(segments, g)))
    return ShardLayout(segments, flat_numel, g, None, {k: i for i, k in enumerate(cuts)})


def test_layout_groups_follow_parameters_not_partitions():
    g = 32
    # rank 1 of a ZeRO-1 partition: tail of "a" (from value 50 of 100), all of "b" (70), 6 padding values
    segs = [Segment("a", 100, 50, 0, 50), Segment("b", 70, 0, 50, 70)]
    lay = _layout(segs, g, 126)
    # a: groups 1 (cut: 32..63, we hold 50..63), 2, 3 (96..99, the parameter's own short group); b: 0, 1, 2
    assert lay.n_meta == 3 + 3
    assert local_cut_keys(segs, g) == [("a", 1)]
    assert lay.bodies == [(14, 36, 1), (50, 70, 3)]  # a[64:100] at flat 14, meta 1; b whole at flat 50, meta 3
    assert lay.cuts == [(0, 0, 0, 18, 14)]  # cut 0: meta 0, flat 0, positions 18..31 of the group, 14 values
    assert lay.record() == [("a", 100, 50, 0, 50), ("b", 70, 0, 50, 70)]


def test_layout_single_rank_step_matches_plain_coat_adamw():
    """World 1: a flat tensor of two parameters steps exactly like CoatAdamW on the parameters."""
    torch.manual_seed(0)
    shapes = [(7, 13), (40,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = CoatAdamW([p.detach().clone().requires_grad_() for p in params], lr=1e-2, group_size=32)
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params] + [torch.zeros(3)]))
    opt = CoatAdamW([flat], lr=1e-2, group_size=32)
    segs = [Segment("w", 91, 0, 0, 91), Segment("b", 40, 0, 91, 40)]
    opt.bind_partition(flat, _layout(segs, 32, flat.numel()))
    for step in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, gr in zip(ref.param_groups[0]["params"], grads):
            p.grad = gr
        flat.grad = torch.cat([gr.reshape(-1) for gr in grads] + [torch.zeros(3)])
        ref.step()
        opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in ref.param_groups[0]["params"]])
    assert torch.equal(flat.detach()[:131], want)
    assert torch.equal(flat.detach()[131:], torch.zeros(3))
    st = opt.state[flat]
    ref_st = [ref.state[p] for p in ref.param_groups[0]["params"]]
    assert torch.equal(st["exp_avg_scale"], torch.cat([s["exp_avg_scale"] for s in ref_st]))
    assert torch.equal(st["exp_avg_q"][:131].view(torch.uint8),
                       torch.cat([s["exp_avg_q"].reshape(-1) for s in ref_st]).view(torch.uint8))


# ------------------------------------------------------------------------ DeepSpeed's own keys (deepspeed_keys.py)
def test_known_top_level_keys_are_what_deepspeeds_parser_reads():
    """The allowed keys come from DeepSpeed: its parser's reads hold its constants' section names, every key of the
    shipped configs, and no misspelling."""
    import json

    from deepspeed.runtime import constants as c
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    from coat_ds.deepspeed.deepspeed_keys import _always_read
    from harness import ROOT

    known = _always_read()
    assert {c.TRAIN_BATCH_SIZE, c.TRAIN_MICRO_BATCH_SIZE_PER_GPU, c.GRADIENT_ACCUMULATION_STEPS, c.OPTIMIZER,
            c.SCHEDULER, c.BFLOAT16, c.BFLOAT16_OLD, c.FP16, c.GRADIENT_CLIPPING, ZERO_OPTIMIZATION} <= known
    assert "zero_optimzation" not in known and "coat" not in known
    for path in sorted((ROOT / "ds_configs").rglob("*.json")):
        assert set(json.loads(path.read_text())) - {"coat"} <= known, path


def test_hf_auto_values_pass_only_for_hf_trainer():
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    check_config(cfg, hf_auto=True)
    with pytest.raises(ValueError, match=r"^train_micro_batch_size_per_gpu='auto' is invalid here; allowed: a value"):
        check_config(cfg)
    with pytest.raises(ValueError, match=r"^train_micro_batch_size_per_gpu=0 is invalid; allowed: an integer >= 1 "
                                         r"or \"auto\""):
        check_config({**cfg, "train_micro_batch_size_per_gpu": 0}, hf_auto=True)


def test_deepspeeds_batch_rule_at_the_jobs_world_size():
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    check_config(cfg, world_size=2)
    with pytest.raises(ValueError, match=r"^DeepSpeed refuses this config: Check batch related parameters.* "
                                         r"16 != 4 \* 2 \* 1$"):
        check_config(cfg, world_size=1)


def test_an_engine_of_coat_ds_refuses_a_key_deepspeed_would_ignore(tmp_path):
    """deepspeed.initialize of a config with a "coat" section (or CoatAdamW): the unknown key in one line, before the
    model is moved or ZeRO built; a config without either is DeepSpeed's alone, which trains on as before."""
    from harness import run_one_rank_job

    source = '''
import json, torch, deepspeed
import coat_ds  # noqa: F401
model = torch.nn.Linear(8, 8)
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimzation": {"stage": 2},
       "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3}}}
try:
    deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    coat = "accepted"
except ValueError as e:
    coat = str(e)
cfg["optimizer"]["type"] = "AdamW"
engine, *_ = deepspeed.initialize(model=torch.nn.Linear(8, 8), config=cfg)
print("RESULT " + json.dumps({"coat": coat, "plain": engine.zero_optimization_stage()}))
'''
    r = run_one_rank_job(tmp_path, source)
    assert r["coat"] == ("zero_optimzation: unknown top-level key, which DeepSpeed would ignore; nearest allowed: "
                         "'zero_optimization' (allowed: the keys DeepSpeed's config parser reads, and 'coat')"), r
    assert r["plain"] == 0
