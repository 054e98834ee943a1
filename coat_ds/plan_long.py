"""Long context in the planner (coat_ds/plan.py): where a recomputed layer's input waits for backward
(coat.activation.checkpoint_store, activation/checkpoint_store.py), what the MLP keeps over sequence tiles
(coat.activation.tile_tokens, activation/tiled.py), what attention's backward holds untiled and over query tiles
(activation/tiled_attention.py), and the longest sequence a GPU takes. Bytes per token per
hidden unit unless said; held to benchmarks/results/long_context.json (tests/test_plan.py). Ulysses sequence
parallelism (--sp-size) over a node's GPUs: what each rank holds of the sequence and of attention's all-to-alls."""
from __future__ import annotations

from typing import Any, Callable

from .activation.config import CHECKPOINT_STORES
from .plan_shape import PlanError

GPU, GPU_FP8, HOST_FP8 = CHECKPOINT_STORES
RECOMPUTE_NOTE = ("activation checkpointing: each decoder layer keeps only its input (where: the next line) and "
                  "backward runs its forward again, one layer at a time (its activations counted once): about a third "
                  "more layer compute a step")
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


def tiles_attention(activation: Any, sp: int = 1) -> bool:
    """Whether attention's backward runs over query tiles (activation/tiled_attention.py): tile_tokens set in mode
    full with attention_fp8, and the stock sdpa or eager function (under Ulysses, `sp` > 1, the layer calls
    DeepSpeed's wrapper: tiled_call leaves it untiled). An activation object may say `tiles_attention = False`: a
    row measured before the tiled backward (tests/test_plan.py)."""
    return sp == 1 and tiled(activation) and activation.attention_fp8 and getattr(activation, "tiles_attention", True)


def tiles_final_norm(activation: Any) -> bool:
    """Whether the model's final norm runs over tiles (hf/final_norm.py): tile_tokens set, in any mode (hf/swap.inject
    tiles it). An activation object may say `tiles_final_norm = False`: a row measured before (tests/test_plan.py)."""
    return (activation is not None and activation.enabled and activation.tile_tokens is not None
            and getattr(activation, "tiles_final_norm", True))


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


def recomputed_layer(shape: Any, activation: Any, kept: float, sp: int = 1) -> float:
    """B/token/hidden the planner counts for the recomputed layer under checkpointing, `kept` being what the layer
    keeps (plan.layer_bytes). The count (with the loss backward's fp32 gradients beside it) was held to the
    long-context rows of the untiled attention backward, whose working set is where that peak is; tiling cuts it by
    attention_backward's difference, down to nothing above the loss backward's own peak (the final norm's fp32 saves
    and the chunked loss's fp32 gradient of the hidden states, which tiling does not touch). A sequence of one tile
    runs untiled: the cut is then overcounted by at most kept x tile_tokens x hidden bytes (0.3 GiB at 8B and 16,384),
    which no long-context plan is near. Under Ulysses (`sp` > 1) attention runs untiled, and its backward holds
    ulysses_backward more."""
    if sp > 1:
        return kept + ulysses_backward(shape, activation, sp)
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


def where_note(layers: int, activation: Any, hidden: int, sp: int = 1) -> str:
    """The command's line on where the checkpoints go, in KB a token (of the GPU's shard under Ulysses)."""
    store = store_of(activation)
    gpu, host = checkpoint_gpu(layers, activation) * hidden / 1e3, checkpoint_host(layers, activation) * hidden / 1e3
    tile = (f"; the MLP{' and attention' if tiles_attention(activation, sp) else ''} over tiles of "
            f"{activation.tile_tokens} tokens{' (not attention: Ulysses)' * (sp > 1)}") if tiled(activation) else ""
    shard = f" (a token of each GPU's 1/{sp} of the sequence: Ulysses)" if sp > 1 else ""
    return (f"checkpoints ({store!r} store): {gpu:.1f} KB a token on the GPU, {host:.1f} KB a token on the host"
            f"{shard}{tile}")


# ------------------------------------------------------------------ Ulysses sequence parallelism (--sp-size)
# DeepSpeed 0.19.8's UlyssesSPAttentionHF (runtime/sequence_parallel/ulysses_sp.py) over sp ranks: each rank runs
# everything but attention on its S/sp tokens, and all-to-alls q, k, v from [S/sp tokens, all heads] to [S tokens,
# heads/sp] and the output back. Every all-to-all keeps the values a rank holds: [S, heads/sp] is as many bytes as
# [S/sp, heads], so in bytes per token of the rank's shard per hidden unit (what the terms below are) a gathered q or
# output is `out` wide, k and v `ulysses_kv` (wider than kv only where DeepSpeed repeats a kv head over sp /
# kv_heads ranks). What grows is that the gathered tensors are new tensors beside the shard's.


