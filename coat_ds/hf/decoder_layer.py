"""CoatDecoderLayer: a stock HF decoder layer (Llama, Mistral, Qwen2/3, Gemma 3, Qwen3-MoE, Mixtral) running COAT's
FP8 flow. A mixture-of-experts MLP keeps its stock router (bf16/fp32: routing is what stock decides) and runs its
experts through activation/experts.py's grouped FP8 GEMMs.

It reuses the HF layer's submodules under the same names, so state_dict keys, checkpoints and weight
tying are unchanged, and `to_hf()` gives the original layer back. The forward keeps HF's signature and
return value and HF's own pieces for what stays bf16: rotary embeddings (`position_embeddings`), the
KV cache, masks and the attention backend (`ALL_ATTENTION_FUNCTIONS`: sdpa / eager / flash)."""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..activation import checkpoint_store
from ..activation.attention import Fp8AttentionFn
from ..activation.config import ActivationConfig
from ..activation.experts import ExpertsFn
from ..kernels import quant
from ..activation.functions import LinearFn, NormLinearFn, RmsNormFn, RopeFn
from ..activation.tiled import mlp
from ..activation.tiled_attention import tiled_call
from ..activation.weight_cache import WeightGroup
from .contract import pop_cache
from .coverage import is_sparse, missing_parts
from .registry import Norms

try:
    from transformers.modeling_layers import GradientCheckpointingLayer as _Base
except ImportError:  # pragma: no cover - older transformers
    _Base = nn.Module

_FP8_ATTN_BACKENDS = (None, "eager", "sdpa")
# The stock act_fn classes (transformers.activations, torch.nn) whose gated MLP the FP8 flow has a non-linear
# for (kernels.quant_reference.GATED_ACTS); tanh-GELU under its three transformers names.
_GATED_ACTS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
               "NewGELUActivation": "gelu_tanh"}


def _eps(norm: nn.Module) -> float:
    """An HF RMSNorm's epsilon (Llama's spelling, or Gemma's)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _qk_norms(attn: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The attention's per-head q/k RMSNorms (Qwen3, Gemma 3; weight [head_dim]), None where it has none."""
    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return None if norms == (None, None) else norms


def _stock_function(impl: str | None) -> bool:
    """Whether the layer's attention function is transformers' own eager or sdpa one (not a wrapper: Ulysses)."""
    if impl in (None, "eager"):
        return True
    if impl != "sdpa":
        return False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None) is sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl] is sdpa_attention_forward  # pragma: no cover - older transformers


def gated_act(mlp: nn.Module) -> str | None:
    """The FP8 flow's name for the stock MLP's (or its experts') activation (None: it has no FP8 non-linear for it)."""
    owner = mlp.experts if is_sparse(mlp) else mlp
    return _GATED_ACTS.get(type(getattr(owner, "act_fn", None)).__name__)


def _check_layer(hf_layer: nn.Module, cfg: ActivationConfig, norms: Norms) -> None:
    missing = missing_parts(hf_layer, norms)
    if missing:
        raise ValueError(f"{type(hf_layer).__name__} is not a Llama-shaped decoder layer: missing {missing}")
    sparse = is_sparse(hf_layer.mlp)
    if (cfg.mode == "full" or sparse) and gated_act(hf_layer.mlp) is None:
        hf_cfg = getattr(hf_layer.self_attn, "config", None)
        act = getattr(hf_cfg, "hidden_act", None) or getattr(hf_cfg, "hidden_activation", None)
        fix = ("the FP8 experts have no other non-linear" if sparse else "use activation.mode='linear'")
        raise ValueError(f"activation.mode={cfg.mode!r} needs a SiLU or tanh-GELU gated MLP, this layer uses "
                         f"hidden_act={act!r}; {fix}")


