"""benchmarks/moe_one_gpu.py as a case over the harness: its CPU smoke on a tiny Qwen3-MoE through real worker
processes (the step breakdown, gradient accumulation, the preset as written), rows merged into one file by identity,
the committed results file still read and merged into, a file of another setting refused."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from harness import ROOT, child_env

sys.path.insert(0, str(ROOT))
from benchmarks import harness as H, moe_one_gpu as M  # noqa: E402
from benchmarks.common import RESULTS  # noqa: E402


def smoke(*argv: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe_one_gpu", "--smoke", *argv], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.slow   # two worker processes: ~70 CPU-s
def test_smoke_breakdown_accumulation_and_a_second_call_merged(tmp_path):
    """coat's FP8 layers with the step breakdown over two accumulated micro-batches, then the stock layers with the
    preset as written (release, host states) in a second call, merged into the same file."""
    smoke("--configs", "coat", "--micro-batches", "1", "--grad-accum", "2", "--breakdown", "--steps", "2",
          "--out", str(tmp_path))
    doc = json.loads((tmp_path / "moe_one_gpu.json").read_text())
    assert doc["model"] == M.SMOKE_MODEL and doc["shape"]["model_type"] == "qwen3_moe" and len(doc["calls"]) == 1
    (row,) = doc["rows"]
    assert (row["config"], row["micro_batch"], row["seq"], row["grad_accum"], row["fits"]) == ("coat", 1, 32, 2, True)
    # tokens/s counts both micro-batches of a step; the three phases, each timed alone, make up the step
    assert row["tokens_per_s"] == pytest.approx(1 * 2 * 32 / row["step_time_s"])
    phases = sum(row[f"{k}_s"] for k in M.PHASES)
    assert min(row[f"{k}_s"] for k in M.PHASES) > 0 and 0.5 * row["step_time_s"] < phases <= row["step_time_s"]
    assert (row["gradients"], row["states"]) == ("per_parameter", "device") and len(row["losses"]) == 2
    smoke("--configs", "stock", "--micro-batches", "1", "--steps", "1", "--out", str(tmp_path))   # the preset as is
    doc = json.loads((tmp_path / "moe_one_gpu.json").read_text())
    assert [M.identity(r) for r in doc["rows"]] == [("coat", 1, 32, 2), ("stock", 1, 32, 1)]
    assert (doc["rows"][1]["gradients"], doc["rows"][1]["states"], doc["rows"][1]["fits"]) == ("release", "host", True)
    assert "forward_s" not in doc["rows"][1] and len(doc["calls"]) == 2 and doc["rows"][0] == row


def test_the_committed_file_is_read_and_a_new_row_merges_into_it(tmp_path):
    """results/moe_one_gpu.json takes a later call's row by identity, keeps its own rows, keys and note, and counts
    its call; a call of another shape is refused in one line."""
    committed = json.loads((RESULTS / "moe_one_gpu.json").read_text())
    args = M.parse_args([])
    assert args.out == RESULTS and (args.model, args.seq, args.batches) == (M.MODEL, 4096, [1, 2, 4])
    new = dict(committed["rows"][1], tokens_per_s=1.0, date="new")              # coat, micro-batch 2, again
    extra = dict(committed["rows"][0], micro_batch=3)
    doc = M.results(args, [new, extra], {"date": "D", "device": "H"})
    assert [M.identity(r) for r in doc["rows"]] == [M.identity(r) for r in committed["rows"]] + [("coat", 3, 4096, 1)]
    assert doc["rows"][0] == committed["rows"][0] and doc["rows"][1]["tokens_per_s"] == 1.0
    calls = H.calls_of([committed])
    assert doc["note"] == committed["note"] and doc["calls"][:len(calls)] == calls
    assert (doc["date"], doc["device"], len(doc["calls"])) == ("D", "H", len(calls) + 1)
    assert {k: doc[k] for k in M.SETTING} == {k: committed[k] for k in M.SETTING}
    with pytest.raises(SystemExit, match=r"its rows followed another setting \(cap_gib differ"):
        M.results(M.parse_args(["--cap-gib", "40"]), [], {})   # (a --layers stand-in writes a file of its own)
    assert H.calls_of([committed, committed]) == calls   # one call counted once, from either file
    legacy = {k: v for k, v in committed.items() if k != "calls"}   # a file from before the harness: its head
    assert H.calls_of([legacy]) == [{k: legacy[k] for k in H.CALL_FIELDS}]


def test_a_worker_without_a_row_says_how_it_failed_and_the_ladder_stops_there():
    """harness.worker_row and harness.ladder, the one-GPU case's job loop: a worker that wrote no row gives one that
    says why (out of memory read from its output, its exit code, its last lines); a name's values stop at its first
    row that does not fit, the next name starts again."""
    fail = [sys.executable, "-c", "import sys; print('step'); print('torch.OutOfMemoryError: CUDA out of memory');"
                                  "sys.exit(3)"]
    row = H.worker_row(lambda path: fail, 60, config="coat", micro_batch=4)
    assert (row["config"], row["micro_batch"], row["fits"], row["oom"], row["returncode"]) == ("coat", 4, False,
                                                                                                True, 3)
    assert row["error"] == "step | torch.OutOfMemoryError: CUDA out of memory"
    write = [sys.executable, "-c", "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'fits': True}))"]
    assert H.worker_row(lambda path: [*write, str(path)], 60, config="coat") == {"fits": True}
    rows = H.ladder(lambda name, b: {"name": name, "b": b, "fits": name == "stock" or b < 2}, ["coat", "stock"],
                    [1, 2, 4])
    assert [(r["name"], r["b"]) for r in rows] == [("coat", 1), ("coat", 2), ("stock", 1), ("stock", 2), ("stock", 4)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would be the real run")
def test_a_real_run_needs_a_gpu(capsys):
    assert M.main(["--configs", "coat"]) == 2
    assert capsys.readouterr().err.strip() == "moe_one_gpu: needs a CUDA GPU; allowed here: --smoke (CPU)"


def test_the_bf16_baseline_changes_only_the_optimizer_and_a_stand_in_has_its_own_file():
    """bf16_cpu_adam: the preset's ZeRO-3 as written, DeepSpeed's AdamW offloaded (DeepSpeedCPUAdam) in place of
    CoatAdamW, no coat section; a shallower stand-in's rows go to a file of their own (a file's rows share a shape)."""
    cfg, preset = M.ds_config("bf16_cpu_adam", 4), M.ds_config("coat", 4)
    assert "coat" not in cfg and cfg["optimizer"]["type"] == "AdamW"
    assert cfg["optimizer"]["params"] == {k: preset["optimizer"]["params"][k] for k in ("lr", "betas", "eps",
                                                                                         "weight_decay")}
    zero = dict(cfg["zero_optimization"])
    assert zero.pop("offload_optimizer") == {"device": "cpu", "pin_memory": True}
    assert zero == preset["zero_optimization"]
    assert M.stem(M.parse_args(["--smoke", "--layers", "1"])) == "moe_one_gpu_1_layers"
    assert M.stem(M.parse_args(["--smoke"])) == M.stem(M.parse_args(["--smoke", "--layers", "48"])) == "moe_one_gpu"
