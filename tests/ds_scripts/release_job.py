"""One launched DeepSpeed job for coat.gradients "release" (issue 36); results go to a JSON file.

    deepspeed --num_gpus N tests/ds_scripts/release_job.py --out r.json --ckpt DIR TASK [TASK ...]

Every run here has one micro-batch per step (release refuses accumulation): each rank trains on its share of
common.batch(step), so 1 and 2 ranks see the same global batch; reduce buckets of 1,000 values, so that
backward reduces (and release steps) the tiny model in several buckets, some parameters alone. ZeRO-3 keeps the
biases gathered (persistent) and the weights partitioned, so that both kinds are stepped.

TASK (stage S: 1, 2 or 3, master M: fp32 | fp32_remainder | bf16_sr):
  equal:S:M[:overlap|:reduce]  100 steps, clipping off (overlap: overlap_comm on; reduce: ZeRO-1/2 reduce each
                slice to its owner, use_multi_rank_bucket_allreduce false): "per_parameter" against "release":
                losses, every rank's final masters and FP8 states equal, and the gradient values held when the
                step begins
  spike:S:M     clipping 1.0, every gradient x1e4 at step SPIKE: the largest second moment after it, with
                "release", "per_parameter" (exact clipping) and "per_parameter" without clipping
  nan:S:M       clipping 1.0; at step NAN_AT rank 0's gradient of the first layer's weight (reduced last) is NaN
  resume:S:M    clipping 1.0: 50 steps saved at 30, and the resumed tail
  refuse:S      engines release refuses: the error of each (stage S with gradient accumulation, fp32
                gradients, Offload; stage 0)
  host:3:M[:w1] coat.states "host" against "device" (ZeRO-3, sub-groups of ~600 values; w1: one device window, so
                every sub-group is evicted and fetched again): clipping 1.0, a NaN at step NAN_AT, saved at SAVE_AT and
                resumed: losses, every rank's final masters and FP8 states equal
  syncs:S:M     clipping 1.0, three steps, the second with a NaN in rank 0's gradient of the weight reduced first
                (the last layer's; ZeRO-1's: the first layer's): the host reads of a tensor (item, tolist, float,
                bool, int) that code under coat_ds/ makes during backward and during engine.step(); whether the
                NaN step left every rank's masters, states (step counts included) and weights as they were
"""
from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import coat_ds  # noqa: E402
import common  # noqa: E402
import job  # noqa: E402
from zero_state_job import _all, _joined, build, build_outcomes, config, masters  # noqa: E402
from coat_ds.deepspeed.zero import states as coat_states  # noqa: E402
from coat_ds.deepspeed.zero.layout import meta_offsets  # noqa: E402
from coat_ds.optim.coat_adamw import fp8_moments  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

STEPS, SAVE_AT = job.STEPS, job.SAVE_AT
if torch.cuda.is_available():   # two GPU runs agree bit for bit only with deterministic algorithms
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
EQUAL_STEPS = 100   # the run length for release == per_parameter
SPIKE, NAN_AT, CLIP = 20, 20, 1.0
HOST_SAVE, HOST_STEPS = NAN_AT + 4, NAN_AT + 8  # coat.states "host": saved after the NaN step, resumed for 4


def release_config(stage: int, world: int, master: str, gradients: str = "release", clip: float = 0.0) -> dict:
    cfg = config(stage, "bf16", world, master_weights=master, gradients=gradients)
    cfg.update(train_micro_batch_size_per_gpu=common.GLOBAL_BATCH // world, gradient_accumulation_steps=1,
               gradient_clipping=clip)
    cfg["zero_optimization"].update(reduce_bucket_size=1000, allgather_bucket_size=1000)
    if stage == 3:  # the biases (72, 72, 10 values) persistent, the weights partitioned
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    return cfg


def train(engine, steps: range, spike: int | None = None, nan: int | None = None, nan_layer: int = 0) -> list[float]:
    """Mean loss of each step's global batch, one backward per step on each rank's share (at step `nan` rank 0's
    gradient of layer `nan_layer`'s weight is NaN)."""
    rank, world, micro = engine.global_rank, engine.world_size, engine.train_micro_batch_size_per_gpu()
    first = engine.module[nan_layer].weight
    losses = []
    for step in steps:
        x, y = common.batch(step)
        mine = slice(rank * micro, (rank + 1) * micro)
        xb, yb = x[mine].to(engine.device, torch.bfloat16), y[mine]
        loss = nn.functional.cross_entropy(engine(xb).float(), yb.to(engine.device))
        handle = first.register_hook(lambda g: g * float("nan")) if step == nan and rank == 0 else None
        engine.backward(loss * 1e4 if step == spike else loss)
        if handle is not None:
            handle.remove()
        engine.step()
        losses.append(common.mean_over_ranks(loss, world))
    return losses


def partitions(engine) -> list[tuple[torch.Tensor, dict]]:
    """(master partition, its param group) of each of this rank's partitions (ZeRO-3 empties the groups' params)."""
    zo, groups = engine.optimizer, engine.basic_optimizer.param_groups
    to_group = getattr(zo, "sub_group_to_group_id", None)
    return [(m, groups[i if to_group is None else to_group[i]]) for i, m in enumerate(masters(zo))]


