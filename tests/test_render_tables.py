"""The measured tables of README.md and docs/*.md are what `python -m benchmarks.render_tables` renders from
benchmarks/results/*.json: a figure edited by hand, or a JSON re-measured without re-rendering, fails here."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import render_tables as rt  # noqa: E402


def test_every_rendered_table_equals_its_json():
    assert rt.stale() == []                            # run: python -m benchmarks.render_tables


def test_every_table_is_shown_somewhere():
    shown = {name for path in rt.DOCS for name, _ in rt.regions(path.read_text())}
    assert shown == set(rt.TABLES)


def test_a_changed_measurement_is_caught(tmp_path):
    """Re-measure one figure in a copy of the results: the committed docs/results.md no longer agrees with it."""
    results = tmp_path / "results"
    shutil.copytree(rt.RESULTS, results)
    run = (results / "e2e_llama-1b.json").read_text()
    assert '"peak_alloc_gb": 16.089115619659424' in run              # coat full's peak at micro-batch 4
    (results / "e2e_llama-1b.json").write_text(run.replace('"peak_alloc_gb": 16.089115619659424',
                                                            '"peak_alloc_gb": 17.089115619659424'))
    doc = ROOT / "docs" / "results.md"
    assert rt.stale(results, [doc]) == ["docs/results.md: e2e_runs"]
    text = doc.read_text()
    assert "| 4 | 17.1 | 40,984 |" in rt.rewrite(text, results) and "| 4 | 17.1 | 40,984 |" not in text


def test_a_region_naming_no_table_is_caught(tmp_path, monkeypatch):
    doc = tmp_path / "x.md"
    doc.write_text("<!-- table:no_such_table -->\n| a |\n<!-- /table -->\n")
    monkeypatch.setattr(rt, "ROOT", tmp_path)
    assert rt.stale(files=[doc]) == ["x.md: no_such_table"]


def test_a_candidate_settings_scaling_file_is_not_a_presets_row(tmp_path):
    """An e2e_scaling*.json measured with --zero-set or --bind-cores sits beside the presets' files and changes no
    table; the same rows without the setting would."""
    results = tmp_path / "results"
    shutil.copytree(rt.RESULTS, results)
    rows = json.loads((results / "e2e_scaling_h200.json").read_text())
    for case in rows["summary"]:
        if case.get("common"):
            case["common"]["tokens_per_s_per_gpu"] = 1.0
    for key, value in (("bind_cores", True), ("zero_set", {"reduce_bucket_size": 500000000})):
        (results / "e2e_scaling_zcandidate.json").write_text(json.dumps({**rows, key: value}))
        assert rt.stale(results, [ROOT / "README.md"]) == []
    (results / "e2e_scaling_zcandidate.json").write_text(json.dumps(rows))
    assert rt.stale(results, [ROOT / "README.md"]) == ["README.md: scaling"]
