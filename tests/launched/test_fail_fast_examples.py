"""The examples exit 2 on bad input with one `error:` line, before any model, data or device memory
(--resume / --resume-from included, DeepSpeed's own keys, --model and --data); the checks themselves:
tests/test_fail_fast.py and tests/test_deepspeed_config.py."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coat_ds.deepspeed.check import check_tag
from harness import ROOT, child_env, free_port, launcher, ranks_launcher

pytestmark = pytest.mark.one_core   # a launch whose ranks exit at the check, then one process at a time

TINY = ["--model-size", "tiny", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--eval-batches", "1",
        "--eval-every", "0"]


def _env() -> dict:
    e = child_env()
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        e.pop(key, None)
    return e


def _run(cmd: list[str], timeout: int = 600) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_bad_config_exits_2_once_before_data_or_model(tmp_path):
    """2 ranks through the launcher: one `error:` line (rank 0), exit 2, and it comes before the data (a
    missing --data path would be reported otherwise) and the model (nothing is written to --save-dir)."""
    cfg = json.loads((ROOT / "ds_configs/zero2_coat.json").read_text())
    cfg["optimizer"]["params"]["group_size"] = 100
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    common = ["--deepspeed", str(tmp_path / "bad.json"), "--data", str(tmp_path / "no_data")]
    rc, out = _run([launcher(), "--num_gpus", "2", "--master_port", str(free_port()),
                    "examples/train.py", *common, "--save-dir", str(tmp_path / "run")])
    want = "error: optimizer.params.group_size=100 is invalid for CoatAdamW; allowed: one of [32, 64, 128, 256]"
    assert rc == 2 and _errors(out) == [want] and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "run").exists()
    rc, out = _run([sys.executable, "examples/hf_trainer.py", *common, "--output-dir", str(tmp_path / "hf")])
    assert rc == 2 and _errors(out) == [want] and "Traceback" not in out, out[-3000:]


def _misspelled(cfg: dict, case: str) -> dict:
    """The issue's three mistakes in a shipped config."""
    cfg = json.loads(json.dumps(cfg))
    if case == "zero_optimzation":
        cfg["zero_optimzation"] = cfg.pop("zero_optimization")
    elif case == "bf16.enable":
        cfg["bf16"] = {"enable": True}
    else:
        cfg["train_micro_batch_size_per_gpu"] = 0
    return cfg


MISSPELLED = {
    "zero_optimzation": "error: zero_optimzation: unknown top-level key, which DeepSpeed would ignore; nearest "
                        "allowed: 'zero_optimization' (allowed: the keys DeepSpeed's config parser reads, and 'coat')",
    "bf16.enable": "error: bf16.enable: unknown key; allowed keys: ['bf16_master_weights_and_grads', ",
    "micro_batch_0": "error: train_micro_batch_size_per_gpu=0 is invalid; allowed: an integer >= 1",
}


@pytest.mark.parametrize("case", list(MISSPELLED))
def test_misspelled_deepspeed_keys_exit_2_in_one_line_before_the_model(tmp_path, case):
    """The main job and HF Trainer (examples/hf_trainer.py, on the ds_configs/hf/ twin with HF's "auto" values): one
    line naming the key and the nearest allowed one, exit 2, before the data (the missing --data is not reported)
    and the model (no --save-dir). Before: "zero_optimzation" trained at ZeRO-0, the other two ended in tracebacks
    inside deepspeed.initialize, after the model and data had loaded."""
    want = MISSPELLED[case]
    for script, base, out_flag in (("train.py", "zero2_coat.json", "--save-dir"),
                                   ("hf_trainer.py", "hf/zero2_coat.json", "--output-dir")):
        bad = tmp_path / f"{script}.json"
        bad.write_text(json.dumps(_misspelled(json.loads((ROOT / "ds_configs" / base).read_text()), case)))
        rc, out = _run([sys.executable, f"examples/{script}", "--deepspeed", str(bad), "--data",
                        str(tmp_path / "no_data"), out_flag, str(tmp_path / script)])
        assert rc == 2 and len(_errors(out)) == 1 and _errors(out)[0].startswith(want), (script, out[-3000:])
        assert "Traceback" not in out and "no_data" not in out and not (tmp_path / script).exists(), out[-3000:]
    if case == "bf16.enable":
        assert _errors(out)[0].endswith("; nearest allowed: 'enabled'"), out[-3000:]