def states(engine) -> torch.Tensor:
    """This rank's FP8 states of every partition, as bytes (codes, scales, exponents)."""
    opt = engine.basic_optimizer
    home = getattr(engine.optimizer, "_coat_home", None)
    if home is not None:  # coat.states "host": the host blocks, once their copies back are done
        home.sync()
    out = []
    for p, _ in partitions(engine):
        for t in opt.state[p].values():
            if torch.is_tensor(t):
                out.append(t.detach().reshape(-1).view(torch.uint8).cpu())   # the step count may live on the host
    return torch.cat(out)


def max_v(engine) -> float:
    """The largest second moment (dequantized) over every rank's partitions."""
    opt = engine.basic_optimizer
    top = torch.zeros((), device=engine.device)
    for p, group in partitions(engine):
        _, v = fp8_moments(opt.state[p], group)
        segments = opt.partition_of(p).segments
        for seg, meta in zip(segments, meta_offsets(segments, group["group_size"])):
            top = torch.maximum(top, seg.piece(v, meta).dequantize().abs().max().float())
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top.item()


def weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole weights (ZeRO-3: gathered from the ranks' slices)."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def grad_numel(engine) -> int:
    """Gradient values this rank holds: the pieces ZeRO keeps for its step and every parameter's .grad."""
    zo = engine.optimizer
    pieces = [t for g in zo.averaged_gradients.values() for t in g or () if not hasattr(t, "_zero_padding")]
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return sum(t.numel() for t in pieces + grads)


def task_equal(args, world, stage, master, rest):
    out, final = {}, {}
    for gradients in ("per_parameter", "release"):
        cfg = release_config(stage, world, master, gradients)
        cfg["zero_optimization"]["overlap_comm"] = "overlap" in rest
        cfg["zero_optimization"]["use_multi_rank_bucket_allreduce"] = "reduce" not in rest
        engine = build(cfg)
        zo, held = engine.optimizer, []
        step = zo.step

        def watched(*a, **kw):
            held.append(grad_numel(engine))
            return step(*a, **kw)

        zo.step = watched
        out[gradients] = {"losses": train(engine, range(EQUAL_STEPS)), "grads_at_step": max(held),
                          "multi_rank_allreduce": getattr(zo, "use_multi_rank_bucket_allreduce", None)}  # ZeRO-1/2
        final[gradients] = (_joined(engine), states(engine))
    out["partition"] = final["release"][0].numel()
    out["masters_equal"] = _all(torch.equal(final["release"][0], final["per_parameter"][0]))
    out["states_equal"] = _all(torch.equal(final["release"][1], final["per_parameter"][1]))
    return out


def task_spike(args, world, stage, master, rest):
    beta2 = release_config(stage, world, master)["optimizer"]["params"]["betas"][1]
    out = {"spike_at": SPIKE, "clip": CLIP, "beta2": beta2}
    runs = (("release", "release", CLIP), ("exact", "per_parameter", CLIP), ("unclipped", "per_parameter", 0.0))
    for name, gradients, clip in runs:
        engine = build(release_config(stage, world, master, gradients, clip))
        losses = train(engine, range(SPIKE))
        before = max_v(engine)
        losses += train(engine, range(SPIKE, SPIKE + 1), spike=SPIKE)
        out[name] = {"v_before": before, "v_after": max_v(engine), "norm": float(engine.get_global_grad_norm()),
                     "losses": losses + train(engine, range(SPIKE + 1, SPIKE + 11))}
    return out


def task_nan(args, world, stage, master, rest):
    engine = build(release_config(stage, world, master, clip=CLIP))
    train(engine, range(NAN_AT))
    before = weights(engine)
    kept = (_joined(engine), states(engine))
    train(engine, range(NAN_AT, NAN_AT + 1), nan=NAN_AT)
    after = weights(engine)
    changed = {n: not torch.equal(w, before[n]) for n, w in after.items()}
    finite = all(torch.isfinite(w).all().item() for w in after.values())
    finite = finite and torch.isfinite(_joined(engine)).all().item()
    out = {"changed": changed, "finite": _all(finite), "skipped": engine.skipped_steps,
           "coat_skipped": engine.basic_optimizer.skipped_steps, "norm": float(engine.get_global_grad_norm()),
           "masters_moved": not _all(torch.equal(kept[0], _joined(engine)))}
    out["losses_after"] = train(engine, range(NAN_AT + 1, NAN_AT + 11))
    out["skipped_after"] = engine.skipped_steps
    return out


def task_resume(args, world, stage, master, rest):
    cfg = release_config(stage, world, master, clip=CLIP)
    engine = build(cfg)
    losses = train(engine, range(SAVE_AT))
    path = os.path.join(args.ckpt, f"release_w{world}_s{stage}_{master}")
    engine.save_checkpoint(path, tag="t")
    losses += train(engine, range(SAVE_AT, STEPS))
    engine = build(cfg)
    engine.load_checkpoint(path, tag="t")
    return {"losses": losses, "resumed": train(engine, range(SAVE_AT, STEPS))}


def task_refuse(args, world, stage, dtype, rest):
    cases = {"accumulation": dict(release_config(stage, world, "fp32"), gradient_accumulation_steps=2,
                                  train_micro_batch_size_per_gpu=common.GLOBAL_BATCH // world // 2),
             "fp32_accumulation": dict(release_config(stage, world, "fp32"), data_types={"grad_accum_dtype": "fp32"}),
             "stage0": release_config(0, world, "fp32"),
             "offload": release_config(stage, world, "fp32")}
    cases["offload"]["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return build_outcomes(cases)


COAT_DS = os.path.dirname(coat_ds.__file__)
HOST_READS = ("item", "tolist", "__float__", "__bool__", "__int__")


@contextlib.contextmanager
def host_reads(ignore: set[int]):
    """[file:line method] of each host read of a tensor (HOST_READS) made from a file under coat_ds/ while active;
    tensors whose id is in `ignore` (the host step counts) left out."""
    seen, originals = [], {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def watched(name, read):
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            where = frame.f_code.co_filename
            if where.startswith(COAT_DS) and id(self) not in ignore:
                seen.append(f"{os.path.relpath(where, COAT_DS)}:{frame.f_lineno} {name}")
            return read(self, *args, **kwargs)
        return wrapper

    for name, read in originals.items():
        setattr(torch.Tensor, name, watched(name, read))
    try:
        yield seen
    finally:
        for name, read in originals.items():
            setattr(torch.Tensor, name, read)


def task_syncs(args, world, stage, master, rest):
    engine = build(release_config(stage, world, master, clip=CLIP))
    train(engine, range(NAN_AT - 1))  # every state made
    ignore = {id(s["step"]) for s in engine.basic_optimizer.state.values() if "step" in s}
    out = {"backward": [], "step": []}
    for name in out:
        call = getattr(engine, name)

        def counted(*a, _call=call, _log=out[name], **kw):
            with host_reads(ignore) as seen:
                result = _call(*a, **kw)
            _log.append(seen)
            return result

        setattr(engine, name, counted)
    losses = train(engine, range(NAN_AT - 1, NAN_AT))
    kept = (_joined(engine), states(engine), weights(engine))
    first = 0 if stage == 1 else 4  # ZeRO-1 reduces after backward, in the parameters' order
    losses += train(engine, range(NAN_AT, NAN_AT + 1), nan=NAN_AT, nan_layer=first)
    now = (_joined(engine), states(engine), weights(engine))
    unchanged = all(torch.equal(a, b) for a, b in zip(kept[:2], now[:2]))
    unchanged = _all(unchanged and all(torch.equal(w, now[2][n]) for n, w in kept[2].items()))
    losses += train(engine, range(NAN_AT + 1, NAN_AT + 2))
    return {**out, "losses": losses, "skipped": engine.skipped_steps, "unchanged": unchanged}


def _state_tensors(engine) -> list[torch.Tensor]:
    return [t for s in engine.basic_optimizer.state.values() for k, t in s.items() if k != "step"]


def _host_blocks(engine) -> set[int]:
    home = getattr(engine.optimizer, "_coat_home", None)
    return set() if home is None else {t.untyped_storage().data_ptr() for t in home.host}


def task_host(args, world, stage, master, rest):
    if "w1" in rest:
        coat_states.WINDOWS = 1
    out, final = {}, {}
    for where in ("device", "host"):
        cfg = release_config(stage, world, master, clip=CLIP)
        cfg["coat"]["states"] = where
        cfg["zero_optimization"]["sub_group_size"] = 600
        engine = build(cfg)
        losses = train(engine, range(HOST_SAVE), nan=NAN_AT)
        path = os.path.join(args.ckpt, f"host_w{world}_{where}_{'_'.join(rest) or 'w3'}")
        engine.save_checkpoint(path, tag="t")
        losses += train(engine, range(HOST_SAVE, HOST_STEPS))
        final[where] = (_joined(engine), states(engine))
        engine = build(cfg)
        engine.load_checkpoint(path, tag="t")
        resumed = train(engine, range(HOST_SAVE, HOST_STEPS))
        out[where] = {"losses": losses, "resumed": resumed, "skipped": engine.skipped_steps,
                      "subgroups": len(engine.optimizer.fp32_partitioned_groups_flat),
                      "on_device": sum(t.numel() for t in _state_tensors(engine) if t.device.type != "cpu"),
                      "in_host_blocks": all(t.untyped_storage().data_ptr() in _host_blocks(engine)
                                            for t in _state_tensors(engine))}
        final[where + "_resumed"] = (_joined(engine), states(engine))
    out["masters_equal"] = _all(torch.equal(final["host"][0], final["device"][0]))
    out["states_equal"] = _all(torch.equal(final["host"][1], final["device"][1]))
    out["resumed_equal"] = _all(torch.equal(final["host_resumed"][1], final["host"][1]))
    return out


TASKS = {"host": task_host, "equal": task_equal, "spike": task_spike, "nan": task_nan, "resume": task_resume,
         "refuse": task_refuse, "syncs": task_syncs}

if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        job.main(TASKS)
