"""Ulysses sequence parallelism (DeepSpeed's ALST) with coat's FP8 decoder layers (issue 61), on 2 CPU ranks.

gloo has the all-to-all Ulysses runs (all_to_all_single, bf16 included), so DeepSpeed's own UlyssesSPAttentionHF runs
here as on GPUs. One launched job (tests/ds_scripts/ulysses_job.py, ~60 s on 2 cores) trains a tiny Llama and a
tiny Qwen3 (coat's FP8 layers in mode full, chunked loss, CoatAdamW, bf16, clipping at 1.0) twice on the same
samples: without SP (both ranks on the whole samples: one GPU's run) and with SP 2 (each rank on half of every
sample's tokens); under ZeRO-2 with attention_fp8 (the Ulysses call inside Fp8AttentionFn, run again in backward),
coat.gradients "release" (ZeRO-2), coat.states "host" (ZeRO-3 release) and the long-context settings (each layer
recomputed from its FP8 input on the host, tile_tokens). The main job's --sp-size: its refusals
in process, and a 2-rank run against a 1-rank one; HF Trainer with accelerate's ParallelismConfig the same way.

The bound. The first step's loss is bit for bit one GPU's (each token's forward is the same with SP: the GEMMs
and norms are row by row, each head's attention sees the same q, k, v) and its gradient norm within 1e-4 (each
rank's weight gradient sums half the tokens and is rounded to bf16 before the ranks' sum: one bf16 rounding, 2^-9
relative). From there the runs part only by that rounding, which the FP8 moments amplify (a moment near a code
boundary moves by a whole E4M3 step, 2^-3 relative, at lr 1e-2). Measured over 6 steps (relative, the largest of
any step): SP 5.1e-4 (long), 7.4e-4 (host), 8.0e-4 (ZeRO-2), 9.8e-4 (release), 1.2e-3 (Qwen3); plain data
parallelism on the same 2 ranks (one sample each: the same rounding of a 2-rank sum) 6.9e-4 to 1.2e-3. So
LOSS_TOL = 3e-3, 2.5x the largest of either: SP stays within what any 2-rank reduction moves. A gradient off by the
SP size (DeepSpeed's recipe under ZeRO-1/2: 2x; the same seed under ZeRO-3's reduce-scatter: 0.5x) fails the norm
check at once."""
from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch
import transformers
from packaging.version import Version

from harness import DS_SCRIPTS, ROOT, TRAIN_SMALL, child_env, free_port, launch_json, ranks_launcher, unsupported

TASKS = ["llama:zero2:dp", "llama:release", "llama:host", "llama:long", "qwen3:zero2"]
# attention calls a step, 2 layers: forward; attention_fp8's backward again; a recomputed layer's forward again
CALLS = {"zero2": 4, "release": 2, "host": 2, "long": 6}
LOSS_TOL, NORM_TOL = 3e-3, 1e-3
STEPS = 6   # ulysses_job.py's


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(y - x) / abs(x) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs (gloo)")
    if unsupported("bf16"):
        pytest.skip(unsupported("bf16"))
    out = tmp_path_factory.mktemp("ulysses") / "r.json"
    env = child_env(COAT_JOB_TIMEOUT="420")
    return launch_json([*ranks_launcher(2), str(DS_SCRIPTS / "ulysses_job.py"), "--out", str(out), *TASKS], out, env)


def _task(runs: dict, task: str) -> dict:
    ranks = runs[task]
    for r in ranks.values():
        assert "error" not in r, f"{r['error']}\n{r.get('trace')}"
    return ranks["rank0"]


@pytest.mark.parametrize("task", TASKS)
def test_sp_trains_as_one_gpu(runs, task):
    """Every step's loss (the SP group's mean) within LOSS_TOL of one GPU's, the first bit for bit, the first gradient
    norm within NORM_TOL; both ranks the same; the attention went through DeepSpeed's Ulysses wrapper from the FP8
    layers, run again in backward where attention_fp8 is on and where the layer is recomputed (CALLS)."""
    res = _task(runs, task)
    one, sp = res["one"], res["sp"]
    assert runs[task]["rank1"]["sp"]["losses"] == sp["losses"]
    assert one["fp8"] == sp["fp8"] == 2
    assert one["attention"] == "sdpa_attention_forward" and sp["attention"] == "uattn_wrapper"
    assert sp["calls"] == one["calls"] == [CALLS[task.split(":")[1]]] * STEPS
    diff = _rel(one["losses"], sp["losses"])
    print(f"{task}: SP vs one GPU, loss per step {['%.1e' % d for d in diff]}, first norm "
          f"{_rel(one['norms'], sp['norms'])[0]:.1e}")
    assert sp["losses"][0] == one["losses"][0]
    assert max(diff) < LOSS_TOL, diff
    assert _rel(one["norms"], sp["norms"])[0] < NORM_TOL, (one["norms"], sp["norms"])


