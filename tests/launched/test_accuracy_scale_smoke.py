"""benchmarks/accuracy_scale.py --smoke end to end on 2 CPU ranks through the real launcher and main job: BF16
pretrained, its model exported, its outliers measured, BF16 and the lowest-memory preset fine-tuned from it side by
side, one rank each (validated before the first step), the verdicts and tables; then the preset's pretraining stopped
by the deadline (a signal: it checkpoints) and continued by a third call that merges the earlier file, and what a
call on a machine without its run directory would do. The corpora are two tiny token folders made here, the way
prepare_corpus makes the real ones."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, child_env

sys.path.insert(0, str(ROOT))
from benchmarks import accuracy_scale as S  # noqa: E402
from benchmarks.accuracy import runs  # noqa: E402


def corpora(root: Path) -> Path:
    """`manpages` (pretraining: this repository's Python, its own BPE of 512) and `perldoc` (fine-tuning: its docs,
    in the same BPE), as data/build.py writes them."""
    from coat_ds.workloads import data

    py = sorted((ROOT / "coat_ds").rglob("*.py"))
    md = sorted((ROOT / "docs").glob("*.md"))
    texts = lambda files: lambda: (f.read_text() for f in files)  # noqa: E731
    tok, _ = data.write_token_folder(root / "manpages", "python", texts(py[:-4]), texts(py[-4:]), None, 512)
    (root / "perldoc").mkdir(parents=True)
    (root / "perldoc" / "tokenizer.json").write_text((root / "manpages" / "tokenizer.json").read_text())
    data.write_token_folder(root / "perldoc", "docs", texts(md[:-3]), texts(md[-3:]), tok, 512)
    return root


def call(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.accuracy_scale", "--smoke", *argv], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout


def test_smoke_pretrain_export_outliers_finetune_then_a_deadline_and_a_resume(tmp_path, monkeypatch):
    """Five main-job launches: BF16's pretraining (exported) and the two fine-tunings in a first call; the lowest-
    memory preset's pretraining stopped by the deadline in a second and continued in a third (the call that
    pretrained it from scratch before, now the path that checkpoints and resumes)."""
    data, run_root, out = corpora(tmp_path / "corpora"), tmp_path / "runs", tmp_path / "out"
    where = ["--data-root", str(data), "--run-root", str(run_root), "--out", str(out)]
    pick = ["--configs", "bf16,lowest_memory", "--seeds", "0"]
    call("--phase", "finetune", *pick, "--side-by-side", *where)
    doc = json.loads((out / "accuracy_scale.json").read_text())
    assert (out / "accuracy_scale.png").read_bytes()[:4] == b"\x89PNG"
    assert list(doc["runs"]) == ["pretrain_bf16_s0", "finetune_bf16_s0", "finetune_lowest_memory_s0"]
    assert {e["status"] for e in doc["runs"].values()} == {"done"} and doc["calls"][-1]["ran"][1] == "outliers"
    pre = doc["runs"]["pretrain_bf16_s0"]
    assert [s for s, *_ in pre["train"]] == list(range(1, 21)) and [s for s, *_ in pre["val"]] == [5, 10, 15, 20]
    assert pre["train"][-1][2] < pre["train"][0][2] and pre["tokens_seen"] == 20 * 4 * 64 and pre["epochs"] > 0
    assert pre["segments"][0]["exit_code"] == 0 and "--export" in pre["segments"][0]["command"]
    assert not (run_root / "pretrain_bf16_s0" / "checkpoints").exists()          # a finished run's checkpoints go
    for name in ("bf16", "lowest_memory"):
        ft = doc["runs"][f"finetune_{name}_s0"]
        assert [s for s, *_ in ft["val"]] == [0, 5, 10] and ft["export_id"] == json.loads(
            (run_root / S.EXPORT / S.MARK).read_text())["written"]
        assert f"--model {run_root / S.EXPORT} --eval-first" in ft["segments"][0]["command"]
        assert ft["gpus"] == 1 and " --num_gpus 1 " in ft["segments"][0]["command"]   # --side-by-side: one rank each
    spans = [(s["start"], s["start"] + s["wall_s"]) for n in ("bf16", "lowest_memory")
             for s in doc["runs"][f"finetune_{n}_s0"]["segments"]]
    assert max(a for a, _ in spans) < min(b for _, b in spans)                     # and at once
    assert pre["gpus"] == 2 and " --num_gpus 2 " in pre["segments"][0]["command"]
    o = doc["outliers"]
    assert len(o["layers"]) == 2 and o["max_ratio"] == max(r["ratio"] for r in o["layers"]) > 1
    v = doc["verdicts"]
    assert v["pretrain"]["bf16_band"]["set_by"] == "0.5% of the mean"
    ft = v["finetune"]["lowest_memory"]        # the same weights: FP8's forward moves the loss a little, not much
    assert ft["before"] != v["finetune"]["bf16"]["before"] and abs(ft["gap_before_rel"]) < 0.02

    # the lowest-memory preset's pretraining told to stop as soon as it has a step (the deadline's signal): it
    # checkpoints and exits; BF16's, done, is not run again
    monkeypatch.setattr(S, "STOP_MARGIN_S", 55.0)
    monkeypatch.setattr(S, "KILL_MARGIN_S", -300.0)
    monkeypatch.setattr(S, "MIN_PARTIAL_S", 0.0)
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    merge = ["--merge", str(out / "accuracy_scale.json")]
    assert S.main(["--smoke", "--phase", "pretrain", *pick, "--deadline", "60", "--partial-ok", *merge, *where]) == 0
    doc = json.loads((out / "accuracy_scale.json").read_text())
    part = doc["runs"]["pretrain_lowest_memory_s0"]
    ckpt = runs.checkpoint_step(run_root / "pretrain_lowest_memory_s0")
    assert part["status"] == "partial" and part["segments"][0]["signalled"] and 1 <= ckpt == part["steps_done"] < 20
    assert doc["runs"]["pretrain_bf16_s0"] == json.loads(json.dumps(pre)) | {"spike": doc["runs"][
        "pretrain_bf16_s0"]["spike"]}                                           # kept, not run again

    # without its run directory (another machine) it would start again; here it continues from its checkpoint
    args = S.parse_args(["--smoke", "--phase", "pretrain", *pick, *merge, *where])
    res = S.merged(args.merge, S.recipe_facts(args))
    assert [(t.job.key, t.resume_from) for t in S.schedule(args, res)] == [("pretrain_lowest_memory_s0", ckpt)]
    elsewhere = S.parse_args(["--smoke", "--phase", "pretrain", *pick, *merge, "--run-root", str(tmp_path / "else")])
    (t,) = S.schedule(elsewhere, res)
    assert t.resume_from is None and t.why == f"restart (its run directory is gone; {ckpt} steps logged)"
    monkeypatch.undo()
    text = call("--phase", "pretrain", *pick, *merge, *where)
    doc = json.loads((out / "accuracy_scale.json").read_text())
    done = doc["runs"]["pretrain_lowest_memory_s0"]
    assert done["status"] == "done" and [(s["from_step"], s["to_step"]) for s in done["segments"]] == \
        [(0, ckpt), (ckpt, 20)]
    assert [s for s, *_ in done["train"]] == list(range(1, 21)) and len(doc["calls"]) == 3
    assert list(doc["runs"]) == ["pretrain_bf16_s0", "finetune_bf16_s0", "finetune_lowest_memory_s0",
                                 "pretrain_lowest_memory_s0"]
    assert doc["verdicts"]["pretrain"]["configs"]["lowest_memory"]["seeds"] == [0]   # the resumed run is judged
    assert "| lowest_memory | 0: " in text and "val loss before the first step" in text
    with pytest.raises(SystemExit, match="no manpages/meta.json"):
        S.main(["--smoke", "--data-root", str(tmp_path / "none"), "--run-root", str(run_root), "--out", str(out)])


def test_long_recipe_fine_tunes_at_four_times_the_sequence_with_fp8_checkpoints_on_the_host(tmp_path):
    """--recipe long --smoke (issue 61): BF16's tiny model pretrained at 64 tokens and exported, then fine-tuned at
    256 by BF16 and long_context (the largest-model preset, each layer recomputed from an FP8 copy of its input in
    pinned host memory, the MLP and FP8 attention's backward over tiles of 64) side by side, one rank each: both end,
    validated before the first step, the FP8 forward of the same weights close to BF16's; the table and the PNG."""
    data, run_root, out = corpora(tmp_path / "corpora"), tmp_path / "runs", tmp_path / "out"
    text = call("--recipe", "long", "--configs", "bf16,long_context", "--side-by-side", "--data-root", str(data),
                "--run-root", str(run_root), "--out", str(out))
    doc = json.loads((out / "accuracy_long.json").read_text())
    assert (out / "accuracy_long.png").read_bytes()[:4] == b"\x89PNG"
    assert list(doc["runs"]) == ["pretrain_bf16_s0", "finetune_bf16_s0", "finetune_long_context_s0"]
    assert {e["status"] for e in doc["runs"].values()} == {"done"}
    ft = doc["runs"]["finetune_long_context_s0"]
    command = ft["segments"][0]["command"].split()
    cfg = json.loads(Path(command[command.index("--deepspeed") + 1]).read_text())["coat"]["activation"]
    assert (cfg["checkpoint_store"], cfg["tile_tokens"], command[command.index("--seq-len") + 1]) == \
        ("host_fp8", 64, "256")
    assert [s for s, *_ in ft["val"]] == [0, 2, 4] and ft["train"][-1][1] == 4 * 256
    v = doc["verdicts"]["finetune"]
    assert v["long_context"]["before"] != v["bf16"]["before"] and abs(v["long_context"]["gap_before_rel"]) < 0.02
    assert "| long_context |" in text and "peak GPU memory (GB)" in text
