"""One launched DeepSpeed job for the ZeRO training state of CoatAdamW (issue 16); results go to a JSON file.

    deepspeed --num_gpus N tests/ds_scripts/zero_state_job.py --out r.json --ckpt DIR TASK [TASK ...]

TASK (stage 1-3; dtype bf16 = bf16 gradients, bf16acc = fp32 gradient accumulation, fp16):
  exact:S:D          50 steps with coat_ds's ZeRO step and with DeepSpeed's own (gradient clipping on):
                     losses of both, the resumed tail of coat_ds's, and the largest fp32 tensor either
                     step allocates (numel) against the partition size
  master:S:M[:offload][:bf16grads]  50 steps with coat.master_weights M (bf16_sr | bf16_rn), fp32 gradient
                     accumulation (bf16grads: bf16); saves DIR/m<world>_s<S>_<M>[_<flags>] at step 30, resumes;
                     the dtypes and sizes of the tensors the optimizer keeps, the largest fp32 tensor
                     deepspeed.initialize allocates (numel)
  cross:S:A:B        load DIR/m<world>_s<S>_<A> (A = fp32 saves one first) into an engine with
                     master_weights B: its master right after loading against the file's, 20 more steps
  resume:S:M:W       load DIR/m<W>_s<S>_<M> (saved at world size W: re-partitioned when it differs), train on
  universal:S:M:W    convert DIR/m<W>_s<S>_<M> to a universal checkpoint, load it, train on
  refuse:S           configs bf16_sr cannot run with: the error of each
"""
from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import common  # noqa: E402
import job  # noqa: E402  (its main runs the tasks)
from coat_ds.deepspeed.zero import step as zero_step  # noqa: E402
from coat_ds.deepspeed.zero.kind import master_partitions as masters  # noqa: E402
from coat_ds.formats import bf16_weight  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

STEPS, SAVE_AT = job.STEPS, job.SAVE_AT


def config(stage: int, dtype: str, world: int, **coat) -> dict:
    cfg = common.config(stage, "bf16" if dtype in ("bf16", "bf16acc") else dtype, world)
    if dtype == "bf16":
        cfg.pop("data_types", None)  # DeepSpeed's default: gradients reduced and kept in bf16
    if coat:
        cfg["coat"] = coat
    return cfg


class KernelRounding(TorchDispatchMode):
    """DeepSpeed's fp32 -> bf16 weight copies rounded as CoatAdamW's kernel writes an fp32 master's bf16 weights
    (formats.bf16_weight, ties away from zero, where DeepSpeed's cast rounds them to even)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].dtype == torch.bfloat16 and args[1].dtype == torch.float32:
            args = (args[0], bf16_weight(args[1]), *args[2:])
        return func(*args, **(kwargs or {}))


def build(cfg: dict, deepspeed_step: bool = False, probe: TorchDispatchMode | None = None):
    """The engine of cfg; `probe`, if given, watches deepspeed.initialize (the model is built outside it).
    deepspeed_step: DeepSpeed's own ZeRO step (its weight copies under KernelRounding), the reference."""
    zero_step.ENABLED = not deepspeed_step
    try:
        model = common.model()
        with probe or contextlib.nullcontext():
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    finally:
        zero_step.ENABLED = True
    if deepspeed_step:
        step = engine.optimizer.step

        def rounded(*a, **kw):
            with KernelRounding():
                return step(*a, **kw)

        engine.optimizer.step = rounded
    return engine


def train_dtype(dtype: str) -> str:
    return "bf16" if dtype == "bf16acc" else dtype


