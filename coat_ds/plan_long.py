"""Long context in the planner (coat_ds/plan.py): where a recomputed layer's input waits for backward
(coat.activation.checkpoint_store, activation/checkpoint_store.py), what the MLP keeps over sequence tiles
(coat.activation.tile_tokens, activation/tiled.py), what attention's backward holds untiled and over query tiles
(activation/tiled_attention.py), the moments where such a step peaks (layer_moments), and the longest sequence a GPU
takes. Bytes per token per hidden unit unless said; held to benchmarks/results/long_context.json
(tests/test_plan.py). Ulysses sequence parallelism (--sp-size) over a node's GPUs: what each rank holds of the
sequence and of attention's all-to-alls."""
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


def cudnn_tiles(activation: Any) -> bool:
    """Whether causal query tiles run as cuDNN calls (tiled_attention.CausalParts, 8d9e05a: CUDA with cuDNN's SDPA,
    the GPUs planned here), whose GQA backward expands no dk, dv; before, FlashAttention-2's did. An activation
    object may say `cudnn_tiles = False`: a row measured before (tests/test_plan.py)."""
    return getattr(activation, "cudnn_tiles", True)


def attention_backward(shape: Any, activation: Any) -> tuple[float, float]:
    """(untiled, tiled) B/token/hidden of what the recomputed layer's attention backward (Fp8AttentionFn) holds
    sequence-long, besides what the layer keeps. Untiled: bf16 q, k, v dequantized, the recomputed output o and do,
    dq/dk/dv, and FlashAttention's scratch: its fp32 dq accumulator and, under GQA, dk and dv expanded to every query
    head. Tiled (tiles much shorter than the sequence): k and v, their fp32 sums, dq, dk and dv as returned, and what
    one kv head's call over all keys holds at the last tile: its dk, dv (and FlashAttention-2's expanded ones; not
    cuDNN's, cudnn_tiles: on an H200 at 524,288 tokens attention's backward held 0.5 B/token/hidden less than with
    them); the tile's own q, o, do and dq (tile_tokens x their widths) are below the MLP tile's transients and never
    coexist with them."""
    h, hd = shape.hidden, shape.hd
    out, kv = hd * shape.heads / h, 2 * hd * shape.kv_heads / h      # o's width, k and v's together, over hidden
    gqa = shape.kv_heads < shape.heads
    expanded = 2 * 2 * out if gqa else 0.0                            # bf16 dk, dv at every query head
    untiled = 2 * (out + kv) + 2 * out + 2 * out + 2 * (out + kv) + 4 * out + expanded + 4 * shape.heads / h
    calls = shape.kv_heads if gqa else 1                              # tiled_attention.head_groups
    tiled = 2 * kv + 4 * kv + 2 * out + 2 * kv + ((0.0 if cudnn_tiles(activation) else expanded) + 2 * kv) / calls
    return untiled, tiled


def recomputed_layer(shape: Any, activation: Any, kept: float, sp: int = 1) -> float:
    """B/token/hidden the planner counts for the recomputed layer under checkpointing where it does not follow the
    step moment by moment (follows_moments: untiled MLPs, experts, bf16 attention), counted in every phase: what
    the layer keeps (`kept`, plan.layer_bytes), standing for its backward's working set (not counted itself);
    attention's query tiles cut it by attention_backward's difference, down to nothing; under Ulysses (`sp` > 1)
    attention runs untiled and its backward holds ulysses_backward more."""
    if sp > 1:
        return kept + ulysses_backward(shape, activation, sp)
    if not tiles_attention(activation):
        return kept
    untiled, tiled = attention_backward(shape, activation)
    return max(kept - (untiled - tiled), 0.0)


# ------------------------------------------------------------------ the long-context step, moment by moment
# Checkpointed layers in mode full with the MLP over tiles and FP8 attention (dense): plan.phases plans each moment
# where such a step can peak, from the tensors alive there (B/token/hidden, and bytes that do not grow with the
# sequence), in place of one layer's activations counted in every phase. Checked against long_context.json's rows
# and a phase probe of 2 layers at 262,144 tokens (docs/plan.md, "Long context").
STEP_INT64 = 3            # int64 a token alive through the step: the input ids, the labels, the position ids
STOCK_NORM_SAVES = 6.0    # HF's RMSNorm keeps its fp32 input (4) and its bf16 normed output (2) for backward
# ... and its backward allocates 18 more beyond them at its peak (the fp32 gradient of its input, the products of
# the mean's and the power's backward: counted under a TorchDispatchMode on the CPU, 17.98; 17.96 on the H200)
STOCK_NORM_BACKWARD = 18.0


def follows_moments(shape: Any, activation: Any, checkpoint: bool) -> bool:
    """Whether plan.phases follows the step moment by moment (layer_moments): checkpointed dense layers in mode full,
    the MLP over tiles, FP8 attention (tiled or not: Ulysses' is not). Elsewhere one layer's activations are counted
    in every phase (plan.activation_bytes)."""
    return checkpoint and tiled(activation) and activation.attention_fp8 and shape.experts is None


