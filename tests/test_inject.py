"""coat_ds.inject / revert on tiny random-init HF models (no download): FP8 layers in, weights intact.

Bounds (FP8 E4M3 forward, E5M2 backward, fp32 model; measured on these configs over 3 seeds, modes full
and linear: loss 1e-5..3.4e-4, logits 0.035..0.048, per-parameter gradient 0.11..0.16 relative error):
  loss      |loss - stock| / stock                         < 2e-3
  logits    ||logits - stock|| / ||stock||                  in (1e-3, 0.08)   (above 1e-3: FP8 really ran)
  gradients ||grad - stock|| / ||stock|| for every param   < 0.25, mean over params < 0.15
"""
import copy
import datetime
import json
import os
import sys

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

import coat_ds
from coat_ds.activation import ActivationConfig
from coat_ds.hf import CoatDecoderLayer
from coat_ds.hf import InjectionPolicy, get_policy, is_injected, register_policy, supported_model_types
from family_cases import SEQ, VOCAB
from harness import TINY_MODELS, TINY_SHAPE, assert_close_to_stock, rel_error, tiny_batch, tiny_model


def _layers(model):
    return list(model.model.layers)


@pytest.mark.parametrize("family", TINY_MODELS)
def test_forward_backward_close_to_stock(family):
    stock = tiny_model(family)
    injected = coat_ds.inject(copy.deepcopy(stock))
    assert all(isinstance(layer, CoatDecoderLayer) for layer in _layers(injected)) and is_injected(injected)
    assert_close_to_stock(stock, injected, tiny_batch())


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_attention_backends(backend):
    stock = tiny_model("mistral", attn_implementation=backend)
    injected = coat_ds.inject(copy.deepcopy(stock), {"mode": "linear"})
    assert injected.config._attn_implementation == backend
    assert_close_to_stock(stock, injected, tiny_batch(1))


