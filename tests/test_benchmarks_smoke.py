"""The end-to-end benchmarks in --smoke mode (CPU, tiny Llama, real DeepSpeed engines, one process per
configuration) and the micro-batch search they rely on.

The smokes run at the same time (they are mostly process start-up) and write to a temporary directory,
never to benchmarks/results/. Their coat workers step with coat_ds's CPU op, which CI's setup JIT-builds into
the cache every test process shares (tests/conftest.py): its reference path took half of such a worker's time."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.configs import CONFIGS, ds_config, parse_zero_set  # noqa: E402
from benchmarks.e2e import main as e2e_main, max_micro_batch  # noqa: E402
from benchmarks.worker import next_batch, oom_needed_gb  # noqa: E402

GIB = 2 ** 30
E2E_SMOKE = "bf16,coat_opt,coat_full"   # e2e.py's default but the bf16 master, which real_shapes' smoke runs


# ---------------------------------------------------------------------------------------------------------
# The micro-batch search (pure function)
# ---------------------------------------------------------------------------------------------------------
def _search(peak_of, limit: float, start: int = 1, max_batch: int = 1024, known_fail: int | None = None):
    """Drive next_batch the way the worker does, with a synthetic peak-memory model."""
    lo, hi, points, tried = None, known_fail, [], []
    b = start
    while b is not None and len(tried) < 20:
        tried.append(b)
        peak = peak_of(b)
        if peak <= limit:
            lo = b if lo is None else max(lo, b)
            points.append((b, peak))
        else:
            hi = b if hi is None else min(hi, b)
        b = next_batch(points, lo, hi, limit, max_batch)
    return lo, hi, tried


def test_search_finds_the_largest_fitting_batch_of_a_linear_model_in_few_tries():
    limit = 80 * GIB
    peak = lambda b: 22 * GIB + 6.5 * GIB * b   # noqa: E731  (bf16 1B at seq 2048, roughly)
    lo, hi, tried = _search(peak, limit)
    assert lo == 8 and peak(lo) <= limit < peak(lo + 1)
    assert len(tried) <= 5, tried


def test_search_bisects_when_memory_grows_faster_than_linear():
    limit = 100.0
    peak = lambda b: 10 + b * b   # noqa: E731  (the linear fit overshoots; bisection has to correct it)
    lo, hi, tried = _search(peak, limit)
    assert lo == 9 and hi == 10, tried
    assert len(tried) <= 8, tried


def test_search_respects_max_batch_known_failure_and_a_start_that_does_not_fit():
    lo, hi, tried = _search(lambda b: float(b), limit=1e9, max_batch=16)
    assert lo == 16 and tried[-1] == 16 and len(tried) <= 5, tried
    lo, hi, tried = _search(lambda b: float(b), limit=1e9, start=4, known_fail=6)
    assert lo == 5 and hi == 6
    lo, hi, tried = _search(lambda b: 10.0 * b, limit=25.0, start=8)
    assert lo == 2 and hi == 3, tried
    lo, hi, tried = _search(lambda b: 10.0 * b, limit=5.0, start=2)
    assert lo is None and tried == [2, 1]


def test_configs_share_everything_but_the_named_change():
    cfgs = {n: ds_config(n, micro_batch=3, zero_stage=1, on_cpu=True, lr=1e-4, total_steps=50, warmup_steps=5)
            for n in CONFIGS}
    for c in cfgs.values():
        assert c["train_micro_batch_size_per_gpu"] == 3 and c["gradient_accumulation_steps"] == 1
        assert c["zero_optimization"]["stage"] == 1
        assert c["optimizer"]["params"]["lr"] == 1e-4
        assert c["scheduler"]["params"]["total_num_steps"] == 50
    assert cfgs["bf16"]["optimizer"]["type"].lower() in ("adam", "adamw")
    assert cfgs["bf16"]["optimizer"]["params"].get("torch_adam") is True     # CPU: no FusedAdam build
    assert not (cfgs["bf16"].get("coat", {}).get("activation", {}).get("enabled", False))
    assert cfgs["coat_opt"]["optimizer"]["type"] == "CoatAdamW"
    assert not (cfgs["coat_opt"].get("coat", {}).get("activation", {}).get("enabled", False))
    assert cfgs["coat_opt"]["coat"]["loss"] == {"chunked": False}   # optimizer-only: BF16's loss as well
    assert cfgs["lowest_memory"]["coat"]["master_weights"] == "bf16_sr"
    assert cfgs["lowest_memory"]["coat"]["activation"]["attention_fp8"] is True
    assert "loss" not in cfgs["lowest_memory"]["coat"]   # the chunked loss by default
    assert cfgs["coat_full"]["optimizer"]["type"] == "CoatAdamW"
    assert cfgs["coat_full"]["coat"]["activation"].get("enabled", True)
    for n, master in (("coat_full_bf16sr", "bf16_sr"), ("coat_full_bf16rn", "bf16_rn")):
        assert cfgs[n]["coat"] == dict(cfgs["coat_full"]["coat"], master_weights=master)
        assert ({k: v for k, v in cfgs[n].items() if k != "coat"}
                == {k: v for k, v in cfgs["coat_full"].items() if k != "coat"})
    assert "master_weights" not in cfgs["coat_full"]["coat"]
    with pytest.raises(ValueError, match="allowed"):
        ds_config("fp16", micro_batch=1)


def test_zero_set_overrides_zero_optimization_and_refuses_bad_input_in_one_line(capsys):
    """e2e --zero-set: ZeRO's bucket and overlap keys for an experiment, checked before any worker starts."""
    got = parse_zero_set("reduce_bucket_size=2e8, stage3_prefetch_bucket_size=100000000,overlap_comm=false")
    assert got == {"reduce_bucket_size": 200_000_000, "stage3_prefetch_bucket_size": 100_000_000,
                   "overlap_comm": False}
    assert all(type(v) is (bool if k == "overlap_comm" else int) for k, v in got.items())
    cfg = ds_config("largest_model", micro_batch=1, zero_stage=3, zero_set=got)
    plain = ds_config("largest_model", micro_batch=1, zero_stage=3)
    assert cfg["zero_optimization"] == {**plain["zero_optimization"], **got} and cfg["zero_optimization"] != \
        plain["zero_optimization"]
    assert parse_zero_set(None) == parse_zero_set("") == {}
    for bad, why in (("stage=3", "'stage' is not a key it sets; allowed: ["),
                     ("reduce_bucket_size=1.5", "invalid for reduce_bucket_size; allowed: a whole number"),
                     ("overlap_comm=1", "invalid for overlap_comm; allowed: true or false")):
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_zero_set(bad)
        with pytest.raises(SystemExit) as e:
            e2e_main(["--zero-set", bad, "--out", "/nonexistent/never"])
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_bind_cores_binds_ranks_as_deepspeeds_launcher_does_and_refuses_bad_input_in_one_line(capsys):
    """e2e --bind-cores: DeepSpeed's --bind_cores_to_rank on a core list (numactl for one rank), disjoint lists for
    rows side by side, checked before any worker starts."""
    from benchmarks.common import core_list, parse_cores, worker_cmd

    assert core_list("2,3", 4, 64) == "32-47,48-63" and core_list("0", 1, 2) == "0-1"
    with pytest.raises(ValueError, match="8 GPUs share 4 cores"):
        core_list("0", 8, 4)
    assert parse_cores("0-3,8") == [0, 1, 2, 3, 8]
    args = argparse.Namespace(seed=3)
    two = worker_cmd("benchmarks.e2e", args, ("seed",), 2, "0,1", "0-31")
    assert two[:5] == ["deepspeed", "--include", "localhost:0,1", "--bind_cores_to_rank", "--bind_core_list"]
    assert two[5] == "0-31" and two.index("--module") > 5
    one = worker_cmd("benchmarks.e2e", args, ("seed",), 1, "2", "32-47")
    assert one[:4] == ["numactl", "-C", "32-47", sys.executable]
    assert "numactl" not in worker_cmd("benchmarks.e2e", args, ("seed",), 1)
    for bad in ("3-1", "a", "0-3,", "-2"):
        with pytest.raises(SystemExit) as e:
            e2e_main(["--bind-cores", bad, "--out", "/nonexistent/never"])
        assert e.value.code == 2 and f"--bind-cores {bad!r}" in capsys.readouterr().err
    if shutil.which("numactl") is None:
        with pytest.raises(SystemExit):
            e2e_main(["--bind-cores", "all", "--out", "/nonexistent/never"])
        assert "--bind-cores all: needs numactl on PATH" in capsys.readouterr().err