def lean_recompute(activation: Any) -> bool:
    """Whether the layer frees its fused q/k/v output before attention and a recompute skips its tiled MLP (789098a).
    An activation object may say `lean_recompute = False`: a row measured before (tests/test_plan.py)."""
    return getattr(activation, "lean_recompute", True)


def fetches_after_recompute(activation: Any) -> bool:
    """Whether "host_fp8" starts the next layer's fetch once this layer's recompute has ended (checkpoint_store's
    Fp8Store._recompute; before, as it began). An activation object may say `fetches_after_recompute = False`."""
    return getattr(activation, "fetches_after_recompute", True)


def reduces_from_input(activation: Any) -> bool:
    """Whether ZeRO-3 reduces a coat layer's gradients from its input (deepspeed/zero/leaf_hooks.py), holding
    nothing; before, torch's full backward hook kept the layer's output gradient through its backward (leaf_hook
    in layer_moments). An activation object may say `reduces_from_input = False`: a row measured before."""
    return getattr(activation, "reduces_from_input", True)


def frees_qkv_grad(activation: Any) -> bool:
    """Whether the q/k/v projection's backward frees the fused q/k/v gradient once quantized (NormLinearFn's
    owns_grad). An activation object may say `frees_qkv_grad = False`: a row measured before (tests/test_plan.py)."""
    return getattr(activation, "frees_qkv_grad", True)


def step_inputs(shape: Any) -> float:
    """B/token/hidden alive through the whole step besides the activations: HF's rotary cos and sin (bf16, head_dim
    wide each; every checkpointed layer keeps them as inputs) and STEP_INT64's int64 tensors."""
    return (2 * 2 * shape.hd + 8 * STEP_INT64) / shape.hidden


def checkpoint_kept(layers: int, activation: Any, phase: str) -> float:
    """B/token/hidden the checkpoints hold on the GPU (beside the layer at work) in a `phase` of the step: "forward"
    (at the last layer: "gpu" every layer's bf16 input, the embeddings' output among them; the FP8 stores the codes
    of every layer so far ("gpu_fp8") and the embeddings' output, which the model's forward keeps, and the running
    layer's input, 2 each), "loss" (the loss and the final norm: "gpu" every input, "gpu_fp8" every layer's codes,
    "host_fp8" none), "recompute" (as "loss") or "layer" (a layer's backward: "host_fp8" also the next layer's
    codes, fetched once this one's recompute has ended; the recomputed layer's dequantized input is the recompute's
    own, layer_moments)."""
    store, f8 = store_of(activation), fp8_input(activation)
    if store == GPU:
        return layers * CHECKPOINT_INPUT
    codes = layers * f8 if store == GPU_FP8 else (f8 if phase == "layer" and layers > 1 else 0.0)
    return codes + (CHECKPOINT_INPUT * min(layers, 2) if phase == "forward" else 0.0)


def mlp_tile_forward(shape: Any, activation: Any, rows: int) -> float:
    """Bytes of one MLP tile's forward of `rows` tokens (MlpFn, at its gate/up quantization): the norm's FP8 input,
    exponents and fp32 rstd, the bf16 gate/up output and its FP8 codes with exponents; and the FP8 weight operands
    held over the tiles (gate/up and down, row-major)."""
    h, i, g = shape.hidden, shape.intermediate, activation.group_size
    return rows * (h * (1 + 1 / g) + 4 + 4 * i + 2 * i * fp8_input(activation)) + 3 * h * i


def mlp_tile_backward(shape: Any, activation: Any, rows: int) -> float:
    """Bytes of TiledMlpFn's backward besides the sequence-long tensors, at its peak (a tile's gate/up gradient
    quantized): the tile's recomputed MlpFn saves (FP8 norm input, exponents, rstd; FP8 gate/up, exponents), the
    bf16 gate/up gradient and its two E5M2 copies (row-major, transposed), the norm's input gradient from the
    gate/up GEMM and the tile's output (bf16, h wide each); down's bf16 weight gradient of the tile, the fp32 sums of
    every weight's gradient (gate, up, down; the norm's), the FP8 weight operands in both layouts."""
    h, i, g = shape.hidden, shape.intermediate, activation.group_size
    saves = h * (1 + 1 / g) + 4 + 2 * i * fp8_input(activation)
    return rows * (saves + 4 * i + 4 * i + 2 * h + 2 * h) + h * i * (2 + 4 * 3 + 2 * 3) + 4 * h


