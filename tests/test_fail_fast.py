"""Bad input is refused in one line before any model, data or device memory: coat_ds.deepspeed.check's
config and checkpoint checks (the examples that exit 2 on them: launched/test_fail_fast_examples.py)."""
import json
import os
from pathlib import Path

import pytest
import torch

from coat_ds.deepspeed.check import check_config, check_tag, intact_tags
from coat_ds.deepspeed.checkpoint import CheckpointError
from harness import ROOT


def _opt(**params) -> dict:
    return {"optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3, **params}}}


BAD = [
    (_opt(group_size=100),
     "optimizer.params.group_size=100 is invalid for CoatAdamW; allowed: one of [32, 64, 128, 256]"),
    (_opt(v_format="e3m4"),
     "optimizer.params.v_format='e3m4' is invalid for CoatAdamW; allowed: one of ['e4m3', 'e5m2']"),
    (_opt(group=32), "optimizer.params.group: unknown key; allowed keys: ['betas', "),
    (_opt(lr="auto"), "optimizer.params.lr='auto' is invalid for CoatAdamW; allowed: a finite number >= 0"),
    ({"optimizer": {"type": "coatadamw"}}, "optimizer.type='coatadamw' is invalid; allowed: 'CoatAdamW'"),
    ({"coat": {"activation": {"mode": "half"}}},
     "coat.activation.mode='half' is not supported; allowed: ['linear', 'full']"),
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
    # DeepSpeed's own keys, by DeepSpeed's parser (coat_ds.deepspeed.deepspeed_keys): before, the first trained
    # silently at ZeRO-0 and the others failed inside deepspeed.initialize, after the model, as tracebacks
    ({"zero_optimzation": {"stage": 2}}, "zero_optimzation: unknown top-level key, which DeepSpeed would ignore; "
                                         "nearest allowed: 'zero_optimization'"),
    ({"bf16": {"enable": True}}, "bf16.enable: unknown key; allowed keys: ["),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0 is invalid; allowed: an integer >= 1"),
    ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps=2.5 is invalid; allowed: an integer >= 1"),
    ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
     "DeepSpeed refuses this config: Check batch related parameters. train_batch_size is not equal to"),
    ({"fp16": {"loss_scale_windw": 100}}, "fp16.loss_scale_windw: unknown key; allowed keys: ["),
    ({"fp16": {"initial_scale_power": "high"}}, "fp16.initial_scale_power='high' is invalid; allowed: a valid int"),
    ({"tensorboard": {"enabeld": True}}, "tensorboard.enabeld: unknown key; allowed keys: ['enabled', "),
    ({"optimizer": {"type": "AdamW", "param": {}}}, "optimizer.param: unknown key; allowed keys: ['legacy_fusion', "
                                                    "'params', 'type']; nearest allowed: 'params'"),
    ({"optimizer": {"type": "AdamX"}}, "optimizer.type='AdamX' is invalid; nearest allowed: 'Adam'; allowed: one of "
                                       "DeepSpeed's ["),
    ({"scheduler": {"type": "WarmupCosine"}}, "scheduler.type='WarmupCosine' is invalid; nearest allowed: "
                                              "'WarmupCosineLR'"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_step": 2}}},
     "scheduler.params.warmup_num_step: unknown key; allowed keys: ['cos_min_ratio', "),
    ({"gradient_clipping": "auto"}, "gradient_clipping='auto' is invalid here; allowed: a value"),
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
        torch.save({"optimizer_state_dict": {"x": torch.zeros(1000)}},
                   d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
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
