"""benchmarks/e2e_scaling.py: the schedule the device call runs (which rows, in which waves, on which GPUs, what
the planner rules out, what a deadline skips, what a merge keeps) and one tiny row through e2e.py's real worker."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, child_env

sys.path.insert(0, str(ROOT))
from benchmarks import e2e_scaling as S, harness  # noqa: E402
from benchmarks import render_tables as rt  # noqa: E402


def schedule(*argv: str) -> tuple:
    args = S.parse_args(list(argv))
    runs = S.matrix(args)
    S.planned(args, runs, S.history())
    return args, runs, S.waves(runs, args.num_gpus)


def test_waves_put_the_issues_first_rows_first_on_disjoint_gpus():
    args, runs, waves = schedule()
    assert args.gpus == [1, 2, 4] and args.memory == pytest.approx(79.18 * 2 ** 30)
    order = [r.key for wave in waves for r in wave]
    assert len(order) == len(set(order)) == sum(1 for r in runs if r.rungs)
    first = {("llama3.1-8b", w, z, "largest_model") for w in (1, 2, 4) for z in (2, 3)}
    assert first <= {r.key for wave in waves[:4] for r in wave}               # 8B largest-model: the first waves
    bf16 = [order.index(("llama3.1-8b", 4, z, "bf16")) for z in (2, 3)]
    lowest = [i for i, k in enumerate(order) if k[3] == "lowest_memory"]
    assert max(bf16) < min(lowest)                                           # BF16 at 4 GPUs before lowest-memory
    for wave in waves:
        assert sum(r.world for r in wave) <= 4
        ids = [int(i) for d in harness.devices(r.world for r in wave) for i in d.split(",")]
        assert sorted(ids) == list(range(len(ids)))                          # disjoint, from GPU 0
    for r in runs:
        assert len(r.rungs) == (2 if r.planned else 0) and r.est_s >= 0
        assert r.rungs in ((), (r.common, r.planned), (r.planned, r.planned + 1))
    common = {m: min(r.planned for r in runs if r.model == m and r.world == 1 and r.preset != "bf16" and r.planned)
              for m in S.MODELS}
    assert all(r.common == common[r.model] for r in runs)
    not_run = {r.key for r in runs if not r.rungs}
    assert ("llama3.1-8b", 1, 2, "bf16") in not_run and ("llama3.1-8b", 4, 3, "bf16") not in not_run


def test_eight_gpus_add_70b_on_zero3():
    args, runs, waves = schedule("--num-gpus", "8")
    assert args.gpus == [1, 2, 4, 8]
    big = {r.preset: r for r in runs if r.model == S.BIG}
    assert {(r.world, r.stage) for r in big.values()} == {(8, 3)} and set(big) == {"largest_model", "bf16"}
    assert big["largest_model"].planned >= 1 and not big["bf16"].rungs       # BF16 does not fit 8 GPUs at 70B
    assert waves[0][0].model == S.BIG
    eargs = S.worker_args(args, big["largest_model"], "0,1,2,3,4,5,6,7")
    assert eargs.num_gpus == 8 and eargs.devices == "0,1,2,3,4,5,6,7"
    assert (eargs.equal_batch, eargs.then_batch, eargs.max_rungs) == (*big["largest_model"].rungs, 2)


def test_plan_only_prints_the_waves_and_a_deadline_runs_nothing_but_keeps_merged_rows(tmp_path, capsys):
    assert S.main(["--plan-only", "--models", "llama2-13b", "--configs", "largest_model"]) == 0
    text = capsys.readouterr().out
    assert "wave 1:" in text and "predicted: ~" in text and "llama3.1-8b" not in text
    top = {"micro_batch": 4, "tokens_per_s_per_gpu": 1.0, "peak_alloc_gb": 60.0, "planner_peak_gb": 61.0, "exact": 0}
    earlier = {"calls": [{"device": "H100", "date": "d", "command": "c", "versions": {}, "commit": "x"}],
               "cases": {"c": {"configs": [{"model": "llama2-13b", "world_size": 4, "zero_stage": 2, "label": "l",
                                            "preset": "largest_model", "largest": top}]}}}
    (tmp_path / "old.json").write_text(json.dumps(earlier))
    argv = ["--models", "llama2-13b", "--configs", "largest_model,bf16", "--merge", str(tmp_path / "old.json"),
            "--deadline", "0", "--out", str(tmp_path / "out")]
    assert S.main(argv) == 0
    res = json.loads((tmp_path / "out" / "e2e_scaling.json").read_text())
    skipped = {s["job"]: s["why"] for s in res["skipped"]}
    assert res["device"] == "H100" and res["waves"] == [] and "llama2-13b x4 ZeRO-2 largest_model" not in skipped
    assert skipped["llama2-13b x4 ZeRO-3 largest_model"].startswith("predicted ")
    rows = {S.key_of(c): c for case in res["cases"].values() for c in case["configs"]}
    assert rows[("llama2-13b", 4, 2, "largest_model")]["largest"] == top
    assert rows[("llama2-13b", 4, 2, "bf16")]["verdict"].startswith("does not fit (planner: ")


def test_zero_set_reaches_the_planner_and_the_workers_and_keeps_merges_apart(tmp_path):
    """--zero-set (the candidate bucket size of docs/deepspeed.md, "Scaling") changes the planned peak as the worker's
    config will, goes to e2e.py's worker, and is written down; a file measured without it is not merged."""
    base, runs, _ = schedule("--models", "llama2-13b", "--configs", "largest_model", "--stages", "3", "--gpus", "4")
    big, runs5, _ = schedule("--models", "llama2-13b", "--configs", "largest_model", "--stages", "3", "--gpus", "4",
                             "--zero-set", "reduce_bucket_size=5e8")
    assert big.zero_set == {"reduce_bucket_size": 500_000_000} and base.zero_set == {}
    (r,), (r5,) = runs, runs5
    peak = [S.plan.plan(S.job(a, x.model, x.config, 3, 4), 2).peak for a, x in ((base, r), (big, r5))]
    assert peak[1] - peak[0] == pytest.approx(2 * (500_000_000 - 50_000_000), rel=0.5)   # bf16 bucket, ~0.84 GiB
    eargs = S.worker_args(big, r5, "0,1,2,3")
    assert eargs.zero_set == "reduce_bucket_size=5e8" and S.worker_args(base, r, "0,1,2,3").zero_set is None
    (tmp_path / "old.json").write_text(json.dumps({"calls": [], "cases": {}}))
    with pytest.raises(SystemExit, match=r"followed another setting \(zero_set differ: {'zero_set': {}} there, "
                                         "{'zero_set': {'reduce_bucket_size'"):
        S.merged_rows([str(tmp_path / "old.json")], vars(big))
    assert S.merged_rows([str(tmp_path / "old.json")], vars(base)) == ({}, [])
    with pytest.raises(SystemExit):
        S.parse_args(["--zero-set", "reduce_bucket=5e8"])


