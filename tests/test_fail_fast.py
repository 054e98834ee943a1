"""Bad input is refused in one line before any model, data or device memory: coat_ds.deepspeed.check's
config and checkpoint checks, and the examples that exit 2 on them (--resume / --resume-from included)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coat_ds.deepspeed.check import check_config, check_tag, intact_tags
from coat_ds.deepspeed.checkpoint import CheckpointError
from harness import ROOT, child_env, free_port, launcher
COAT = {"type": "CoatAdamW", "params": {"lr": 1e-3}}
TINY = ["--model-size", "tiny", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--eval-batches", "1",
        "--eval-every", "0"]


def _opt(**params) -> dict:
    return {"optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3, **params}}}


BAD = [
    (_opt(group_size=100), "optimizer.params.group_size=100 is invalid for CoatAdamW; allowed: one of [32, 64, 128, 256]"),
    (_opt(v_format="e3m4"), "optimizer.params.v_format='e3m4' is invalid for CoatAdamW; allowed: one of ['e4m3', 'e5m2']"),
    (_opt(group=32), "optimizer.params.group: unknown key; allowed keys: ['betas', "),
    (_opt(lr="auto"), "optimizer.params.lr='auto' is invalid for CoatAdamW; allowed: a finite number >= 0"),
    ({"optimizer": {"type": "coatadamw"}}, "optimizer.type='coatadamw' is invalid; allowed: 'CoatAdamW'"),
    ({"coat": {"activation": {"mode": "half"}}}, "coat.activation.mode='half' is not supported; allowed: ['linear', 'full']"),
    ({"coat": {"activation": {"fwd_format": "e3m4"}}}, "coat.activation.fwd_format='e3m4' is not an FP8 format"),
    ({"coat": {"activation": {"modes": "full"}}}, "coat.activation.modes: unknown key; allowed keys: ['enabled', "),
    ({"coat": {"activations": {}}}, "coat.activations: unknown key; allowed keys: ['activation'"),
    ({"coat": True}, "coat=True is invalid; allowed: an object with keys ['activation'"),
    ({"coat": {"master_weights": "bf16"}}, "coat.master_weights='bf16' is invalid; allowed: ['fp32', 'bf16_sr', "),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is invalid; allowed: 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"devices": "cpu"}}},
     "zero_optimization.offload_optimizer.devices: unknown key; allowed keys: ['buffer_count', "),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device='gpu' is invalid; allowed: 'none', 'cpu' or 'nvme'"),
    ({**_opt(), "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}},
     "zero_optimization.offload_optimizer.device='nvme' is invalid with ZeRO-3 and CoatAdamW; allowed: 'cpu' or"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"coat": {"master_weights": "bf16_sr"}, "zero_optimization": {"stage": 2}},
     "coat.master_weights='bf16_sr' needs a bf16 model (\"bf16\": {\"enabled\": true}); this one trains in fp32"),
    ({"coat": {"master_weights": "bf16_sr"}, "bf16": {"enabled": True}},
     "coat.master_weights='bf16_sr' needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)"),
    ({"coat": {"master_weights": "bf16_rn"}, "bf16": {"enabled": True},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     "coat.master_weights='bf16_rn' under ZeRO-3 needs parameters and optimizer on the device"),
]


@pytest.mark.parametrize("cfg,line", BAD, ids=[line.split("=")[0].split(":")[0].split(" ")[0] for _, line in BAD])
def test_bad_config_is_one_line_naming_key_and_allowed(cfg, line):
    with pytest.raises(ValueError) as e:
        check_config(cfg)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_shipped_configs_and_hf_auto_values_pass():
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        cfg = json.loads(path.read_text())
        check_config(cfg)
        if "coat" in cfg and cfg["zero_optimization"]["stage"] in (1, 2):  # where a bf16 master runs, offload too
            check_config({**cfg, "coat": {**cfg["coat"], "master_weights": "bf16_sr"}})
    for path in sorted((ROOT / "ds_configs" / "hf").glob("*.json")):  # HF Trainer-style, with "auto" values
        check_config(json.loads(path.read_text()), hf_auto=True)
    hf = {**_opt(lr="auto", betas="auto", weight_decay="auto"), "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    check_config(hf, hf_auto=True)  # HF Trainer fills "auto"; plain DeepSpeed does not:
    with pytest.raises(ValueError, match="optimizer.params.lr='auto'"):
        check_config(hf)


def test_fp16_follows_the_accelerator():
    from deepspeed.accelerator import get_accelerator

    cfg = {**_opt(), "fp16": {"enabled": True}}
    if get_accelerator().is_fp16_supported():
        check_config(cfg)
    else:
        with pytest.raises(ValueError, match=r"fp16.enabled=true is invalid on this machine: DeepSpeed's \w+ "
                                             r"accelerator says is_fp16_supported\(\) -> "):
            check_config(cfg)


# ---------------------------------------------------------------------------------------------- checkpoint files
def _tag(root: Path, name: str, world: int = 2) -> Path:
    """A DeepSpeed-shaped ZeRO tag: a model-states file and one optimizer file per rank."""
    d = root / name
    d.mkdir(parents=True)
    torch.save({"dp_world_size": world, "module": {"w": torch.ones(4)}}, d / "mp_rank_00_model_states.pt")
    for r in range(world):
        torch.save({"optimizer_state_dict": {"x": torch.zeros(1000)}}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return d


def test_check_tag_names_the_missing_or_truncated_file(tmp_path):
    good = _tag(tmp_path, "global_step20")
    check_tag(str(good))
    gone = _tag(tmp_path, "global_step100")
    (gone / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # a rank the others do not reveal
    with pytest.raises(CheckpointError, match=r"checkpoint file missing: .*global_step100/zero_pp_rank_1_mp"):
        check_tag(str(gone))
    cut = _tag(tmp_path, "global_step3")
    f = cut / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"unreadable \(truncated or corrupt\): .*global_step3/zero_pp_rank_0"):
        check_tag(str(cut))
    with pytest.raises(CheckpointError, match="checkpoint missing"):
        check_tag(str(tmp_path / "nope"))
    _tag(tmp_path, "global_step4")
    (tmp_path / "global_step5.tmp").mkdir()  # a save killed midway: never a tag
    assert intact_tags(str(tmp_path)) == ["global_step20", "global_step4"]  # newest first, by step number
    assert intact_tags(str(tmp_path), exclude="global_step20") == ["global_step4"]


# ---------------------------------------------------------------------------------------------- the examples
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_unreadable_latest_checkpoint_names_file_and_intact_tags_then_resume_from(tmp_path):
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

    rc, out = _run([*train, "--steps", "4", "--resume-from", "step0000002"])
    assert rc == 0, out[-3000:]
    again = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    train_of = lambda recs: [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]  # noqa: E731
    assert train_of(again) == train_of(log)  # steps 1-2 kept, 3-4 re-run from step 2: the same losses
    assert (ckpt / "latest").read_text() == "step0000004"
    check_tag(str(ckpt / "step0000004"))  # the bad tag was written anew
