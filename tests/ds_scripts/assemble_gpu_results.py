"""benchmarks/results/zero_multi_gpu.json from the files tests/ds_scripts/gpu_run.sh leaves in its $OUT.

    python tests/ds_scripts/assemble_gpu_results.py OUT_DIR benchmarks/results/zero_multi_gpu.json \
        --command "..." --date 2026-11-22T22:00:00+00:00
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def assemble(out: Path, command: str, date: str) -> dict:
    summary = _load(out / "gpu_summary.json")
    coat, fused = _load(out / "bench_coat.json"), _load(out / "bench_fused.json")
    if summary is None:
        raise SystemExit(f"{out}/gpu_summary.json is missing: the gpu-marked test did not finish "
                         f"(see {out}/pytest_gpu.log)")
    diffs = list(summary["fp32"].values()) + list(summary["bf16"].values())
    res = {
        "device": summary["device"], "world_size": summary["world_size"], "steps": summary["steps"],
        "stages_passed": summary["stages_passed"], "max_loss_diff": max(diffs),
        "loss_diff_vs_stage0_one_rank": {"fp32": summary["fp32"], "bf16": summary["bf16"]},
        "resume_same_world_max_diff": summary["resume_same_world_max_diff"],
        "resume_1_to_2_ranks_zero2_max_diff": summary["resume_1_to_2_ranks_zero2"],
        "state_bytes_per_param_per_rank": {"CoatAdamW": summary["state_bytes_per_param_per_rank"]},
    }
    if coat and fused:
        res["zero2_step"] = {
            "model": f"{coat['n_params']:,} params, bf16, ZeRO-2, world size {coat['world_size']}",
            "coat_step_ms": coat["step_ms_median"], "fusedadam_step_ms": fused["step_ms_median"],
            "speedup_vs_fusedadam": fused["step_ms_median"] / coat["step_ms_median"],
            "state_bytes_per_param_per_rank": {"CoatAdamW": coat["state_bytes_per_param_per_rank"],
                                               "FusedAdam": fused["state_bytes_per_param_per_rank"]},
        }
        res["versions"] = coat["versions"]
    res.update(command=command, date=date)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("dest")
    ap.add_argument("--command", default="bash tests/ds_scripts/gpu_run.sh")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    args = ap.parse_args()
    res = assemble(Path(args.out_dir), args.command, args.date)
    Path(args.dest).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
