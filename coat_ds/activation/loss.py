"""The LM-head loss without the full logits: a chunked linear + cross-entropy, forward and backward.

The stock loss computes `logits = hidden @ weight^T` for every token, upcasts them to fp32 and keeps an fp32
log-softmax for backward: at Llama-3.1-8B's 128,256-token vocabulary and 4096 tokens that is 1 GiB of bf16
logits and 2 GiB for each fp32 copy, per sample. Here forward walks the tokens in chunks of `chunk_tokens`
(chunk_tokens x vocab logits at a time) and keeps one log-sum-exp per token. Backward recomputes the logits in
one of two walks, whichever holds less: up to as many tokens as the vocabulary has entries, vocabulary slices
holding as many logits (`slice_rows`), so that each slice's weight gradient is one GEMM over all the tokens
(rounded once, as stock) and the hidden-state gradient is summed over slices in fp32 (4 B/token/hidden and a
product as large); past that (long sequences), chunks of tokens, each chunk's hidden-state gradient one GEMM over
the whole vocabulary written in the hidden states' dtype (rounded once, as stock) and the weight gradient summed
over chunks in fp32 (4 B per weight, fixed). The math per element is the stock one: logits in the weight's dtype,
softmax in fp32, the logits' gradient rounded to the weight's dtype before the two GEMMs. On CUDA the logits stay
bf16 (kernels.quant.xent_*: one read forward, one in-place pass backward, no fp32 copy). The extra cost is one
more logits GEMM (backward recomputes them)."""
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


def by_tokens(tokens: int, vocab: int) -> bool:
    """Whether backward walks chunks of tokens (an fp32 weight gradient, vocab x hidden) rather than vocabulary
    slices (an fp32 hidden-state gradient, tokens x hidden): the smaller of the two."""
    return tokens > vocab


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32, without rounding the product to a's dtype first."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _add_mm_fp32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32) += a @ b accumulated in fp32; on CUDA cuBLAS adds into out (no fp32 product of out's size)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out += torch.mm(a.float(), b.float())


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
        # d loss / d logits[i, v] = (softmax[i, v] - [v == target_i]) * scale_i
        scale = torch.where(keep, grad_out.float() / divisor, 0.0)
        need_h, need_w = ctx.needs_input_grad[:2]
        if by_tokens(hidden.shape[0], weight.shape[0]):
            return (*_backward_by_tokens(hidden, weight, safe, lse, scale, ctx.chunk, need_h, need_w),
                    None, None, None, None)
        vocab, rows = weight.shape[0], slice_rows(ctx.chunk, weight.shape[0], hidden.shape[0])
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


def _backward_by_tokens(hidden: torch.Tensor, weight: torch.Tensor, safe: torch.Tensor, lse: torch.Tensor,
                        scale: torch.Tensor, chunk: int, need_h: bool, need_w: bool):
    """(d hidden, d weight) chunk by chunk of tokens: the chunk's logits over the whole vocabulary, its rows of d
    hidden in one GEMM, d weight summed over chunks in fp32 and rounded once."""
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk]
        g = quant.xent_backward_(F.linear(h, weight), lse[s:s + chunk], safe[s:s + chunk], scale[s:s + chunk])
        if need_h:
            torch.mm(g, weight, out=grad_h[s:s + chunk])
        if need_w:
            _add_mm_fp32_(grad_w, g.t(), h)
        del g
    return grad_h, (grad_w.to(weight.dtype) if need_w else None)


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
