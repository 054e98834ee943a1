"""A model's shape as the planner (`python -m coat_ds.plan`, coat_ds/plan.py) reads it: a shipped shape by name, an HF
config.json or a cached hub name, with each family's extra norms and a mixture of experts' routed experts
(coat_ds/plan_moe.py). Parameter counts and ZeRO-3's order of the parameters are the stock HF model's
(tests/test_plan.py builds it on the meta device)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from .plan_moe import Experts, MoeError, experts_from_hf
from .workloads.causal_lm import MODEL_SIZES
from .workloads.shapes import ALIASES, SHAPES


class PlanError(ValueError):
    """Bad input to the planner: one line naming the flag or key and what is allowed."""


# What a family's layer has beyond Llama's: per-head q/k norms (Qwen3, Qwen3-MoE, Gemma 3), a norm after attention
# and after the MLP too (Gemma 3: 4 a layer), RMSNorms that multiply by (1 + w) in fp32 (Gemma 3).
FAMILIES = {"qwen3": dict(qk_norm=True), "qwen3_moe": dict(qk_norm=True),
            "gemma3_text": dict(qk_norm=True, norms=4, fp32_norms=True)}


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape (Llama family: gated MLP, RMSNorm, no biases; FAMILIES' extra norms; a
    mixture of experts' sparse MLPs: plan_moe.Experts)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0
    tied: bool = False
    norms: int = 2
    qk_norm: bool = False
    fp32_norms: bool = False       # the stock RMSNorm keeps its normed output in fp32 (Gemma 3)
    family: str = "llama"          # config.model_type: whether the engine runs the chunked loss (plan.chunk_runs)
    experts: Experts | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def _attention_tensors(self) -> list[int]:
        h, hd = self.hidden, self.hd
        return [h * hd * self.heads, h * hd * self.kv_heads, h * hd * self.kv_heads, h * hd * self.heads,
                *[hd] * (2 * self.qk_norm)]

    def _mlp_tensors(self, index: int) -> list[int]:
        e = self.experts
        if e is None or index in e.dense_layers:
            return [self.hidden * self.intermediate] * 3
        return e.tensors(self.hidden)

    def _layer_tensors(self, index: int) -> list[int]:
        return [*self._attention_tensors(), *self._mlp_tensors(index), *[self.hidden] * self.norms]

    @property
    def sparse_layers(self) -> int:
        """Decoder layers with routed experts."""
        return 0 if self.experts is None else self.layers - len(self.experts.dense_layers)

    @property
    def layer_params(self) -> int:
        """The largest decoder layer's parameters (a sparse one's where there are any: what ZeRO-3 gathers)."""
        return max(sum(self._layer_tensors(i)) for i in (0, *(self.experts.dense_layers if self.experts else ())))

    @property
    def params(self) -> int:
        return sum(self.tensors())

    @property
    def active_params(self) -> int:
        """The parameters one token's forward runs through (all of them in a dense model)."""
        if self.experts is None:
            return self.params
        return self.params - self.sparse_layers * (self.experts.params(self.hidden)
                                                   - self.experts.active_params(self.hidden))

    def tensors(self) -> list[int]:
        """Each parameter's values in HF's module order (ZeRO-3 cuts its optimizer sub-groups in this order)."""
        layers = [t for i in range(self.layers) for t in self._layer_tensors(i)]
        return [self.vocab * self.hidden, *layers, self.hidden, *[self.vocab * self.hidden] * (not self.tied)]

    @property
    def cached_params(self) -> int:
        """Decoder-layer parameters the FP8 weight cache holds: all but the routers and experts (quantized per call)."""
        layers = sum(sum(self._layer_tensors(i)) for i in range(self.layers))
        return layers - (self.sparse_layers * self.experts.params(self.hidden) if self.experts else 0)

    @property
    def largest(self) -> int:
        """Values of the largest tensor (the embedding or lm_head in every Llama; a MoE's gate_up experts)."""
        return max(self.tensors())


def shape_from_hf(cfg: Mapping[str, Any], where: str) -> Shape:
    """Shape of an HF config.json (a multimodal config's text_config)."""
    cfg = cfg.get("text_config") or cfg
    try:
        experts = experts_from_hf(cfg, where)
    except MoeError as e:
        raise PlanError(str(e)) from None
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(cfg.get(k), int)]
    if missing:
        raise PlanError(f"{where}: no integer {missing[0]}; allowed: a Llama-family config.json")
    return Shape(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                 cfg.get("num_key_value_heads") or cfg["num_attention_heads"], cfg["intermediate_size"],
                 cfg["vocab_size"], cfg.get("head_dim") or 0, bool(cfg.get("tie_word_embeddings", False)),
                 family=cfg.get("model_type") or "llama", experts=experts, **FAMILIES.get(cfg.get("model_type"), {}))


def resolve_shape(model: str, vocab: int | None = None) -> Shape:
    """A shipped shape (workloads.shapes.SHAPES, or the main job's MODEL_SIZES with `vocab`), a config.json (or
    its folder), or a hub name whose config.json is in the local HF cache."""
    name = ALIASES.get(model, model)
    if name in SHAPES or name in MODEL_SIZES:
        d = dict(SHAPES[name]) if name in SHAPES else dict(MODEL_SIZES[name], vocab_size=vocab or 8192)
        if vocab:
            d["vocab_size"] = vocab
        return shape_from_hf(d, model)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        path = _cached_config(model)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--model {model}: cannot read {path} ({e})") from None
    shape = shape_from_hf(cfg, str(path))
    return replace(shape, vocab=vocab) if vocab else shape


def _cached_config(model: str) -> Path:

    found = None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json") if "/" in model else None
    except Exception:  # noqa: BLE001 - no hub library, or not a repo id: the same refusal
        found = None
    if isinstance(found, str):
        return Path(found)
    raise PlanError(f"--model {model}: not a shipped shape, a config.json or a model in the local HF cache; "
                    f"allowed: {sorted(SHAPES) + sorted(MODEL_SIZES)}, a path, or a cached hub name")
