"""Whole HF models with HF's defaults (use_cache=True) through coat_ds.inject: cached decoding, generate(),
training forwards without a KV cache, and what attention_fp8 saves in a whole default-config model.

These hold on every transformers release coat_ds supports; the KV cache's name differs between them
(coat_ds/hf/contract.py), and a layer that reads the wrong one decodes garbage without an error."""
import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import coat_ds
from family_cases import SEQ, VOCAB
from harness import CACHE_KW, TINY_MODELS, cache_of, kept_bytes, memorizing, rel_error, tiny_batch, tiny_model


@pytest.mark.parametrize("family", TINY_MODELS)
def test_cached_decode_step_equals_full_recompute(family):
    """Prefill with HF's default cache, then one new token on the cache: the same logits as the whole
    sequence run again (a layer that ignores the cache gives the new token attending to itself alone)."""
    model = coat_ds.inject(tiny_model(family)).eval()
    x = tiny_batch(seed=1, batch=2)
    nxt = tiny_batch(seed=2, batch=2)[:, :1]
    with torch.no_grad():
        prefill = model(input_ids=x)
        cache = cache_of(prefill)
        assert cache is not None and cache.get_seq_length() == SEQ
        step = model(input_ids=nxt, **{CACHE_KW: cache}).logits[:, -1]
        full = model(input_ids=torch.cat([x, nxt], 1)).logits[:, -1]
    assert rel_error(step, full) < 0.02  # per-token activation scales: measured 0 on every family


@pytest.mark.parametrize("family", TINY_MODELS)
def test_generate_equals_stock_on_peaked_logits(family):
    stock, seq = memorizing(family)
    injected = coat_ds.inject(copy.deepcopy(stock))
    prompt = seq[:, :8]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=SEQ - 8, do_sample=False, pad_token_id=0)
    ref = stock.generate(prompt, **kw)
    assert torch.equal(ref[0, 8:], seq[0, 8:]), "the stock model did not memorize its sequence: logits not peaked"
    assert torch.equal(injected.generate(prompt, **kw), ref)


def test_training_forward_builds_no_cache_and_evaluation_keeps_it():
    model = coat_ds.inject(tiny_model("llama2"))
    x = tiny_batch()
    model.train()
    assert cache_of(model(input_ids=x, labels=x)) is None           # HF's default use_cache=True
    assert cache_of(model(input_ids=x, labels=x, use_cache=True)) is None
    assert cache_of(model.model(input_ids=x)) is None                 # the base model directly, too
    mine = DynamicCache(config=model.config)
    model(input_ids=x, **{CACHE_KW: mine})                            # a cache the caller passes is kept
    assert mine.get_seq_length() == SEQ
    with torch.no_grad():
        assert cache_of(model(input_ids=x)) is not None               # a forward without grad keeps HF's default
    assert cache_of(model.eval()(input_ids=x)) is not None
    coat_ds.revert(model).train()
    assert cache_of(model(input_ids=x)) is not None                   # revert takes the hooks away


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
        kept[flag] = kept_bytes(model, x)
    # bf16 q, k, v and attention's output are FP8 with the flag: 2 layers x 128 tokens x (4 x 128) x ~1 byte
    assert kept[True] < kept[False] - 2 * 128 * 4 * 128 * 0.75, kept
