"""examples/hf_trainer.py: HF Trainer with `--deepspeed ds_configs/zero2_coat.json` builds CoatAdamW through
DeepSpeed, runs the FP8 layers and trains a few steps (real `deepspeed` launcher, CPU accelerator here)."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hf_trainer_with_coat_config(tmp_path):
    env = dict(os.environ)
    env.setdefault("COAT_DATA_CACHE", str(ROOT / ".cache" / "coat_data"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    cmd = [deepspeed, "--num_gpus", "1", "--master_port", str(28500 + os.getpid() % 1000), "examples/hf_trainer.py",
           "--deepspeed", "ds_configs/zero2_coat.json", "--model-size", "tiny", "--seq-len", "64", "--steps", "3",
           "--eval-samples", "4", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"hf_trainer.py timed out:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    result = json.loads([line for line in out.splitlines() if line.startswith('{"engine"')][-1])
    assert result["engine"] == "DeepSpeedEngine" and result["optimizer"] == "CoatAdamW"
    assert result["fp8_layers"] == 2                                  # tiny Llama: both decoder layers swapped
    assert result["steps"] == 3
    for key in ("train_loss_first", "train_loss_last", "eval_loss"):
        assert 0 < result[key] < 20, result                           # finite, near ln(8192) = 9.0 at the start
