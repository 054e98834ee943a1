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
