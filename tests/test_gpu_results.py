"""tests/ds_scripts/assemble_gpu_results.py: the 2-GPU run's files -> zero_multi_gpu.json."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "ds_scripts" / "assemble_gpu_results.py"


def _bench(opt: str, ms: float, bpp: float) -> dict:
    return {"optimizer": opt, "world_size": 2, "n_params": 1000, "step_ms_median": ms,
            "state_bytes_per_param_per_rank": bpp, "versions": {"torch": "t", "deepspeed": "d", "coat_ds": "c"}}


def test_assembles_summary_and_step_times(tmp_path):
    summary = {"world_size": 2, "device": "GPU X", "steps": 50, "fp32": {"1": 0.0, "2": 0.0, "3": 1e-7},
               "bf16": {"2": 0.0, "3": 2e-3}, "resume_same_world_max_diff": 0.0, "resume_1_to_2_ranks_zero2": 0.0,
               "state_bytes_per_param_per_rank": {"1": 1.25}, "stages_passed": [1, 2]}
    (tmp_path / "gpu_summary.json").write_text(json.dumps(summary))
    (tmp_path / "bench_coat.json").write_text(json.dumps(_bench("coat", 8.0, 1.0625)))
    (tmp_path / "bench_fused.json").write_text(json.dumps(_bench("fused", 10.0, 4.0)))
    dest = tmp_path / "out.json"
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(dest), "--date", "D"], check=True,
                   capture_output=True)
    res = json.loads(dest.read_text())
    assert res["max_loss_diff"] == 2e-3 and res["stages_passed"] == [1, 2] and res["device"] == "GPU X"
    assert res["zero2_step"]["speedup_vs_fusedadam"] == 1.25 and res["date"] == "D"
    assert res["zero2_step"]["state_bytes_per_param_per_rank"] == {"CoatAdamW": 1.0625, "FusedAdam": 4.0}


def test_missing_summary_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path / "o.json")],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "gpu_summary.json is missing" in out.stderr
    assert not (tmp_path / "o.json").exists()