def test_data_parallelism_rounds_as_sp_does(runs):
    """The same Llama on the same 2 ranks without SP, one sample a rank: its losses part from one GPU's by the same
    order as SP's (what the bound is made of)."""
    res = _task(runs, "llama:zero2:dp")
    diff = _rel(res["one"]["losses"], res["dp"]["losses"])
    print(f"llama:zero2: data parallelism vs one GPU, loss per step {['%.1e' % d for d in diff]}")
    assert max(diff) < LOSS_TOL and _rel(res["one"]["norms"], res["dp"]["norms"])[0] < NORM_TOL


# ------------------------------------------------------------------ the main job: examples/train.py --sp-size
sys.path.insert(0, str(ROOT / "examples"))


def _refusal(monkeypatch, world: int, *argv: str) -> str:
    """examples/train.py's refusal (exit 2, one `error:` line) as rank 0 of `world` ranks, before any model or data."""
    import train

    def boom(*a, **k):
        raise AssertionError("bad --sp-size reached the model and data")

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(train, "load_inputs", boom)
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        train.main(["--deepspeed", str(ROOT / "ds_configs/zero2_coat.json"), "--model-size", "tiny", *argv])
    said = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(said) == 1, err.getvalue()
    return said[0]


@pytest.mark.parametrize("world,argv,why", [
    (2, ["--sp-size", "3"], "--sp-size=3 does not divide the world size (2 ranks); allowed: [1, 2]"),
    (8, ["--sp-size", "8"], "--sp-size=8 does not divide the model's 4 attention heads; allowed: [1, 2, 4]"),
    (4, ["--sp-size", "4", "--seq-len", "66"], "--sp-size=4 does not divide --seq-len=66; allowed: [1, 2]"),
    (2, ["--sp-size", "0"], "--sp-size=0 is invalid; allowed: an integer >= 1"),
])
def test_main_job_refuses_a_bad_sp_size_in_one_line(monkeypatch, world, argv, why):
    assert _refusal(monkeypatch, world, *argv) == f"error: {why}"