OOM = ("CUDA out of memory. Tried to allocate 25.10 GiB. GPU 0 has a total capacity of 79.19 GiB of which 12.50 GiB "
       "is free. Including non-PyTorch memory, this process has 66.68 GiB memory in use. Of the allocated memory "
       "65.90 GiB is allocated by PyTorch, and 256.00 MiB is reserved by PyTorch but unallocated.")


def test_max_micro_batch_is_zero_with_what_one_needed_when_one_does_not_fit():
    assert oom_needed_gb(OOM) == pytest.approx(65.90 + 25.10)
    assert oom_needed_gb("RuntimeError: something else") is None
    rung = {"kind": "rung", "micro_batch": 4, "fits": True, "peak_reserved_gb": 50.0}
    assert max_micro_batch([rung], rung) == {"max_micro_batch": 4}
    oom = {"kind": "oom", "micro_batch": 1, "phase": "training step", "error": OOM, "needed_gb": oom_needed_gb(OOM)}
    got = max_micro_batch([oom], None)
    assert got["max_micro_batch"] == 0 and got["needed_gb_at_1"] == pytest.approx(91.0)
    over = {"kind": "rung", "micro_batch": 1, "fits": False, "peak_reserved_gb": 78.0}
    assert max_micro_batch([over], None) == {"max_micro_batch": 0, "needed_gb_at_1": 78.0,
                                             "needed_from": "peak reserved"}
    assert max_micro_batch([], None) == {"max_micro_batch": None}


