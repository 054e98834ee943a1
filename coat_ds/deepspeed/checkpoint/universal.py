"""DeepSpeed universal checkpoints for CoatAdamW engines (DeepSpeed's ds_to_universal needs exp_avg/exp_avg_sq).

    python -m coat_ds.deepspeed.checkpoint.universal CKPT_DIR/TAG OUT_DIR/TAG_universal

writes DeepSpeed's universal layout: `zero/<param>/fp32.pt` ({"param": fp32 weight}) and `step.pt`,
which DeepSpeed's own loader reads (`"checkpoint": {"load_universal": true}`), plus
`zero/<param>/coat_states.bin` (FP8 codes, per-group scales and exponents of the whole parameter;
`.bin` so that DeepSpeed's loader, which slices every `*.pt` element-wise, leaves it alone).
coat_ds's load_checkpoint wrapper fills the FP8 states from those files after DeepSpeed's load.
A regular checkpoint re-partitions to any world size without this step (load.py); the universal
form is for tools that read DeepSpeed's universal layout.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil

import torch

from .files import (LATEST_UNIVERSAL, MODEL_STATES, CheckpointError, ParamState, canonical, read_mapped, torch_load,
                    zero_files)

STATES = "coat_states.bin"
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def _model_files(src: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(src, "*" + MODEL_STATES)))
    if not files:
        raise CheckpointError(f"{src}: no *{MODEL_STATES} file")
    return files


def convert(src: str, dst: str) -> int:
    """Convert the checkpoint folder `src` (…/TAG) into a universal one at `dst`; returns the parameter count."""
    model = read_mapped(_model_files(src)[0])
    world = int(model.get("dp_world_size", 1))
    zsds = [read_mapped(p)["optimizer_state_dict"] for p in zero_files(src, world)]  # each file's pages read once
    canon = canonical(zsds)
    shapes = {}
    for group in model.get("param_shapes") or []:
        shapes.update(group)
    os.makedirs(os.path.join(dst, "zero"), exist_ok=True)
    for name, c in canon.items():
        folder = os.path.join(dst, "zero", name)
        os.makedirs(folder, exist_ok=True)
        shape = tuple(shapes.get(name, c.master.shape))
        torch.save({"param": c.master.view(shape)}, os.path.join(folder, "fp32.pt"))
        torch.save(c.step, os.path.join(folder, "step.pt"))
        torch.save(c.to_file(), os.path.join(folder, STATES))
    osd = zsds[0]
    if "base_optimizer_state" in osd:
        common = {k: v for k, v in osd.items() if k not in _SHARDED}
        common["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    else:  # ZeRO-3
        common = {k: v for k, v in osd.items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
        inner = osd["optimizer_state_dict"]
        common["param_groups"] = inner["param_groups"]
        common["optimizer_state_dict"] = {"param_groups": inner["param_groups"],
                                          "state": {i: {"step": st["step"]} for i, st in inner["state"].items()}}
    torch.save(common, os.path.join(dst, "zero", "optimizer_state.pt"))
    for f in _model_files(src):
        shutil.copy2(f, dst)
    root, tag = os.path.split(os.path.normpath(dst))
    with open(os.path.join(root, LATEST_UNIVERSAL), "w") as f:
        f.write(tag)
    return len(canon)


def read(folder: str) -> dict[str, ParamState]:
    """The per-parameter form (as files.canonical returns it) of a universal folder written by convert()."""
    canon = {}
    zero = os.path.join(folder, "zero")
    for name in sorted(os.listdir(zero)):
        states = os.path.join(zero, name, STATES)
        if not os.path.isfile(states):
            continue
        canon[name] = ParamState.from_file(torch_load(states), torch_load(os.path.join(zero, name, "fp32.pt"))["param"])
    if not canon:
        raise CheckpointError(f"{folder}: no {STATES} files; convert with "
                              "python -m coat_ds.deepspeed.checkpoint.universal")
    return canon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input_folder", help="a checkpoint tag folder written by engine.save_checkpoint")
    ap.add_argument("output_folder", help="where to write the universal checkpoint (a tag folder)")
    args = ap.parse_args()
    n = convert(args.input_folder, args.output_folder)
    print(f"coat_ds: wrote a universal checkpoint of {n} parameters to {args.output_folder}")


if __name__ == "__main__":
    main()
