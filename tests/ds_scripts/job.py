"""One launched DeepSpeed job running several checks; results go to a JSON file read by the tests.

    deepspeed --num_gpus N tests/ds_scripts/job.py --out r.json --ckpt DIR TASK [TASK ...]

TASK (stage 0-3, dtype fp32|bf16|fp16):
  train:S:D[:offload]      50 steps, loss per step, state bytes; saves a checkpoint at step SAVE_AT
                           into DIR/w<world>_s<S>_<D> (and checks the same-world resume: losses after
                           loading equal the uninterrupted run, bit for bit)
  resume:S:D:W             load DIR/w<W>_s<S>_<D> (saved at world size W) and train to the end
  skip:S:fp16              fp16 run whose step SKIP_AT overflows: the FP8 states must not change
  refuse:S                 truncated / foreign checkpoints must be refused before anything loads
  tofp32:S:D               DeepSpeed's zero_to_fp32 recovers the fp32 masters of DIR/w<world>_s<S>_<D>
  quick:S:D                12 steps, losses only
  regroup:S:D              resume DIR/w<world>_s<S>_<D> with group_size 64 instead of 32
  universal:S:D:W          convert DIR/w<W>_s<S>_<D> to a universal checkpoint, load it, train on
  plant:S                  files that run code when unpickled (a function, a blocked module, a class), planted
                           in a saved checkpoint: refused, never run
  contents:S               (last) the classes pickled in every checkpoint file the jobs saved under DIR
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402

STEPS, SAVE_AT, SKIP_AT = 50, 30, 6


def state_bytes(engine) -> int:
    return sum(v.numel() * v.element_size() for st in engine.basic_optimizer.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")


def build(stage: int, dtype: str, world: int, **kw):
    model = common.model()
    cfg = common.config(stage, dtype, world, **kw)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def ckpt_dir(root: str, world: int, stage: int, dtype: str) -> str:
    return os.path.join(root, f"w{world}_s{stage}_{dtype}")


def barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def task_train(args, world, stage, dtype, rest):
    offload = "offload" in rest
    engine = build(stage, dtype, world, offload=offload)
    t0 = time.perf_counter()
    losses = common.train(engine, range(SAVE_AT), dtype)
    path = ckpt_dir(args.ckpt, world, stage, dtype + ("_offload" if offload else ""))
    engine.save_checkpoint(path, tag="t")
    losses += common.train(engine, range(SAVE_AT, STEPS), dtype)
    secs = time.perf_counter() - t0
    out = {"losses": losses, "state_bytes": state_bytes(engine), "bound": getattr(engine, "_coat_bound", 0),
           "n_params": sum(p.numel() for p in engine.module.parameters()), "seconds": secs}
    del engine
    engine = build(stage, dtype, world, offload=offload)
    engine.load_checkpoint(path, tag="t")
    out["resumed"] = common.train(engine, range(SAVE_AT, STEPS), dtype)
    return out


def task_quick(args, world, stage, dtype, rest):
    """12 steps, losses only (the multi-node run)."""
    engine = build(stage, dtype, world)
    return {"losses": common.train(engine, range(12), dtype), "world": world,
            "nodes": int(os.environ.get("CROSS_SIZE", os.environ.get("GROUP_WORLD_SIZE", "0")) or 0)}


def task_resume(args, world, stage, dtype, rest):
    src = int(rest[0])
    engine = build(stage, dtype, world)
    engine.load_checkpoint(ckpt_dir(args.ckpt, src, stage, dtype), tag="t")
    return {"resumed": common.train(engine, range(SAVE_AT, STEPS), dtype), "global_steps": engine.global_steps}


def task_regroup(args, world, stage, dtype, rest):
    """Load DIR/w<world>_s<S>_fp32 (group_size 32) into an engine with group_size 64: states re-grouped."""
    engine = build(stage, dtype, world, group_size=64)
    engine.load_checkpoint(ckpt_dir(args.ckpt, world, stage, dtype), tag="t")
    st = next(iter(engine.basic_optimizer.state.values()))
    return {"resumed": common.train(engine, range(SAVE_AT, STEPS), dtype),
            "n_meta": int(st["exp_avg_scale"].numel()),
            "group_size": engine.basic_optimizer.param_groups[0]["group_size"]}


def task_universal(args, world, stage, dtype, rest):
    """Convert DIR/w<W>_s<S>_<D> with coat_ds's universal converter, load it with load_universal, train on."""
    from coat_ds.deepspeed.checkpoint.universal import convert

    src = int(rest[0])
    dst = os.path.join(args.ckpt, f"uni_from_w{src}_s{stage}_{dtype}_to_w{world}")
    if dist.get_rank() == 0:
        convert(os.path.join(ckpt_dir(args.ckpt, src, stage, dtype), "t"), os.path.join(dst, "t"))
    barrier()
    engine = build(stage, dtype, world, checkpoint={"load_universal": True})
    engine.load_checkpoint(dst, tag="t")
    return {"resumed": common.train(engine, range(SAVE_AT, STEPS), dtype), "global_steps": engine.global_steps}


