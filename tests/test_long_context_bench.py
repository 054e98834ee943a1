"""benchmarks/long_context.py: its CPU smoke through real worker processes (the checkpoint stores and MLP tiles as
the configurations set them, and DeepSpeed's ALST stack), its configurations and per-model files, and its flags
refused in one line before any model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import ROOT, child_env

sys.path.insert(0, str(ROOT))
from benchmarks import long_context as L  # noqa: E402


@pytest.mark.slow   # three worker processes (alst's JIT-builds DeepSpeedCPUAdam where no build is cached)
def test_smoke_rows_and_the_first_loss_equal_over_stores_and_close_under_alst(tmp_path):
    """The first step's loss is the forward's, which no checkpoint store changes (they keep the input for the
    recompute) and one MLP tile equals untiled: equal bit for bit across coat's configurations. alst computes it
    through DeepSpeed's tiled MLP and TiledFusedLogitsLoss from the same initial weights and tokens, without coat's
    FP8 layers: close. Its checkpoint offload matched the one layer's input (on the CPU a matched input stays put)."""
    argv = ["--smoke", "--configs", "gpu,host_fp8_tiled,alst", "--seqs", "64", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.long_context", *argv], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    doc = json.loads((tmp_path / "long_context.json").read_text())
    assert [L.identity(r) for r in doc["rows"]] == [(c, 1, 64, None) for c in ("gpu", "host_fp8_tiled", "alst")]
    assert all(r["fits"] and r["tokens_per_s"] > 0 and r["host_peak_rss_gib"] > 0 for r in doc["rows"])
    gpu, tiled, alst = (r["losses"][0] for r in doc["rows"])
    assert gpu == tiled and abs(alst - tiled) < 0.02, (tiled, alst)   # measured 6.2691 vs 6.2706 (bf16 on the CPU)
    assert doc["rows"][2]["checkpoint_offload"]["skipped_marked_tensors"] == 1
    assert doc["preset"] == L.PRESET and len(doc["calls"]) == 1


def test_configs_set_what_they_say_and_bad_flags_fail_in_one_line(capsys):
    act = L.ds_config("host_fp8_tiled")["coat"]["activation"]
    assert (act["checkpoint"], act["checkpoint_store"], act["tile_tokens"]) == (True, "host_fp8", L.TILE)
    assert "checkpoint_store" not in L.ds_config("gpu")["coat"]["activation"]
    for argv, key in ((["--configs", "gpu,fp4"], "--configs"), (["--seqs", "1k"], "--seqs"),
                      (["--steps", "-1"], "--steps"), (["--emulate-layers", "32"], "--emulate-layers"),
                      (["--layers", "2", "--emulate-layers", "2"], "--emulate-layers")):
        with pytest.raises(SystemExit):
            L.parse_args(argv)
        assert key in capsys.readouterr().err.splitlines()[-1]


def test_alst_is_deepspeeds_stack_without_coat_and_another_model_has_its_own_file(capsys):
    cfg = L.ds_config("alst")
    zero = cfg["zero_optimization"]
    assert "coat" not in cfg and cfg["optimizer"]["type"] == "AdamW" and cfg["bf16"]["enabled"]
    assert zero["stage"] == 3 and zero["offload_param"] == zero["offload_optimizer"] == {"device": "cpu",
                                                                                       "pin_memory": True}
    assert cfg["optimizer"]["params"]["lr"] == L.ds_config("host_fp8_tiled")["optimizer"]["params"]["lr"]
    assert L.stem(L.parse_args([])) == L.stem(L.parse_args(["--smoke"])) == "long_context"
    assert L.stem(L.parse_args(["--model", "llama3.2-3b-untied", "--configs", "alst"])) == \
        "long_context_llama3.2-3b-untied"
    for argv, words in ((["--model", "qwen3-8b"], "--model 'qwen3-8b' is unknown; allowed: ['tiny'"),
                        (["--model", "llama3.2-3b", "--configs", "alst"], "ties its embeddings")):
        with pytest.raises(SystemExit):
            L.parse_args(argv)
        assert words in capsys.readouterr().err.splitlines()[-1]


def test_the_committed_file_takes_a_new_row_by_identity():
    """results/long_context.json: a later call's row replaces its identity's and a new identity is added, the other
    rows, the note and the calls kept; a file of another cap is refused in one line."""
    from benchmarks.common import RESULTS
    committed = json.loads((RESULTS / "long_context.json").read_text())
    args = L.parse_args([])
    again = dict(committed["rows"][0], tokens_per_s=1.0)
    new = dict(committed["rows"][0], seq=1 << 20)
    doc = L.results(args, [again, new], {"date": "D", "device": "H"})
    assert [L.identity(r) for r in doc["rows"]] == [L.identity(r) for r in committed["rows"]] + [L.identity(new)]
    assert doc["rows"][0]["tokens_per_s"] == 1.0 and doc["rows"][1] == committed["rows"][1]
    assert doc["rows"][0]["date"] == doc["rows"][-1]["date"] == "D"   # a row carries its call's date
    assert doc["note"] == committed["note"] and len(doc["calls"]) == len(committed["calls"]) + 1
    with pytest.raises(SystemExit):
        L.results(L.parse_args(["--cap-gib", "139"]), [], {})


def test_the_offload_configuration_and_a_deeper_models_ballast():
    """offload_fp8_tiled runs the ZeRO-3 preset with the FP8 moments on the host; a 2-layer stand-in of 8B emulating
    32 layers holds what 30 more layers hold there beyond activations: their bf16 weights (the states' device
    windows and DeepSpeed's buffers do not grow with depth), 2 B x 218,112,000 parameters a layer."""
    cfg = L.ds_config("offload_fp8_tiled")
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["coat"]["states"] == "host"
    assert cfg["coat"]["activation"]["checkpoint_store"] == "host_fp8" and cfg["train_micro_batch_size_per_gpu"] == 1
    shape = dict(L.MODELS[L.MODEL], num_hidden_layers=2)
    assert L.ballast_bytes("offload_fp8_tiled", shape, 1 << 20, 32) == pytest.approx(30 * 2 * 218_112_000, rel=1e-3)