class LargestAlloc(TorchDispatchMode):
    """The largest tensor of `dtype` (numel) with fresh storage that any op creates while active (views and
    in-place results share their input's storage): DeepSpeed's fp32 gradient partition shows up here.
    `total`: the numel of all of them together."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.numel = self.total = 0
        self.dtype = dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if torch.is_tensor(a)}
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.dtype == self.dtype and t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
                self.total += t.numel()
        return out


def step_alloc(engine, dtype: str, step: int) -> tuple[int, list[float]]:
    """Train one step with the optimizer step watched: the largest fp32 tensor created inside the step, the loss."""
    probe = LargestAlloc()
    original = engine.optimizer.step

    def watched(*a, **kw):
        with probe:
            return original(*a, **kw)

    engine.optimizer.step = watched
    try:
        losses = common.train(engine, range(step, step + 1), dtype)
    finally:
        engine.optimizer.step = original
    return probe.numel, losses


def partition_numel(engine) -> int:
    return max(f.numel() for f in masters(engine.optimizer))


def task_exact(args, world, stage, dtype, rest):
    cfg = dict(config(stage, dtype, world), gradient_clipping=0.2)
    out = {"partition": 0}
    for name, ds in (("deepspeed", True), ("coat", False)):
        engine = build(cfg, deepspeed_step=ds)
        out["partition"] = partition_numel(engine)
        d = train_dtype(dtype)
        losses = common.train(engine, range(SAVE_AT - 1), d)
        out[f"{name}_alloc"], last = step_alloc(engine, d, SAVE_AT - 1)
        losses += last
        path = os.path.join(args.ckpt, f"exact_w{world}_s{stage}_{dtype}_{name}")
        engine.save_checkpoint(path, tag="t")
        losses += common.train(engine, range(SAVE_AT, STEPS), d)
        out[name] = losses
        out[f"{name}_skipped"] = engine.skipped_steps
        if not ds:
            engine = build(cfg)
            engine.load_checkpoint(path, tag="t")
            out["coat_resumed"] = common.train(engine, range(SAVE_AT, STEPS), d)
    return out


def kept_tensors(engine) -> list[tuple[str, str, int]]:
    """(where, dtype, numel) of every tensor the ZeRO optimizer and CoatAdamW keep (attributes, lists,
    dicts, optimizer state, the hp fragments linked to the model's parameters)."""
    seen, out = set(), []

    def walk(obj, where, depth):
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if torch.is_tensor(obj):
            out.append((where, str(obj.dtype), obj.numel()))
            if obj.grad is not None:
                walk(obj.grad, where + ".grad", depth)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{where}[{k!r}]"[:120], depth + 1)
        elif isinstance(obj, (list, tuple)):
            for k, v in enumerate(obj):
                walk(v, f"{where}[{k}]", depth + 1)

    zo = engine.optimizer
    walk(vars(zo), "zero", 0)
    walk(dict(engine.basic_optimizer.state), "state", 0)
    for p in engine.module.parameters():
        if getattr(p, "_hp_mapping", None) is not None:
            walk(vars(p._hp_mapping), "hp_mapping", 0)
    return out


def task_master(args, world, stage, master, rest):
    offload = "offload" in rest
    cfg = config(stage, "bf16" if "bf16grads" in rest else "bf16acc", world, master_weights=master)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    setup = LargestAlloc()
    engine = build(cfg, probe=setup)
    n = partition_numel(engine)
    losses = common.train(engine, range(SAVE_AT), "bf16")
    path = os.path.join(args.ckpt, "_".join([f"m{world}_s{stage}_{master}", *rest]))
    engine.save_checkpoint(path, tag="t")
    losses += common.train(engine, range(SAVE_AT, STEPS), "bf16")
    kept = kept_tensors(engine)
    # ZeRO-3's gradient buffer holds what grad_accum_dtype asks for (fp32 here): not a copy of the weights
    out = {"losses": losses, "partition": n,
           "fp32_partition_sized": [k for k in kept if k[1] == "torch.float32" and k[2] >= n
                                    and "grad_partitions_flat_buffer" not in k[0]],
           "master_dtypes": sorted({str(f.dtype) for f in masters(engine.optimizer)}),
           "setup_fp32_alloc": setup.numel, "setup_fp32_total": setup.total,
           "skipped": engine.skipped_steps}
    del engine
    engine = build(cfg)
    engine.load_checkpoint(path, tag="t")
    out["resumed"] = common.train(engine, range(SAVE_AT, STEPS), "bf16")
    return out


def _masters(engine) -> torch.Tensor:
    return torch.cat([f.detach().float().reshape(-1) for f in masters(engine.optimizer)])


def _saved_masters(path: str, world: int) -> torch.Tensor:
    """This rank's master partitions as the checkpoint holds them (without DeepSpeed's padding)."""
    from coat_ds.deepspeed.checkpoint.files import zero_files

    f = zero_files(os.path.join(path, "t"), world)[dist.get_rank()]
    osd = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    flats = osd.get("single_partition_of_fp32_groups") or osd["fp32_flat_groups"]
    return torch.cat([t.reshape(-1) for t in flats])


def task_grads(args, world, stage, master, rest):
    """coat.gradients "per_parameter" against "partition_buffer" (bf16 gradients, clipping on, contiguous
    gradients): losses of each, whether every rank's final masters are equal, at each step how many storages
    hold the gradient pieces the step reads (zero padding aside) against the number of pieces, and (ZeRO-3) the
    gradient values kept between steps."""
    out, final = {}, []
    for gradients in ("partition_buffer", "per_parameter"):
        engine = build(dict(config(stage, "bf16", world, master_weights=master, gradients=gradients),
                            gradient_clipping=0.2))
        zo, seen = engine.optimizer, set()
        step = zo.step

        def watched(*a, **kw):
            pieces = [t for g in zo.averaged_gradients.values() for t in g or () if not hasattr(t, "_zero_padding")]
            seen.add((len(pieces), len({t.untyped_storage().data_ptr() for t in pieces})))
            return step(*a, **kw)

        zo.step = watched
        out[gradients] = {"losses": common.train(engine, range(STEPS), "bf16"), "pieces_storages": sorted(seen)}
        if stage == 3:  # what the gradient map and buffer still hold between steps
            out[gradients]["kept_between_steps"] = zo.grad_partitions_flat_buffer.numel() + sum(
                t.numel() for t in getattr(zo, zero_step.GRAD_MAP).values())
        final.append(_joined(engine))
        out["partition"] = partition_numel(engine)
    out["masters_equal"] = _all(torch.equal(*final))
    return out


def task_cross(args, world, stage, src, rest):
    """Checkpoint with master_weights src, saved at this world size, loaded with master_weights rest[0]."""
    dst = rest[0]
    path = os.path.join(args.ckpt, f"m{world}_s{stage}_{src}")
    if src == "fp32":  # an fp32-master checkpoint of the same run, saved here
        engine = build(config(stage, "bf16acc", world))
        common.train(engine, range(SAVE_AT), "bf16")
        engine.save_checkpoint(path, tag="t")
        del engine
    saved = _saved_masters(path, world)
    engine = build(config(stage, "bf16acc", world, master_weights=dst))
    engine.load_checkpoint(path, tag="t")
    got = _masters(engine)[:saved.numel()]
    want = saved.to(torch.bfloat16).float() if dst != "fp32" else saved.float()
    return {"saved_dtype": str(saved.dtype), "master_dtype": str(masters(engine.optimizer)[0].dtype),
            "master_exact": bool(torch.equal(got, want)),
            "resumed": common.train(engine, range(SAVE_AT, STEPS), "bf16")}


def task_resume(args, world, stage, master, rest):
    """Load DIR/m<W>_s<S>_<M> (saved at world size W = rest[0]) here and train to the end."""
    engine = build(config(stage, "bf16acc", world, master_weights=master))
    engine.load_checkpoint(os.path.join(args.ckpt, f"m{rest[0]}_s{stage}_{master}"), tag="t")
    return {"resumed": common.train(engine, range(SAVE_AT, STEPS), "bf16")}


def task_universal(args, world, stage, master, rest):
    from coat_ds.deepspeed.checkpoint.universal import convert

    src = int(rest[0])
    dst = os.path.join(args.ckpt, f"uni_m{src}_s{stage}_{master}_to_w{world}")
    if dist.get_rank() == 0:
        convert(os.path.join(args.ckpt, f"m{src}_s{stage}_{master}", "t"), os.path.join(dst, "t"))
    job.barrier()
    cfg = config(stage, "bf16acc", world, master_weights=master)
    cfg["checkpoint"] = {"load_universal": True}
    engine = build(cfg)
    engine.load_checkpoint(dst, tag="t")
    return {"resumed": common.train(engine, range(SAVE_AT, STEPS), "bf16")}


def task_refuse(args, world, stage, dtype, rest):
    zero3_offload = config(3, "bf16acc", world, master_weights="bf16_sr")
    zero3_offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    ds_bf16_master = config(2, "bf16acc", world)  # DeepSpeed's own bf16 host master, with an fp32 coat master
    ds_bf16_master["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    ds_bf16_master["bf16"]["bf16_master_weights_and_grads"] = True
    cases = {"zero3_offload": zero3_offload, "ds_bf16_master": ds_bf16_master,
             "bf16_optimizer": config(1, "bf16acc", world, master_weights="bf16_sr"),
             "fp32_model": config(2, "fp32", world, master_weights="bf16_sr"),
             "bad_value": config(2, "bf16acc", world, master_weights="bf16")}
    return build_outcomes(cases)


def build_outcomes(cases: dict) -> dict:
    """name -> "built", or the one-line ValueError the engine refused that config with."""
    out = {}
    for name, cfg in cases.items():
        try:
            build(cfg)
            out[name] = "built"
        except ValueError as exc:
            out[name] = str(exc)
    return out


REM_STEPS, REM_SAVE = 100, 60


def _device() -> str:
    """Where collectives of this job's small tensors run (NCCL has no CPU tensors)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _even_ties(engine) -> int:
    """Values of all ranks' fp32 masters on an exact tie with an even high half: where the split's bf16 weight
    (ties away from zero) and DeepSpeed's nearest-even cast differ."""
    u = _masters(engine).view(torch.int32).long()
    n = torch.tensor([float((((u & 0xFFFF) == 0x8000) & (((u >> 16) & 1) == 0)).sum())], device=_device())
    dist.all_reduce(n)
    return int(n.item())


def _train_counting_ties(engine, steps: range, count: bool) -> tuple[list[float], list[int]]:
    """Losses, and per step the even ties among the masters that step wrote (count: else [])."""
    losses, ties = [], []
    for step in steps:
        losses += common.train(engine, range(step, step + 1), "bf16")
        ties += [_even_ties(engine)] if count else []
    return losses, ties


def _joined(engine) -> torch.Tensor:
    """This rank's fp32 masters: DeepSpeed's fp32 partitions, or high halves joined with the remainders."""
    opt = engine.basic_optimizer
    parts = []
    for f in masters(engine.optimizer):
        layout = opt.partition_of(f)
        parts.append((f.float() if layout is None else layout.master(f).float()).reshape(-1))
    return torch.cat(parts)


def _all(flag: bool) -> bool:
    t = torch.tensor([0.0 if flag else 1.0], device=_device())
    dist.all_reduce(t)
    return t.item() == 0


def task_remainder(args, world, stage, dtype, rest):
    """fp32 master against fp32_remainder, 100 steps with clipping: losses, masters and model weights, and the
    fp32 run's even ties per step (where a nearest-even weight would have differed); the remainder run saved at
    step 60 and resumed, loaded into fp32 / bf16_sr engines, and zero_to_fp32 of it."""
    out = {}
    runs = {}
    for mode in ("fp32", "fp32_remainder"):
        cfg = dict(config(stage, dtype, world, master_weights=mode), gradient_clipping=0.2)
        engine = build(cfg)
        losses, ties = _train_counting_ties(engine, range(REM_SAVE), mode == "fp32")
        path = os.path.join(args.ckpt, f"rem_w{world}_s{stage}_{mode}")
        engine.save_checkpoint(path, tag="t")
        saved = _joined(engine).clone()
        more, more_ties = _train_counting_ties(engine, range(REM_SAVE, REM_STEPS), mode == "fp32")
        runs[mode] = dict(engine=engine, saved=saved, path=path, cfg=cfg)
        out[mode] = losses + more
        out[f"{mode}_ties"] = ties + more_ties
    a, b = runs["fp32"]["engine"], runs["fp32_remainder"]["engine"]
    out["masters_equal"] = _all(torch.equal(_joined(a).view(torch.int32), _joined(b).view(torch.int32)))
    out["weights_equal"] = _all(all(torch.equal(x.ds_tensor if stage == 3 else x, y.ds_tensor if stage == 3 else y)
                                    for x, y in zip(a.module.parameters(), b.module.parameters())))
    out["remainder_dtypes"] = sorted({str(f.dtype) for f in masters(b.optimizer)})
    del a, b, runs["fp32"]["engine"], runs["fp32_remainder"]["engine"]
    rem = runs["fp32_remainder"]
    engine = build(rem["cfg"])
    engine.load_checkpoint(rem["path"], tag="t")
    out["resumed"] = _train_counting_ties(engine, range(REM_SAVE, REM_STEPS), False)[0]
    for into in ("fp32", "bf16_sr"):  # the remainder checkpoint loads as an fp32 one
        engine = build(dict(rem["cfg"], coat={"master_weights": into}))
        engine.load_checkpoint(rem["path"], tag="t")
        want = rem["saved"] if into == "fp32" else rem["saved"].to(torch.bfloat16).float()
        out[f"into_{into}_exact"] = _all(torch.equal(_joined(engine)[:want.numel()], want))
    engine = build(rem["cfg"])  # an fp32-master checkpoint loads into remainders exactly
    engine.load_checkpoint(runs["fp32"]["path"], tag="t")
    out["from_fp32_exact"] = _all(torch.equal(_joined(engine), runs["fp32"]["saved"]))
    saved = _saved_masters(rem["path"], world)
    out["saved_dtypes"] = str(saved.dtype)
    out["saved_exact"] = _all(torch.equal(saved, rem["saved"][:saved.numel()].cpu()))
    return out


def task_refuse_remainder(args, world, stage, dtype, rest):
    cases = {}
    for name, st in (("offload_z2", 2), ("offload_z3", 3)):
        cases[name] = config(st, "bf16", world, master_weights="fp32_remainder")
        cases[name]["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cases["fp32_model"] = config(2, "fp32", world, master_weights="fp32_remainder")
    return build_outcomes(cases)


TASKS = {"grads": task_grads, "remainder": task_remainder, "refuse_remainder": task_refuse_remainder,
         "exact": task_exact, "master": task_master, "cross": task_cross, "resume": task_resume,
         "universal": task_universal, "refuse": task_refuse}


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        job.main(TASKS)