def _fp8_states(engine) -> list[torch.Tensor]:
    return [v.clone() for st in engine.basic_optimizer.state.values() for k, v in sorted(st.items())]


def task_skip(args, world, stage, dtype, rest):
    """fp16: step SKIP_AT gets an inf loss; DeepSpeed skips it, FP8 codes/scales/exponents stay put."""
    engine = build(stage, dtype, world)
    common.train(engine, range(SKIP_AT), dtype)
    before = _fp8_states(engine)
    scale_before = engine.optimizer.cur_scale if hasattr(engine.optimizer, "cur_scale") else None
    common.train(engine, range(SKIP_AT, SKIP_AT + 1), dtype, poison={SKIP_AT})
    after = _fp8_states(engine)
    scale_after = getattr(engine.optimizer, "cur_scale", None)
    same = len(before) == len(after) and all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                         b.view(torch.uint8) if b.element_size() == 1 else b)
                                             for a, b in zip(before, after))
    losses = common.train(engine, range(SKIP_AT + 1, SKIP_AT + 11), dtype)
    return {"unchanged": same, "skipped_steps": engine.skipped_steps, "losses": losses,
            "scale_before": scale_before, "scale_after": scale_after}


def task_refuse(args, world, stage, dtype, rest):
    """A truncated file and another optimizer's checkpoint: both refused, the model untouched."""
    from coat_ds.deepspeed.checkpoint import CheckpointError

    out = {}
    src = ckpt_dir(args.ckpt, world, stage, "fp32")
    bad = os.path.join(args.ckpt, f"bad_w{world}_s{stage}")
    if dist.get_rank() == 0:
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(src, bad)
        f = [n for n in sorted(os.listdir(os.path.join(bad, "t"))) if "optim_states" in n][-1]
        p = os.path.join(bad, "t", f)
        with open(p, "r+b") as fh:
            fh.truncate(os.path.getsize(p) // 2)
    barrier()
    engine = build(stage, "fp32", world)
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(bad, tag="t")
        out["truncated"] = "loaded"
    except CheckpointError as exc:
        out["truncated"] = str(exc)
    out["truncated_untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    # a checkpoint written by DeepSpeed's own AdamW
    foreign = os.path.join(args.ckpt, f"adamw_w{world}_s{stage}")
    model = common.model()
    cfg = common.config(stage, "fp32", world)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    other, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    common.train(other, range(2), "fp32")
    other.save_checkpoint(foreign, tag="t")
    del other
    try:
        engine.load_checkpoint(foreign, tag="t")
        out["foreign"] = "loaded"
    except CheckpointError as exc:
        out["foreign"] = str(exc)
    out["foreign_untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    return out


class RunsCode:
    """Unpickling it creates the file `marker` (what a hostile checkpoint file could do with any code): through
    io.open, a global torch's weights-only reader does not allow, or (`shell`) os.system, whose module it blocks."""

    def __init__(self, marker: str, shell: bool = False):
        self.marker, self.shell = marker, shell

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",)) if self.shell else (open, (self.marker, "w"))


class Planted:
    """A class outside DeepSpeed's checkpoint contents whose unpickling creates the file `marker` (its setstate)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __setstate__(self, state: dict) -> None:
        open(state["marker"], "w").close()


PLANTS = {"function": RunsCode, "blocked module": lambda marker: RunsCode(marker, shell=True), "class": Planted}


def task_plant(args, world, stage, dtype, rest):
    """Rank world-1's optimizer file of a saved checkpoint (one that only that rank's DeepSpeed load reads) gets each
    of PLANTS in turn: every rank refuses the load before DeepSpeed unpickles it, the code never runs; the same file
    under DeepSpeed's own torch.load(weights_only=False) does run it."""
    from coat_ds.deepspeed.checkpoint import CheckpointError

    src, bad = ckpt_dir(args.ckpt, world, stage, "fp32"), os.path.join(args.ckpt, f"plant_w{world}_s{stage}")
    name = f"zero_pp_rank_{world - 1}_mp_rank_00_optim_states.pt"
    victim = os.path.join(bad, "t", name)
    if dist.get_rank() == 0:
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(src, bad)
    engine = build(stage, "fp32", world)
    before = [p.detach().clone() for p in engine.module.parameters()]
    out = {"victim": victim}
    for kind, plant in PLANTS.items():
        marker = f"{bad}.{kind.replace(' ', '_')}.ran"
        if dist.get_rank() == 0:
            sd = torch.load(os.path.join(src, "t", name), map_location="cpu", weights_only=False)  # task_train's
            sd["extra"] = plant(marker)
            torch.save(sd, victim)
        barrier()
        try:
            engine.load_checkpoint(bad, tag="t")
            got = {"refused": "loaded"}
        except CheckpointError as exc:
            got = {"refused": str(exc)}
        got["untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        barrier()
        got["ran"] = os.path.exists(marker)
        barrier()
        if dist.get_rank() == 0:
            torch.load(victim, map_location="cpu", weights_only=False)
        barrier()
        out[kind] = dict(got, live=os.path.exists(marker))
    return out


def task_contents(args, world, stage, dtype, rest):
    """The globals (other than what torch allows by default) pickled in the files of every checkpoint the jobs saved,
    planted and truncated copies left out; and those coat_ds's reader allows."""
    from coat_ds.deepspeed.checkpoint.files import ds_globals

    found = {}
    for root, _, files in os.walk(args.ckpt):
        if os.path.basename(os.path.dirname(root)).startswith(("bad_", "plant_")):
            continue
        for name in files:
            if name.endswith(".pt"):
                for g in torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(root, name)):
                    found.setdefault(g, os.path.join(root, name))
    return {"found": found, "allowed": sorted(f"{c.__module__}.{c.__qualname__}" for c in ds_globals())}


def task_tofp32(args, world, stage, dtype, rest):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    path = ckpt_dir(args.ckpt, world, stage, dtype)
    engine = build(stage, dtype, world)
    engine.load_checkpoint(path, tag="t")
    sd = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
    diff = 0.0
    for name, p in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                ref = p.detach().float().clone()
        else:
            ref = p.detach().float()
        if dtype == "fp32":
            diff = max(diff, (sd[name].float() - ref).abs().max().item())
    return {"n": len(sd), "max_diff_fp32_model": diff}


TASKS = {"train": task_train, "quick": task_quick, "regroup": task_regroup, "universal": task_universal,
         "resume": task_resume, "skip": task_skip, "refuse": task_refuse, "tofp32": task_tofp32, "plant": task_plant,
         "contents": task_contents}


def main(tasks: dict = TASKS) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("tasks", nargs="+")
    args = ap.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("COAT_JOB_TIMEOUT", "240")), exit=True)
    if not torch.cuda.is_available():
        # one thread per rank whatever the launcher decides: CPU kernels' reduction order (e.g. the loss
        # mean) depends on the thread count, and the runs compared must do the same arithmetic
        torch.set_num_threads(1)
    deepspeed.init_distributed()
    world = dist.get_world_size()
    out = {"world": world, "tasks": {}}
    for task in args.tasks:
        kind, stage, *rest = task.split(":")
        dtype = rest.pop(0) if rest else "fp32"
        with common.timed(task):
            try:
                out["tasks"][task] = tasks[kind](args, world, int(stage), dtype, rest)
            except Exception as exc:  # noqa: BLE001 - recorded; the test shows it
                import traceback

                out["tasks"][task] = {"error": f"{type(exc).__name__}: {exc}",
                                      "trace": traceback.format_exc()[-3000:]}
            barrier()
    common.write(args.out, out)
    barrier()


if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        main()
