"""coat_ds.hf.loss: an HF causal LM's training loss without full logits, equal to the stock one, and stock
everywhere else (eval, no labels, logits_to_keep, tuples, other model types)."""
from __future__ import annotations

import pytest
import torch

from coat_ds.hf import loss as hf_loss
from coat_ds.activation.loss import linear_cross_entropy
from coat_ds.hf.loss import EXACT_MODEL_TYPES

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=211, max_position_embeddings=64,
             head_dim=8)   # hidden / heads: Llama's own; Qwen3 and Gemma 3 default to a fixed 128 / 256


def tiny(model_type: str = "llama", dtype=torch.float32, **extra):
    cfg = transformers.AutoConfig.for_model(model_type, **SHAPE, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).train()


def batch(b: int = 2, s: int = 12, vocab: int = SHAPE["vocab_size"], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100   # a masked prompt
    return ids, labels


def loss_and_grads(model, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    tol = (1e-5 if dtype == torch.float32 else 2 ** -7) * b.abs().max().float().clamp_min(1e-30)
    err = (a.float() - b.float()).abs().max()
    assert err <= tol, f"{err.item():.3g} > {tol.item():.3g}"


@pytest.mark.parametrize("model_type,dtype", [(t, torch.float32) for t in EXACT_MODEL_TYPES] +
                         [(t, torch.bfloat16) for t in ("llama", "qwen3", "gemma3_text")])
def test_training_loss_and_gradients_equal_the_stock_ones(model_type, dtype):
    model = tiny(model_type, dtype)
    ids, labels = batch()
    ref_out, ref = loss_and_grads(model, input_ids=ids, labels=labels)
    assert "chunked loss" in hf_loss.apply(model, {"chunk_tokens": 5})
    out, ours = loss_and_grads(model, input_ids=ids, labels=labels)
    assert out.logits is None and ref_out.logits is not None   # never silently garbage: absent
    assert_same(out.loss.detach(), ref_out.loss.detach(), dtype)
    assert ours.keys() == ref.keys()
    for name in ref:
        assert_same(ours[name], ref[name], dtype)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_router_aux_loss_is_added_as_stock_adds_it(model_type):
    """With output_router_logits, HF adds router_aux_loss_coef x aux_loss to the loss it computes; the chunked loss
    adds the same term (a coefficient large enough that leaving it out fails)."""
    model = tiny(model_type, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                 output_router_logits=True, router_aux_loss_coef=0.5)
    ids, labels = batch()
    ref_out, ref = loss_and_grads(model, input_ids=ids, labels=labels)
    hf_loss.apply(model, {"chunk_tokens": 5})
    out, ours = loss_and_grads(model, input_ids=ids, labels=labels)
    assert ref_out.aux_loss is not None and ref_out.aux_loss.item() > 0.1
    assert_same(out.loss.detach(), ref_out.loss.detach(), torch.float32)
    for name in ref:
        assert_same(ours[name], ref[name], torch.float32)


@pytest.mark.parametrize("extra", [dict(num_items_in_batch=torch.tensor(7)), dict(num_items_in_batch=31),
                                   dict(shift_labels="given"), dict(ignore_index=5)])
def test_hf_trainer_loss_kwargs(extra):
    """num_items_in_batch (HF Trainer's gradient-accumulation count), shift_labels (already shifted
    targets, what examples/train.py passes) and ignore_index mean what they mean to the stock loss."""
    model = tiny()
    ids, labels = batch()
    if extra.get("shift_labels") == "given":
        extra = dict(shift_labels=torch.roll(ids, -1, dims=1))
    if "ignore_index" in extra:
        labels[labels == -100] = extra["ignore_index"]
    ref_out, ref = loss_and_grads(model, input_ids=ids, labels=labels, **extra)
    hf_loss.apply(model, {"chunk_tokens": 8})
    out, ours = loss_and_grads(model, input_ids=ids, labels=labels, **extra)
    assert out.logits is None
    assert_same(out.loss.detach(), ref_out.loss.detach(), torch.float32)
    for name in ref:
        assert_same(ours[name], ref[name], torch.float32)


def test_stock_forward_wherever_the_chunked_loss_does_not_apply():
    model = tiny()
    ids, labels = batch()
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
    model.train()
    hf_loss.apply(model)
    cases = {"no labels": dict(input_ids=ids), "logits_to_keep": dict(input_ids=ids, logits_to_keep=3),
             "tuple": dict(input_ids=ids, labels=labels, return_dict=False)}
    for name, kw in cases.items():
        out = model(**kw)
        logits = out[1] if name == "tuple" else out.logits
        assert logits is not None and logits.shape[-1] == SHAPE["vocab_size"], name
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)   # evaluation: loss and logits, as stock
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    model.train()
    model.loss_function = lambda logits, labels, **kw: logits.float().mean()   # a user's own loss: kept
    assert model(input_ids=ids, labels=labels).logits is not None


def test_apply_again_updates_and_remove_restores_the_stock_forward():
    model = tiny()
    ids, labels = batch()
    hf_loss.apply(model, {"chunk_tokens": 4})
    hf_loss.apply(model, {"chunk_tokens": 6})
    assert hf_loss.is_applied(model) and len(model._forward_pre_hooks) == 1
    assert "coat.loss.chunked is false" in hf_loss.apply(model, {"chunked": False})
    assert not hf_loss.is_applied(model) and not model._forward_pre_hooks and not model._forward_hooks
    assert "forward" not in model.lm_head.__dict__
    assert model(input_ids=ids, labels=labels).logits is not None
    assert "_coat" not in "".join(model.state_dict())


def test_refuses_models_whose_loss_it_would_change():
    assert "soft-caps" in hf_loss.refusal(tiny(final_logit_softcapping=30.0))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert "stock loss (model_type 'gpt2'" in hf_loss.apply(gpt2)
    assert not hf_loss.is_applied(gpt2)
    base = transformers.LlamaModel(transformers.LlamaConfig(**SHAPE))
    assert "nn.Linear" in hf_loss.refusal(base)


def test_gemma3_logit_softcapping_keeps_the_stock_loss():
    """With final_logit_softcapping set, Gemma 3's forward takes the loss of tanh(logits / c) c, not of the
    linear's logits: apply keeps the stock loss, and a cap switched on after apply is seen at the call."""
    cap = 0.05   # the tiny model's logits reach ~0.4: a cap this small moves the loss visibly
    model = tiny("gemma3_text", final_logit_softcapping=cap)
    ids, labels = batch()
    ref_out, ref = loss_and_grads(model, input_ids=ids, labels=labels)
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    uncapped = linear_cross_entropy(model.model(input_ids=ids).last_hidden_state, model.lm_head.weight, targets)
    assert (uncapped - ref_out.loss).abs() > 1e-3 * ref_out.loss   # what chunked would say: 100x its tolerance
    assert "stock loss (its config soft-caps the logits" in hf_loss.apply(model)
    assert not hf_loss.is_applied(model)
    model.config.final_logit_softcapping = None
    assert "chunked loss" in hf_loss.apply(model)
    model.config.final_logit_softcapping = cap
    out, ours = loss_and_grads(model, input_ids=ids, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, ref_out.loss)
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name


ZERO3_JOB = """
import copy, json
import torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
import coat_ds  # noqa: F401  (the engine applies the "coat" section)

cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
torch.manual_seed(0)
base = LlamaForCausalLM(cfg)
x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
out = {}
for name, loss_cfg in (("chunked", {"chunk_tokens": 5}), ("stock", {"chunked": False})):
    model = copy.deepcopy(base)
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True, "coat": {"loss": loss_cfg},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=ds, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, logits = [], []
    for _ in range(2):
        o = engine(input_ids=x, labels=x)
        logits.append(o.logits is None)
        engine.backward(o.loss)
        engine.step()
        losses.append(o.loss.item())
    w = model.lm_head.weight
    out[name] = {"losses": losses, "no_logits": logits, "freed": w.data.numel() == 0}
print("RESULT " + json.dumps(out))
"""


def test_zero3_engine_section_trains_like_the_stock_loss(tmp_path):
    """ZeRO-3 partitions lm_head's (tied) weight and gathers it for forward and backward around lm_head's own
    call, where the chunked loss runs; the "coat": {"loss": ...} section installs it from the engine."""
    pytest.importorskip("deepspeed")
    from harness import run_one_rank_job

    out = run_one_rank_job(tmp_path, ZERO3_JOB)
    assert out["chunked"]["no_logits"] == [True] * 2 and out["stock"]["no_logits"] == [False] * 2
    assert out["chunked"]["freed"] and out["stock"]["freed"]
    for ours, ref in zip(out["chunked"]["losses"], out["stock"]["losses"]):
        assert abs(ours - ref) <= 1e-5 * ref, out
    assert out["chunked"]["losses"][-1] < out["chunked"]["losses"][0]   # it trains


def test_check_config_names_the_loss_keys():
    from coat_ds.deepspeed.check import check_config

    check_config({"coat": {"loss": {"chunked": True, "chunk_tokens": 512}}})
    for bad, msg in (({"chunk_tokens": -1}, "coat.loss.chunk_tokens=-1 is invalid"),
                     ({"chunks": 1}, "coat.loss.chunks: unknown key"), ("on", "coat.loss='on' is invalid")):
        with pytest.raises(ValueError, match=msg):
            check_config({"coat": {"loss": bad}})


def test_main_job_loss_is_next_token_cross_entropy_on_both_paths():
    """coat_ds.workloads.causal_lm.lm_loss: targets y = x shifted by one (a non-contiguous slice, as the data
    loader gives them), chunked in training and stock in evaluation, both the plain cross-entropy."""
    import torch.nn.functional as F

    from coat_ds.workloads.causal_lm import lm_loss

    model = tiny()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(4))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    hf_loss.apply(model, {"chunk_tokens": 7})
    assert_same(lm_loss(model, x, y).detach(), ref, torch.float32)
    model.eval()
    with torch.no_grad():
        assert_same(lm_loss(model, x, y), ref, torch.float32)