def test_refusals_name_the_key_and_what_is_allowed():
    """coat_ds.deepspeed.sequence_parallel's checks, in process: the kv heads (divided by N, or dividing it: DeepSpeed
    repeats them), an attention implementation Ulysses does not wrap, a sliding window sdpa would lose."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from coat_ds.deepspeed.sequence_parallel import attention_refusal, refusal

    assert refusal(4, 8, 8, 2, 64) is None and refusal(8, 8, 8, 2, 64) is None   # 2 kv heads repeated 4x over 8
    assert refusal(4, 8, 12, 3, 64) == ("--sp-size=4 neither divides nor is a multiple of the model's 3 key/value "
                                        "heads; allowed: [1]")

    def model(family: str, impl: str, **kw):
        cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, **kw)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)

    assert attention_refusal(model("llama", "sdpa"), 64) is None
    assert attention_refusal(model("llama", "eager"), 64) == (
        "--sp-size needs an attention implementation Ulysses wraps; this model's is 'eager'; allowed: ['sdpa', "
        "'flash_attention_2', 'flash_attention_3', 'flex_attention'] (attn_implementation)")
    mistral = model("mistral", "sdpa", sliding_window=16)
    assert attention_refusal(mistral, 16) is None
    assert attention_refusal(mistral, 64) == (
        "--sp-size with sdpa attention drops the mask that holds this model's sliding window (16 < --seq-len=64); "
        "allowed: attn_implementation 'flash_attention_2' or 'flash_attention_3', or --seq-len <= 16")


def _train(tmp, launch: list[str], config: str, *extra: str) -> list[dict]:
    run = tmp / "run"
    cmd = [*launch, "examples/train.py", "--deepspeed", f"ds_configs/{config}", "--save-dir", str(run),
           *TRAIN_SMALL, "--steps", "3", "--eval-every", "0", *extra]
    launch_json(cmd, run / "summary.json", child_env())
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["zero2_coat.json", "zero3_coat.json"])
def test_main_job_with_sp_size_trains_as_one_rank(tmp_path, config):
    """`examples/train.py --sp-size 2` on 2 ranks (one SP group: the samples of a 1-rank run, each rank half their
    tokens) against 1 rank, ZeRO-2 and ZeRO-3 (the model built partitioned, then Ulysses): the same tokens a step,
    every train and validation loss within LOSS_TOL (measured: within 2e-5; the first step's differs by the
    rounding of the group's mean, a weighted sum)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs (gloo)")
    sp = _train(tmp_path / "sp", ranks_launcher(2), config, "--sp-size", "2")
    one = _train(tmp_path / "one", [sys.executable], config)
    assert [r["tokens"] for r in sp if r["kind"] == "train"] == [r["tokens"] for r in one if r["kind"] == "train"]
    loss = {k: [r.get("loss", r.get("val_loss")) for r in log] for k, log in (("sp", sp), ("one", one))}
    print(f"main job {config}, --sp-size 2 vs 1 rank: {['%.1e' % d for d in _rel(loss['one'], loss['sp'])]}")
    assert len(loss["sp"]) == len(loss["one"]) == 4 and max(_rel(loss["one"], loss["sp"])) < LOSS_TOL


# the first transformers whose Trainer trains under Ulysses SP as on one rank (docs/versions.md, .ci/drift lowest of
# 2026-12-04: HF's own, with or without coat_ds)
TRAINER_SP = "5.10.1"


def test_hf_trainer_with_parallelism_config_trains_as_one_rank(tmp_path):
    """HF Trainer with accelerate's ParallelismConfig(sp_backend="deepspeed", sp_size=2) and
    ds_configs/hf/zero2_coat.json on 2 ranks (tests/ds_scripts/ulysses_hf_job.py) against the same Trainer on 1 rank:
    the FP8 layers run DeepSpeed's Ulysses attention, the first loss is one rank's bit for bit and every one within
    LOSS_TOL (measured: 1.4e-3 at most). Before transformers 5.25 Trainer averaged the shards with DeepSpeed's recipe,
    so under ZeRO-2 its gradient norm was 2x one rank's (the clip acted at half its value); 5.25 rescales its SP loss
    and the norm is one rank's (measured: 2.39 both). This pins the installed version's factor."""
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs (gloo)")
    if Version(transformers.__version__) < Version(TRAINER_SP):
        pytest.skip(f"HF Trainer's Ulysses SP needs transformers >= {TRAINER_SP} (docs/activation.md)")
    job = str(DS_SCRIPTS / "ulysses_hf_job.py")
    sp = launch_json([*ranks_launcher(2), job, "--out", str(tmp_path / "sp.json"), "--sp", "2"], tmp_path / "sp.json")
    # one rank as a world of one without LOCAL_SIZE, so without DeepSpeed's CPU shm all-reduce, whose set-up
    # (deepspeed/comm/torch.py, shm_comm_op.initialize) once crashed a 1-rank run here with a segmentation fault
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.pop("LOCAL_SIZE", None)
    one = launch_json([sys.executable, job, "--out", str(tmp_path / "one.json")], tmp_path / "one.json", env)
    print(f"HF Trainer, sp_size 2 vs 1 rank: {['%.1e' % d for d in _rel(one['losses'], sp['losses'])]}")
    assert (sp["attention"], sp["fp8"]) == ("uattn_wrapper", 2)
    assert (one["attention"], one["fp8"]) == ("sdpa_attention_forward", 2)
    assert len(sp["losses"]) == len(one["losses"]) == 4 and sp["losses"][0] == one["losses"][0]
    assert max(_rel(one["losses"], sp["losses"])) < LOSS_TOL
    factor = 1 if Version(transformers.__version__) >= Version("5.25") else 2
    assert sp["norms"][0] == pytest.approx(factor * one["norms"][0], rel=NORM_TOL)