# ---------------------------------------------------------------------------------------------------------
# Both smokes, end to end
# ---------------------------------------------------------------------------------------------------------
def smoke_env(tmp: Path) -> dict[str, str]:
    """A smoke's environment: this checkout, its own corpus cache, no launcher's rank variables."""
    env = dict(os.environ, COAT_DATA_CACHE=str(tmp / "data_cache"), PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "COAT_DISABLE_OPS"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """The four smokes side by side, ~2.5 min on 2 cores (10 worker processes): the tests that read them are
    marked slow. The e2e ladders' rungs and HF's runs are capped by the smoke, not by a time budget: on a loaded
    machine the first worker's set-up alone may take a default share."""
    tmp = tmp_path_factory.mktemp("bench")
    env = smoke_env(tmp)
    runs = {
        "e2e": [sys.executable, "-m", "benchmarks.e2e", "--smoke", "--profile", "--configs", E2E_SMOKE,
                "--time-budget", "1200", "--out", str(tmp / "e2e")],
        "convergence": [sys.executable, "-m", "benchmarks.convergence", "--smoke", "--parallel",
                        "--out", str(tmp / "convergence")],
        "hf_trainer": [sys.executable, "-m", "benchmarks.hf_trainer_speed", "--smoke", "--time-budget", "1200",
                       "--out", str(tmp / "hf_trainer")],
        "real_shapes": [sys.executable, "-m", "benchmarks.e2e_real_shapes", "--smoke", "--configs", "lowest_memory",
                        "--time-budget", "1200", "--out", str(tmp / "real_shapes")],   # its bf16 row: e2e's smoke
    }
    procs = {k: subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, cmd in runs.items()}
    outs = {}
    for k, proc in procs.items():
        try:
            outs[k] = (proc.communicate(timeout=600)[0], proc.returncode)
        except subprocess.TimeoutExpired:
            proc.kill()
            outs[k] = (proc.communicate()[0], "timeout")
    return tmp, outs


@pytest.mark.slow
def test_e2e_smoke_writes_json_and_png(smoke_runs):
    tmp, outs = smoke_runs
    log, rc = outs["e2e"]
    assert rc == 0, log[-4000:]
    res = json.loads((tmp / "e2e" / "e2e.json").read_text())
    for key in ("device", "model", "memory_reduction", "speedup_at_max_batch", "configs", "versions", "command",
                "date", "seq_len", "equal_micro_batch", "world_size", "zero_stage"):
        assert key in res, key
    assert res["model"] == "tiny" and res["smoke"] is True
    assert {r["name"] for r in res["configs"]} == set(E2E_SMOKE.split(","))
    assert math.isfinite(res["memory_reduction"]) and res["memory_reduction"] > 0
    assert math.isfinite(res["speedup_at_max_batch"]) and res["speedup_at_max_batch"] > 0
    for key in ("torch", "deepspeed", "transformers", "coat_ds"):
        assert key in res["versions"]
    by = {r["name"]: r for r in res["configs"]}
    # the chunked loss wherever a "coat" section is, but optimizer-only (BF16's loss, as BF16's activations)
    assert {n: r["chunked_loss"] for n, r in by.items()} == {"bf16": False, "coat_opt": False, "coat_full": True}
    for r in by.values():
        assert r["errors"] == [], r["errors"]
        assert r["equal_batch"]["micro_batch"] == 1 and r["equal_batch"]["tokens_per_s"] > 0
        assert r["max_batch"]["micro_batch"] == 2          # the smoke's cap; CPU memory never runs out
        assert all(math.isfinite(x["loss"]) for x in r["rungs"])
        bd = r["breakdown"]
        for key in ("weights_gb", "optimizer_state_gb", "grads_gb", "activations_gb"):
            assert bd[key] > 0, (r["name"], key)
    # The accounting reads real tensors: 16-bit model + fp32 master, 8 B/param of Adam state for BF16 and
    # about 2 B/param (+ group metadata) for CoatAdamW, FP8 activations smaller than BF16 ones.
    n = res["params"]
    bf16, opt, full = by["bf16"]["breakdown"], by["coat_opt"]["breakdown"], by["coat_full"]["breakdown"]
    assert bf16["master_weights_gb"] * GIB >= 4 * n
    assert 8 * n <= bf16["optimizer_state_gb"] * GIB < 8.5 * n
    assert 2 * n <= opt["optimizer_state_gb"] * GIB < 0.5 * bf16["optimizer_state_gb"] * GIB
    assert full["optimizer_state_gb"] == pytest.approx(opt["optimizer_state_gb"])
    assert full["activations_gb"] < bf16["activations_gb"]
    assert bf16["activations_gb"] == pytest.approx(opt["activations_gb"])
    assert (tmp / "e2e" / "e2e.png").stat().st_size > 10_000
    for r in by.values():          # --profile: one step at the largest batch, from the host's side too
        prof = r["profile"]
        assert "error" not in prof, prof
        assert prof["micro_batch"] == 2 and prof["step_wall_ms"] > 0 and prof["syncs"] == {}   # CPU: no syncs
        assert prof["host"] and all(h["ms"] > 0 for h in prof["host"]) and prof["profiled_step_ms"] > 0


@pytest.mark.slow
def test_hf_trainer_smoke_compares_the_trainer_with_the_plain_loop_on_the_config_hf_fills(smoke_runs):
    """HF Trainer and the plain loop build the same engine from the HF config: one param group (HF's, for a
    config optimizer), reduce_bucket_size = hidden_size^2 where the config says "auto" and the tuned value
    where it is set; each run is timed and profiled for one step."""
    tmp, outs = smoke_runs
    log, rc = outs["hf_trainer"]
    assert rc == 0, log[-4000:]
    res = json.loads((tmp / "hf_trainer" / "hf_trainer.json").read_text())
    for key in ("device", "versions", "command", "date", "seq_len", "runs", "trainer_over_plain", "coat_over_bf16"):
        assert key in res, key
    hidden = 256                                                    # e2e.MODELS["tiny"]
    by = {r["spec"]: r for r in res["runs"]}
    assert set(by) == {"trainer:bf16:tiny:1:hf_auto", "trainer:coat:tiny:1:hf_auto:profile",
                       "trainer:coat:tiny:1:one_gpu", "plain:coat:tiny:1:one_gpu:profile"}
    for spec, r in by.items():
        assert "error" not in r and r["tokens_per_s"] > 0 and math.isfinite(r["loss"]), (spec, r.get("error"))
        assert len(r["step_times_s"]) == res["timed_steps"] and r["param_groups"] == 1
        auto = r["tuning"] == "hf_auto"
        assert r["zero_optimization"]["reduce_bucket_size"] == (hidden * hidden if auto else 50_000_000), spec
        assert r["zero_optimization"]["overlap_comm"] is auto, spec
        assert r["optimizer"] == ("CoatAdamW" if r["preset"] == "coat" else "AdamW")
        assert r["fp8_layers"] == (1 if r["preset"] == "coat" else 0)
        prof = r["profile"]
        if not r["profiled"]:
            assert prof is None
            continue
        assert prof["syncs"] == {} and prof["host"] and prof["profiled_step_ms"] > 0   # CPU: no device syncs
        assert all(h["ms"] > 0 for h in prof["host"]) and prof["gpu_gaps"] == ["no device events"]
        assert prof["streams"] == ["no device events"]
    assert set(res["trainer_over_plain"]) == {"coat:tiny:1:one_gpu"}
    assert res["trainer_over_plain"]["coat:tiny:1:one_gpu"] > 0
    assert set(res["coat_over_bf16"]) == {"trainer:tiny:1:hf_auto"}
    assert (tmp / "hf_trainer" / "hf_trainer.png").stat().st_size > 10_000


def test_hf_trainer_runs_are_checked_before_any_process_starts():
    from benchmarks.hf_trainer_speed import parse_run

    assert parse_run("trainer:coat:llama-1b:4:tuned")["micro_batch"] == 4
    assert parse_run("plain:coat:llama-1b:4:tuned:profile")["profiled"] is True
    for bad, key in (("trainer:coat:llama-1b:4", "path:preset"), ("plain:coat:llama-1b:4:tuned:trace", "path:preset"),
                     ("train:coat:llama-1b:4:tuned", "path 'train'"),
                     ("plain:fp8:llama-1b:4:tuned", "preset 'fp8'"), ("plain:coat:llama-1b:0:tuned", "micro_batch"),
                     ("plain:coat:llama-1b:4:fast", "tuning 'fast'")):
        with pytest.raises(ValueError, match=key):
            parse_run(bad)


@pytest.mark.slow
def test_convergence_smoke_writes_json_png_and_a_state_quant_error_reads(smoke_runs):
    from benchmarks import quant_error

    tmp, outs = smoke_runs
    log, rc = outs["convergence"]
    assert rc == 0, log[-4000:]
    out = tmp / "convergence"
    res = json.loads((out / "convergence.json").read_text())
    for key in ("steps", "bf16_val_loss", "coat_val_loss", "val_loss_gap_rel", "versions", "command", "date",
                "device", "model", "runs"):
        assert key in res, key
    assert res["steps"] == 3
    assert res["val_loss_gap_rel"] == pytest.approx((res["coat_val_loss"] - res["bf16_val_loss"]) /
                                                    res["bf16_val_loss"])
    for name, run in res["runs"].items():
        assert run["status"] == "ok", (name, run.get("log_tail"))
        assert [s for s, _ in run["train"]] == [1, 2, 3]
        assert all(math.isfinite(v) for _, v in run["train"] + run["val"])
    # same seed, same data: the first step's loss is the same model on the same batch in every configuration
    first = [run["train"][0][1] for run in res["runs"].values()]
    assert max(first) - min(first) < 0.05 * abs(first[0])
    assert (out / "convergence.png").stat().st_size > 10_000

    state = out / "adam_state_bf16.pt"
    assert res["adam_state"]["path"] == str(state)
    quant_error.main(["--state", str(state), "--out", str(tmp / "quant_error.json")])
    table = json.loads((tmp / "quant_error.json").read_text())
    assert table["numel"] == res["adam_state"]["numel"] > 0
    assert all(0 <= r["m_rel_err"] < 1 and 0 <= r["v_rel_err"] < 1 for r in table["rows"])


def test_llama_layer_dry_run_times_each_variant_and_compares_its_gradients_with_bf16(tmp_path, capsys):
    from benchmarks import llama_layer

    out = tmp_path / "layer.json"
    cmd = [sys.executable, "-m", "benchmarks.llama_layer", "--dry-run", "--shapes", "llama2-7b",
           "--variants", "bf16_eager", "coat_full", "--iters", "2", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["bf16_eager", "coat_full"]
    for r in rows:
        assert r["fwd_bwd_ms"] > 0 and r["date"] and r["command"] and r["versions"]["torch"]
    assert rows[0]["dx_cos_vs_bf16_eager"] == pytest.approx(1.0)          # bf16 against itself
    assert 0.99 < rows[1]["dx_cos_vs_bf16_eager"] < 1.0 + 1e-6              # FP8: close, not equal
    with pytest.raises(SystemExit) as bad:   # in this process: a second one took ~2 s to import what it refuses
        llama_layer.parse_args(["--iters", "0"])
    assert bad.value.code == 2 and "--iters=0 is invalid; allowed: an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow  # ~15 s with warm caches, 20-45 s in a fresh clone
def test_seed_spread_smoke_statistics_recompute_from_each_seed_and_merge_keeps_what_ran(tmp_path):
    import statistics

    from benchmarks import seed_spread

    proc = subprocess.run([sys.executable, "-m", "benchmarks.seed_spread", "--smoke", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=smoke_env(tmp_path), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "seed_spread.json").read_text())
    for key in ("device", "versions", "command", "date", "calls", "default"):
        assert key in res, key
    sec = res["default"]
    assert sec["recipe"]["steps"] == 4 and sec["steps_compared"] == 4
    assert set(sec["runs"]) == {"bf16", "coat_full"} and all(set(r) == {"0", "1"} for r in sec["runs"].values())
    # the seed changes the weights and the data: the two seeds' curves differ
    assert sec["runs"]["bf16"]["0"]["val"] != sec["runs"]["bf16"]["1"]["val"]
    st = {}
    for name, runs in sec["runs"].items():
        final = [dict(runs[s]["val"])[4] for s in ("0", "1")]
        best = [min(v for _, v in runs[s]["val"]) for s in ("0", "1")]
        got = sec["summary"][name]
        assert got["seeds"] == [0, 1] and got["final"] == final and got["best"] == best
        assert got["final_mean"] == pytest.approx(sum(final) / 2)
        assert got["final_std"] == pytest.approx(abs(final[0] - final[1]) / math.sqrt(2))   # n - 1
        assert got["best_std"] == pytest.approx(statistics.stdev(best))
        st[name] = got
    b = st["bf16"]   # BF16's band: verdicts.band, the accuracy benchmark's (mean +- the wider of 2 std and 0.5%)
    half = max(2 * b["final_std"], 0.005 * b["final_mean"])
    lo, hi = b["final_mean"] - half, b["final_mean"] + half
    assert [sec["bf16_band"]["low"], sec["bf16_band"]["high"]] == pytest.approx([lo, hi])
    for got in st.values():
        assert got["gap_rel_mean"] == pytest.approx((got["final_mean"] - b["final_mean"]) / b["final_mean"])
        assert got["within_bf16_spread"] is (lo <= got["final_mean"] <= hi)
    assert (tmp_path / "out" / "seed_spread.png").stat().st_size > 10_000
    # merging: a later run of a pair replaces it, a run that saved no curve does not
    new = {"status": "ok", "val": [[2, 1.0], [4, 0.5]], "steps_done": 4}
    seed_spread.merge(sec, {("bf16", 0): {"status": "failed (exit 1)", "val": []}, ("bf16", 1): new}, call=1)
    seed_spread.summarize(sec)
    assert sec["runs"]["bf16"]["0"]["call"] == 0 and sec["runs"]["bf16"]["1"]["val"] == new["val"]
    assert sec["summary"]["bf16"]["final"] == [st["bf16"]["final"][0], 0.5]


@pytest.mark.slow
def test_e2e_real_shapes_smoke_merges_its_case_and_records_the_loss_path(smoke_runs):
    """e2e_real_shapes --smoke --configs lowest_memory: the tiny case through e2e's worker (the chunked loss, a
    bf16 master, attention in FP8); a later run of one configuration keeps the case's other rows."""
    from benchmarks.harness import merged

    tmp, outs = smoke_runs
    log, rc = outs["real_shapes"]
    assert rc == 0, log[-4000:]
    path = tmp / "real_shapes" / "e2e_real_shapes.json"
    case = json.loads(path.read_text())["cases"]["tiny"]
    for key in ("device", "model", "shape", "seq_len", "summary", "configs", "versions", "command", "date"):
        assert key in case, key
    (s,) = case["summary"]
    assert s["name"] == "lowest_memory" and s["chunked_loss"] is True and case["smoke"] is True
    assert s["max_micro_batch"] == 2 and s["tokens_per_s"] > 0   # the smoke's cap
    assert case["meets_target"] is True and case["bf16_fits_at_1"] is None   # BF16 not run here
    (coat,) = case["configs"]
    assert coat["ds_config"]["coat"]["master_weights"] == "bf16_sr"
    assert coat["ds_config"]["coat"]["activation"]["attention_fp8"] is True
    assert all(math.isfinite(x["loss"]) for r in case["configs"] for x in r["rungs"])
    assert all(r["measured"]["command"] and r["measured"]["date"] for r in case["configs"])
    # a later run of one configuration keeps the case's other rows
    kept = list(merged(lambda r: r["name"], [dict(coat, name="bf16"), coat], [dict(coat, tokens_per_s=1.0)]).values())
    assert [r["name"] for r in kept] == ["bf16", "lowest_memory"] and kept[1]["tokens_per_s"] == 1.0
    assert (tmp / "real_shapes" / "e2e_real_shapes.png").stat().st_size > 10_000


@pytest.mark.slow  # ~15 s with warm caches, 20-45 s in a fresh clone
@pytest.mark.one_core   # one worker at a time
def test_offload_smoke_rows_account_for_every_host_byte(tmp_path):
    """benchmarks.offload --smoke (ZeRO-2 Offload on DeepSpeed's CPU accelerator): each row's host tensors add
    up by category, per parameter, to the bytes of the layout DeepSpeed and the bf16 master keep, and to the
    prediction the benchmark skips rows by."""
    from benchmarks import offload

    cmd = [sys.executable, "-m", "benchmarks.offload", "--smoke", "--configs",
           "coat_full,coat_full_bf16sr", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=smoke_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "offload.json").read_text())
    assert {"device", "versions", "command", "date"} <= res.keys()
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"coat_full", "coat_full_bf16sr"}
    master_b = {"coat_full": 4, "coat_full_bf16sr": 2}   # fp32 master and gradient, or bf16 ones
    for name, r in rows.items():
        assert r["fits"] and r["model"] == "tiny" and r["micro_batch"] == 2 and r["tokens_per_s"] > 0
        assert r["host_rss_peak_gb"] >= r["host_rss_stages_gb"]["engine_built"] > 0 and r["host_rss_gb"] > 0
        acc, n = r["host_accounting"], r["params"]
        cats = acc["categories"]
        for c in cats.values():
            assert c["per_param"] == pytest.approx(c["bytes"] / n)
        assert acc["host_total_bytes"] == sum(c["bytes"] for k, c in cats.items() if k != "other")
        assert r["host_optimizer_bytes_per_param"] == pytest.approx((cats["master"]["bytes"] +
                                                                     cats["optimizer_states"]["bytes"]) / n)
        # padding to DeepSpeed's alignment and per-parameter FP8 groups: a few percent at this size
        assert cats["master"]["per_param"] == pytest.approx(master_b[name], rel=0.02)
        assert cats["master_grads"]["per_param"] == pytest.approx(master_b[name], rel=0.02)
        assert 2.125 <= cats["optimizer_states"]["per_param"] <= 2.25
        # bf16_sr: DeepSpeed's bf16 staging buffer *is* the master, nothing beside it
        assert cats["bf16_staging"]["per_param"] == (pytest.approx(2, rel=0.02) if name == "coat_full" else 0)
        groups, largest = offload.model_numels("tiny")
        pred = offload.predict_host(groups, largest, name, pinned=False, pow2=False, base=0)
        assert acc["host_total_bytes"] == pytest.approx(pred["steady_bytes"], rel=0.03)
    assert (tmp_path / "offload.png").stat().st_size > 10_000