@pytest.mark.parametrize("family", ["llama3-gqa", "qwen2"])
def test_same_parameters_and_state_dict_keys(family):
    model = tiny_model(family)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat_ds.inject(model, ActivationConfig(mode="full"))
    assert list(model.state_dict()) == keys
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_save_pretrained_loads_into_stock_transformers(tmp_path):
    model = coat_ds.inject(tiny_model("llama3-gqa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tiny_batch()
    for _ in range(2):  # train a little so the saved weights are not the init ones
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after training
    model.save_pretrained(tmp_path)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is LlamaForCausalLM and not any(isinstance(m, CoatDecoderLayer) for m in loaded.modules())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    saved = model.state_dict()
    assert list(loaded.state_dict()) == list(saved)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    with torch.no_grad():
        stock_logits = loaded(input_ids=x).logits
        assert torch.equal(coat_ds.revert(model)(input_ids=x).logits, stock_logits)
        # from_pretrained -> inject: the same logits within FP8 tolerance
        injected_logits = coat_ds.inject(AutoModelForCausalLM.from_pretrained(tmp_path))(input_ids=x).logits
    assert 1e-3 < rel_error(injected_logits, stock_logits) < 0.08


def _saved_tensor_count(model, x):
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return count


@pytest.mark.parametrize("enable,reentrant", [("before_inject", False), ("after_inject", True)])
def test_gradient_checkpointing(enable, reentrant):
    x = tiny_batch()
    plain = coat_ds.inject(tiny_model("qwen2"))
    plain.train()
    checkpointed = tiny_model("qwen2")
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    if enable == "before_inject":
        checkpointed.gradient_checkpointing_enable(**kwargs)
        coat_ds.inject(checkpointed)
    else:
        coat_ds.inject(checkpointed)
        checkpointed.gradient_checkpointing_enable(**kwargs)
    checkpointed.train()
    assert all(layer.gradient_checkpointing for layer in _layers(checkpointed))
    # checkpointing really happens: the layers' FP8 saves are dropped in the forward
    assert _saved_tensor_count(checkpointed, x) < _saved_tensor_count(plain, x) / 2
    # and the recompute gives the same gradients (the FP8 quantization is deterministic)
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_mistral_window_reaches_attention_from_its_policy(monkeypatch):
    """MistralAttention keeps no window (its forward reads config.sliding_window): the policy's
    attention_kwargs alone hand HF's attention function (flash-attention applies it; eager and sdpa get the
    window through the mask) the stock layer's sliding_window."""
    from transformers.models.mistral import modeling_mistral

    seen, eager = [], modeling_mistral.eager_attention_forward

    def recording(*args, **kwargs):
        seen.append(kwargs.get("sliding_window"))
        return eager(*args, **kwargs)

    monkeypatch.setattr(modeling_mistral, "eager_attention_forward", recording)
    stock = tiny_model("mistral", attn_implementation="eager")
    injected = coat_ds.inject(copy.deepcopy(stock))
    x = tiny_batch()
    stock(input_ids=x)
    want, seen[:] = list(seen), []
    injected(input_ids=x)
    assert want == [8, 8] and seen == want


def test_revert_restores_stock_modules():
    stock = tiny_model("mistral")
    model = copy.deepcopy(stock)
    originals = _layers(model)
    model.gradient_checkpointing_enable()
    coat_ds.inject(model)
    model.eval()
    coat_ds.revert(model)
    assert _layers(model) == originals and not is_injected(model)
    assert all(type(layer).__name__ == "MistralDecoderLayer" for layer in _layers(model))
    # what the model set on the FP8 layers came back with the stock ones; inject's own hook did not
    assert all(layer.gradient_checkpointing and not layer.training for layer in _layers(model))
    assert all(not layer._forward_pre_hooks and not hasattr(layer, "_z3_leaf") for layer in _layers(model))
    x = tiny_batch()
    model.gradient_checkpointing_disable()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, stock.eval()(input_ids=x).logits)


def test_deepcopy_of_injected_model_is_independent():
    model = coat_ds.inject(tiny_model("qwen2"))
    clone = copy.deepcopy(model)
    assert all(isinstance(layer, CoatDecoderLayer) for layer in _layers(clone))
    x = tiny_batch()
    with torch.no_grad():
        torch.testing.assert_close(clone(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)
    coat_ds.revert(clone)
    assert all(isinstance(layer, CoatDecoderLayer) and layer._forward_pre_hooks for layer in _layers(model))
    shared = {id(p) for p in model.parameters()} & {id(p) for p in clone.parameters()}
    assert not shared and set(clone.state_dict()) == set(model.state_dict())


def test_inject_twice_and_disabled():
    model = coat_ds.inject(tiny_model("llama2"))
    layers = _layers(model)
    assert _layers(coat_ds.inject(model)) == layers
    with pytest.raises(ValueError, match="revert"):
        coat_ds.inject(model, {"mode": "linear"})
    stock = tiny_model("llama2")
    assert not is_injected(coat_ds.inject(stock, {"enabled": False}))
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in _layers(stock))


def test_unknown_model_type_lists_supported():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="gpt2") as err:
        coat_ds.inject(gpt2)
    for model_type in ("llama", "mistral", "qwen2"):
        assert model_type in str(err.value)
    with pytest.raises(ValueError, match="model_type"):
        coat_ds.inject(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode"):
        coat_ds.inject(tiny_model("llama2"), {"mode": "fp4"})


def test_unsupported_family_is_refused_in_one_line_saying_what_stays_stock():
    """gpt-oss (a mixture of experts with attention sinks and biased, interleaved, clamped-SwiGLU experts): no policy,
    nothing swapped, one line naming its layers and why."""
    from family_cases import SMALL
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_oss", **SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError) as err:
        coat_ds.inject(moe)
    msg = str(err.value)
    assert "\n" not in msg and "gpt_oss" in msg and "nothing swapped" in msg and "supported" in msg
    assert "GptOssDecoderLayer x2" in msg and "attention sinks" in msg and "biases" in msg
    assert not is_injected(moe) and not any(isinstance(m, CoatDecoderLayer) for m in moe.modules())


def test_partial_swap_is_refused_and_a_swap_says_what_it_covers(caplog):
    """A model whose policy covers only some of its decoder layers is refused untouched; a full swap logs one
    line naming the FP8 layers and what stays stock."""
    model = tiny_model("llama2")
    model.model.layers[1] = Qwen2ForCausalLM(Qwen2Config(**TINY_SHAPE)).model.layers[1]
    with pytest.raises(ValueError, match="Qwen2DecoderLayer x1.*stay stock; nothing swapped"):
        coat_ds.inject(model)
    assert not is_injected(model) and type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    with caplog.at_level("INFO", logger="coat_ds.hf.swap"):
        coat_ds.inject(tiny_model("qwen2"))
    lines = [r.getMessage() for r in caplog.records if "FP8" in r.getMessage()]
    assert lines == ["coat_ds.inject: Qwen2ForCausalLM: FP8 (full): 2 Qwen2DecoderLayer; "
                     "stays stock: embeddings, final norm, lm_head, rotary embeddings"]


def test_refused_layer_leaves_model_untouched():
    model = tiny_model("llama2", hidden_act="gelu")  # COAT's full mode fuses SiLU*mul only
    with pytest.raises(ValueError, match="hidden_act"):
        coat_ds.inject(model, {"mode": "full"})
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in _layers(model)) and not is_injected(model)


