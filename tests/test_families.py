"""The contract every registered family passes (coat_ds.hf.supported_model_types()), on whole default-config
models (tests/family_cases.py): every decoder layer swapped; training loss and gradients close to stock;
cached decoding and greedy generate equal to the stock model's on peaked logits; revert restores the stock
model; attention_fp8 keeps fewer bytes. ZeRO-3 under zero.Init with 2 ranks: launched/test_families_zero3.py."""
import copy

import pytest
import torch

import coat_ds
from coat_ds.hf import CoatDecoderLayer, get_policy, supported_model_types
from family_cases import BOUNDS, MEMORIZE_STEPS, SEQ, VOCAB, build
from harness import CACHE_KW, assert_close_to_stock, cache_of, kept_bytes, memorizing, rel_error

FAMILIES = supported_model_types()


def _batch(seed=0, batch=2, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _decoder_layers(model, model_type):
    names = get_policy(model_type).layer_class_names
    return [m for m in model.modules() if isinstance(m, CoatDecoderLayer) or type(m).__name__ in names]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_layer_swapped_and_training_close_to_stock(model_type):
    stock = build(model_type)
    injected = coat_ds.inject(copy.deepcopy(stock))
    layers = _decoder_layers(injected, model_type)
    assert len(layers) == stock.config.num_hidden_layers
    assert all(isinstance(layer, CoatDecoderLayer) for layer in layers)
    assert_close_to_stock(stock.train(), injected.train(), _batch(), **BOUNDS.get(model_type, {}))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cached_decoding_and_generate_equal_stock(model_type):
    stock, seq = memorizing(model_type, steps=MEMORIZE_STEPS.get(model_type, 60), build=build)
    injected = coat_ds.inject(copy.deepcopy(stock)).eval()
    prompt = seq[:, :8]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=SEQ - 8, do_sample=False, pad_token_id=0)
    ref = stock.generate(prompt, **kw)
    assert torch.equal(ref[0, 8:], seq[0, 8:]), "the stock model did not memorize its sequence: logits not peaked"
    assert torch.equal(injected.generate(prompt, **kw), ref)
    # one step on HF's default cache against the whole prefix again, and against stock, at a position whose next
    # token was memorized (past the sequence's end the logits are flat: their argmax is noise)
    with torch.no_grad():
        cache = cache_of(injected(input_ids=seq[:, :-2]))
        step = injected(input_ids=seq[:, -2:-1], **{CACHE_KW: cache}).logits[:, -1]
        full = injected(input_ids=seq[:, :-1]).logits[:, -1]
        stock_step = stock(input_ids=seq[:, :-1]).logits[:, -1]
    assert rel_error(step, full) < 0.02 and step.argmax() == stock_step.argmax() == seq[0, -1]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_revert_restores_the_stock_model(model_type):
    stock = build(model_type).eval()
    model = copy.deepcopy(stock)
    originals = _decoder_layers(model, model_type)
    coat_ds.revert(coat_ds.inject(model))
    assert _decoder_layers(model, model_type) == originals
    assert not any(isinstance(m, CoatDecoderLayer) for m in model.modules())
    assert list(model.state_dict()) == list(stock.state_dict())
    x = _batch(1)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, stock(input_ids=x).logits)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_attention_fp8_keeps_fewer_bytes(model_type):
    x = _batch(seq=64)
    kept = {}
    for flag in (False, True):
        model = coat_ds.inject(build(model_type), {"attention_fp8": flag}).train()
        kept[flag] = kept_bytes(model, x)
    cfg = model.config
    q_bytes = cfg.num_hidden_layers * x.numel() * cfg.num_attention_heads * model.model.layers[0].self_attn.head_dim
    assert kept[True] < kept[False] - q_bytes, kept  # fp32 q, k, v and output saved as ~1-byte FP8 q, k, v