def test_gpu_gaps_of_a_trace():
    """The step probe's idle-time read-out: overlapping device events count once, gaps between them are idle."""
    from benchmarks.common import gpu_gaps

    ev = [("kernel", 0, 10, "a"), ("kernel", 5, 10, "b"), ("gpu_memset", 40, 5, "c"), ("cpu_op", 0, 100, "x"),
          ("kernel", 50, 10, "d")]
    text = gpu_gaps({"traceEvents": [{"cat": c, "ts": t, "dur": d, "name": n} for c, t, d, n in ev]})
    head, first, second = text.splitlines()
    assert head == "GPU span 0.06 ms, busy 0.03, idle 0.03 in 2 gaps"
    assert first.split()[:4] == ["25.0", "us", "after", "b"] and second.split()[0] == "5.0"


def test_stream_gaps_of_a_trace():
    """Per stream busy time, then the busiest stream's idle gaps with what other streams ran inside each."""
    from benchmarks.common import stream_gaps

    ev = [(7, 0, 40, "gemm"), (7, 100, 50, "gemm"), (7, 160, 40, "gemm"), (9, 30, 30, "reduce_scatter"),
          (9, 60, 20, "adamw_step"), (9, 70, 5, "norm")]
    trace = {"traceEvents": [{"cat": "kernel", "ts": t, "dur": d, "name": n, "args": {"stream": k}}
                             for k, t, d, n in ev] + [{"cat": "cpu_op", "ts": 0, "dur": 500, "name": "x"}]}
    lines = stream_gaps(trace).splitlines()
    assert lines[:3] == ["stream 7: busy 0.13 ms of 0.20 (3 events)", "stream 9: busy 0.05 ms of 0.20 (3 events)",
                         "stream 7 idle 0.07 ms in 2 gaps; the longest:"]
    # the 60 us gap (40-100): reduce_scatter's 20 us and the step's 20 inside it, the norm's 5 us within the step
    assert lines[3].split()[:5] == ["60.0", "us", "after", "gemm", "before"]
    assert lines[3].endswith("meanwhile: reduce_scatter 20 us, adamw_step 20 us")
    assert lines[4].endswith("meanwhile: nothing") and lines[4].split()[0] == "10.0"
    assert stream_gaps({"traceEvents": []}) == "no device events\n"


