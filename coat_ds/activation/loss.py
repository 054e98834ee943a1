"""The LM-head loss without the full logits: a chunked linear + cross-entropy, forward and backward.

The stock loss computes `logits = hidden @ weight^T` for every token, upcasts them to fp32 and keeps an fp32
log-softmax for backward: at Llama-3.1-8B's 128,256-token vocabulary and 4096 tokens that is 1 GiB of bf16
logits and 2 GiB for each fp32 copy, per sample. Here forward walks the tokens in chunks of `chunk_tokens`
(chunk_tokens x vocab logits at a time) and keeps one log-sum-exp per token; backward recomputes the logits
in vocabulary slices holding as many logits (`slice_rows`), so that each slice's weight gradient is one GEMM
over all the tokens (rounded once, as stock) and the hidden-state gradient is summed over slices in fp32.
The math per element is the stock one: logits in the weight's dtype, softmax in fp32, the logits' gradient
rounded to the weight's dtype before the two GEMMs. On CUDA the logits stay bf16 (kernels.quant.xent_*: one
read forward, one in-place pass backward, no fp32 copy). The extra cost is one more logits GEMM (backward
recomputes them)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..kernels import quant
from ..keys import unknown_key

IGNORE_INDEX = -100          # the targets left out of the loss (PyTorch's and HF's default)
DEFAULT_CHUNK_TOKENS = 1024  # 1024 x 128,256 logits at a time: 0.25 GiB in bf16 (CUDA), ~1.2 GiB with fp32 copies


@dataclass(frozen=True)
class LossConfig:
    """The `"coat": {"loss": {...}}` section. `chunked`: compute the causal-LM loss with
    `linear_cross_entropy` where it equals the stock loss (coat_ds.hf.loss says where); `chunk_tokens`:
    tokens per forward chunk, which bounds the logits alive at once to chunk_tokens x vocabulary (forward and
    backward)."""

    chunked: bool = True
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.chunked, bool):
            raise ValueError(f"coat.loss.chunked={self.chunked!r} is invalid; allowed: true or false")
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"coat.loss.chunk_tokens={self.chunk_tokens!r} is invalid; allowed: an integer >= 1")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "LossConfig":
        """Build from the JSON section; an unknown key is a ValueError naming it and the allowed keys."""
        if d is not None and not isinstance(d, Mapping):
            raise ValueError(f"coat.loss={d!r} is invalid; allowed: an object with keys {_keys()}")
        d = dict(d or {})
        for key in d:
            if key not in _keys():
                raise ValueError(unknown_key("coat.loss", key, _keys()))
        return cls(**d)


def _keys() -> list[str]:
    return [f.name for f in fields(LossConfig)]


def slice_rows(chunk: int, vocab: int, tokens: int) -> int:
    """Vocabulary rows per backward slice: as many logits as a forward chunk holds (chunk x vocab), so the
    backward's few large GEMMs and fp32 accumulations cost no more memory; a multiple of 8 (the kernels' vector)."""
    rows = max(chunk, chunk * vocab // max(tokens, 1))
    return min(vocab, -(-rows // 8) * 8)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32, without rounding the product to a's dtype first."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over kept tokens of (logsumexp(logits) - logits[target]) / divisor, logits = hidden @ weight^T."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, ignore_index: int, chunk: int):
        keep = targets != ignore_index
        safe = torch.where(keep, targets, 0)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            lse[s:s + chunk], picked = quant.xent_forward(F.linear(hidden[s:s + chunk], weight), safe[s:s + chunk])
            total += torch.where(keep[s:s + chunk], lse[s:s + chunk] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, safe, keep, lse, divisor)
        ctx.chunk = chunk
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, safe, keep, lse, divisor = ctx.saved_tensors
        vocab, rows = weight.shape[0], slice_rows(ctx.chunk, weight.shape[0], hidden.shape[0])
        # d loss / d logits[i, v] = (softmax[i, v] - [v == target_i]) * scale_i
        scale = torch.where(keep, grad_out.float() / divisor, 0.0)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for v0 in range(0, vocab, rows):
            w = weight[v0:v0 + rows]
            g = quant.xent_backward_(F.linear(hidden, w), lse, safe - v0, scale)
            if need_w:
                grad_w[v0:v0 + rows] = torch.mm(g.t(), hidden)
            if need_h:
                grad_h += _mm_fp32(g, w)
            del g
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, num_items_in_batch: Any = None,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight^T` against `targets` without the full logits; fp32 scalar.

    hidden (..., H) and weight (V, H) of one dtype, targets (...) of class indices. Reduction as HF's
    `fixed_cross_entropy`: the mean over targets != ignore_index, or their sum / num_items_in_batch when that
    is given (HF Trainer's count over all gradient-accumulation micro-batches). Gradients flow to hidden and
    weight; the logits exist chunk_tokens x V (forward) or tokens x chunk_tokens (backward) at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} is invalid; allowed: an integer >= 1")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    if num_items_in_batch is None:
        divisor = (t != ignore_index).sum().float()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=h.device).float()
    return _LinearCrossEntropy.apply(h, weight, t, divisor, ignore_index, chunk_tokens)
