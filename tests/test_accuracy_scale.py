"""benchmarks/accuracy_scale.py without launching the main job: the targets' arithmetic (the BF16 band, spikes,
fine-tuning gaps) on curves whose answers are known, the outlier measure on a tiny Llama against its own hidden
states, the schedule (order, continue or restart, the export the fine-tuning needs, predicted minutes), merging,
the tables, and the main job's flags the runs use (--warmup-steps, --eval-first)."""
from __future__ import annotations

import json
import math
from pathlib import Path
import sys

import pytest
import torch

from harness import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import accuracy_scale as S, harness  # noqa: E402
from benchmarks import render_tables as rt  # noqa: E402
from benchmarks.accuracy import outliers, recipe as R, runs, verdicts as V  # noqa: E402


# --- the targets' arithmetic ------------------------------------------------------------------------------------------
def test_band_is_the_wider_of_two_std_and_half_a_percent():
    wide = V.band([2.00, 2.01, 2.02])                  # std 0.01: 2 std = 0.02 > 0.5% of 2.01 = 0.01005
    assert wide["half_width"] == pytest.approx(0.02) and wide["set_by"] == "2 std"
    assert (wide["low"], wide["high"]) == pytest.approx((1.99, 2.03))
    tight = V.band([2.000, 2.001, 2.002])              # std 0.001: 0.5% of the mean wins
    assert tight["half_width"] == pytest.approx(0.005 * 2.001) and tight["set_by"] == "0.5% of the mean"
    one = V.band([3.0])
    assert one["std"] is None and one["half_width"] == pytest.approx(0.015)

    finals = {"bf16": {0: 2.00, 1: 2.01, 2: 2.02}, "exact": {0: 2.029}, "lowest_memory": {0: 2.02, 1: 2.04, 2: 2.04}}
    v = V.pretrain(finals, {"bf16": {0: 0.0, 1: 0.01, 2: 0.0}, "exact": {0: 0.02},
                            "lowest_memory": {0: 0.0, 1: 0.0, 2: 0.0}})
    assert v["configs"]["exact"]["within_band"] and v["configs"]["exact"]["meets_targets"]
    lm = v["configs"]["lowest_memory"]                 # its mean 2.0333 lies above 2.03
    assert lm["final_mean"] == pytest.approx(2.03333, abs=1e-4) and not lm["within_band"]
    assert lm["seeds_within_band"] == [True, False, False] and lm["meets_targets"] is False
    assert v["bf16_largest_rise"] == 0.01 and v["configs"]["exact"]["gap_rel"] == pytest.approx(0.019 / 2.01)
    assert v["allowed_rise"] == pytest.approx(0.02) and v["configs"]["exact"]["spike_ok"]


def test_a_spike_is_a_rise_of_the_validation_loss_that_bf16s_own_seeds_can_fail():
    """Issue 57: the earlier criterion (a preset's largest train-loss spike <= BF16's largest) could not fail for BF16
    and read 0 for every run. Now every seed's largest validation-loss rise over its running minimum is held to
    BF16's band half-width (here 0.02): BF16's seed 1 rising 0.03 fails it, its row says so."""
    assert V.val_rise([[155, 0, 4.0], [310, 0, 3.0], [465, 0, 2.5]]) == {"rise": 0.0, "at_step": None,
                                                                         "over_step": None}
    # falls to 2.5 at 465, back up to 2.6 at 620 and 2.56 at 775: 0.1 over the minimum, seen at 620
    up = V.val_rise([[155, 0, 4.0], [310, 0, 3.0], [465, 0, 2.5], [620, 0, 2.6], [775, 0, 2.56], [930, 0, 2.4]])
    assert up["rise"] == pytest.approx(0.1) and (up["at_step"], up["over_step"]) == (620, 465)
    finals = {"bf16": {0: 2.00, 1: 2.01, 2: 2.02}, "exact": {0: 2.01}}
    v = V.pretrain(finals, {"bf16": {0: 0.0, 1: 0.03, 2: 0.0}, "exact": {0: 0.025}})
    bf16, exact = v["configs"]["bf16"], v["configs"]["exact"]
    assert bf16["seeds_spike_ok"] == [True, False, True] and bf16["spike_ok"] is False
    assert exact["spike_ok"] is False and exact["within_band"] and exact["meets_targets"] is False   # 0.025 > 0.02
    assert V.pretrain(finals, {"bf16": {0: 0.0, 1: 0.0, 2: 0.0}, "exact": {0: 0.02}})["configs"]["exact"][
        "meets_targets"]                                                                               # 0.02: allowed
    assert V.pretrain(finals, {"bf16": {0: 0.0}})["configs"]["exact"]["spike_ok"] is None    # its rise unknown


