"""Train the tiny model under several ZeRO stages / dtypes in one launched job; write losses and state sizes.

    deepspeed --num_gpus N tests/ds_scripts/trajectory.py --out result.json --runs 0:fp32,1:bf16 --steps 50
"""
from __future__ import annotations

import argparse
import sys
import os

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402


def state_bytes(engine) -> int:
    opt = engine.basic_optimizer
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", required=True, help="comma list of stage:dtype[:offload]")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    deepspeed.init_distributed()
    world = torch.distributed.get_world_size()
    out = {"world": world, "runs": {}}
    for run in args.runs.split(","):
        stage, dtype, *rest = run.split(":")
        offload = "offload" in rest
        model = common.model()
        cfg = common.config(int(stage), dtype, world, offload=offload)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        losses = common.train(engine, range(args.steps), dtype)
        n_params = sum(p.numel() for p in model.parameters())
        out["runs"][run] = {"losses": losses, "state_bytes": state_bytes(engine), "n_params": n_params,
                            "bound": getattr(engine, "_coat_bound", 0),
                            "skipped": engine.basic_optimizer.skipped_steps}
        del engine
    common.write(args.out, out)


if __name__ == "__main__":
    main()