def test_other_heads_and_base_model():
    """The walk finds decoder layers under any head (and in a bare base model)."""
    from transformers import LlamaModel, Qwen2ForSequenceClassification
    cls_model = Qwen2ForSequenceClassification(Qwen2Config(**TINY_SHAPE, num_key_value_heads=2, num_labels=3,
                                                            pad_token_id=0))
    base = LlamaModel(LlamaConfig(**TINY_SHAPE, num_key_value_heads=2))
    for model, layers in ((cls_model, cls_model.model.layers), (base, base.layers)):
        coat_ds.inject(model)
        assert all(isinstance(layer, CoatDecoderLayer) for layer in layers)
    x = tiny_batch()
    assert cls_model(input_ids=x).logits.shape == (2, 3)
    assert base(input_ids=x).last_hidden_state.shape == (2, SEQ, TINY_SHAPE["hidden_size"])


def test_policy_registry():
    assert {"llama", "mistral", "qwen2"} <= set(supported_model_types())
    with pytest.raises(ValueError, match="already has a policy"):
        register_policy(InjectionPolicy("llama", ("LlamaDecoderLayer",)))
    with pytest.raises(ValueError, match="layer_class_names"):
        InjectionPolicy("x", "LlamaDecoderLayer")
    with pytest.raises(ValueError, match="supported"):
        get_policy("falcon")


def test_output_hidden_states_and_generate():
    stock = tiny_model("llama3-gqa")
    model = coat_ds.inject(copy.deepcopy(stock)).eval()
    x = tiny_batch(2, batch=1)
    with torch.no_grad():
        ref = stock.eval()(input_ids=x, output_hidden_states=True)
        out = model(input_ids=x, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == model.config.num_hidden_layers + 1
    for h, r in zip(out.hidden_states[1:], ref.hidden_states[1:]):
        assert rel_error(h, r) < 0.08

    gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert gen.sequences.shape == (1, SEQ + 6) and not model.training
    # prefill is the plain forward; later steps read the KV cache and must agree with a full forward
    assert gen.sequences[0, SEQ].item() == out.logits[0, -1].argmax().item()
    with torch.no_grad():
        full = model(input_ids=gen.sequences).logits
    for step, logits in enumerate(gen.logits):  # measured 0 (activations scaled per 1 x 16 group, per token)
        assert rel_error(logits[0], full[0, SEQ - 1 + step]) < 0.02, step


# ---------------------------------------------------------------------------------------------- GPU (bf16)
# Bounds in bf16 (both models bf16, so the stock model's own rounding is on both sides): loss < 1e-2,
# logits in (1e-3, 0.1), gradients max < 0.4, mean < 0.25; KV cache vs full forward < 0.05. Measured on
# one H100 (benchmarks/results/inject_gpu.json, written where COAT_INJECT_RESULTS names a file): loss
# <= 1.1e-3, logits 0.076..0.091, gradients max 0.165..0.186, mean 0.127..0.134, KV cache 0.037.
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_hidden_layers=2,
                 max_position_embeddings=256)
