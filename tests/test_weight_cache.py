"""The FP8 weight cache follows optimizer steps, also when weights are written behind autograd's back."""
import torch

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
