"""The "coat" section takes effect wherever DeepSpeed reads the config (coat_ds/deepspeed/engine.py).

Two launched 2-rank jobs (CPU accelerator, gloo; tests/ds_scripts/section_job.py), shared by the tests:
  DS   2 ranks as `deepspeed --num_gpus 2` starts them (harness.ranks_launcher), in the session's one launch of
       section_job.py (harness.section_launch, beside the tasks of test_presets, test_hf_trainer and
       test_activation_checkpoint_zero3): a user's own script with plain
       deepspeed.initialize and a shipped config file; ZeRO-3 with the model built under HF's zero.Init; every
       shipped config but the presets (test_presets) as it is; HF Trainer with an HF "auto" config
       (ds_configs/hf/); what the section refuses
  ACC  `accelerate launch` with an accelerate config naming a DeepSpeed config file
Each route's losses are compared with ==, per rank, to coat_ds.deepspeed.initialize's on the same
model, config and batches: the same FP8 model trains the same way whatever built the engine.
The last test is in-process: what the engine's swap (coat_ds.hf.swap.apply) accepts and refuses.
"""
from __future__ import annotations

import json
import math

import pytest

from harness import DS_SCRIPTS, ROOT, free_port, launch_results, launcher, module_tasks, ranks

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

JOB = DS_SCRIPTS / "section_job.py"
DS_TASKS = ["plain", "zero3_init", "refusals", "hf_trainer", "configs"]
STEPS = 3


SECTION_TASKS = DS_TASKS   # in the session's one launch of section_job.py (harness.section_launch)


@pytest.fixture(scope="module")
def ds_job(section_launch) -> dict:
    return module_tasks(section_launch, SECTION_TASKS)


@pytest.fixture(scope="module")
def acc_job(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("section_acc")
    out = tmp / "r.json"
    conf = tmp / "accelerate.yaml"
    conf.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                    f"  deepspeed_config_file: {ROOT / 'ds_configs' / 'zero2_coat.json'}\n  zero3_init_flag: false\n"
                    "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\n")
    cmd = [launcher("accelerate"), "launch", "--config_file", str(conf), "--main_process_port", str(free_port()),
           str(JOB), "--out", str(out), "--tmp", str(tmp), "accelerate"]
    return launch_results(cmd, out)


def assert_trains_like_reference(r: dict, steps: int = STEPS) -> None:
    assert r["fp8"] == 2 and r["optimizer"] == "CoatAdamW", r     # both decoder layers are FP8 layers
    assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"]), r
    assert r["losses"] == r["reference"], r                         # bit-equal to coat_ds.deepspeed.initialize


def test_plain_deepspeed_initialize_with_a_shipped_config(ds_job):
    for r in ranks(ds_job, "plain"):
        assert_trains_like_reference(r)
        assert r["injected_by_user"] == r["losses"]                 # a model the user injected is accepted as is
        assert r["cache"] == [False]                                # cache_weights: no accumulation, no cache


def test_hf_trainer_with_an_auto_config(ds_job):
    for r in ranks(ds_job, "hf_trainer"):
        assert_trains_like_reference(r)


def test_accelerate_with_a_deepspeed_config_file(acc_job):
    for r in ranks(acc_job, "accelerate"):
        assert r["config_file"] == str(ROOT / "ds_configs" / "zero2_coat.json")
        assert_trains_like_reference(r)


def test_zero3_with_zero_init(ds_job):
    for r in ranks(ds_job, "zero3_init"):
        assert r["partitioned"]                                     # from_pretrained built it under zero.Init
        assert r["probe_fp8"] == 2 and r["probe_untouched"]         # the swap left every partition as it was
        assert r["leaf"]
        assert_trains_like_reference(r)                             # reference: the same weights, built whole


def test_every_shipped_config_through_plain_deepspeed(ds_job):
    """The measured configs and the baselines, as they are (the presets: test_presets)."""
    from coat_ds.deepspeed import presets

    shipped = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json") if p.name not in presets.file_names())
    assert len(shipped) >= 9, shipped
    for res in ranks(ds_job, "configs"):
        assert sorted(res) == shipped
        for name, r in res.items():
            cfg = json.loads((ROOT / "ds_configs" / name).read_text())
            coat = cfg.get("coat", {}).get("activation", {"enabled": False}).get("enabled", True)
            assert r["fp8"] == (2 if coat else 0), (name, r)
            assert (r["optimizer"] == "CoatAdamW") == (cfg["optimizer"]["type"] == "CoatAdamW"), (name, r)
            assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]), (name, r)
            assert all(lr > 0 for lr in r["lr"]), (name, r)             # the scheduler ran on numbers


def test_what_the_section_cannot_apply_to_is_refused(ds_job):
    for r in ranks(ds_job, "refusals"):
        for case, why in (("gpt2", "model_type='gpt2' has no coat_ds injection policy"),
                          ("sequential", "has no config.model_type"),
                          ("other_config", "already injected with"),
                          ("disabled_but_injected", "enabled is false but the model already runs 2 FP8"),
                          ("wrapped", "already carries DeepSpeed ZeRO-3 hooks"),
                          ("engine", "got a DeepSpeedEngine")):
            assert r[case] and r[case].startswith("ValueError: coat.activation cannot be applied"), (case, r[case])
            assert why in r[case], (case, r[case])
        assert r["bad_value"].startswith("ValueError: coat.activation.mode='half'"), r["bad_value"]


def test_enabled_false_and_engines_without_a_config_optimizer(ds_job):
    for r in ranks(ds_job, "refusals"):
        assert r["disabled_fp8"] == 0                               # "enabled": false: the model stays stock
        assert r["client_optimizer_fp8"] == 2                       # the optimizer section is not needed
        assert r["no_optimizer_fp8"] == 2
        assert r["cache_gas1"] == [False, 1]                        # [cache on?, engine's accumulation steps]
        assert r["cache_derived_gas2"] == [True, 2]                 # derived from train_batch_size by DeepSpeed


def test_apply_accepts_the_same_settings_and_decides_the_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    import coat_ds
    from coat_ds.hf.swap import apply, is_injected

    def tiny():
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=2))

    def caches(model):
        return {(layer.coat_config.cache_weights, g.cache) for layer in model.model.layers for g in layer.weight_groups}

    model = coat_ds.inject(tiny(), {"cache_weights": True})
    layers = list(model.model.layers)
    assert apply(model, {}, 1) == 2 and list(model.model.layers) == layers   # accepted, nothing swapped again
    assert caches(model) == {(False, False)}                  # "when_accumulating", one micro-batch: no cache
    assert apply(model, {}, 4) == 2 and caches(model) == {(True, True)}
    with pytest.raises(ValueError, match="already injected with"):
        apply(model, {"mode": "linear"}, 1)
    with pytest.raises(ValueError, match="enabled is false but the model already runs 2 FP8"):
        apply(model, {"enabled": False}, 1)
    stock = tiny()
    assert apply(stock, {"enabled": False}, 1) == 0 and not is_injected(stock)
    assert apply(stock, {"mode": "linear"}, 2) == 2 and caches(stock) == {(True, True)}
