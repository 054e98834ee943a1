"""The main job (examples/train.py) across two "nodes" of 2 ranks each through a hostfile, checkpointed, then resumed
as one node of 4 ranks, as docs/train.md "Two nodes, then one" shows, on DeepSpeed's CPU accelerator (gloo).

The two-node run trains STEPS steps without a stop and checkpoints at SAVE_AT on the way, so it is both the job that
is resumed and the uninterrupted 4-rank run that the resumed one must match (a third launch, from scratch on one
node, would cost ~45 s more of CPU; the steps after SAVE_AT already run on one node). The resumed run (`deepspeed
--num_gpus 4 ... --resume-from stepSAVE_AT`) logs the steps after SAVE_AT again, and they must equal the two-node
run's with ==: the world is 4 ranks with the same global ranks both times (the hostfile puts ranks 0-1 on node 0 and
2-3 on node 1), so every sample (a function of seed, step and rank), every gloo reduction and every stochastic
rounding of the bf16_sr master (keyed by seed, step and position, docs/deepspeed.md) is the same arithmetic; only
where the ranks run changes. A checkpoint that dropped a state (a moment, its scale, the LR schedule, the step)
shows as a different loss, LR or validation loss.
"""
import json
import subprocess
from pathlib import Path

import pytest

from harness import ROOT, TRAIN_SMALL, child_env, finish, free_port, launcher, require_launcher, start_two_nodes

STEPS, SAVE_AT = 6, 3
TIMINGS = ("tokens_per_s", "step_time_s", "peak_mem_gb")   # the fields of a train record that no rerun repeats


def records(run: Path) -> list[dict]:
    """log.jsonl's records, as written."""
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def untimed(rows: list[dict]) -> list[dict]:
    """The records without TIMINGS: what a resumed step must repeat."""
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


# ZeRO-3 (its partitions cut every parameter); ZeRO-2 passed too when written (103 s more on 2 loaded cores)
@pytest.mark.parametrize("config", ["zero3_largest_model.json"])
def test_two_nodes_then_one_node_resumes_bit_for_bit(tmp_path, config):
    require_launcher()
    run = tmp_path / "run"
    job = ["examples/train.py", "--deepspeed", f"ds_configs/{config}", "--save-dir", str(run), *TRAIN_SMALL,
           "--steps", str(STEPS), "--save-every", str(SAVE_AT), "--eval-every", "0"]
    logs = start_two_nodes(tmp_path, 2, job, child_env())()
    for r, log in enumerate(logs):
        assert f"nnodes=2, num_local_procs=2, node_rank={r}" in log and "dist_world_size=4" in log, log[-3000:]
        assert log.count("exits successfully") == 2, log[-3000:]
    two_nodes = records(run)
    assert [r["step"] for r in two_nodes] == [*range(1, STEPS + 1), STEPS]   # STEPS train records, the final eval
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["zero_stage"] == int(config[4]) and summary["fp8_layers"] == 2
    tag = f"step{SAVE_AT:07d}"
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == [tag, f"step{STEPS:07d}"]
    assert len(list((run / "checkpoints" / tag).glob("*optim_states.pt"))) == 4   # one per rank of both nodes

    cmd = [launcher(), "--num_gpus", "4", "--master_port", str(free_port()), *job, "--resume-from", tag]
    out = finish(subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True))   # one process group: a timeout kills every rank
    assert out.count("exits successfully") == 4 and "Traceback" not in out, out[-3000:]
    assert "nnodes=1, num_local_procs=4" in out and "warning: resuming" not in out, out[-3000:]   # same data order
    resumed = records(run)
    # steps 1..SAVE_AT are the two-node run's lines, timings included: the resumed run started at SAVE_AT, not at 0
    # (which, the arithmetic being the same, would log the same losses)
    assert resumed[:SAVE_AT] == two_nodes[:SAVE_AT]
    # the steps after it and the final validation loss: those the two-node run logged, bit for bit
    assert untimed(resumed[SAVE_AT:]) == untimed(two_nodes[SAVE_AT:])
    assert json.loads((run / "summary.json").read_text())["world_size"] == 4
