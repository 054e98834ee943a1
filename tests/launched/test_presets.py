"""The presets of ds_configs/ (coat_ds/deepspeed/presets.py, docs/presets.md): generated from one source, valid, and
each one trains through plain deepspeed.initialize on 2 ranks (tests/ds_scripts/presets_job.py; its HF
Trainer twins: tests/launched/test_hf_trainer.py)."""
from __future__ import annotations

import json

import pytest

from harness import ROOT, assert_runs_as_configured, launch_presets_job, ranks

pytest.importorskip("deepspeed")

from coat_ds.deepspeed import presets  # noqa: E402

NAMES = presets.file_names()


def test_preset_files_are_what_the_package_writes():
    assert presets.stale() == []                       # edit coat_ds/deepspeed/presets.py, then run it


def test_presets_differ_only_in_their_intent():
    from coat_ds.deepspeed import coat_section
    from coat_ds.deepspeed.check import check_config

    for layout, intent in presets.shipped():
        base = json.loads((ROOT / "ds_configs" / presets.LAYOUTS[layout]).read_text())
        presets.merge(base, {k: v for k, v in presets.LAYOUT_OVER.get(layout, {}).items() if k != "coat"})
        over = presets.INTENTS[intent]
        cfg = json.loads((ROOT / "ds_configs" / presets.file_name(layout, intent)).read_text())
        check_config(cfg)
        hf = json.loads((ROOT / "ds_configs" / "hf" / presets.file_name(layout, intent)).read_text())
        check_config(hf, hf_auto=True)
        assert {k: v for k, v in cfg.items() if k != "coat"} == {k: v for k, v in base.items() if k != "coat"}
        section = coat_section(cfg)
        assert section == coat_section(hf)
        assert section.master_weights == (over["master_weights"] or presets.EXACT_MASTER[layout])
        assert section.activation.attention_fp8 == (intent != "exact")
        assert section.gradients == over.get("gradients", "per_parameter")


def test_largest_model_is_only_where_release_runs():
    from coat_ds.deepspeed import coat_section

    largest = [lay for lay, intent in presets.shipped() if intent == "largest_model"]
    assert largest == ["zero2", "zero3", "zero3_offload"]
    assert [intent for lay, intent in presets.shipped() if lay == "zero3_offload"] == ["largest_model"]
    assert coat_section(json.loads((ROOT / "ds_configs" / "zero3_offload_largest_model.json").read_text())).states \
        == "host"


@pytest.fixture(scope="module")
def plain_job(tmp_path_factory) -> dict:
    return launch_presets_job(tmp_path_factory.mktemp("presets"), "plain")


@pytest.mark.slow
def test_every_preset_trains_through_plain_deepspeed(plain_job):
    for res in ranks(plain_job, "plain"):
        assert sorted(res) == sorted(NAMES)
        for name, r in res.items():
            cfg = json.loads((ROOT / "ds_configs" / name).read_text())
            assert_runs_as_configured(name, r, cfg)
            lowest = "exact" not in name
            layout = name.rsplit("_", 2 if lowest else 1)[0]
            assert r["master_weights"] == ("bf16_sr" if lowest else presets.EXACT_MASTER[layout]), (name, r)
            assert r["gradients"] == cfg["coat"].get("gradients", "per_parameter"), (name, r)
            assert r["attention_fp8"] == [lowest], (name, r)
            assert r["losses"][-1] < r["losses"][0], (name, r)               # one fixed batch: it learns it
