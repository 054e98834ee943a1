"""Whole HF models with HF's defaults (use_cache=True) through coat_ds.inject: cached decoding, generate(),
training forwards without a KV cache, and what attention_fp8 saves in a whole default-config model.

These hold on every transformers release coat_ds supports; the KV cache's name differs between them
(coat_ds/hf/contract.py), and a layer that reads the wrong one decodes garbage without an error."""
import copy
import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LlamaModel

import coat_ds
from coat_ds.hf.contract import CACHE_ARGS
from test_inject import FAMILIES, SEQ, VOCAB, _batch, _model, _rel

# The name under which this transformers release takes the cache (the other one is a deprecated alias or absent).
CACHE_KW = next(n for n in CACHE_ARGS if n in inspect.signature(LlamaModel.forward).parameters)


def _cache_of(out):
    """The KV cache an HF output carries (field `cache` or `past_key_values`, by release), or None."""
    return next((getattr(out, n) for n in CACHE_ARGS if getattr(out, n, None) is not None), None)


def _memorizing(family, steps=60, build=_model):
    """A tiny model (`build(family)`) trained to continue one sequence: peaked next-token logits, so that greedy
    decoding is decided by a margin far above FP8 noise and the injected model must produce the stock tokens."""
    model = build(family)
    seq = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[None, :SEQ]  # no token repeats
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=seq, labels=seq).loss.backward()
        opt.step()
    return model.eval(), seq


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_step_equals_full_recompute(family):
    """Prefill with HF's default cache, then one new token on the cache: the same logits as the whole
    sequence run again (a layer that ignores the cache gives the new token attending to itself alone)."""
    model = coat_ds.inject(_model(family)).eval()
    x = _batch(seed=1, batch=2)
    nxt = _batch(seed=2, batch=2)[:, :1]
    with torch.no_grad():
        prefill = model(input_ids=x)
        cache = _cache_of(prefill)
        assert cache is not None and cache.get_seq_length() == SEQ
        step = model(input_ids=nxt, **{CACHE_KW: cache}).logits[:, -1]
        full = model(input_ids=torch.cat([x, nxt], 1)).logits[:, -1]
    assert _rel(step, full) < 0.02  # per-token activation scales: measured 0 on every family


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_equals_stock_on_peaked_logits(family):
    stock, seq = _memorizing(family)
    injected = coat_ds.inject(copy.deepcopy(stock))
    prompt = seq[:, :8]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=SEQ - 8, do_sample=False, pad_token_id=0)
    ref = stock.generate(prompt, **kw)
    assert torch.equal(ref[0, 8:], seq[0, 8:]), "the stock model did not memorize its sequence: logits not peaked"
    assert torch.equal(injected.generate(prompt, **kw), ref)


def test_training_forward_builds_no_cache_and_evaluation_keeps_it():
    model = coat_ds.inject(_model("llama2"))
    x = _batch()
    model.train()
    assert _cache_of(model(input_ids=x, labels=x)) is None          # HF's default use_cache=True
    assert _cache_of(model(input_ids=x, labels=x, use_cache=True)) is None
    assert _cache_of(model.model(input_ids=x)) is None                # the base model directly, too
    mine = DynamicCache(config=model.config)
    model(input_ids=x, **{CACHE_KW: mine})                            # a cache the caller passes is kept
    assert mine.get_seq_length() == SEQ
    with torch.no_grad():
        assert _cache_of(model(input_ids=x)) is not None              # a forward without grad keeps HF's default
    assert _cache_of(model.eval()(input_ids=x)) is not None
    coat_ds.revert(model).train()
    assert _cache_of(model(input_ids=x)) is not None                  # revert takes the hooks away


def _kept_bytes(model, x) -> int:
    """Bytes that a training forward leaves alive for backward: what autograd saves (unique storages, parameters
    left out) plus what the output holds beside the loss (a KV cache)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(input_ids=x, labels=x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    cache = _cache_of(out)
    held = [t for layer in (cache.layers if cache is not None else []) for t in (layer.keys, layer.values)]
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved + held}
    out.loss.backward()
    return sum(n for ptr, n in kept.items() if ptr not in params)


def test_attention_fp8_saves_in_a_whole_default_config_model():
    """A default-config LlamaForCausalLM (use_cache=True), trained as users train it: attention_fp8 keeps fewer
    bytes. Before training forwards went cacheless, both kept the same (the flag declined every cached call)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128)
    assert config.use_cache
    x = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    kept = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = coat_ds.inject(LlamaForCausalLM(config), {"enabled": True, "attention_fp8": flag}).train()
        kept[flag] = _kept_bytes(model, x)
    # bf16 q, k, v and attention's output are FP8 with the flag: 2 layers x 128 tokens x (4 x 128) x ~1 byte
    assert kept[True] < kept[False] - 2 * 128 * 4 * 128 * 0.75, kept