def test_bind_cores_gives_rows_side_by_side_disjoint_cores(monkeypatch, tmp_path):
    """--bind-cores: each row's ranks on its GPUs' share of the host's cores, written down, kept apart in merges."""
    monkeypatch.setattr("benchmarks.configs.shutil.which", lambda name: f"/usr/bin/{name}")   # numactl, anywhere
    monkeypatch.setattr("benchmarks.common.os.cpu_count", lambda: 64)
    args, runs, waves = schedule("--bind-cores")
    two = next(r for r in runs if r.world == 2 and r.rungs)
    assert S.worker_args(args, two, "2,3").bind_cores == "32-47,48-63"
    assert S.worker_args(args, two, None).bind_cores == "all"                   # CPU ranks: no devices
    plain, runs0, _ = schedule()
    assert S.worker_args(plain, runs0[0], "0").bind_cores is None
    (tmp_path / "old.json").write_text(json.dumps({"calls": [], "cases": {}}))
    with pytest.raises(SystemExit, match="bind_cores differ: {'bind_cores': False} there, {'bind_cores': True} in"):
        S.merged_rows([str(tmp_path / "old.json")], vars(args))


@pytest.mark.slow   # ~10 s alone; more on a loaded machine
def test_one_tiny_row_through_the_real_worker(tmp_path):
    """--smoke: one ZeRO-3 row, two rungs (the common micro-batch, then the planner's largest + 1) in e2e's worker,
    profiled at the first (--profile)."""
    cmd = [sys.executable, "-m", "benchmarks.e2e_scaling", "--smoke", "--gpus", "1", "--stages", "3", "--configs",
           "largest_model", "--profile", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "e2e_scaling.json").read_text())
    assert {"device", "versions", "command", "date", "commit"} <= res.keys() and res["versions"]["torch"]
    (case,) = res["cases"].values()
    (row,) = case["configs"]
    assert case["smoke"] and row["ds_config"]["zero_optimization"]["stage"] == 3 and not row["errors"]
    assert row["cores"] >= 1 and row["omp_threads"] >= 1 and res["bind_cores"] is False
    assert [g["micro_batch"] for g in row["rungs"]] == row["rungs_planned"] == [1, 2]
    assert row["common"]["micro_batch"] == 1 and row["largest"]["micro_batch"] == 2
    assert row["largest"]["tokens_per_s_per_gpu"] == row["largest"]["tokens_per_s"] > 0
    prof = row["profile"]   # CPU: host calls, no device events
    assert prof["micro_batch"] == 1 and prof["host"] and prof["streams"] == ["no device events"], prof
    (s,) = res["summary"]
    assert s["efficiency_common"] == 1.0 and s["coat_over_bf16"] is None
    assert "| tiny, 1, ZeRO-3 |" in rt.render("e2e_scaling", tmp_path)
    assert re.search(r"\| tiny, ZeRO-3, largest-model \| [^|]+ \| 1 \|", rt.render("scaling", tmp_path))
    assert (tmp_path / "e2e_scaling.png").stat().st_size > 10_000


def test_tables_say_not_measured_without_the_json(tmp_path):
    assert "not measured yet" in rt.render("scaling", tmp_path) and "not measured yet" in rt.render("e2e_scaling",
                                                                                                   tmp_path)
    assert Path(rt.RESULTS / "e2e_scaling.json").is_file() or "not measured yet" in rt.render("scaling")
