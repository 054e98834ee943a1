"""HF Trainer with coat_ds configs (CPU accelerator here).

- examples/hf_trainer.py with `--deepspeed ds_configs/zero2_coat.json` builds CoatAdamW through DeepSpeed,
  runs the FP8 layers and trains a few steps;
- every ds_configs/hf/ config runs with TrainingArguments' defaults (2 ranks, tests/ds_scripts/presets_job.py).
"""
import json
import subprocess

import pytest

from harness import (DS_SCRIPTS, ROOT, assert_runs_as_configured, child_env, finish, module_tasks, ranks,
                     ranks_launcher)

HF_CONFIGS = sorted(p.name for p in (ROOT / "ds_configs" / "hf").glob("*.json"))


@pytest.mark.one_core   # one rank
def test_hf_trainer_with_coat_config(tmp_path):
    cmd = [*ranks_launcher(1), "examples/hf_trainer.py",
           "--deepspeed", "ds_configs/zero2_coat.json", "--model-size", "tiny", "--seq-len", "64", "--steps", "3",
           "--eval-samples", "4", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    result = json.loads([line for line in out.splitlines() if line.startswith('{"engine"')][-1])
    assert result["engine"] == "DeepSpeedEngine" and result["optimizer"] == "CoatAdamW"
    assert result["fp8_layers"] == 2                                  # tiny Llama: both decoder layers swapped
    assert result["steps"] == 3
    for key in ("train_loss_first", "train_loss_last", "eval_loss"):
        assert 0 < result[key] < 20, result                           # finite, near ln(8192) = 9.0 at the start


def test_hf_configs_run_with_default_warmup():
    """HF's default warmup_steps=0 fills "auto" warmup with 0 (transformers 5.17), which DeepSpeed's warmup
    schedulers refuse: a shipped HF config either leaves the scheduler to HF or builds with warmup 0."""
    import torch
    from deepspeed.runtime import lr_schedules
    from transformers import TrainingArguments

    warmup = TrainingArguments(output_dir="unused").get_warmup_steps(10)
    assert warmup == 0
    for name in HF_CONFIGS:
        sched = json.loads((ROOT / "ds_configs" / "hf" / name).read_text()).get("scheduler")
        if sched is None:
            continue                                   # HF Trainer builds its own from TrainingArguments
        params = {k: (warmup if k == "warmup_num_steps" else 10 if v == "auto" else v)
                  for k, v in sched["params"].items()}
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        getattr(lr_schedules, sched["type"])(opt, **params)


SECTION_TASKS = ["presets_job.hf"]   # in the session's one launch of section_job.py (harness.section_launch)


@pytest.fixture(scope="module")
def hf_job(section_launch) -> dict:
    return module_tasks(section_launch, SECTION_TASKS)


def test_every_hf_config_runs_with_default_training_arguments(hf_job):
    for res in ranks(hf_job, "hf"):
        assert sorted(res) == HF_CONFIGS
        for name, r in res.items():
            assert_runs_as_configured(name, r, json.loads((ROOT / "ds_configs" / "hf" / name).read_text()))
            assert r["bf16"] == (r["master_weights"] != "fp32"), (name, r)   # defaults, bf16 for a bf16-based master
            assert len(r["losses"]) == 3, (name, r)
            steps = len(r["lr"])                                     # HF's default: linear decay, no warmup
            assert r["lr"] == pytest.approx([r["default_lr"] * (1 - k / steps) for k in range(1, steps + 1)]), r


@pytest.mark.one_core   # one rank
def test_a_users_trainer_script_gets_deepspeeds_ignored_key_in_one_line(tmp_path):
    """A user's HF Trainer script (not ours: no check before the model) with "gradient_cliping" in its ds_configs/hf/
    config: DeepSpeed would train without clipping (accelerate itself refuses a config without "zero_optimization");
    the engine of coat_ds (a "coat" section) raises one line naming the nearest key as the Trainer builds it, before
    ZeRO (coat_ds.deepspeed.config.engine_section)."""
    cfg = json.loads((ROOT / "ds_configs" / "hf" / "zero2_coat.json").read_text())
    del cfg["gradient_clipping"]
    cfg["gradient_cliping"] = 1.0
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    proc = subprocess.run([*ranks_launcher(1), str(DS_SCRIPTS / "user_hf_trainer.py"), "--deepspeed",
                           str(tmp_path / "bad.json"), "--out", str(tmp_path / "out")], cwd=ROOT,
                          env=child_env(COAT_DISABLE_OPS="1"), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "trained" not in out.splitlines(), out[-3000:]
    assert out.splitlines()[-1].endswith("ValueError: gradient_cliping: unknown top-level key, which DeepSpeed would "
                                         "ignore; nearest allowed: 'gradient_clipping' (allowed: the keys DeepSpeed's "
                                         "config parser reads, and 'coat')"), out[-3000:]
