"""Ulysses sequence parallelism with coat's FP8 decoder layers: DeepSpeed's ALST pieces
(deepspeed.runtime.sequence_parallel.ulysses_sp), through plain deepspeed.initialize.

Each rank of a sequence-parallel (SP) group holds 1/sp of every sample's tokens. DeepSpeed's
`UlyssesSPAttentionHF.register_with_transformers` replaces an attention implementation in transformers'
ALL_ATTENTION_FUNCTIONS ("sdpa": for every sdpa model of the process) by a wrapper that all-to-alls q, k, v from
[local tokens, all heads] to [all tokens, heads / sp], runs the stock function, and all-to-alls the output back.
CoatDecoderLayer calls that table by the config's implementation, so its FP8 projections, norms, RoPE and MLP run
on the rank's tokens and only attention sees the whole sequence; with `activation.attention_fp8` the wrapped call
runs inside Fp8AttentionFn, whose backward runs it again from the FP8 q, k, v (its all-to-alls again, in the same
layer order on every rank). What coat needs of the rest:

- `shard`: the rank's tokens with their global position ids (what UlyssesSPDataLoaderAdapter hands each rank,
  without its gathers): HF's rotary embedding is computed per shard from them, and Ulysses gathers them to restore
  the causal order, so the decoder layer hands them to the attention call as the stock layer does;
- `mean_loss`: each rank's loss (coat's chunked loss on its shard: `shift_labels` are its own targets) averaged over
  the SP group's kept tokens as DeepSpeed's recipe does, its backward seeded so that the engine steps on one GPU's
  gradient (`shard_weight`: DeepSpeed 0.19.8 divides an SP group's gradient sum by world / sp under ZeRO-1/2 and by
  the world under ZeRO-3's reduce-scatter; the recipe's gradient is sp times one GPU's under ZeRO-1/2);
- the mpu `register` returns goes to deepspeed.initialize(mpu=...): ZeRO partitions, reduces and clips over every
  rank of the job; coat's ZeRO glue (partition layouts, release, host states) runs on DeepSpeed's groups and
  reductions, so it is unchanged.

HF Trainer and accelerate (`ParallelismConfig(sp_size=N, sp_backend="deepspeed")`) wire the same pieces themselves:
Accelerator.prepare registers the attention, wraps the data loader and passes the mpu, Trainer.compute_loss
averages the shards' losses. `refusal` says in one line what cannot run, before any model memory.
"""
from __future__ import annotations

from typing import Any

import torch

from ..activation.loss import IGNORE_INDEX

KEY = "--sp-size"
# The implementations Ulysses wraps for HF (DeepSpeed refuses eager: it materialises a full-sequence 4D mask)
WRAPPED = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def allowed_sizes(world: int, heads: int, kv_heads: int, seq_len: int) -> list[int]:
    """The SP sizes a job of `world` ranks can run: dividing the world, the query heads and the sequence, and the
    key/value heads or divided by them (DeepSpeed then repeats each kv head over sp / kv_heads ranks)."""
    return [n for n in range(1, world + 1) if world % n == 0 and heads % n == 0 and seq_len % n == 0
            and (kv_heads % n == 0 or n % kv_heads == 0)]


def refusal(sp_size: int, world: int, heads: int, kv_heads: int, seq_len: int, key: str = KEY) -> str | None:
    """Why `sp_size` cannot run (one line naming the key and the allowed values), or None."""
    ok = allowed_sizes(world, heads, kv_heads, seq_len)
    if sp_size in ok:
        return None
    if sp_size < 1:
        why = "is invalid"
    elif world % sp_size:
        why = f"does not divide the world size ({world} ranks)"
    elif heads % sp_size:
        why = f"does not divide the model's {heads} attention heads"
    elif kv_heads % sp_size and sp_size % kv_heads:
        why = f"neither divides nor is a multiple of the model's {kv_heads} key/value heads"
    else:
        why = f"does not divide --seq-len={seq_len}"
    return f"{key}={sp_size} {why}; allowed: {ok}"


