"""The main job (examples/train.py) across two "nodes" of 2 ranks each through a hostfile, checkpointed, then resumed
as one node of 4 ranks, as docs/train.md "Two nodes, then one" shows, on DeepSpeed's CPU accelerator (gloo), through
`benchmarks/two_nodes.py --smoke` (the same script runs it on GPUs).

The two-node run trains STEPS steps without a stop and checkpoints at SAVE_AT on the way, so it is both the job that
is resumed and the uninterrupted 4-rank run that the resumed one must match. The resumed run (`deepspeed --num_gpus 4
... --resume-from stepSAVE_AT`) logs the steps after SAVE_AT again, and they must equal the two-node run's with ==:
the world is 4 ranks with the same global ranks both times (the hostfile puts ranks 0-1 on node 0 and 2-3 on node 1),
so every sample (a function of seed, step and rank), every gloo reduction and every stochastic rounding of the bf16_sr
master (keyed by seed, step and position, docs/deepspeed.md) is the same arithmetic; only where the ranks run changes.
A checkpoint that dropped a state (a moment, its scale, the LR schedule, the step) shows as a different loss, LR or
validation loss.
"""
import json

from benchmarks import two_nodes
from harness import child_env, require_launcher

STEPS, SAVE_AT = two_nodes.SMOKE["steps"], two_nodes.SMOKE["save_at"]


def test_two_nodes_then_one_node_resumes_bit_for_bit(tmp_path, monkeypatch):
    require_launcher()
    monkeypatch.setenv("COAT_DATA_CACHE", child_env()["COAT_DATA_CACHE"])   # the BPE + tokens the other jobs built
    run = tmp_path / "run"
    assert two_nodes.main(["--smoke", "--out", str(tmp_path), "--run-dir", str(run)]) == 0
    res = json.loads((tmp_path / "two_nodes_smoke.json").read_text())
    two, resumed = res["two_nodes"], res["resumed"]
    assert two["exit_codes"] == {"node1": 0, "node0": 0} and two["nnodes_2_seen"], res.get("error")
    assert [r["step"] for r in two["records"]] == [*range(1, STEPS + 1), STEPS]   # STEPS train records, the final eval
    assert sum(f.endswith("optim_states.pt") for f in two["checkpoint_files"]) == 4   # one per rank of both nodes
    assert resumed["exit_code"] == 0 and resumed["one_node_seen"] and not resumed["warned_data_order"]
    # steps 1..SAVE_AT are the two-node run's lines, timings included: the resumed run started at SAVE_AT, not at 0
    # (which, the arithmetic being the same, would log the same losses)
    assert resumed["kept_the_steps_before"]
    # the steps after it and the final validation loss: those the two-node run logged, bit for bit
    assert res["comparison"]["steps"] == [*range(SAVE_AT + 1, STEPS + 1), STEPS]
    assert res["comparison"]["bit_equal"] and res["comparison"]["max_rel_loss_diff"] == 0.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["zero_stage"] == 3 and summary["fp8_layers"] == 2
