"""Long context in the planner (coat_ds/plan.py): where a recomputed layer's input waits for backward
(coat.activation.checkpoint_store, activation/checkpoint_store.py), what the MLP keeps over sequence tiles
(coat.activation.tile_tokens, activation/tiled.py), what attention's backward holds untiled and over query tiles
(activation/tiled_attention.py), and the longest sequence a GPU takes. Bytes per token per
hidden unit unless said; held to benchmarks/results/long_context.json (tests/test_plan.py)."""
from __future__ import annotations

from typing import Any, Callable

from .activation.config import CHECKPOINT_STORES

GPU, GPU_FP8, HOST_FP8 = CHECKPOINT_STORES
CHECKPOINT_INPUT = 2.0   # B/token/hidden a checkpointed layer keeps: its bf16 input (what torch's checkpoint saves)
TILED_MLP_INPUT = 2.0    # what TiledMlpFn saves: its bf16 input h (the MLP's norm and FP8 operands are recomputed)


def store_of(activation: Any) -> str:
    """The checkpoint store of an activation config ("gpu" for the stock layers: HF's checkpoint)."""
    return activation.checkpoint_store if activation is not None else GPU


def fp8_input(activation: Any) -> float:
    """One layer input in the FP8 stores' format: E4M3 codes and one uint8 exponent a group (quant_heads)."""
    return 1 + 1 / activation.group_size


def checkpoint_gpu(layers: int, activation: Any) -> float:
    """What every layer's kept input holds on the GPU in backward: "gpu" the bf16 input; the FP8 stores the bf16
    input dequantized for the layer being recomputed (Fp8Store.unpack) and FP8 codes: "gpu_fp8" every layer's,
    "host_fp8" only the next layer's, fetched back while this one is recomputed (unpack prefetches p.prev)."""
    store = store_of(activation)
    if store == GPU:
        return layers * CHECKPOINT_INPUT
    return CHECKPOINT_INPUT + (layers if store == GPU_FP8 else 1) * fp8_input(activation)


def checkpoint_host(layers: int, activation: Any) -> float:
    """What the host keeps per GPU: every layer's FP8 input under "host_fp8" (pinned pool buffers, each rounded up
    by at most a sixteenth: HostPool), else nothing."""
    return layers * fp8_input(activation) if store_of(activation) == HOST_FP8 else 0.0


def tiled(activation: Any) -> bool:
    """Whether the MLP runs over tiles: tile_tokens set in mode full (the only flow that calls tiled.mlp)."""
    return (activation is not None and activation.enabled and activation.mode == "full"
            and activation.tile_tokens is not None)


def tile_bytes(intermediate: int, activation: Any, tokens: int) -> float:
    """Bytes (not per hidden unit) of one MLP tile in TiledMlpFn's backward, besides the sequence-long tensors:
    the recomputed MlpFn's saved FP8 gate/up with their exponents (2 (1 + 1/g) B per intermediate unit) and their
    bf16 gradient (4 B), for min(tile_tokens, tokens) tokens."""
    if not tiled(activation):
        return 0.0
    return min(activation.tile_tokens, tokens) * intermediate * (2 * fp8_input(activation) + 4)


def tiles_attention(activation: Any) -> bool:
    """Whether attention's backward runs over query tiles (activation/tiled_attention.py): tile_tokens set in mode
    full with attention_fp8 (the stock sdpa or eager function; the planner does not see Ulysses' wrapper). An
    activation object may say `tiles_attention = False`: a row measured before the tiled backward
    (tests/test_plan.py)."""
    return tiled(activation) and activation.attention_fp8 and getattr(activation, "tiles_attention", True)


def attention_backward(shape: Any, activation: Any) -> tuple[float, float]:
    """(untiled, tiled) B/token/hidden of what the recomputed layer's attention backward (Fp8AttentionFn) holds
    sequence-long, besides what the layer keeps. Untiled: bf16 q, k, v dequantized, the recomputed output o and do,
    dq/dk/dv, and FlashAttention's scratch: its fp32 dq accumulator and, under GQA, dk and dv expanded to every query
    head. Tiled (tiles much shorter than the sequence): k and v, their fp32 sums, dq, dk and dv as returned, and the
    scratch of one kv head's call over all keys at the last tile (its expanded dk, dv and its dk, dv); the tile's own
    q, o, do and dq (tile_tokens x their widths) are below the MLP tile's transients and never coexist with them."""
    h, hd = shape.hidden, shape.hd
    out, kv = hd * shape.heads / h, 2 * hd * shape.kv_heads / h      # o's width, k and v's together, over hidden
    gqa = shape.kv_heads < shape.heads
    expanded = 2 * 2 * out if gqa else 0.0                            # bf16 dk, dv at every query head
    untiled = 2 * (out + kv) + 2 * out + 2 * out + 2 * (out + kv) + 4 * out + expanded + 4 * shape.heads / h
    calls = shape.kv_heads if gqa else 1                              # tiled_attention.head_groups
    tiled = 2 * kv + 4 * kv + 2 * out + 2 * kv + (expanded + 2 * kv) / calls
    return untiled, tiled


def recomputed_layer(shape: Any, activation: Any, kept: float) -> float:
    """B/token/hidden the planner counts for the recomputed layer under checkpointing, `kept` being what the layer
    keeps (plan.layer_bytes). The count (with the loss backward's fp32 gradients beside it) was held to the
    long-context rows of the untiled attention backward, whose working set is where that peak is; tiling cuts it by
    attention_backward's difference, down to nothing above the loss backward's own peak (the final norm's fp32 saves
    and the chunked loss's fp32 gradient of the hidden states, which tiling does not touch). A sequence of one tile
    runs untiled: the cut is then overcounted by at most kept x tile_tokens x hidden bytes (0.3 GiB at 8B and 16,384),
    which no long-context plan is near."""
    if not tiles_attention(activation):
        return kept
    untiled, tiled = attention_backward(shape, activation)
    return max(kept - (untiled - tiled), 0.0)


def largest(fits: Callable[[int], bool], most: int = 1 << 26) -> int:
    """The largest n <= ~most that `fits` accepts (0: not even 1), by doubling then bisection; `fits` must be
    monotone (a micro-batch, a sequence length: every planned term grows with them)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= most and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def where_note(layers: int, activation: Any, hidden: int) -> str:
    """The command's line on where the checkpoints go, in KB a token."""
    store = store_of(activation)
    gpu, host = checkpoint_gpu(layers, activation) * hidden / 1e3, checkpoint_host(layers, activation) * hidden / 1e3
    tile = (f"; the MLP{' and attention' if tiles_attention(activation) else ''} over tiles of "
            f"{activation.tile_tokens} tokens") if tiled(activation) else ""
    return (f"checkpoints ({store!r} store): {gpu:.1f} KB a token on the GPU, {host:.1f} KB a token on the host"
            f"{tile}")
