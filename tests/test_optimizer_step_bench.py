"""Smoke test of `python -m benchmarks.optimizer_step`: a CPU dry run writes every case's row with its bytes moved."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_optimizer_step_smoke_writes_a_row_per_case(tmp_path):
    out = tmp_path / "step.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "benchmarks.optimizer_step", "--smoke", "--out", str(out)], check=True,
                   cwd=ROOT, env=env, capture_output=True, text=True)
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["grad_dtype"], r["master"]): r for r in rows}
    assert set(cases) == {("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16_sr"),
                          ("bfloat16", "float32_remainder")}
    # master r+w + grad + 2 x (1 B of codes + 8 B of (scale, expo) per 128 values) per moment
    state = 2 * (2 + 16 / 128)
    for (grad, master), want in ((("float32", "float32"), 8 + 4), (("bfloat16", "float32"), 8 + 2),
                                 (("bfloat16", "bfloat16_sr"), 4 + 2),
                                 (("bfloat16", "float32_remainder"), 4 + 2 + 4)):   # + the int16 remainder r+w
        row = cases[(grad, master)]
        assert row["coat_bytes_per_param"] == want + state
        assert row["coat_ms"] > 0 and row["coat_frac_of_copy"] > 0
        assert abs(row["state_bytes_per_param"] - state / 2) < 1e-3
    assert cases[("float32", "float32")]["coat_step_ms"] > 0  # the optimizer's full step beside the kernel
    head = cases[("float32", "float32")]   # CPU: contenders interleaved, the per-round ratio beside the medians
    assert head["coat_min_ms"] > 0 and head["speedup_vs_coat_step_paired"] > 0
    assert cases[("bfloat16", "bfloat16_sr")]["coat_step_ms"] is None