GPU_SEQ = 64
_GPU_RESULTS = []


@pytest.fixture(scope="module", autouse=True)
def _write_gpu_results():
    yield
    path = os.environ.get("COAT_INJECT_RESULTS")
    if not path or not _GPU_RESULTS:
        return
    import transformers
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "cuda": torch.version.cuda, "transformers": transformers.__version__,
                   "command": os.environ.get("COAT_INJECT_COMMAND", " ".join(sys.argv)),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "shape": {**GPU_SHAPE, "batch": 2, "seq": GPU_SEQ, "dtype": "bfloat16"},
                   "results": _GPU_RESULTS}, f, indent=1)


def _gpu_model(family, backend="sdpa", seed=0):
    window = dict(sliding_window=16) if family in ("mistral", "qwen2") else {}
    return tiny_model(family, seed, attn_implementation=backend, **GPU_SHAPE, **window).to("cuda", torch.bfloat16)


def _gpu_batch(seed=0):
    return torch.randint(0, VOCAB, (2, GPU_SEQ), generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash_attention_2"])
@pytest.mark.parametrize("family", TINY_MODELS)
def test_gpu_bf16_close_to_stock(family, backend):
    if backend == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available
        if not is_flash_attn_2_available():
            pytest.skip("flash_attn is not installed")
    stock = _gpu_model(family, backend)
    injected = coat_ds.inject(copy.deepcopy(stock))
    measured = assert_close_to_stock(stock, injected, _gpu_batch(), loss_tol=1e-2, logits_tol=0.1, grad_max=0.4,
                                      grad_mean=0.25)
    _GPU_RESULTS.append({"test": "forward_backward", "family": family, "backend": backend, **measured})


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama2", "llama3-gqa"])
def test_gpu_sdpa_flash_kernel(family):
    """HF's sdpa backend pinned to PyTorch's flash-attention kernel (no mask: causal, no padding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    stock = _gpu_model(family, "sdpa")
    injected = coat_ds.inject(copy.deepcopy(stock))
    x = _gpu_batch(1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            stock(input_ids=x)
        except RuntimeError as exc:
            pytest.skip(f"stock model cannot run on the flash kernel alone: {exc}")
        measured = assert_close_to_stock(stock, injected, x, loss_tol=1e-2, logits_tol=0.1, grad_max=0.4,
                                          grad_mean=0.25)
    _GPU_RESULTS.append({"test": "forward_backward", "family": family, "backend": "sdpa(flash kernel only)",
                         **measured})


@pytest.mark.gpu
def test_gpu_gradient_checkpointing_and_generate():
    x = _gpu_batch(2)
    plain = coat_ds.inject(_gpu_model("qwen2"))
    checkpointed = coat_ds.inject(_gpu_model("qwen2"))
    checkpointed.gradient_checkpointing_enable()
    for model in (plain, checkpointed):
        model.train()
        model(input_ids=x, labels=x).loss.backward()
    worst = max(rel_error(q.grad, p.grad) for p, q in zip(plain.parameters(), checkpointed.parameters()))
    assert worst < 1e-2

    model = checkpointed.eval()
    prompt = x[:1, :16]
    gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert gen.sequences.shape == (1, 24)
    with torch.no_grad():
        full = model(input_ids=gen.sequences).logits
    cache_err = max(rel_error(logits[0], full[0, 15 + i]) for i, logits in enumerate(gen.logits))
    assert cache_err < 0.05
    _GPU_RESULTS.append({"test": "checkpointing+generate", "family": "qwen2", "backend": "sdpa",
                         "grad_rel_err_checkpointed_vs_not": worst, "kv_cache_vs_full_logits_rel_err": cache_err})
