"""The measured tables of README.md and docs/*.md are what `python -m benchmarks.render_tables` renders from
benchmarks/results/*.json: a figure edited by hand, or a JSON re-measured without re-rendering, fails here."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import render_tables as rt  # noqa: E402
from benchmarks.tables.scaling import ONE_NODE_70B  # noqa: E402


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


def test_each_headline_is_one_row_of_its_full_table():
    """The README shows one row of a table whose every row is in docs/: the same header, a row the full table has."""
    headlines = [name for name in rt.TABLES if name.endswith("_headline")]
    assert sorted(headlines) == ["accuracy_headline", "long_context_headline", "moe_one_gpu_headline",
                                 "one_node_70b_headline", "real_shapes_headline", "scaling_headline"]
    for name in headlines:
        head, full = rt.render(name).splitlines(), rt.render(name.removesuffix("_headline")).splitlines()
        assert len(head) == 3 and head[:2] == full[:2] and head[2] in full[2:], name


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
    doc = ROOT / "docs" / "results.md"
    for key, value in (("bind_cores", True), ("zero_set", {"reduce_bucket_size": 500000000})):
        (results / "e2e_scaling_zcandidate.json").write_text(json.dumps({**rows, key: value}))
        assert rt.stale(results, [doc]) == []
    (results / "e2e_scaling_zcandidate.json").write_text(json.dumps(rows))
    assert rt.stale(results, [doc]) == ["docs/results.md: scaling", "docs/results.md: e2e_scaling"]


def test_each_70b_row_names_the_gpus_it_ran_on_and_the_h100_run_is_shown_beside_the_h200_one():
    """Issue 57: the README's 70B heading said 4 H100s over rows measured on 4 H200s, and the H100 run (3,371 / 4,558
    tokens/s) had been overwritten; each file keeps its own device, command and date, each row names them."""
    table = rt.render("one_node_70b")
    h100 = [row for row in table.splitlines() if "| 4x H100 80GB HBM3 (2026-11-28, 5308fbd) |" in row]
    h200 = [row for row in table.splitlines() if "| 4x H200 (2026-11-28, b33f019) |" in row]
    assert [r.split(" | ")[6] for r in h100] == ["3,371 (843)", "4,558 (1,139)"]
    assert [r.split(" | ")[6] for r in h200] == ["3,561 (890)", "4,688 (1,172)", "6,087 (1,522)"]
    runs = {name: json.loads((rt.RESULTS / name).read_text()) for name in ONE_NODE_70B}
    assert {(r["device"], r["date"], r["command"].split()[-1]) for r in runs.values()} == {
        ("4x NVIDIA H100 80GB HBM3", "2026-11-28T02:05:41+00:00", "/root/out"),
        ("4x NVIDIA H200", "2026-11-28T06:16:26+00:00", "/root/out")}
    readme = (ROOT / "README.md").read_text()
    heading = next(line for line in readme.splitlines() if line.startswith("### One node: Llama-3.1-70B"))
    named = {g for g in ("H100", "H200") if g in heading}
    assert named == {g for g in ("H100", "H200") if any(f"x {g}" in row for row in h100 + h200)}, heading


def test_a_70b_memory_breakdown_splits_gpu_and_host():
    """coat.states 'host' keeps the FP8 moments in pinned host memory: the breakdown's GPU parts add up to the
    allocated peak (other_gb >= 0; it read -30.1 with 34.9 GiB of host states counted on the GPU), the states are in
    host_gb: 2.125 B/param over 4 ranks."""
    for name in ONE_NODE_70B:
        run = json.loads((rt.RESULTS / name).read_text())
        (c,) = run["configs"]
        bd = c["breakdown"]
        gpu = bd["weights_gb"] + bd["optimizer_state_gb"] + bd["grads_gb"] + bd["activations_gb"] + bd["other_gb"]
        assert bd["other_gb"] >= 0 and gpu == pytest.approx(c["equal_batch"]["peak_alloc_gb"]), name
        assert bd["optimizer_state_gb"] == 0.0 and bd["host_gb"]["optimizer_state_gb"] * 2 ** 30 == pytest.approx(
            2.125 * run["params"] / run["world_size"], rel=1e-3), name
        rung = next(r for r in run["records"] if r["kind"] == "rung" and "breakdown" in r)
        assert {k: v for k, v in rung["breakdown"].items() if k != "memory_trace"}.items() <= bd.items(), name


def test_the_breakdown_counts_what_lies_off_the_gpu_as_host():
    """What wrote the 70B file's -30.1: benchmarks' StorageCounter counted every storage as the GPU's. A GPU job's
    counter (a device object is enough, no GPU) now keeps host tensors apart, by category; a CPU job's counts all."""
    import torch

    from benchmarks.worker import StorageCounter

    states, weights = torch.zeros(1000, dtype=torch.uint8), torch.zeros(10, device="meta")
    gpu_job = StorageCounter(torch.device("cuda", 0))
    assert gpu_job.add([states, states[10:]], "optimizer_state_gb") == 0 and gpu_job.add([weights]) == 0
    assert gpu_job.host == {"optimizer_state_gb": 1000}
    cpu_job = StorageCounter(torch.device("cpu"))
    assert cpu_job.add([states, states[10:]], "optimizer_state_gb") == 1000 and cpu_job.host == {}