def test_harness_stops_a_job_that_saves_kills_one_that_does_not_and_merges_rows_by_identity(tmp_path, capsys):
    """benchmarks/harness.py, what every runner now leaves to it: a job told to stop at the deadline's stop (SIGTERM
    to its process group) saves and exits (and a launcher that dies at once is waited for until its child has); one
    that ignores it is killed at the kill; waves on disjoint GPUs; rows
    merged by identity, an ended row never replaced by a partial or failed one; a file of another setting refused."""
    import time

    from benchmarks import harness

    job = ("import signal, subprocess, sys, time, pathlib\n"
           "def stop(*_):\n    time.sleep(sys.argv[2] == 'late')\n"
           "    pathlib.Path(sys.argv[1]).write_text('saved'); sys.exit(143)\n"
           "if sys.argv[2] == 'launcher':   # dies at SIGTERM, as DeepSpeed's runner, while its rank saves\n"
           "    subprocess.Popen([sys.executable, sys.argv[0], sys.argv[1], 'late'])\n"
           "else:\n    signal.signal(signal.SIGTERM, stop if sys.argv[2] in ('saves', 'late') else signal.SIG_IGN)\n"
           "print('started', flush=True)\ntime.sleep(60)\n")
    (tmp_path / "job.py").write_text(job)
    now = time.time()
    saves = harness.run_process([sys.executable, str(tmp_path / "job.py"), str(tmp_path / "a"), "saves"],
                                stop_at=now + 1.5, kill_at=now + 20)
    assert saves["signalled"] and not saves["killed"] and saves["exit_code"] == 143 and saves["wall_s"] < 15
    assert (tmp_path / "a").read_text() == "saved" and saves["tail"] == "started\n"
    stubborn = harness.run_process([sys.executable, str(tmp_path / "job.py"), str(tmp_path / "b"), "ignores"],
                                   stop_at=now, kill_at=time.time() + 2, log=tmp_path / "b.log")
    assert stubborn["signalled"] and stubborn["killed"] and stubborn["exit_code"] == -9
    assert not (tmp_path / "b").exists()
    assert "started" in (tmp_path / "b.log").read_text()
    launched = harness.run_process([sys.executable, str(tmp_path / "job.py"), str(tmp_path / "c"), "launcher"],
                                   stop_at=time.time() + 1.5, kill_at=time.time() + 20, log=tmp_path / "c.log")
    assert launched["signalled"] and not launched["killed"] and (tmp_path / "c").read_text() == "saved"   # waited
    assert harness.run_worker([sys.executable, "-c", "import time; time.sleep(30)"], 1.0)[0] == 124

    waves = harness.pack([1, 2, 1, 4, 1], 4, size=lambda n: n, joins=lambda wave, n: True)
    assert waves == [[1, 2, 1], [4], [1]] and harness.devices([1, 2, 1]) == ["0", "1,2", "3"]
    ones = lambda wave, n: n == 1  # noqa: E731
    assert harness.pack([1, 2, 1], 4, lambda n: n, ones) == [[1, 1], [2]]                  # the later 1 joins early
    assert harness.pack([1, 2, 1], 4, lambda n: n, ones, in_order=True) == [[1], [2, 1]]   # in order: not past the 2
    old = [{"k": 1, "status": "done", "steps_done": 9}, {"k": 2, "status": "partial"}]
    new = [{"k": 1, "status": "partial", "steps_done": 10}, {"k": 2, "status": "failed"}, {"k": 3}]
    rows = harness.merged(lambda r: r["k"], old, new, [{"k": 3, "x": 1}])
    assert [(k, r.get("status"), r.get("x")) for k, r in rows.items()] == [(1, "done", None), (2, "partial", None),
                                                                           (3, None, 1)]
    assert harness.Deadline(100, stop_s=40).fits(50) and not harness.Deadline(100, stop_s=60).fits(50)
    (tmp_path / "old.json").write_text(json.dumps({"seq_len": 32, "calls": [{"date": "d"}]}))
    seq = lambda doc: {"seq": doc["seq_len"]}  # noqa: E731
    docs = harness.merge_files([str(tmp_path / "old.json"), str(tmp_path / "none.json")], seq, {"seq": 32})
    assert harness.calls_of(docs + docs) == [{"date": "d"}]
    assert "none.json: no such file; skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"old.json: its rows followed another setting \(seq differ: {'seq': 32} "
                                         r"there, {'seq': 64} in this call\); allowed: "):
        harness.merge_files([str(tmp_path / "old.json")], seq, {"seq": 64})