class CoatDecoderLayer(_Base):
    """FP8 twin of an HF decoder layer; same parameters, same forward signature and output."""

    # coat.activation.checkpoint's recompute with checkpoint_store "gpu" (torch's non-reentrant checkpoint)
    CHECKPOINT = checkpoint_store.CHECKPOINT

    def __init__(self, hf_layer: nn.Module, config: ActivationConfig | dict | None = None,
                 attention_kwargs: dict[str, Any] | None = None, norms: Norms | None = None) -> None:
        """attention_kwargs: extra keyword arguments for HF's attention function, what the family's policy
        hands over (Mistral's sliding_window, which its attention module does not keep).
        norms: the block's norm layout, from the family's policy (Llama's by default)."""
        super().__init__()
        self.attention_kwargs = dict(attention_kwargs or {})
        self.norms = norms or Norms()
        cfg = ActivationConfig.coerce(config)
        _check_layer(hf_layer, cfg, self.norms)
        self.coat_config = cfg
        for name, child in hf_layer.named_children():  # same names, same order: state_dict keys unchanged
            setattr(self, name, child)
        self._act = gated_act(self.mlp)
        self._qk = _qk_norms(self.self_attn)
        for name in ("hidden_size", "attention_type", "layer_idx"):
            if hasattr(hf_layer, name):
                setattr(self, name, getattr(hf_layer, name))
        self.gradient_checkpointing = getattr(hf_layer, "gradient_checkpointing", False)
        self.checkpoint_if_configured()
        object.__setattr__(self, "_hf_layer", hf_layer)  # not a submodule: state_dict keys stay unchanged
        a, m, fwd, cache = self.self_attn, self.mlp, cfg.fwd, cfg.cache_enabled
        self._qkv = WeightGroup([a.q_proj, a.k_proj, a.v_proj], fwd, cache)
        self._o = WeightGroup([a.o_proj], fwd, cache)
        self._sparse = is_sparse(m)   # the experts quantize their weights per call: no cached WeightGroup
        self._gu = None if self._sparse else WeightGroup([m.gate_proj, m.up_proj], fwd, cache)
        self._down = None if self._sparse else WeightGroup([m.down_proj], fwd, cache)
        hf_module = sys.modules[type(a).__module__]
        self._rope = hf_module.apply_rotary_pos_emb
        self._eager_attention = hf_module.eager_attention_forward

    # ---------------------------------------------------------------- bookkeeping
    def to_hf(self) -> nn.Module:
        """The original HF layer (its submodules are the ones this layer trained)."""
        self.clear_weight_cache()
        return self._hf_layer

    @property
    def weight_groups(self) -> tuple[WeightGroup, ...]:
        return tuple(g for g in (self._qkv, self._o, self._gu, self._down) if g is not None)

    def clear_weight_cache(self) -> None:
        for g in self.weight_groups:
            g.clear()

    def resolve_weight_cache(self, gradient_accumulation_steps: int) -> None:
        """Decide cache_weights "when_accumulating" now that the micro-batches per step are known."""
        self.coat_config = self.coat_config.resolve(gradient_accumulation_steps)
        for g in self.weight_groups:
            g.cache = self.coat_config.cache_enabled
            if not g.cache:
                g.clear()

    def checkpoint_if_configured(self) -> None:
        """coat.activation.checkpoint: recompute this layer in backward as HF's gradient_checkpointing_enable()
        does (the flag and function transformers' GradientCheckpointingLayer reads), the layer's input kept where
        coat.activation.checkpoint_store says. Off leaves what HF set."""
        if not self.coat_config.checkpoint:
            return
        if _Base is nn.Module:  # pragma: no cover - transformers without GradientCheckpointingLayer
            raise ValueError("activation.checkpoint=true needs transformers' GradientCheckpointingLayer "
                             "(transformers >= 4.52); allowed here: false")
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = checkpoint_store.function(self.coat_config)

    def weight_cache_bytes(self) -> int:
        return sum(g.nbytes() for g in self.weight_groups)

    def extra_repr(self) -> str:
        c = self.coat_config
        return f"mode={c.mode}, fwd={c.fwd_format}, bwd={c.bwd_format}, group_size={c.group_size}"

    # ---------------------------------------------------------------- forward
    def _fp8_attention(self, q: torch.Tensor, impl: str | None, cache: Any, dropout: float) -> bool:
        """attention_fp8 applies to training steps of the sdpa/eager backends without a KV cache or dropout
        (its backward recomputes the call, which dropout would not repeat); eager and traced (torch.compile).
        Training forwards reach the layers without a cache: coat_ds.inject makes them cacheless (swap.py)."""
        return (self.coat_config.attention_fp8 and impl in _FP8_ATTN_BACKENDS and cache is None
                and dropout == 0.0 and self.training and q.requires_grad)

    def _norm(self, name_or_norm: str | nn.Module, x: torch.Tensor) -> torch.Tensor:
        """An RMSNorm of the block whose output is no GEMM operand, on [rows, n]: FP8-saving in mode full,
        the stock module in mode linear."""
        norm = getattr(self, name_or_norm) if isinstance(name_or_norm, str) else name_or_norm
        if self.coat_config.mode != "full":
            return norm(x)
        return RmsNormFn.apply(x, self._norm_weight(norm), _eps(norm), self.coat_config)

    def _norm_weight(self, norm: nn.Module) -> torch.Tensor:
        """The weight the norm multiplies by: w, or w + offset (Gemma's 1 + w, rounded to w's dtype: 2^-9
        relative in bf16, far below the E4M3 step of what the norm's output feeds)."""
        offset = self.norms.weight_offset
        return norm.weight + offset if offset else norm.weight

    def _head_norm(self, t: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """Per-head RMSNorm of q or k [tokens, heads x head_dim]: rows = tokens x heads."""
        return self._norm(norm, t.reshape(-1, self.self_attn.head_dim)).view(t.shape)

    def _heads(self, qkv: torch.Tensor, input_shape, position_embeddings) -> tuple[torch.Tensor, ...]:
        """q, k, v [b, h, s, d] of the fused q/k/v output, per-head q/k norms and RoPE applied."""
        hd = self.self_attn.head_dim
        cos, sin = position_embeddings
        batch, seq = input_shape[0], qkv.shape[0] // input_shape[0]
        nh, nkv = (n // hd for n in self._qkv.out_features[:2])
        if (self._qk is None and quant.rope_available(qkv, cos, hd) and cos.shape[0] in (1, batch)
                and cos.shape[1] == seq and sin.shape == cos.shape and len(input_shape) == 2):
            return RopeFn.apply(qkv, cos, sin, batch, nh, nkv, hd)
        q, k, v = qkv.split(self._qkv.out_features, dim=-1)
        # attention saves v as it gets it; a view would keep the whole fused q/k/v output alive
        v = v.contiguous()
        if self._qk is not None:
            q, k = (self._head_norm(t, norm) for t, norm in zip((q, k), self._qk))
        shape = (*input_shape, -1, hd)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        q, k = self._rope(q, k, cos, sin)
        return q, k, v

    def _attention_call(self, dropout: float, **kwargs: Any):
        """call(q, k, v, mask) -> [b, s, h, d]: HF's attention function for this layer's backend and options."""
        attn = self.self_attn
        impl = attn.config._attn_implementation
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, self._eager_attention)
        else:  # pragma: no cover - older transformers
            fn = self._eager_attention if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
        sliding = getattr(attn, "sliding_window", None)   # per layer (Qwen2, Gemma 3); Mistral's: attention_kwargs
        if sliding is not None:
            kwargs.setdefault("sliding_window", sliding)
        kwargs = {**kwargs, **self.attention_kwargs}

        def call(q, k, v, mask):
            out = fn(attn, q, k, v, mask, dropout=dropout, scaling=attn.scaling, **kwargs)[0]
            # a wrapper may return the heads flattened, [b, s, h x d] (DeepSpeed's Ulysses): a view as [b, s, h, d]
            return out if out.dim() == 4 else out.unflatten(-1, (-1, q.shape[-1]))
        return call

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor | None,
                   attention_mask, cache, **kwargs: Any) -> torch.Tensor:
        """residual + o_proj(attention(q, k, v)), [tokens, hidden] (residual None: no add)."""
        attn, cfg = self.self_attn, self.coat_config
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx)
        dropout = 0.0 if not self.training else attn.attention_dropout
        call = self._attention_call(dropout, **kwargs)
        if self._fp8_attention(q, attn.config._attn_implementation, cache, dropout):
            call = tiled_call(call, attn, attention_mask, q, cfg.tile_tokens, kwargs,   # backward over query tiles
                              _stock_function(attn.config._attn_implementation))
            return Fp8AttentionFn.apply(q, k, v, attention_mask, residual, call, cfg, self._o, *self._o.params())
        out = call(q, k, v, attention_mask)
        o = out.reshape(-1, out.shape[-2] * out.shape[-1])
        # full: o is attention's own saved output, so o_proj keeps a reference to it instead of an FP8 copy
        return LinearFn.apply(o, residual, cfg, self._o, cfg.mode != "full", *self._o.params())

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """The sparse MLP on the normed [tokens, hidden]: the stock router module (its output hooks, HF's
        router_logits capture, fire as in stock), then the experts' grouped FP8 GEMMs."""
        _, weights, index = self.mlp.gate(x)
        e = self.mlp.experts
        keep_codes = self.gradient_checkpointing and self.training   # recomputed: codes live recompute -> backward
        return ExpertsFn.apply(x, index, weights, self.coat_config, self._act, e, keep_codes, e.gate_up_proj,
                               e.down_proj)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        """HF's decoder-layer forward; the KV cache comes as `cache` or `past_key_values` (contract.py)."""
        cfg = self.coat_config
        if not cfg.enabled:
            return self._hf_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        cache = pop_cache(kwargs)
        input_shape = hidden_states.shape[:-1]
        hsz = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, hsz)
        full, norms = cfg.mode == "full", self.norms
        ln1, ln2 = getattr(self, norms.attn_in), getattr(self, norms.mlp_in)
        if full:
            # q/k/v's gradient is _heads' own (NormLinearFn's owns_grad)
            qkv = NormLinearFn.apply(x, self._norm_weight(ln1), _eps(ln1), cfg, self._qkv, True, *self._qkv.params())
        else:
            qkv = LinearFn.apply(ln1(x), None, cfg, self._qkv, True, *self._qkv.params())
        residual = None if norms.attn_out else x
        q, k, v = self._heads(qkv, input_shape, position_embeddings)
        # q, k, v are tensors of their own (RoPE's outputs, v copied): the fused output is not kept through the
        # attention and the MLP (3 B/token/hidden at Llama-8B, at a long sequence's peak in a recompute)
        del qkv
        # position_ids reach the attention function as in the stock layer (its attention's kwargs): Ulysses gathers
        # them to order the whole sequence (coat_ds.deepspeed.sequence_parallel), flash's varlen path reads them
        h = self._attention(q, k, v, residual, attention_mask, cache, position_ids=position_ids, **kwargs)
        del q, k, v
        if norms.attn_out:
            h = x + self._norm(norms.attn_out, h)
        add_residual = not norms.mlp_out
        if self._sparse:
            out = self._experts(self._norm(ln2, h))
            out = out + h if add_residual else out
        elif full:
            # in a checkpoint's recompute the layer's output is thrown away: where it is the MLP's (+ h), skip it
            discard = add_residual and checkpoint_store.recomputing()
            out = mlp(h, self._norm_weight(ln2), _eps(ln2), cfg, self._gu, self._down, self._act, add_residual,
                      cfg.tile_tokens, discard)
        else:
            gate_up = LinearFn.apply(ln2(h), None, cfg, self._gu, True, *self._gu.params())
            gate, up = gate_up.split(self._gu.out_features, dim=-1)
            out = LinearFn.apply(self.mlp.act_fn(gate) * up, h if add_residual else None, cfg, self._down, True,
                                 *self._down.params())
        if norms.mlp_out:
            out = h + self._norm(norms.mlp_out, out)
        return out.view(*input_shape, hsz)