def shard_tokens(job: Any, micro_batch: int) -> int:
    """Tokens a GPU holds of every sequence-long tensor but attention's all-to-alls: micro_batch x seq / sp."""
    return micro_batch * job.seq // job.sp


def ulysses_kv(shape: Any, sp: int) -> float:
    """k and v's width over hidden after the all-to-all, per token of the shard: each rank gets max(kv_heads / sp, 1)
    kv heads over S tokens (combine_sequence's repeat_interleave where sp > kv_heads)."""
    return 2 * shape.hd * max(shape.kv_heads, sp) / shape.hidden


def ulysses_kept(shape: Any, activation: Any, sp: int) -> float:
    """B/token/hidden a layer keeps under Ulysses beyond plan.layer_bytes (per token of the shard). With attention_fp8,
    none: Fp8AttentionFn saves the q, k, v the layer hands it, the shard's before the all-to-all (attention.py; the
    call is the wrapper), and recomputes the output. Otherwise the backend saves the gathered q, k, v and output,
    as many bytes as the shard's but k and v at ulysses_kv's width; and o_proj's input, the output after the
    all-to-all back, is a tensor of its own (2 out) where the flow keeps attention's output as o_proj's operand (the
    stock layers, coat's full mode; linear mode saves its FP8 copy either way)."""
    if sp == 1 or (activation is not None and activation.enabled and activation.attention_fp8):
        return 0.0
    out, kv = shape.hd * shape.heads / shape.hidden, 2 * shape.hd * shape.kv_heads / shape.hidden
    linear = activation is not None and activation.enabled and activation.mode == "linear"
    return 2 * (ulysses_kv(shape, sp) - kv) + (0.0 if linear else 2 * out)


def ulysses_backward(shape: Any, activation: Any, sp: int) -> float:
    """B/token/hidden (of the shard) Ulysses adds to the recomputed layer's attention backward at its peak, the
    backend's backward (dq, dk, dv and its scratch allocated), over what it holds without SP. With attention_fp8:
    the gathered bf16 q, k, v the backend saved beside the shard's dequantized ones (2 (out + kv')), the gathered
    output beside the call's own (2 out), the gathered gradient of the output beside do (2 out), and dk, dv at the
    repeated width (2 (kv' - kv)). Otherwise the saved q, k, v and outputs are ulysses_kept's: the gathered gradient
    of the output and the wider dk, dv. The all-to-alls' other copies (reshape, rearrange, the exchange's output
    buffer: two of one tensor at a time) are freed before the backend's backward and are smaller than it."""
    if sp == 1:
        return 0.0
    out, kv = shape.hd * shape.heads / shape.hidden, 2 * shape.hd * shape.kv_heads / shape.hidden
    wide = ulysses_kv(shape, sp)
    grads = 2 * out + 2 * (wide - kv)
    if activation is not None and activation.enabled and activation.attention_fp8:
        return grads + 2 * (out + wide) + 2 * out
    return grads


def check_sp(sp: int, world: int, shape: Any, seq: int) -> None:
    """--sp-size: PlanError in one line naming the key and the sizes allowed where the main job refuses it
    (sequence_parallel.refusal, the rule workloads.cli.check_sp_size runs): sp divides the world, the query heads and
    the sequence, and divides the key/value heads or is a multiple of them."""
    from .deepspeed.sequence_parallel import refusal

    why = refusal(sp, world, shape.heads, shape.kv_heads, seq)
    if why is not None:
        raise PlanError(why)


def sp_title(seq: int, sp: int) -> str:
    """The table title's words on Ulysses ("" without)."""
    return f"; Ulysses SP: {sp} GPUs a sample, {seq // sp:,} tokens a GPU" if sp > 1 else ""


def longest_line(n: int, world: int, memory: float, sp: int, host: float, gpus_per_node: int) -> str:
    """The command's --longest line: `n` tokens at micro-batch 1 on GPUs of `memory` bytes, with Ulysses' share a GPU
    and the host (`host` bytes per rank at that length) per rank and per node."""
    gib = 2 ** 30
    line = f"longest sequence at micro-batch 1 on {world} GPU(s) of {memory / gib:.1f} GiB: {n:,} tokens"
    if sp > 1:
        line += f" (Ulysses over {sp} GPUs: {n // sp:,} a GPU)"
    if host:
        line += f"; host at that length {host / gib:.1f} GiB a rank, {host * gpus_per_node / gib:.1f} a node " \
                f"({gpus_per_node} ranks)"
    return line
