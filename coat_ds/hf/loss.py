"""An HF causal LM's training loss through coat_ds.activation.loss, without the full logits.

HF's ForCausalLM models compute `logits = self.lm_head(hidden_states)` and then `self.loss_function(logits,
labels, ...)` (transformers 5.17 and 5.24 alike). `apply` makes the lm_head return the loss instead, in a
training forward with labels: a forward pre-hook on the model takes `labels` out of the call (HF then computes
no loss) and hands them to the lm_head, whose call computes the chunked loss from its input and weight
(inside its own call, so a ZeRO-3 gather of the weight for forward and backward works as for the stock one);
a forward hook moves that value from `outputs.logits` to `outputs.loss` and leaves `outputs.logits` None.

Only where the result is the stock one: the model types below (nothing between lm_head and the stock
ForCausalLMLoss), module.training with grad enabled, labels given by keyword, logits_to_keep 0, a dict output,
no autocast, no custom loss_function. Anything else runs the stock forward and returns logits."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..activation.loss import IGNORE_INDEX, LossConfig, linear_cross_entropy

# Model types whose ForCausalLM forward applies lm_head and then the stock loss, with nothing in between but
# Gemma 3's optional logit soft-capping, where `refusal` keeps the stock loss (Gemma 3's sqrt(hidden) scaling
# is of the input embeddings, not the logits), and the MoE families' router load-balancing loss, which HF adds
# (router_aux_loss_coef x aux_loss) only to a loss it computed itself: `after` adds it. Each one is checked
# against the stock loss in tests/test_hf_loss.py.
EXACT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral")
ATTR = "_coat_chunked_loss"   # a plain attribute on the model: not in state_dict or config.json


class _ChunkedLoss:
    """The hooks of one model, and the labels / loss on their way between them within one forward."""

    def __init__(self, model: nn.Module, config: LossConfig) -> None:
        self.config, self.head = config, model.get_output_embeddings()
        self.pending: tuple[torch.Tensor, dict] | None = None
        self.ran = False
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after)]
        self.head.forward = self.head_forward   # instance attribute: nn.Module.__call__ (and its hooks) call it

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        del self.head.forward

    def before(self, model: nn.Module, args: tuple, kwargs: dict):
        self.pending, self.ran = None, False
        if kwargs.get("labels") is None or not _stock_would_match(model, kwargs):
            return None
        kwargs = dict(kwargs)
        self.pending = (kwargs.pop("labels"), kwargs)
        return args, kwargs

    def head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pending is None:
            return type(self.head).forward(self.head, hidden)
        (labels, kw), self.pending = self.pending, None
        ignore = kw.get("ignore_index", IGNORE_INDEX)
        targets = kw.get("shift_labels")
        if targets is None:   # HF's shift: position t predicts label t + 1, the last position nothing
            targets = nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
        self.ran = True
        return linear_cross_entropy(hidden, self.head.weight, targets.to(hidden.device), ignore_index=ignore,
                                    num_items_in_batch=kw.get("num_items_in_batch"),
                                    chunk_tokens=self.config.chunk_tokens)

    def after(self, model: nn.Module, args: tuple, output: Any):
        if not self.ran:
            return None
        self.ran = False
        fields = {k: v for k, v in output.items() if k != "logits"}
        loss = output["logits"]   # what lm_head's call returned (after any hooks of its own)
        aux = output.get("aux_loss")
        if aux is not None:   # output_router_logits: the term HF adds to the loss it computes
            loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
        fields["loss"] = loss
        return type(output)(**fields)


def _stock_would_match(model: nn.Module, kwargs: Mapping[str, Any]) -> bool:
    """Whether this call's stock loss is what the chunked one computes (see the module docstring)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    keep = kwargs.get("logits_to_keep", 0)
    return_dict = kwargs.get("return_dict")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    autocast = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    return (model.training and torch.is_grad_enabled() and not autocast and return_dict is not False
            and isinstance(keep, int) and keep == 0 and model.loss_function is LOSS_MAPPING["ForCausalLM"]
            and refusal(model) is None)   # e.g. soft-capping switched on in the config after apply


def refusal(model: nn.Module) -> str | None:
    """Why the chunked loss cannot stand in for `model`'s stock loss, or None if it can."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in EXACT_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {list(EXACT_MODEL_TYPES)}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.bias is not None:
        return f"its output embedding is a {type(head).__name__}, not a bias-free nn.Linear (no lm_head: a base model?)"
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        return (f"its config soft-caps the logits (final_logit_softcapping={cfg.final_logit_softcapping}: "
                "the loss of tanh-capped logits is not a linear + cross-entropy)")
    return None


def apply(model: nn.Module, config: LossConfig | Mapping[str, Any] | None = None) -> str:
    """Install (config.chunked, the default) or remove the chunked causal-LM loss on `model`, in place;
    returns one line saying which loss the model's training forward now computes, and why.

    config: a LossConfig, the dict of the `"coat": {"loss": ...}` section, or None for the defaults. Call it
    before a framework wraps the model (the hooks must be the model's own); applying again updates it."""
    cfg = config if isinstance(config, LossConfig) else LossConfig.from_dict(config)
    installed = getattr(model, ATTR, None)
    why = refusal(model) if cfg.chunked else "coat.loss.chunked is false"
    if why is not None:
        remove(model)
        return f"stock loss ({why})"
    if installed is None:
        object.__setattr__(model, ATTR, _ChunkedLoss(model, cfg))
    else:
        installed.config = cfg
    return f"chunked loss ({cfg.chunk_tokens} tokens x {model.get_output_embeddings().out_features} logits at a time)"


def remove(model: nn.Module) -> nn.Module:
    """Put the stock loss back (a no-op where apply installed nothing); returns `model`."""
    installed = model.__dict__.pop(ATTR, None)
    if installed is not None:
        installed.remove()
    return model


def is_applied(model: nn.Module) -> bool:
    return getattr(model, ATTR, None) is not None
