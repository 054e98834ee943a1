"""Activation checkpointing of the FP8 decoder layers, in process (CPU): HF's gradient_checkpointing_enable(), HF
Trainer's TrainingArguments(gradient_checkpointing=True) and coat's `"activation": {"checkpoint": true}` recompute
each layer in backward; the gradients equal the run without the recompute, bit for bit, and each layer keeps only
its input. Through deepspeed.initialize under ZeRO-3 on 2 ranks: tests/launched/test_activation_checkpoint_zero3.py."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import coat_ds
from coat_ds.activation import ActivationConfig
from coat_ds.deepspeed.config import coat_section
from coat_ds.plan import CHECKPOINT_INPUT
from layer_probe import counting_forwards, saved_per_layer

# HF defaults (use_cache=True) but a hidden size the layers' saves dominate, in bf16 as trained
SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
BATCH, SEQ = 2, 64


def _model(act: dict | None = None, **hf) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**SHAPE, **hf})
    assert config.use_cache
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    return coat_ds.inject(model, act or {})


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _step(model: torch.nn.Module) -> dict:
    """One training forward + backward (same RNG state each call): gradients, what each decoder layer saved for
    backward (B per token per hidden unit) and how many layer forwards ran."""
    model.train()
    x = _batch()
    torch.manual_seed(1)
    with counting_forwards() as calls:
        saved = saved_per_layer(model, lambda: model(input_ids=x, labels=x).loss.backward(), x.numel())
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, "saved": saved, "forwards": calls[0]}


def _hf_switch(model: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # gradient_checkpointing_enable: deprecated alias on 5.2x
        model.gradient_checkpointing_enable()
    return model


@pytest.mark.parametrize("how", ["hf", "coat"])
@pytest.mark.parametrize("act,hf", [({}, {}), ({"attention_fp8": True}, {}), ({"mode": "linear"}, {}),
                                    ({}, {"attention_dropout": 0.2, "attn_implementation": "eager"})])
def test_recompute_gives_the_same_gradients_and_keeps_only_layer_inputs(how, act, hf):
    """HF's switch or coat's key: every layer runs its forward twice (once recomputed), keeps 2 B/token/hidden (its
    bf16 input) instead of its FP8 activations, and every gradient equals the run without the recompute bit for
    bit: the quantization is deterministic, and with attention dropout torch's checkpoint replays the RNG state."""
    plain = _step(_model(act, **hf))
    model = _hf_switch(_model(act, **hf)) if how == "hf" else _model({**act, "checkpoint": True}, **hf)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    ck = _step(model)
    layers = SHAPE["num_hidden_layers"]
    assert plain["forwards"] == layers and ck["forwards"] == 2 * layers
    # the planner's term for it (coat_ds.plan.CHECKPOINT_INPUT)
    assert ck["saved"] == [CHECKPOINT_INPUT] * layers == [2.0] * layers and min(plain["saved"]) > 8.0, plain["saved"]
    for name, g in plain["grads"].items():
        assert torch.equal(ck["grads"][name], g), name


def test_dropout_changes_with_the_seed():
    """The dropout case above is a real one: another RNG state gives other gradients."""
    model = _model({}, attention_dropout=0.2, attn_implementation="eager")
    first = _step(model)["grads"]
    model.zero_grad()
    torch.manual_seed(7)
    x = _batch()
    model(input_ids=x, labels=x).loss.backward()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.get_parameter(name).grad, first[name])


def test_hf_trainer_gradient_checkpointing_recomputes_the_fp8_layers(tmp_path):
    """TrainingArguments(gradient_checkpointing=True) on an injected model: each step runs every FP8 layer's forward
    twice, and three steps end at the weights of the run without it, bit for bit."""
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": x, "labels": x} for x in (_batch(i)[0] for i in range(6))]

    def train(checkpointing: bool) -> tuple[torch.nn.Module, int]:
        model = _model()
        args = TrainingArguments(output_dir=str(tmp_path / str(checkpointing)), per_device_train_batch_size=2,
                                 max_steps=3, learning_rate=1e-2, use_cpu=True, gradient_checkpointing=checkpointing,
                                 report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
        with counting_forwards() as calls:
            Trainer(model=model, args=args, train_dataset=data).train()
        return model, calls[0]

    (plain, plain_calls), (ck, ck_calls) = train(False), train(True)
    assert all(layer.gradient_checkpointing for layer in ck.model.layers)
    assert plain_calls == 3 * SHAPE["num_hidden_layers"] and ck_calls == 2 * plain_calls
    for (name, p), q in zip(plain.named_parameters(), ck.parameters()):
        assert torch.equal(q, p), name
    assert not torch.equal(plain.model.layers[0].mlp.up_proj.weight, _model().model.layers[0].mlp.up_proj.weight)


def test_checkpoint_key_is_a_boolean_named_in_one_line():
    with pytest.raises(ValueError) as exc:
        coat_section({"coat": {"activation": {"checkpoint": "yes"}}})
    assert str(exc.value) == "coat.activation.checkpoint='yes' must be true or false"
    assert ActivationConfig().checkpoint is False
    assert coat_section({"coat": {"activation": {"checkpoint": True}}}).activation.checkpoint is True


def test_the_key_applies_to_an_injected_model_and_revert_drops_it():
    """An engine's section with checkpoint true serves a model injected without it (the layers are the same) and
    turns the recompute on; revert gives back stock layers without coat's checkpointing."""
    model = _model()
    layers = list(model.model.layers)
    assert coat_ds.hf.swap.apply(model, {"checkpoint": True}, 1) == len(layers)
    assert list(model.model.layers) == layers and all(layer.gradient_checkpointing for layer in layers)
    coat_ds.revert(model)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