def layer_moments(shape: Any, activation: Any, kept: float, layers: int, tokens: int, seq: int,
                  sp: int = 1, leaf_hook: bool = False) -> dict[str, tuple[float, float]]:
    """Per moment of a decoder layer's step where it can peak, (B/token/hidden, bytes that do not grow with the
    sequence), for follows_moments' flow: `kept` what the layer keeps (plan.layer_bytes: its norms' and attention's
    saves and the MLP's bf16 input h), `tokens` the GPU's (micro-batch x seq / sp), `seq` a sample's (attention's
    query tiles); `leaf_hook`: ZeRO-3 before its reduce fired from the layer's input (reduces_from_input), when
    DeepSpeed's full backward hook on each coat layer kept the layer's output gradient (2) from its arrival to the
    layer's input gradient: through attention's and the q/k/v projection's backward too (measured on an H200 at
    524,288 tokens; under ZeRO-1/2, and since, it is freed after the MLP's backward: tests/test_inject_zero3.py).
    Every moment holds the checkpoints (checkpoint_kept) and step_inputs. Widths over hidden: out (attention's output,
    q), kv (k and v), qkv = 2 (out + kv) the bf16 q, k, v (as wide as the fused projection)."""
    h, g = shape.hidden, activation.group_size
    out, kv = shape.hd * shape.heads / h, 2 * shape.hd * shape.kv_heads / h
    qkv, f8 = 2 * (out + kv), fp8_input(activation)
    codes = (out + kv) * f8                       # Fp8AttentionFn's saves: E4M3 q, k, v and their exponents
    norm1 = 1 + 1 / g + 4 / h                     # NormLinearFn's saves: the input norm's FP8 input, exponents, rstd
    base = step_inputs(shape)
    fwd, bwd = (base + checkpoint_kept(layers, activation, p) for p in ("forward", "layer"))
    rec = base + checkpoint_kept(layers, activation, "recompute" if fetches_after_recompute(activation) else "layer")
    held = 0.0 if lean_recompute(activation) else qkv   # before 789098a the fused q/k/v output lived to the layer's end
    dout = 2.0 if leaf_hook else 0.0                      # the layer's output gradient past the MLP's backward
    deq = CHECKPOINT_INPUT if store_of(activation) != GPU else 0.0   # the recomputed layer's input, dequantized
    rows = min(activation.tile_tokens, tokens)
    o_proj = out * h * h                          # o_proj's FP8 weight operand
    untiled, tiled_bw = attention_backward(shape, activation)
    if tiles_attention(activation, sp) and seq > activation.tile_tokens:   # tiled_call: one tile runs untiled
        gqa = shape.kv_heads < shape.heads
        # a query tile's own: its bf16 q, the calls' outputs (and their concatenation under GQA), o's FP8 copy, dh's
        # rows in E5M2 twice, do; o_proj's fp32 weight-gradient sum and the tile's part
        tile = min(activation.tile_tokens, seq) * h * (2 * out + 2 * out * (1 + gqa) + out + 2 + 2 * out)
        attention = (out * f8 + tiled_bw, tile + 8 * o_proj)    # q's codes stay (each tile dequantizes its rows)
    else:       # the codes dequantized whole and freed; o_proj's transposed operand and bf16 weight gradient
        attention = (untiled + ulysses_backward(shape, activation, sp), 3 * o_proj)
    moments = {
        # the running layer's attention, at its saves (quant_heads): q, k, v, o_proj's output h (+ the residual)
        "forward": (fwd + held + qkv + 2 + codes, o_proj),
        # its MLP over tiles: h and the output being written, one tile's forward
        "forward (MLP)": (fwd + held + 2 + 2, mlp_tile_forward(shape, activation, rows)),
        # the recompute at attention's saves: the layer's output gradient (dout), its input dequantized (the FP8
        # stores), its saves so far (kept, h made now), q, k, v
        "recompute": (rec + 2 + deq + kept + qkv + held, o_proj),
        # TiledMlpFn's backward: dout, what the layer keeps (h among it), dh; one tile's transients
        "MLP backward": (bwd + 2 + kept + 2, mlp_tile_backward(shape, activation, rows)),
        # Fp8AttentionFn's backward: dh (o_proj's output gradient, the residual's too), the norms' saves, what the
        # attention's backward holds (plan_long.attention_backward; Ulysses' exchange: ulysses_backward)
        "attention backward": (bwd + 2 + dout + (kept - TILED_MLP_INPUT - codes) + attention[0], attention[1]),
        # NormLinearFn's backward (q/k/v projection): dh (waiting to be summed into the layer input's gradient), the
        # norm's saves, its FP8 normed input rebuilt transposed (1), dqkv's two E5M2 copies (qkv / 2 each), and either
        # RopeFn's bf16 dqkv as they are made or, once it is freed (frees_qkv_grad), the input-gradient GEMM's bf16
        # output (2; before, both); the weight's transposed operand and gradient
        "q/k/v backward": (bwd + 2 + dout + norm1 + 1 + qkv + (max(qkv, 2) if frees_qkv_grad(activation) else qkv + 2),
                           3 * (out + kv) * h * h),
    }
    if not lean_recompute(activation):   # the recompute ran the tiled MLP too: h, its output and one tile's forward
        moments["recompute (MLP)"] = (rec + 2 + deq + kept + held + 2, mlp_tile_forward(shape, activation, rows))
    return moments


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