def test_misspelled_key_under_the_launcher_is_said_once(tmp_path):
    """2 ranks through DeepSpeed's launcher: the line once (rank 0), exit 2."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_misspelled(json.loads((ROOT / "ds_configs/zero2_coat.json").read_text()),
                                          "zero_optimzation")))
    rc, out = _run([launcher(), "--num_gpus", "2", "--master_port", str(free_port()), "examples/train.py",
                    "--deepspeed", str(bad), "--save-dir", str(tmp_path / "run")])
    assert rc == 2 and _errors(out) == [MISSPELLED["zero_optimzation"]] and "Traceback" not in out, out[-3000:]


def test_input_errors_exit_2_once_from_rank_0(tmp_path):
    """A --model path that does not exist is said as such (HF said "Repo id must be in the form 'repo_name'..."), and
    a --data path that does not exist: once each on 2 ranks, exit 2, as a config error. Before: every rank printed
    it and the job exited 1."""
    ranks = ranks_launcher(2)
    rc, out = _run([*ranks, "examples/train.py", "--model", str(tmp_path / "no_model"), "--save-dir",
                    str(tmp_path / "run")])
    assert rc == 2 and _errors(out) == [f"error: --model {tmp_path / 'no_model'}: no such directory; allowed: an HF "
                                        "model folder (config.json, weights; --export writes one) or a hub id such as "
                                        "'org/name'"] and "Repo id" not in out, out[-3000:]
    rc, out = _run([*ranks, "examples/train.py", "--data", str(tmp_path / "no_data"), *TINY,
                    "--save-dir", str(tmp_path / "run")])
    assert rc == 2 and len(_errors(out)) == 1 and str(tmp_path / "no_data") in _errors(out)[0], out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "run").exists(), out[-3000:]


class _Shell:
    """Unpickled, runs `touch MARKER` through os.system, whose module torch's weights-only reader blocks."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_unreadable_latest_checkpoint_names_file_and_intact_tags_then_resume_from(tmp_path):
    """A truncated file, then a model file carrying code (a module torch blocks, a class): one line each, the code
    refused unrun and never the advice to load with weights_only=False; then --resume-from the intact tag."""
    run, train = tmp_path / "run", [sys.executable, "examples/train.py", "--save-dir", str(tmp_path / "run"), *TINY]
    rc, out = _run([*train, "--steps", "4", "--save-every", "2"])
    assert rc == 0, out[-3000:]
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "step0000004"
    bad = sorted((ckpt / "step0000004").glob("*optim_states.pt"))[0]
    os.truncate(bad, bad.stat().st_size // 2)

    rc, out = _run([*train, "--steps", "4", "--resume"])
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    [line] = _errors(out)
    assert line.startswith(f"error: checkpoint step0000004 cannot be loaded: checkpoint file unreadable "
                           f"(truncated or corrupt): {bad} ") and line.endswith(
        "; intact tags: step0000002 (resume with --resume-from TAG)"), line

    model, marker = ckpt / "step0000004" / "mp_rank_00_model_states.pt", tmp_path / "ran"
    sd = torch.load(model, map_location="cpu", weights_only=False)  # written by the run above: trusted
    torch.save({**sd, "planted": _Shell(marker), "args": argparse.Namespace(lr=1.0)}, model)  # blocked module, class
    rc, out = _run([*train, "--steps", "4", "--resume"])
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    assert _errors(out) == [f"error: checkpoint step0000004 cannot be loaded: checkpoint file refused unread: {model} "
                            "holds objects outside DeepSpeed's checkpoint contents (globals "
                            f"{os.system.__module__}.system, argparse.Namespace); unpickling it could run code; "
                            "intact tags: step0000002 (resume with --resume-from TAG)"], out[-3000:]
    assert not marker.exists()

    rc, out = _run([*train, "--steps", "4", "--resume-from", "step0000002"])
    assert rc == 0, out[-3000:]
    again = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    train_of = lambda recs: [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]  # noqa: E731
    assert train_of(again) == train_of(log)  # steps 1-2 kept, 3-4 re-run from step 2: the same losses
    assert (ckpt / "latest").read_text() == "step0000004"
    check_tag(str(ckpt / "step0000004"))  # the bad tag was written anew
