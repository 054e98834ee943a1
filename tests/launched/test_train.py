"""The main command itself, `deepspeed examples/train.py --deepspeed ds_configs/zero2_coat.json`, with the real
launcher on 2 ranks (DeepSpeed's CPU accelerator here): a few steps, then --resume, then a run stopped by a
signal. Tiny model and short sequences keep it within the CPU budget."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from coat_ds.workloads.causal_lm import MODEL_SIZES
from harness import ROOT, TRAIN_SMALL, child_env, finish, free_port, launcher


def launch(save_dir: Path, *extra: str, config: str = "ds_configs/zero2_coat.json"):
    cmd = [launcher(), "--num_gpus", "2", "--master_port", str(free_port()),
           "examples/train.py", "--deepspeed", config, "--save-dir", str(save_dir), *TRAIN_SMALL, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)   # one process group: a timeout or a signal reaches every rank


def records(save_dir: Path, kind: str) -> list[dict]:
    lines = (save_dir / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_main_command_then_resume(tmp_path):
    run = tmp_path / "run"
    out = finish(launch(run, "--steps", "4", "--eval-every", "2", "--save-every", "2"))
    assert "exits successfully" in out and "Traceback" not in out, out[-3000:]
    train = records(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    losses = [r["loss"] for r in train]
    assert all(x == x and abs(x) < 100 for x in losses), losses                   # finite
    assert sum(losses[-2:]) / 2 < losses[0], losses                                # falling
    assert [r["step"] for r in records(run, "eval")] == [2, 4]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "step0000004"
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step0000002", "step0000004"]
    assert any((ckpt / "step0000004").glob("*optim_states.pt"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 4 and summary["world_size"] == 2 and summary["optimizer"] == "CoatAdamW"
    assert summary["fp8_layers"] == MODEL_SIZES[summary["model"].removeprefix("llama-")]["num_hidden_layers"]
    assert f"FP8 decoder layers {summary['fp8_layers']}" in out

    # the same config plus DeepSpeed's CSV monitor; and an HF export at the end
    cfg = json.loads((ROOT / "ds_configs/zero2_coat.json").read_text())
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    (tmp_path / "csv.json").write_text(json.dumps(cfg))
    out = finish(launch(run, "--steps", "6", "--eval-every", "2", "--save-every", "2", "--resume",
                        "--export", str(tmp_path / "hf"), config=str(tmp_path / "csv.json")))
    assert "exits successfully" in out and "Traceback" not in out, out[-3000:]
    train2 = records(run, "train")
    assert [r["step"] for r in train2] == [1, 2, 3, 4, 5, 6]                     # continued at step 5
    assert train2[:4] == train                                                     # history kept as it was
    assert all(r["loss"] == r["loss"] for r in train2)
    assert train2[-1]["loss"] < losses[0]
    assert (ckpt / "latest").read_text() == "step0000006"
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step0000004", "step0000006"]   # --keep-last 2
    assert json.loads((run / "summary.json").read_text())["steps_done"] == 6
    csv = (tmp_path / "csv" / "job" / "Train_tokens_per_s.csv").read_text().splitlines()
    assert len(csv) >= 2 and (tmp_path / "csv" / "job" / "Eval_val_loss.csv").exists()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([tok("def main():\n    return 0\n")["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss.item()
    assert type(model).__name__ == "LlamaForCausalLM" and 0 < loss < 20


def test_signal_saves_a_checkpoint_and_resume_continues(tmp_path):
    """SIGTERM to the whole job (what a scheduler sends): every rank stops at the same step and saves."""
    run = tmp_path / "run"
    proc = launch(run, "--steps", "1000", "--eval-every", "0", "--save-every", "0")
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (run / "log.jsonl").exists() and len(records(run, "train")) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, finish(proc)[-3000:]
    os.killpg(proc.pid, signal.SIGTERM)
    out = finish(proc)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").is_file(), out[-3000:]
    tag = (ckpt / "latest").read_text()
    steps = [r["step"] for r in records(run, "train")]
    assert tag == f"step{steps[-1]:07d}" and (ckpt / tag).is_dir() and not list(ckpt.glob("*.tmp"))
    assert json.loads((run / "summary.json").read_text())["interrupted"] is True

    out = finish(launch(run, "--steps", str(steps[-1] + 1), "--eval-every", "0", "--resume"))
    assert "exits successfully" in out, out[-3000:]
    assert [r["step"] for r in records(run, "train")] == list(range(1, steps[-1] + 2))
