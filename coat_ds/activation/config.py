"""The `"coat": {"activation": {...}}` section: which parts of a decoder layer run in FP8, and how."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from ..formats import FP8Format, get_format
from ..keys import check_choice, unknown_key

TILE_MULTIPLE = 16  # FP8 GEMMs (torch._scaled_mm) and the tile kernels take row counts that are multiples of 16


def check_tile_tokens(tile_tokens: object) -> None:
    """A one-line ValueError unless tile_tokens is a positive multiple of TILE_MULTIPLE."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0 \
            or tile_tokens % TILE_MULTIPLE:
        raise ValueError(f"activation.tile_tokens={tile_tokens!r} is invalid; allowed: null (the MLP untiled) or a "
                         f"positive multiple of {TILE_MULTIPLE}")


MODES = ("linear", "full")
CHECKPOINT_STORES = ("gpu", "gpu_fp8", "host_fp8")
ACT_GROUP_SIZES = (16, 32, 64, 128)
CACHE_WHEN_ACCUMULATING = "when_accumulating"


@dataclass(frozen=True)
class ActivationConfig:
    """FP8 activation flow of a decoder layer.

    mode "linear": only the linears are FP8 (what TransformerEngine / torchao do); norms and SiLU*mul stay
    bf16. mode "full": COAT's flow; RMSNorm and SiLU*mul also save FP8 inputs with per-group scales.
    Forward tensors use `fwd_format` (E4M3 by default), output gradients `bwd_format` (E5M2): gradients
    need range more than precision. `group_size` is the 1 x G group of the non-linear layers' saved
    inputs along the hidden dimension; the fused CUDA kernels exist for G = 16, other sizes use the
    plain-PyTorch path. `cache_weights` keeps each FP8 weight (and its transpose) until the weight
    changes, so gradient-accumulation micro-batches quantize it once per optimizer step; it costs 2 bytes per
    parameter for the whole step (12 GiB at 7B), so "when_accumulating" turns it on only where DeepSpeed's
    gradient_accumulation_steps > 1 (`resolve`); with one micro-batch per step there is nothing to reuse.
    `attention_fp8` (opt-in) saves attention's q, k, v in E4M3 instead of the backend's bf16 tensors and
    recomputes attention in backward from them (`activation/attention.py`). `checkpoint` recomputes each
    decoder layer in backward (torch.utils.checkpoint, non-reentrant), keeping only its bf16 input: what HF's
    gradient_checkpointing_enable() does, for users of plain deepspeed.initialize or coat_ds.inject.
    `checkpoint_store` is where that input waits for backward (activation/checkpoint_store.py): "gpu" as it is
    (2 B/token/hidden), "gpu_fp8" in the FP8 flow's per-group format on the GPU (1 + 1/group_size), "host_fp8" the
    same in pinned host memory, streamed back one layer ahead of backward (nothing on the GPU); the recompute runs
    on the dequantized input. `tile_tokens`: the MLP runs over sequence tiles of this many tokens in forward and
    recompute (activation/tiled.py), and with attention_fp8 attention's backward over query tiles of this many tokens
    where a sequence is longer (activation/tiled_attention.py), and the model's final norm over tiles
    (hf/final_norm.py); None: untiled."""

    enabled: bool = True
    mode: str = "full"
    fwd_format: str = "e4m3"
    bwd_format: str = "e5m2"
    group_size: int = 16
    cache_weights: bool | str = "when_accumulating"
    attention_fp8: bool = False
    checkpoint: bool = False
    checkpoint_store: str = "gpu"
    tile_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"activation.enabled={self.enabled!r} must be true or false")
        if self.mode not in MODES:
            raise ValueError(f"activation.mode={self.mode!r} is not supported; allowed: {list(MODES)}")
        get_format(self.fwd_format, "activation.fwd_format")
        get_format(self.bwd_format, "activation.bwd_format")
        if self.group_size not in ACT_GROUP_SIZES:
            raise ValueError(f"activation.group_size={self.group_size!r} is not supported; "
                             f"allowed: {list(ACT_GROUP_SIZES)}")
        if not isinstance(self.cache_weights, bool) and self.cache_weights != CACHE_WHEN_ACCUMULATING:
            raise ValueError(f"activation.cache_weights={self.cache_weights!r} is invalid; allowed: true, false, "
                             f"{CACHE_WHEN_ACCUMULATING!r} (not 'auto': HF Trainer rejects 'auto' values it does not fill)")
        if not isinstance(self.attention_fp8, bool):
            raise ValueError(f"activation.attention_fp8={self.attention_fp8!r} must be true or false")
        if not isinstance(self.checkpoint, bool):
            raise ValueError(f"activation.checkpoint={self.checkpoint!r} must be true or false")
        check_choice("activation.checkpoint_store", self.checkpoint_store, CHECKPOINT_STORES)
        if self.checkpoint_store != CHECKPOINT_STORES[0] and not self.checkpoint:
            raise ValueError(f"activation.checkpoint_store={self.checkpoint_store!r} stores the input of a recomputed "
                             "layer: it needs activation.checkpoint=true")
        if self.tile_tokens is not None:
            check_tile_tokens(self.tile_tokens)

    @property
    def cache_enabled(self) -> bool:
        """Whether the FP8 weight cache is on ("when_accumulating" unresolved means off)."""
        return self.cache_weights is True

    def resolve(self, gradient_accumulation_steps: Any) -> "ActivationConfig":
        """A copy with cache_weights "when_accumulating" decided by DeepSpeed's gradient_accumulation_steps."""
        if self.cache_weights != CACHE_WHEN_ACCUMULATING:
            return self
        gas = gradient_accumulation_steps if isinstance(gradient_accumulation_steps, int) else 1
        return replace(self, cache_weights=gas > 1)

    @property
    def fwd(self) -> FP8Format:
        return get_format(self.fwd_format)

    @property
    def bwd(self) -> FP8Format:
        return get_format(self.bwd_format)

    @classmethod
    def coerce(cls, config: "ActivationConfig | Mapping[str, Any] | None") -> "ActivationConfig":
        """What the FP8 layers and the swap accept as their config: one, its JSON section, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        raise TypeError(f"config must be an ActivationConfig, a dict (the \"coat\": {{\"activation\": ...}} section) "
                        f"or None, got {type(config).__name__}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ActivationConfig":
        """Build from the JSON section; an unknown key is a ValueError naming it and the allowed keys."""
        d = dict(d or {})
        allowed = [f.name for f in fields(cls)]
        for key in d:
            if key not in allowed:
                raise ValueError(unknown_key("coat.activation", key, allowed))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