def test_the_committed_verdicts_are_those_of_its_recorded_curves():
    """accuracy_scale.json's verdicts recomputed from its runs' validation curves: what the file says, BF16's
    seeds judged for spikes too."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "accuracy_scale.json").read_text())
    kept = json.loads(json.dumps(doc["verdicts"]))
    assert S.judge(S.parse_args([]), doc) == kept and doc["targets"] == V.TARGETS
    pre = kept["pretrain"]
    assert pre["allowed_rise"] == pytest.approx(pre["bf16_band"]["half_width"])
    assert all(c["spike_ok"] is not None for c in pre["configs"].values())         # BF16's row included


def test_fine_tuning_gaps_within_half_a_percent_before_and_at_the_end():
    v = V.finetune({"bf16": 2.0, "exact": 2.0099, "lowest_memory": 1.98}, {"bf16": 1.5, "exact": 1.5, "lowest_memory":
                                                                           1.5})
    assert list(v) == ["bf16", "exact", "lowest_memory"]
    assert v["exact"]["gap_before_rel"] == pytest.approx(0.00495) and v["exact"]["meets_targets"]
    assert v["lowest_memory"]["before_ok"] is False and v["lowest_memory"]["end_ok"] and \
        v["lowest_memory"]["meets_targets"] is False
    assert V.finetune({"bf16": 2.0}, {"bf16": 1.0, "exact": 1.0})["exact"]["meets_targets"] is None


# --- outliers ---------------------------------------------------------------------------------------------------------
def test_outliers_are_max_abs_over_rms_of_each_decoder_layers_input():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[7, 5] = 40.0           # one outlier channel in one token's embedding
    ids = [torch.randint(0, 64, (2, 16)), torch.tensor([[7] + [1] * 15])]
    rows = outliers.measure(model, ids)
    with torch.no_grad():
        hidden = [model(input_ids=x, output_hidden_states=True).hidden_states for x in ids]
    for i, r in enumerate(rows):                                 # hidden_states[i]: what layer i receives
        h = torch.cat([hs[i].reshape(-1) for hs in hidden]).double()
        assert r["max_abs"] == pytest.approx(h.abs().max().item(), rel=1e-5)
        assert r["rms"] == pytest.approx(h.square().mean().sqrt().item(), rel=1e-5)
    assert rows[0]["max_abs"] == pytest.approx(40.0) and rows[0]["ratio"] > 20
    assert outliers.summary(rows)["max_ratio"] == max(r["ratio"] for r in rows)
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)      # the hooks are gone
    with pytest.raises(ValueError, match="has no model.layers"):
        outliers.decoder_layers(torch.nn.Linear(2, 2))


# --- the schedule and the file ----------------------------------------------------------------------------------------
def test_the_plan_puts_bf16_first_then_outliers_and_fine_tuning_and_meets_the_issues_recipe(capsys):
    pre = R.PRETRAIN
    assert pre.tokens_per_step * pre.steps >= 200e6 and pre.steps >= 3000 and pre.steps * pre.tokens_per_step / \
        115_387_969 <= 2
    assert pre.eval_every * 20 == pre.steps and R.FINETUNE.steps == 1000
    args = S.parse_args([])
    keys = [j.key for j in S.jobs(args)]
    assert keys[:6] == ["pretrain_bf16_s0", "outliers", "finetune_bf16_s0", "finetune_exact_s0",
                        "finetune_lowest_memory_s0", "finetune_largest_model_s0"]
    pre_keys = [k for k in keys if k.startswith("pretrain")]
    assert len(pre_keys) == 8 and sum("_bf16_" in k for k in pre_keys) == 3 and \
        sum("lowest_memory" in k for k in pre_keys) == 3
    later = [j.key for j in S.jobs(S.parse_args(["--seeds", "1,2"]))]      # the export is seed 0's whatever --seeds
    assert later[:3] == ["pretrain_bf16_s0", "outliers", "finetune_bf16_s0"] and "pretrain_exact_s1" in later
    assert [j.key for j in S.jobs(S.parse_args(["--phase", "pretrain", "--seeds", "2"]))][0] == "pretrain_bf16_s2"
    assert S.main(["--plan-only", "--run-root", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "13 jobs on 4 GPUs" in out and "pretrain_bf16_s0: from scratch, 3,100 steps at 350,000 tokens/s (assumed)" \
        in out
    plan = S.schedule(args, {"runs": {}, "outliers": None})
    est = {t.job.key: t.est_s for t in plan}
    # 203.2M tokens at 350k/s, 60 s to start, 21 evaluations of 524K tokens at a third of the cost, 4 saves
    assert est["pretrain_bf16_s0"] == pytest.approx(60 + 203_161_600 / 350_000 + 21 * 524_288 / 1_050_000 + 40)
    two = S.parse_args(["--num-gpus", "2", "--tokens-per-s", "bf16=500000"])
    assert S.rate(two, {"runs": {}}, "pretrain", "bf16") == (250_000, "given")
    cmd = runs.command(R.PRETRAIN, R.CONFIGS["bf16"], 1, 2, ROOT / "r", ROOT / "d")
    assert cmd[cmd.index("--micro-batch") + 1] == "16" and cmd[cmd.index("--warmup-steps") + 1] == "100"


@pytest.mark.parametrize("argv, msg", [(["--num-gpus", "3"], "--num-gpus=3 is invalid; allowed: one of [1, 2, 4]"),
                                       (["--seeds", "0,0"], "--seeds='0,0' is invalid"),
                                       (["--tokens-per-s", "fp8=3"], "--tokens-per-s='fp8=3' is invalid"),
                                       (["--configs", "bf16,coat"], "--configs: ['coat'] is invalid"),
                                       (["--num-gpus", "2", "--host-gpus", "3"],
                                        "--host-gpus=3 is invalid; allowed: a multiple of --num-gpus (2)"),
                                       (["--jobs-per-gpu", "0"], "--jobs-per-gpu=0 is invalid; allowed: an integer"),
                                       (["--recipe", "sparse"], "argument --recipe: invalid choice: 'sparse'")])
def test_bad_flags_fail_in_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit):
        S.parse_args(argv)
    assert msg in capsys.readouterr().err


def test_side_by_side_pairs_pretraining_runs_on_disjoint_gpus_and_fine_tunings_one_a_gpu(capsys):
    """--side-by-side --host-gpus 4 --num-gpus 2: pretraining runs two at once on GPUs 0,1 and 2,3 (continuations
    first, as alone); fine-tunings four at once, one GPU each; without it one job at a time."""
    argv = ["--num-gpus", "2", "--host-gpus", "4", "--run-root", "/nonexistent"]
    args = S.parse_args([*argv, "--side-by-side"])
    plan = S.schedule(args, {"runs": {}, "outliers": None})
    groups = [[t.job.key for t in g] for g in S.groups(args, plan)]
    tunings = ["finetune_bf16_s0", "finetune_exact_s0", "finetune_lowest_memory_s0", "finetune_largest_model_s0"]
    assert groups[:3] == [["pretrain_bf16_s0"], ["outliers"], tunings]
    pre = groups[3:]
    assert all(len(g) == 2 for g in pre[:-1]) and sum(map(len, pre)) == 7 and pre[0] == ["pretrain_exact_s0",
                                                                                         "pretrain_lowest_memory_s0"]
    assert harness.devices([S.side_gpus(args, "pretrain")] * 2) == ["0,1", "2,3"]
    assert harness.devices([S.side_gpus(args, "finetune")] * 4) == ["0", "1", "2", "3"]
    assert all(len(g) == 1 for g in S.groups(S.parse_args(argv), plan))          # not side by side: one at a time
    assert S.main([*argv, "--side-by-side", "--plan-only", "--phase", "pretrain"]) == 0
    out = capsys.readouterr().out
    assert "8 jobs on 4 GPUs" in out
    wave = next(w for w in out.split("wave ") if "pretrain_exact_s0" in w).splitlines()
    assert len(wave) == 3 and wave[2].startswith("    pretrain_exact_s0: from scratch, 3,100 steps at 175,000 tokens/s "
                                                  "(assumed), 2 GPUs: ~")          # beside one more


def test_the_moe_recipe_pretrains_only_its_twelve_runs_sharing_one_gpu(capsys):
    """--recipe moe: pretraining alone (no export, outliers or fine-tuning), moe-90m on the kernel corpus, into
    accuracy_moe.json, every configuration over every seed; --jobs-per-gpu 8 on one GPU: the twelve runs in waves of
    eight, every one on GPU 0."""
    argv = ["--recipe", "moe", "--num-gpus", "1", "--side-by-side", "--jobs-per-gpu", "8", "--run-root", "/nonexistent"]
    args = S.parse_args(argv)
    assert (args.phase, args.name, args.recipes["pretrain"]) == ("pretrain", "accuracy_moe", R.MOE_PRETRAIN)
    assert R.MOE_PRETRAIN.model_size == "moe-90m" and R.MOE_PRETRAIN.corpus == "kernel"
    groups = [[t.job.key for t in g] for g in S.groups(args, S.schedule(args, {"runs": {}, "outliers": None}))]
    assert [len(g) for g in groups] == [8, 4] and all(k.startswith("pretrain_") for g in groups for k in g)
    assert {f"pretrain_{c}_s{s}" for c in R.CONFIGS for s in (0, 1, 2)} == {k for g in groups for k in g}
    assert set(harness.devices([S.side_gpus(args, "pretrain")] * 8, args.jobs_per_gpu)) == {"0"}
    assert S.main([*argv, "--plan-only"]) == 0
    assert "12 jobs on 1 GPUs" in capsys.readouterr().out


def test_the_long_recipe_fine_tunes_bf16s_export_at_16k_with_fp8_checkpoints_on_the_host(tmp_path, capsys):
    """--recipe long (issue 61): BF16's 125M pretrained and exported, then fine-tuned at 16,384 tokens by every
    configuration, long_context included, side by side on one GPU, into accuracy_long.json; no outliers, no other
    pretraining. long_context's config is its preset's file with the FP8 host checkpoints and tiles of a quarter of
    the sequence, one coat accepts; a dense run cannot name it."""
    argv = ["--recipe", "long", "--num-gpus", "1", "--side-by-side", "--jobs-per-gpu", "5",
            "--run-root", str(tmp_path / "runs")]
    args = S.parse_args(argv)
    assert args.name == "accuracy_long" and args.recipes == {"pretrain": R.LONG_PRETRAIN, "finetune": R.LONG_FINETUNE}
    assert R.LONG_PRETRAIN.model_size == "125m" and R.LONG_FINETUNE.seq_len == 16384 and R.LONG_FINETUNE.corpus == \
        "kernel"
    groups = [[t.job.key for t in g] for g in S.groups(args, S.schedule(args, {"runs": {}, "outliers": None}))]
    assert groups == [["pretrain_bf16_s0"], [f"finetune_{c}_s0" for c in (*R.CONFIGS, "long_context")]]
    path = S.config_file(args, "long_context", R.LONG_FINETUNE)
    cfg = json.loads(Path(path).read_text())
    shipped = json.loads((ROOT / R.CONFIGS["largest_model"]).read_text())
    act = cfg["coat"]["activation"]
    assert act == {**shipped["coat"]["activation"], "checkpoint": True, "checkpoint_store": "host_fp8",
                   "tile_tokens": 4096}
    assert {k: v for k, v in cfg.items() if k != "coat"} == {k: v for k, v in shipped.items() if k != "coat"}
    from coat_ds.activation.config import ActivationConfig
    ActivationConfig(**act)                                                          # coat takes it
    assert S.config_file(args, "exact", R.LONG_FINETUNE) == R.CONFIGS["exact"]        # a shipped one as it is
    assert S.main([*argv, "--plan-only"]) == 0
    assert "6 jobs on 1 GPUs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        S.parse_args(["--recipe", "long", "--num-gpus", "2"])                 # one sequence a step over 2 GPUs
    assert "--num-gpus=2 is invalid for --recipe long: its finetune runs 1 sample(s) a step on 2 GPUs; allowed: a " \
        "count dividing 1 (or --side-by-side: one GPU a fine-tuning)" in capsys.readouterr().err
    assert S.parse_args(["--recipe", "long", "--num-gpus", "2", "--side-by-side"]).num_gpus == 2
    with pytest.raises(SystemExit):
        S.parse_args(["--configs", "long_context"])
    assert "allowed: a comma-separated list from ['bf16', 'exact', 'lowest_memory', 'largest_model']" in \
        capsys.readouterr().err


def test_the_router_verdict_takes_bf16s_band_of_aux_losses():
    """verdicts.router: a preset's router is no worse than BF16's where its mean aux loss is at most the top of BF16's
    band (the loss band's rule: mean + max(2 std, 0.5%)); none without a router measured."""
    r = lambda aux: {"aux_loss": aux, "share_max": 1.5, "share_min": 0.5}   # noqa: E731
    bf16 = {0: r(2.00), 1: r(2.02), 2: r(2.04)}   # mean 2.02, std 0.02: top 2.06
    got = V.router({"bf16": bf16, "exact": {0: r(2.05)}, "lowest_memory": {0: r(2.03), 1: r(2.10)}, "x": {}})
    assert got["exact"]["no_worse_than_bf16"] and not got["lowest_memory"]["no_worse_than_bf16"]
    assert got["lowest_memory"]["aux_loss"] == [2.03, 2.10] and "x" not in got
    assert V.router({"bf16": {}}) is None


def test_moe_eval_is_the_language_model_loss_without_the_routers_term():
    """causal_lm.moe_eval on a tiny Qwen3-MoE: its loss + coefficient x aux equals HF's returned loss, which is the
    plain next-token loss plus that term; every token is routed to its k experts in every layer."""
    from coat_ds.workloads.causal_lm import MODEL_SIZES, from_shape, moe_eval
    model = from_shape(dict(MODEL_SIZES["moe-tiny"], vocab_size=128), seed=0).eval()

    class Engine(torch.nn.Module):   # what moe_eval reads of DeepSpeed's engine: module, device, a call
        def __init__(self):
            super().__init__()
            self.module, self.device = model, torch.device("cpu")

        def forward(self, **kwargs):
            return self.module(**kwargs)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lm, aux, counts = moe_eval(Engine(), x, y)
        plain = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    torch.testing.assert_close(lm, plain, rtol=1e-5, atol=1e-6)
    assert aux > 0 and counts.shape == (2, 8) and (counts.sum(1) == 2 * 16 * 2).all()


def entry(phase: str, config: str, seed: int, status: str, steps: int, **extra) -> dict:
    return {"phase": phase, "config": config, "seed": seed, "label": config, "status": status, "steps_done": steps,
            "tokens_per_s": 300_000.0, "train": [], "val": [], "segments": [{"startup_s": 50.0}], **extra}


def test_merge_keeps_what_ended_and_continues_or_restarts_what_did_not(tmp_path):
    args = S.parse_args(["--run-root", str(tmp_path / "runs")])
    facts = S.recipe_facts(args)
    a = {"recipe": facts, "calls": [{"n": 1}], "runs": {
        "pretrain_bf16_s0": entry("pretrain", "bf16", 0, "done", 3100),
        "pretrain_exact_s0": entry("pretrain", "exact", 0, "partial", 1200),
        "pretrain_bf16_s1": entry("pretrain", "bf16", 1, "partial", 900)}}
    b = {"recipe": facts, "calls": [{"n": 1}, {"n": 2}], "runs": {           # b was merged from a, then ran
        "pretrain_bf16_s0": entry("pretrain", "bf16", 0, "partial", 500),        # a later partial loses to done
        "pretrain_bf16_s1": entry("pretrain", "bf16", 1, "partial", 1500)}}
    for name, doc in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    res = S.merged([str(tmp_path / "a.json"), str(tmp_path / "missing.json"), str(tmp_path / "b.json")], facts)
    assert res["calls"] == [{"n": 1}, {"n": 2}]
    assert res["runs"]["pretrain_bf16_s0"]["status"] == "done" and res["runs"]["pretrain_bf16_s1"]["steps_done"] == 1500
    ckpt = tmp_path / "runs" / "pretrain_bf16_s1" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step0001500")
    order = S.schedule(args, res)
    plan = {t.job.key: t for t in order}
    assert (plan["pretrain_bf16_s1"].resume_from, plan["pretrain_bf16_s1"].steps_left) == (1500, 1600)
    assert order[0].job.key == "pretrain_bf16_s1"   # its checkpoint lives on this machine only: it goes first
    assert plan["pretrain_exact_s0"].resume_from is None and plan["pretrain_exact_s0"].why.startswith("restart")
    # measured: 300k tokens/s and 50 s to start replace the assumptions
    assert S.rate(args, res, "pretrain", "bf16") == (300_000.0, "measured")
    two = S.parse_args(["--num-gpus", "2"])   # measured on 4 GPUs, a pretraining's rate is per GPU on 2
    assert S.rate(two, res, "pretrain", "bf16") == (150_000.0, "measured")
    res["runs"]["pretrain_bf16_s0"]["gpus"] = 2   # once measured on 2 GPUs too, 2 GPUs' own rate
    res["runs"]["pretrain_bf16_s0"]["tokens_per_s"] = 200_000.0
    assert S.rate(two, res, "pretrain", "bf16") == (200_000.0, "measured")
    res["runs"]["pretrain_bf16_s0"]["tokens_per_s"] = 300_000.0
    assert plan["pretrain_bf16_s1"].est_s == pytest.approx(50 + 1600 * 65_536 / 300_000 + 11 * 524_288 / 900_000 + 20)
    # BF16's seed 0 ended, but the fine-tuning needs its export, which this machine lacks: it runs again
    assert plan["pretrain_bf16_s0"].why == "again: the fine-tuning needs its export"
    assert "pretrain_bf16_s0" not in {t.job.key for t in S.schedule(S.parse_args(["--phase", "pretrain", "--run-root",
                                                                                   str(tmp_path / "runs")]), res)}
    (tmp_path / "other.json").write_text(json.dumps({**a, "recipe": S.recipe_facts(S.parse_args(["--smoke"]))}))
    with pytest.raises(SystemExit, match="followed another recipe"):
        S.merged([str(tmp_path / "other.json")], facts)


def test_fine_tuning_from_another_export_runs_again(tmp_path):
    args = S.parse_args(["--phase", "finetune", "--run-root", str(tmp_path)])
    (tmp_path / S.EXPORT).mkdir()
    (tmp_path / S.EXPORT / S.MARK).write_text(json.dumps({"source": "pretrain_bf16_s0", "written": "T2"}))
    res = {"runs": {"pretrain_bf16_s0": entry("pretrain", "bf16", 0, "done", 3100),
                    "finetune_bf16_s0": entry("finetune", "bf16", 0, "done", 1000, export_id="T2"),
                    "finetune_exact_s0": entry("finetune", "exact", 0, "done", 1000, export_id="T1")},
           "outliers": {"export_id": "T2"}}
    plan = {t.job.key: t.why for t in S.schedule(args, res)}
    assert plan["finetune_exact_s0"] == "again: made from another export"
    assert "finetune_bf16_s0" not in plan and "pretrain_bf16_s0" not in plan and "outliers" not in plan


def test_the_verdicts_of_a_results_file_and_their_tables(tmp_path):
    """judge() on runs with known finals and spikes, then the README's and docs' tables rendered from the file."""
    args = S.parse_args([])
    train = [[s, s * 65_536, 2.0 + 3.0 * math.exp(-s / 300), 6e-4] for s in range(1, 3101)]
    runs_ = {}
    for seed, final in enumerate((2.00, 2.01, 2.02)):
        runs_[f"pretrain_bf16_s{seed}"] = entry("pretrain", "bf16", seed, "done", 3100, train=train,
                                                val=[[3100, 0, final]])
    runs_["pretrain_exact_s0"] = entry("pretrain", "exact", 0, "done", 3100, train=train,
                                       val=[[2325, 0, 2.1], [2480, 0, 2.4], [3100, 0, 2.005]])
    runs_["pretrain_lowest_memory_s0"] = entry("pretrain", "lowest_memory", 0, "partial", 1000, val=[[155, 0, 4.0]])
    for name, (before, end) in {"bf16": (1.50, 1.20), "exact": (1.505, 1.2), "lowest_memory": (1.5, 1.2)}.items():
        runs_[f"finetune_{name}_s0"] = entry("finetune", name, 0, "done", 1000, export_id="T",
                                             val=[[0, 0, before], [1000, 0, end]])
    res = {"runs": runs_, "outliers": {"layers": [{"layer": 0, "max_abs": 12.0, "rms": 0.5, "ratio": 24.0}]}}
    doc = S.result(args, res, [{"device": "4x H100", "date": "D"}], {"kernel": 115_387_969})
    pre, ft = doc["verdicts"]["pretrain"], doc["verdicts"]["finetune"]
    assert list(pre["configs"]) == ["bf16", "exact"]                       # the partial run is not judged
    assert pre["configs"]["exact"]["within_band"] and pre["configs"]["exact"]["spike_ok"] is False
    assert pre["bf16_largest_rise"] == 0.0 and doc["runs"]["pretrain_exact_s0"]["spike"] == {
        "rise": pytest.approx(0.3), "at_step": 2480, "over_step": 2325}
    assert ft["exact"]["gap_before_rel"] == pytest.approx(0.005 / 1.5) and ft["exact"]["meets_targets"]
    (tmp_path / "accuracy_scale.json").write_text(json.dumps(doc))
    readme = rt.render("accuracy", tmp_path)
    assert "| exact | 2.0050 (1) | -0.25% | yes, no | +0.33% / +0.00% | no |" in readme
    assert "| bf16 | 2.0100 (3) | +0.00% | -, yes | - | - |" in readme
    assert "| lowest_memory | - (0) | - | -, - | +0.00% / +0.00% | so far (no pretraining yet) |" in readme
    scale = rt.render("accuracy_scale", tmp_path)
    assert "1.9900 - 2.0300 (2 std, 3 seeds)" in scale and "| 0: 0.3000: no |" in scale
    assert "| 0 | 12.00 | 0.500 | 24.0 |" in rt.render("accuracy_scale_outliers", tmp_path)
    assert "not measured yet" in rt.render("accuracy_scale_finetune", tmp_path / "none")


# --- the main job's flags ---------------------------------------------------------------------------------------------
def test_warmup_steps_override_the_configs_and_are_checked(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    args = train.parse_args(["--deepspeed", "ds_configs/zero2_bf16.json", "--steps", "3100", "--warmup-steps", "100"])
    assert train.load_ds_config(args)["scheduler"]["params"]["warmup_num_steps"] == 100
    assert train.parse_args(["--eval-first"]).eval_first
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "10", "--warmup-steps", "10"])
    assert "--warmup-steps=10 is invalid; allowed: an integer in [1, --steps=10)" in capsys.readouterr().err