def attention_refusal(model: torch.nn.Module, seq_len: int, key: str = KEY) -> str | None:
    """Why Ulysses cannot wrap `model`'s attention (one line), or None: an implementation it does not wrap, or a
    sliding window shorter than the sequence under a backend that takes the window from the mask (Ulysses drops
    masks: the window would be lost)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in WRAPPED:
        return f"{key} needs an attention implementation Ulysses wraps; this model's is {impl!r}; allowed: " \
               f"{list(WRAPPED)} (attn_implementation)"
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if impl in ("sdpa", "flex_attention") and window is not None and window < seq_len:
        return (f"{key} with {impl} attention drops the mask that holds this model's sliding window ({window} < "
                f"--seq-len={seq_len}); allowed: attn_implementation 'flash_attention_2' or 'flash_attention_3', "
                f"or --seq-len <= {window}")
    return None


def register(model: torch.nn.Module, sp_size: int, micro_batch: int, seq_len: int | None = None):
    """Ulysses over groups of `sp_size` consecutive ranks for `model` (an HF model, its FP8 layers swapped in or
    not): register_with_transformers on the model's own implementation; the mpu for deepspeed.initialize(mpu=...),
    None where sp_size is 1. Once per process (DeepSpeed's groups are global). `seq_len`: the global length where
    every batch has it (a fixed shape), else variable."""
    if sp_size == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=cfg._attn_implementation, sequence_parallel_size=sp_size,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=seq_len is None)


def shard(mpu, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's sequence shard of each [batch, seq, ...] tensor (the same samples on every rank of its SP
    group), then their global position ids [batch, seq / sp]."""
    size, rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
    batch, seq = tensors[0].shape[:2]
    chunk = seq // size
    mine = slice(rank * chunk, (rank + 1) * chunk)
    positions = torch.arange(rank * chunk, (rank + 1) * chunk, device=tensors[0].device).expand(batch, chunk)
    return (*(t[:, mine] for t in tensors), positions.contiguous())


def mean_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any, weight: float = 1.0,
              ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The SP group's loss from each rank's `loss` (the mean over its shard's kept targets `shift_labels`): the mean
    over every kept target of the group, the same value on every rank (DeepSpeed's recipe: each shard's loss weighted
    by its kept targets; a shard with none counts for nothing). Differentiable in this rank's own term only, seeded
    with its share times `weight` (shard_weight: what makes the engine's reduction give one GPU's gradient); the
    recipe's differentiable all_gather seeds each shard with sp times its share (its backward sums the group's)."""
    import torch.distributed as dist

    kept = (shift_labels != ignore_index).sum().to(loss.device, torch.float32)
    own = torch.where(kept > 0, loss.float(), 0.0) * kept
    mine = torch.stack([own.detach(), kept])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    total, count = torch.stack(every).sum(0)
    seeded = own * weight
    return (seeded - seeded.detach() + total) / count.clamp(min=1)   # the value: total / count on every rank


def shard_weight(engine: Any, sp_size: int) -> float:
    """What each shard's loss term weighs in backward so that `engine` steps on one GPU's gradient. DeepSpeed 0.19.8
    averages an SP group's gradients two ways: ZeRO-0/1/2 (and ZeRO-3's all-reduce of a contiguous bucket) divide the
    sum over every rank by the data-parallel size (world / sp), ZeRO-3's reduce-scatter (its default) by the world.
    So 1, and sp under ZeRO-3's reduce-scatter (where DeepSpeed's own recipe is right; under ZeRO-1/2 it gives sp
    times the gradient: DeepSpeed #5248, a clip at 1/sp of its threshold)."""
    scatter = engine.zero_reduce_scatter() or not engine.zero_contiguous_gradients()
    return float(sp_size) if engine.zero_optimization_stage() == 3 and scatter else 1.0


def lm_loss(engine: Any, mpu, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The SP group's next-token loss of an HF causal LM `engine` on whole samples `x` [batch, seq] against their
    targets `y` (x shifted by one): this rank's shard through the model with its position ids and its targets as
    `shift_labels` (coat's chunked loss in training), then mean_loss with the engine's shard_weight."""
    x, y, positions = shard(mpu, x.to(engine.device), y.to(engine.device))
    y = y.contiguous()   # HF's stock loss (evaluation) views shift_labels flat
    loss = engine(input_ids=x, position_ids=positions, labels=y, shift_labels=y).loss
    weight = shard_weight(engine, mpu.get_sequence_parallel_world_size())
    return mean_loss(loss, y, mpu.get_sequence_parallel_group(), weight)


def data_parallel(mpu, rank: int, world: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global `rank`: which samples its SP group trains on."""
    size = 1 if mpu is None else mpu.get_sequence_parallel_world_size()
    return rank // size, world // size
