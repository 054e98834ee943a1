"""CoatAdamW: validation, tracking torch's AdamW, exact resume, non-finite steps, fp32 opt-out groups."""
import copy

import pytest
import torch

from coat_ds import CoatAdamW
from coat_ds.formats import dequantize


def _task(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    x = torch.randn(1024, 16)
    y = torch.sin(x[:, :4] * 1.5) + 0.3 * torch.randn(1024, 4)  # noise: the loss plateaus near 0.09
    return model, x, y


def _train(model, opt, x, y, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (64,), generator=gen)
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_loss(model, x, y):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


@pytest.mark.parametrize("v_format", ["e4m3", "e5m2"])
def test_tracks_torch_adamw(v_format):
    model, x, y = _task()
    ref = copy.deepcopy(model)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01), x, y, 300)
    _train(model, CoatAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, v_format=v_format), x, y, 300)
    ref_loss, coat_loss = _full_loss(ref, x, y), _full_loss(model, x, y)
    assert ref_loss < 0.2  # it learned something
    assert abs(coat_loss - ref_loss) / ref_loss < 0.01, (coat_loss, ref_loss)


def test_state_layout_is_two_bytes_per_param():
    model, x, y = _task()
    opt = CoatAdamW(model.parameters(), group_size=128)
    _train(model, opt, x, y, 1)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert state_bytes / n_params < 2.2
    for p in model.parameters():
        s = opt.state[p]
        assert s["exp_avg_q"].dtype == torch.float8_e4m3fn and s["exp_avg_q"].shape == p.shape
        m = dequantize(s["exp_avg_q"], s["exp_avg_scale"], s["exp_avg_expo"])
        assert torch.isfinite(m).all() and m.abs().sum() > 0


def test_state_dict_round_trip_continues_bit_exactly():
    model, x, y = _task()
    opt = CoatAdamW(model.parameters(), lr=2e-3)
    _train(model, opt, x, y, 20)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    after = _train(model, opt, x, y, 10, seed=7)

    model2, _, _ = _task(seed=5)  # different init: everything must come from the checkpoint
    model2.load_state_dict(saved_model)
    opt2 = CoatAdamW(model2.parameters(), lr=2e-3)
    opt2.load_state_dict(saved_opt)
    for s in opt2.state.values():  # loading must not widen the FP8 codes to the param's dtype
        assert s["exp_avg_q"].dtype == torch.float8_e4m3fn and s["exp_avg_scale"].dtype == torch.float32
    resumed = _train(model2, opt2, x, y, 10, seed=7)
    assert resumed == after
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_nonfinite_gradient_skips_the_step():
    model, x, y = _task()
    opt = CoatAdamW(list(model.named_parameters()), lr=1e-2)
    _train(model, opt, x, y, 3)
    params = copy.deepcopy([p.detach() for p in model.parameters()])
    states = copy.deepcopy([dict(s) for s in opt.state.values()])
    torch.nn.functional.mse_loss(model(x[:8]), y[:8]).backward()
    model[2].weight.grad[3, 5] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"2\.weight"):
        opt.step()
    assert opt.skipped_steps == 1
    for p, p0 in zip(model.parameters(), params):
        assert torch.equal(p, p0)
    for s, s0 in zip(opt.state.values(), states):
        for k in s:
            assert torch.equal(s[k].view(torch.uint8) if s[k].dtype.itemsize == 1 else s[k],
                               s0[k].view(torch.uint8) if s0[k].dtype.itemsize == 1 else s0[k])


def test_fp32_group_matches_torch_adamw_exactly():
    model, x, y = _task()
    ref = copy.deepcopy(model)
    first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
    opt = CoatAdamW([{"params": first, "fp8_state": False}, {"params": rest}], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref[0].parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        idx = torch.randint(0, 1024, (64,), generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x[idx]), y[idx]).backward()
        opt.step()
        ref_opt.step()
        for p in list(ref.parameters())[2:]:  # ref trains only its first layer; keep the rest in sync
            p.data.copy_(dict(zip([id(q) for q in ref.parameters()], model.parameters()))[id(p)].data)
        for a, b in zip(model[0].parameters(), ref[0].parameters()):
            assert torch.equal(a, b)
    assert opt.state[first[0]]["exp_avg"].dtype == torch.float32
    assert "exp_avg_q" in opt.state[rest[0]]


@pytest.mark.parametrize("kwargs, key", [
    ({"lr": -1.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"betas": (1.0, 0.9)}, "betas"),
    ({"betas": (0.9,)}, "betas"), ({"eps": -1e-8}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"group_size": 100}, "group_size"), ({"v_format": "e3m4"}, "v_format"), ({"expansion": "yes"}, "expansion"),
    ({"fp8_state": 1}, "fp8_state"),
])
def test_bad_arguments_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        CoatAdamW([torch.nn.Parameter(torch.randn(4))], **kwargs)


def test_bad_param_group_is_refused():
    opt = CoatAdamW([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match="v_format"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "v_format": "int8"})


def test_bf16_params_train_through_an_fp32_copy():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    opt = CoatAdamW([p], lr=1e-2)
    start = p.detach().clone()
    p.grad = torch.randn(300, dtype=torch.bfloat16)
    opt.step()
    assert p.dtype == torch.bfloat16 and not torch.equal(p, start)
    # Adam's first step moves every value by ~lr against its gradient's sign
    moved = (p.float() - start.float() * (1 - 1e-2 * 1e-2)) * p.grad.float().sign()
    assert (moved < 0).float().mean() > 0.95
    opt2 = CoatAdamW([p], lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[p]["exp_avg_scale"].dtype == torch.float32


def test_foreign_state_dict_is_refused_before_anything_changes():
    model, x, y = _task()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, adamw, x, y, 2)
    opt = CoatAdamW(model.parameters(), lr=5e-3)
    _train(model, opt, x, y, 2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(adamw.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k].float(), v.float())
