"""FP8 copies of a layer's weights, made once per optimizer step and reused across micro-batches.

Linears that read the same input (q/k/v, gate/up) are fused into one GEMM over their concatenated
weights, quantized per tensor with one shared scale. A cached copy is valid for one value of a step
counter (`new_step`) and while every weight keeps its storage and autograd version (a torch optimizer's
in-place update, load_state_dict, manual edits). Nothing is cached for partitioned parameters
(ZeRO-3: `sharding.ShardingHooks.is_partitioned`). Each layout is made when first needed: the row-major
copy by the forward, the transposed one (the grad-input GEMM's operand) by the backward, so the first
micro-batch's forward holds only one copy."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..formats import FP8Format
from ..kernels import quant
from .sharding import sharding


_steps = 0
_follows_torch_optimizers = False


def new_step() -> None:
    """Every FP8 weight cached so far is stale: weights were updated where no autograd version shows it.

    DeepSpeed writes the updated weights through `.data` (ZeRO-1/2 copy the partitions into the bf16
    weights) and CoatAdamW's ZeRO step calls no torch optimizer's `step`: coat_ds.deepspeed calls this
    after every engine step (engine.py). PyTorch's fused Adam/AdamW update in place without bumping
    `_version` either, so once a cache is kept, every torch optimizer's step calls it too."""
    global _steps
    _steps += 1


def _follow_torch_optimizers() -> None:
    """Count every torch optimizer's step (PyTorch's process-wide hook, installed once, where a cache is kept)."""
    global _follows_torch_optimizers
    if not _follows_torch_optimizers:
        register_optimizer_step_post_hook(lambda *_: new_step())
        _follows_torch_optimizers = True


class WeightGroup:
    """The FP8 operand of one GEMM: the row-wise concatenation of the weights of `linears`."""

    def __init__(self, linears: Sequence[nn.Linear], fmt: FP8Format, cache: bool = True) -> None:
        self.linears = list(linears)
        self.fmt = fmt
        self.cache = cache
        self._key: tuple | None = None
        self._scale: torch.Tensor | None = None
        self._codes: dict[bool, torch.Tensor] = {}

    @property
    def weights(self) -> list[torch.Tensor]:
        return [lin.weight for lin in self.linears]

    @property
    def biases(self) -> list[torch.Tensor]:
        return [lin.bias for lin in self.linears if lin.bias is not None]

    @property
    def has_bias(self) -> bool:
        return bool(self.biases)

    def params(self) -> list[torch.Tensor]:
        """Weights, then biases: the tensors an autograd Function takes so that their gradients flow."""
        return self.weights + self.biases

    @property
    def out_features(self) -> list[int]:
        return [lin.out_features for lin in self.linears]

    def bias_cat(self) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        if len(self.biases) != len(self.linears):
            raise ValueError("a fused FP8 GEMM needs a bias on all of its linears or on none")
        b = self.biases
        return b[0] if len(b) == 1 else torch.cat(b)

    def _state_key(self) -> tuple:
        return (_steps,) + tuple((w.data_ptr(), w._version, w.dtype, w.shape) for w in self.weights)

    def operand(self, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 codes, fp32 scale): [N, K] for the forward, [K, N] (transposed) for the grad-input GEMM."""
        if quant.tracing(self.linears[0].weight):  # a traced graph quantizes in place of a cache lookup
            return self._quantize(transposed, None)
        key = self._state_key()
        if key != self._key:
            self.clear()
            self._key = key
        if transposed not in self._codes:
            codes, self._scale = self._quantize(transposed, self._scale)
            # ZeRO-3 gathers a parameter for each use and frees it after: an FP8 copy must not outlive that
            if not self.cache or any(sharding().is_partitioned(w) for w in self.weights):
                return codes, self._scale
            _follow_torch_optimizers()
            self._codes[transposed] = codes
        return self._codes[transposed], self._scale

    def _quantize(self, transposed: bool, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # a traced graph takes the parameters themselves: its partitioner saves a graph input for free, but
        # counts a detached view of one as an activation, and then keeps the smaller FP8 copy across the step
        ws = self.weights if quant.tracing(self.weights[0]) else [w.detach() for w in self.weights]
        if scale is None:  # per-row maxima of each weight, then one scale for the fused operand
            amax = quant.row_amax(ws[0]) if len(ws) == 1 else torch.cat([quant.row_amax(w) for w in ws])
            scale = quant.tensor_scale(amax, self.fmt)
        if len(ws) > 1:
            fused = quant.quant_weights(ws, scale, self.fmt, transposed)  # each weight into its slice
            if fused is not None:
                return fused, scale
        # elsewhere (traced graphs, the CPU) each weight is quantized on its own and the codes concatenated: a
        # bf16 concatenation is one graph node shared by forward and backward, which the partitioner would
        # rather replace by the backward's FP8 transposed copy (1 B/param), kept across the step
        codes = [self._quant_one(w, scale, transposed) for w in ws]
        if len(codes) == 1:
            return codes[0], scale
        return torch.cat([c.view(torch.uint8) for c in codes], dim=int(transposed)).view(self.fmt.dtype), scale

    def _quant_one(self, w: torch.Tensor, scale: torch.Tensor, transposed: bool) -> torch.Tensor:
        q, qt = quant.quant_tensor(w, scale, self.fmt, rowmajor=not transposed, transposed=transposed)
        return qt if transposed else q  # (q, qt)[transposed] breaks Dynamo's graph: it indexes by int only

    def clear(self) -> None:
        self._key, self._scale, self._codes = None, None, {}

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._codes.values())

    def split_grad(self, dw: torch.Tensor, db: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Per-parameter gradients, in params() order, from the fused weight (and bias) gradient."""
        sizes = self.out_features
        grads = list(dw.split(sizes, dim=0))
        if self.has_bias:
            grads += list(db.split(sizes, dim=0))
        return grads
