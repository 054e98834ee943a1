"""The chunked linear + cross-entropy (coat_ds.activation.loss) against the stock loss and its gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coat_ds.activation.loss import IGNORE_INDEX, LossConfig, by_tokens, linear_cross_entropy


def _inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int, ignored: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * 2).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = IGNORE_INDEX
    return h, w, t


def _loss_and_grads(fn, h, w, t, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, t, **kw)
    g_out = torch.tensor(1.7)  # a non-unit upstream gradient (loss scaling, a weighted sum of losses)
    (loss * g_out).backward()
    return loss.detach(), h.grad, w.grad


def stock(h, w, t, num_items_in_batch=None, ignore_index=IGNORE_INDEX):
    """HF's fixed_cross_entropy over the logits of an nn.Linear lm_head, upcast as HF does."""
    logits = F.linear(h, w).float()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, t, ignore_index=ignore_index)
    return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


def _check_close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element within the rounding of `dtype` at the tensor's scale; NaN never passes."""
    assert torch.isfinite(ours).all() and torch.isfinite(ref).all()
    assert ours.dtype == ref.dtype
    scale = ref.abs().max().float().clamp_min(1e-30)
    tol = (1e-5 if dtype == torch.float32 else 2 ** -7) * scale
    err = (ours.float() - ref.float()).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} > {tol.item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("vocab", [300, 30])   # backward by vocabulary slices (300 rows: they do not divide it); by
def test_loss_and_gradients_match_the_stock_loss(dtype, chunk, vocab):   # token chunks (50 tokens > 30 entries)
    assert by_tokens(50, vocab) == (vocab == 30)
    h, w, t = _inputs(n=50, hidden=32, vocab=vocab, dtype=dtype, seed=chunk)
    ours = _loss_and_grads(linear_cross_entropy, h, w, t, chunk_tokens=chunk)
    ref = _loss_and_grads(stock, h, w, t)
    for a, b in zip(ours, ref):
        _check_close(a, b, dtype)


@pytest.mark.parametrize("vocab", [1000, 40])
def test_bf16_error_is_no_larger_than_the_stock_bf16_error(vocab):
    """Both against a float64 evaluation of the same bf16 inputs: chunking adds no error of its own."""
    h, w, t = _inputs(n=96, hidden=64, vocab=vocab, dtype=torch.bfloat16, seed=3)
    exact = _loss_and_grads(stock, h.double(), w.double(), t)
    ours = _loss_and_grads(linear_cross_entropy, h, w, t, chunk_tokens=16)
    ref = _loss_and_grads(stock, h, w, t)
    for o, r, e in zip(ours, ref, exact):
        err_ours = (o.double() - e).abs().max()
        err_stock = (r.double() - e).abs().max()
        assert err_ours <= 1.5 * err_stock + 1e-6 * e.abs().max(), (err_ours, err_stock)


def test_num_items_in_batch_sums_and_divides_like_hf():
    h, w, t = _inputs(n=40, hidden=16, vocab=90, dtype=torch.float32, seed=5)
    for items in (123, torch.tensor(123)):
        ours = _loss_and_grads(linear_cross_entropy, h, w, t, num_items_in_batch=items, chunk_tokens=8)
        ref = _loss_and_grads(stock, h, w, t, num_items_in_batch=items)
        for a, b in zip(ours, ref):
            _check_close(a, b, torch.float32)


def test_other_ignore_index_and_all_ignored():
    h, w, t = _inputs(n=20, hidden=8, vocab=30, dtype=torch.float32, seed=6, ignored=0.0)
    t[::3] = 7
    ours = _loss_and_grads(linear_cross_entropy, h, w, t, ignore_index=7, chunk_tokens=4)
    ref = _loss_and_grads(stock, h, w, t, ignore_index=7)
    for a, b in zip(ours, ref):
        _check_close(a, b, torch.float32)
    none = torch.full_like(t, IGNORE_INDEX)
    assert torch.isnan(linear_cross_entropy(h, w, none)) and torch.isnan(stock(h, w, none))  # 0 / 0, as stock


@pytest.mark.parametrize("vocab", [40, 16])
def test_batched_hidden_and_no_weight_gradient(vocab):
    h, w, t = _inputs(n=24, hidden=8, vocab=vocab, dtype=torch.float32, seed=7)
    hb = h.reshape(2, 12, 8).clone().requires_grad_()
    loss = linear_cross_entropy(hb, w, t.reshape(2, 12), chunk_tokens=5)   # w: no gradient wanted
    loss.backward()
    ref_h = h.clone().requires_grad_()
    stock(ref_h, w, t).backward()
    _check_close(loss.detach(), stock(h, w, t), torch.float32)
    _check_close(hb.grad.reshape(24, 8), ref_h.grad, torch.float32)


def test_config_defaults_and_one_line_errors():
    assert LossConfig.from_dict(None) == LossConfig(chunked=True, chunk_tokens=1024)
    assert LossConfig.from_dict({"chunked": False}).chunked is False
    for bad, key in (({"chunk": 3}, "coat.loss.chunk: unknown key"), ({"chunk_tokens": 0}, "coat.loss.chunk_tokens=0"),
                     ({"chunk_tokens": True}, "coat.loss.chunk_tokens=True"), ({"chunked": "yes"}, "coat.loss.chunked"),
                     ([1], "coat.loss=[1] is invalid")):
        with pytest.raises(ValueError, match="^" + key.replace("[", r"\[").replace("]", r"\]")) as exc:
            LossConfig.from_dict(bad)
        assert "\n" not in str(exc.value) and "allowed" in str(exc.value)


@pytest.mark.gpu
def test_cuda_bf16_matches_stock_and_holds_less_memory():
    """On the GPU (fp32-output GEMM for the hidden-state gradient): the stock loss's values within bf16
    rounding, and a peak well under the stock one (its fp32 logits and log-softmax)."""
    n, hidden, vocab, chunk = 4096, 1024, 32000, 512
    h, w, t = (x.cuda() for x in _inputs(n, hidden, vocab, torch.bfloat16, seed=11))
    peaks = {}
    results = {}
    for name, fn, kw in (("stock", stock, {}), ("chunked", linear_cross_entropy, {"chunk_tokens": chunk})):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results[name] = _loss_and_grads(fn, h, w, t, **kw)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    for a, b in zip(results["chunked"], results["stock"]):
        _check_close(a, b, torch.bfloat16)
    logits_bytes = n * vocab * 4
    assert peaks["stock"] > 2 * logits_bytes               # its fp32 logits and their log-softmax, at least
    assert peaks["chunked"] < peaks["stock"] / 3, peaks


@pytest.mark.gpu
def test_cuda_past_the_vocabulary_backward_holds_the_bf16_hidden_gradient_only():
    """More tokens than vocabulary entries: backward walks token chunks, holding the hidden-state gradient in bf16
    (what it returns) and the weight's in fp32, not an fp32 hidden-state gradient and a product as large (8 B a
    token a hidden unit); the stock loss's values within bf16 rounding."""
    n, hidden, vocab, chunk = 65536, 2048, 2048, 1024
    h, w, t = (x.cuda() for x in _inputs(n, hidden, vocab, torch.bfloat16, seed=12))
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hg, wg, t, chunk_tokens=chunk)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    (loss * 1.7).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 2 * n * hidden + 6 * vocab * hidden + 8 * chunk * vocab + (32 << 20)
    assert peak <= bound < 8 * n * hidden / 2, (peak, bound)
    for a, b in zip((loss.detach(), hg.grad, wg.grad), _loss_and_grads(stock, h, w, t)):
        _check_close(a, b, torch.bfloat16)
