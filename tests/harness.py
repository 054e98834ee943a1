"""What test modules share, kept here so that no test module imports another: starting jobs in other processes
(a free port, a child's environment, the launchers, a launched job's results, the worlds of one and two ranks a job
script runs in) and the tiny HF models that the injection tests build."""
from __future__ import annotations

import functools
import inspect
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaModel, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from coat_ds.hf.contract import CACHE_ARGS
from family_cases import SEQ, VOCAB

ROOT = Path(__file__).resolve().parents[1]
DS_SCRIPTS = ROOT / "tests" / "ds_scripts"   # the job scripts the launched tests start


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT / --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict:
    """os.environ with this checkout first on PYTHONPATH (children import it, not the editable install), the data
    cache of the examples kept in the checkout, and Python's fault handler on (a child that crashes in native code,
    as one rank of test_hf_trainer once did in CI, prints every thread's stack); `extra` added."""
    env = dict(os.environ, **extra)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.setdefault("COAT_DATA_CACHE", str(ROOT / ".cache" / "coat_data"))   # BPE + tokens built once per checkout
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def launcher(name: str = "deepspeed") -> str:
    """The path of a launcher script (`deepspeed`, `accelerate`): on PATH, else beside this Python."""
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def ranks_launcher(gpus: int) -> list[str]:
    """In place of `deepspeed --num_gpus GPUS --master_port PORT`: the job script's ranks started directly
    (ds_scripts/ranks.py says why), for the launched jobs that test coat_ds, not the launcher."""
    return [sys.executable, str(DS_SCRIPTS / "ranks.py"), "--num_gpus", str(gpus), "--master_port", str(free_port())]


def run_one_rank_job(tmp_path: Path, source: str) -> dict:
    """Run a job script (`source`) as a world of one without a launcher; what it printed last after "RESULT "."""
    script = tmp_path / "job.py"
    script.write_text(source)
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def launch_json(cmd: list[str], out: Path, env: dict | None = None, timeout: int = 600, exit_0: bool = True) -> dict:
    """Run a launcher command whose job writes its results to the JSON file `out`; the test fails with the log's
    tail where it writes none or (`exit_0`) exits with another status."""
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)
    if (exit_0 and proc.returncode != 0) or not Path(out).is_file():
        pytest.fail(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(Path(out).read_text())


@functools.cache
def tmpfs_ok() -> bool:
    """Whether this machine lets a test mount a tmpfs of its own: `unshare -rm` (a user and mount namespace)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


# examples/train.py's default model and data shrunk for CI: tiny Llama, 64-token samples, 2 samples per rank
TRAIN_SMALL = ["--model-size", "tiny", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--eval-batches", "2"]


def finish(proc: subprocess.Popen, timeout: int = 600) -> str:
    """The output of a job started in a session of its own (`start_new_session=True`), once it exits (the first run
    may JIT-build ops); on timeout the whole job is killed, not just the launcher, and the test fails."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"job timed out after {timeout} s:\n{out[-3000:]}")
    return out


def start_two_nodes(tmp: str | Path, slots: int, tail: list[str], env: dict) -> Callable[[], list[str]]:
    """Two "nodes" of `slots` ranks on this machine, as docs/deepspeed.md "Multi-node" starts nodes without ssh: one
    `deepspeed --hostfile H --no_ssh --node_rank r` launcher each running `tail` (script and arguments), node 0
    holding global ranks 0..slots-1. The call returned waits for both and gives their logs (node 0's first); the test
    fails with the logs' tails where a launcher exits non-zero or runs past 600 s (its whole job killed)."""
    hostfile = os.path.join(tmp, "hostfile")
    with open(hostfile, "w") as f:
        f.write(f"nodeA slots={slots}\nnodeB slots={slots}\n")
    base = [launcher(), "--hostfile", hostfile, "--no_ssh", "--master_addr=127.0.0.1", "--master_port",
            str(free_port())]
    logs = [os.path.join(tmp, f"node{r}.log") for r in (0, 1)]
    procs = {}
    for r in (1, 0):   # node 0 last: its rank 0 hosts the rendezvous the others wait for
        with open(logs[r], "w") as log:   # a file, not a pipe: nobody reads it meanwhile
            procs[r] = subprocess.Popen([*base, f"--node_rank={r}", *tail], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait() -> list[str]:
        deadline = time.monotonic() + 600
        for p in procs.values():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs.values():
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                        q.wait()
        out = [Path(log).read_text() for log in logs]
        if any(p.returncode for p in procs.values()):
            pytest.fail("two-node run failed (exit " + ", ".join(f"node {r}: {p.returncode}" for r, p in
                                                                 sorted(procs.items())) + "):\n" +
                        "\n".join(text[-4000:] for text in out))
        return out

    return wait


# ------------------------------------------------------------------ ds_scripts/job.py and the job scripts built on it
SAVE_AT, STEPS = 30, 50   # job.py's (release_job.py and zero_state_job.py take them): 50 steps, a checkpoint at 30


def require_launcher() -> None:
    """Skip where the `deepspeed` launcher is not installed."""
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not installed")


@functools.cache
def unsupported(dtype: str) -> str | None:
    """Why DeepSpeed would refuse `dtype` on this machine ("Type fp16 is not supported on your device"), or None."""
    if dtype not in ("fp16", "bf16"):
        return None
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    ok = getattr(acc, f"is_{dtype}_supported")()
    return None if ok else (f"DeepSpeed's {acc.device_name()} accelerator has no {dtype} here "
                            f"(is_{dtype}_supported() -> {ok!r})")


def _dtype(task: str) -> str:
    """The dtype field of a job.py task (kind:stage[:dtype...]); fp32 when left out."""
    return (task.split(":")[2:] or ["fp32"])[0]


def job_env() -> dict:
    """child_env() with the job's own time limit (COAT_JOB_TIMEOUT, 300 s unless set)."""
    env = child_env()
    env.setdefault("COAT_JOB_TIMEOUT", "300")
    return env


def launch_job(out: str | Path, ckpt: str | Path, tasks: list[str], gpus: int,
               job: str | Path = DS_SCRIPTS / "job.py") -> dict:
    """`tasks` of a job script (job.py's kind:stage[:dtype...]) on `gpus` ranks (ranks_launcher), checkpoints
    under `ckpt`; its results. A task in a dtype DeepSpeed's accelerator lacks here is left out."""
    tasks = [t for t in tasks if unsupported(_dtype(t)) is None]
    cmd = [*ranks_launcher(gpus), str(job), "--out", str(out), "--ckpt", str(ckpt), *tasks]
    return launch_json(cmd, out, job_env())


def launch_worlds(tmp_path_factory, name: str, job: str | Path, **worlds: tuple[list[str], int]) -> dict:
    """A test module's launched runs of `job` on DeepSpeed's CPU accelerator, one per world and in order, sharing
    one checkpoint folder (a later world loads what an earlier one saved): `w1=(tasks, 1), w2=(tasks, 2)` ->
    {"w1": results, "w2": results}. Skipped where CUDA is (gpu-marked tests run there)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs")
    tmp = tmp_path_factory.mktemp(name)
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    return {w: launch_job(tmp / f"{w}.json", ckpt, tasks, gpus, job=job) for w, (tasks, gpus) in worlds.items()}


def task_result(res: dict, job: str, task: str) -> dict:
    """What `task` returned in the run `job` of `res` ({job: results}); skipped where its dtype was left out, failed
    with the task's error and trace where it raised."""
    if task not in res[job]["tasks"] and unsupported(_dtype(task)):
        pytest.skip(unsupported(_dtype(task)))
    out = res[job]["tasks"][task]
    assert "error" not in out, f"{job} {task}: {out.get('error')}\n{out.get('trace')}"
    return out


# ------------------------------------------------------------------ section_job.py and presets_job.py: 2 ranks
def launch_results(cmd: list[str], out: Path) -> dict:
    """Run a launcher command whose job writes each task's results per rank, or the error it raised, to `out`: the
    file decides, not the exit status (COAT_JOB_TIMEOUT 420 s unless set)."""
    env = child_env()
    env.setdefault("COAT_JOB_TIMEOUT", "420")
    return launch_json(cmd, out, env, exit_0=False)


def ranks(result: dict, task: str) -> list[dict]:
    """Both ranks' results of `task` in such a file; the test fails with a rank's trace where it raised."""
    assert task in result, f"task {task} did not finish: {sorted(result)}"
    per_rank = list(result[task].values())
    for r in per_rank:
        assert "error" not in r, r.get("trace", r["error"])
    assert len(per_rank) == 2
    return per_rank


def section_launch(session: pytest.Session, tmp: Path) -> dict:
    """One 2-rank launch of section_job.py running the tasks that this session's selected tests read through the
    `section_launch` fixture (tests/launched/conftest.py): each such test module names its tasks in SECTION_TASKS
    (section_job's own, or SCRIPT.TASK of checkpoint_job.py and presets_job.py). Its results, per task
    {"rank0": ..., "rank1": ...}. One launch for the four modules instead of three: each launch's ranks import torch,
    DeepSpeed and transformers (~8 s of CPU a rank) before any task."""
    tasks: list[str] = []
    for item in session.items:
        if "section_launch" in item.fixturenames:
            tasks += [t for t in getattr(item.module, "SECTION_TASKS", ()) if t not in tasks]
    out = tmp / "r.json"
    cmd = [*ranks_launcher(2), str(DS_SCRIPTS / "section_job.py"), "--out", str(out), "--tmp", str(tmp), *tasks]
    env = child_env()
    env.setdefault("COAT_JOB_TIMEOUT", "900")   # the four modules' tasks: ~3 minutes in CI
    return launch_json(cmd, out, env, timeout=1200, exit_0=False)


def module_tasks(launch: dict, tasks: list[str]) -> dict:
    """A module's `tasks` of section_launch's results, by their own names (SCRIPT.TASK -> TASK); a task that did not
    finish is left out (harness.ranks says so)."""
    return {t.rpartition(".")[2]: launch[t] for t in tasks if t in launch}


def assert_runs_as_configured(name: str, r: dict, cfg: dict) -> None:
    """What presets_job recorded for one config on one rank is what the config asks for."""
    master = cfg["coat"].get("master_weights", "fp32")
    assert r["fp8"] == 2 and r["optimizer"] == "CoatAdamW", (name, r)          # both decoder layers are FP8
    assert r["attention_fp8"] == [cfg["coat"]["activation"].get("attention_fp8", False)], (name, r)
    assert r["master_weights"] == master, (name, r)
    assert (r["fp32_master_values"] == 0) == (master != "fp32"), (name, r)  # only "fp32" keeps an fp32 copy
    assert r["losses"] and all(math.isfinite(x) for x in r["losses"]), (name, r)


# ------------------------------------------------------------------ tiny HF models, built in-process (no download)
TINY_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
_TINY_CONFIGS = {
    "llama2": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=4)),
    # GQA (4 query heads on 2 kv heads), llama3 rope scaling, tied embeddings
    "llama3-gqa": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                       rope_parameters=_LLAMA3_ROPE)),
    # a window (8) shorter than the sequence (24), so the window matters
    "mistral": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=8)),
    # q/k/v biases; layer 1 slides, layer 0 does not
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=1)),
}
TINY_MODELS = list(_TINY_CONFIGS)


def tiny_model(name: str, seed: int = 0, **kw) -> torch.nn.Module:
    """The TINY_MODELS variant `name`, randomly initialized from `seed`; `kw` overrides its config."""
    model_cls, config_cls, own = _TINY_CONFIGS[name]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**TINY_SHAPE, **own, **kw}))


def tiny_batch(seed: int = 0, batch: int = 2) -> torch.Tensor:
    """`batch` random sequences of SEQ tokens."""
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_close_to_stock(stock, injected, x, loss_tol=2e-3, logits_tol=0.08, grad_max=0.25, grad_mean=0.15) -> dict:
    """Forward + backward of both on `x`; checks the bounds (tests/test_inject.py says why these) and returns the
    measured errors."""
    ref, out = stock(input_ids=x, labels=x), injected(input_ids=x, labels=x)
    ref.loss.backward()
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.logits).all()
    errs = {}
    for (name, p), (name2, q) in zip(stock.named_parameters(), injected.named_parameters()):
        assert name == name2
        assert q.grad is not None and torch.isfinite(q.grad).all(), name
        errs[name] = rel_error(q.grad, p.grad)
    measured = {"loss": abs(out.loss.item() - ref.loss.item()) / ref.loss.item(),
                "logits": rel_error(out.logits, ref.logits), "grad_max": max(errs.values()),
                "grad_mean": sum(errs.values()) / len(errs)}
    assert measured["loss"] < loss_tol, measured
    assert 1e-3 < measured["logits"] < logits_tol, measured
    assert measured["grad_max"] < grad_max, errs
    assert measured["grad_mean"] < grad_mean, errs
    return measured


# The name under which this transformers release takes the cache (the other one is a deprecated alias or absent).
CACHE_KW = next(n for n in CACHE_ARGS if n in inspect.signature(LlamaModel.forward).parameters)


def cache_of(out):
    """The KV cache an HF output carries (field `cache` or `past_key_values`, by release), or None."""
    return next((getattr(out, n) for n in CACHE_ARGS if getattr(out, n, None) is not None), None)


def memorizing(family: str, steps: int = 60, build=tiny_model):
    """A tiny model (`build(family)`) trained to continue one sequence: peaked next-token logits, so that greedy
    decoding is decided by a margin far above FP8 noise and the injected model must produce the stock tokens."""
    model = build(family)
    seq = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[None, :SEQ]  # no token repeats
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=seq, labels=seq).loss.backward()
        opt.step()
    return model.eval(), seq


def kept_bytes(model, x) -> int:
    """Bytes that a training forward leaves alive for backward: what autograd saves (unique storages, parameters
    left out) plus what the output holds beside the loss (a KV cache)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(input_ids=x, labels=x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    cache = cache_of(out)
    held = [t for layer in (cache.layers if cache is not None else []) for t in (layer.keys, layer.values)]
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved + held}
    out.loss.backward()
    return sum(n for ptr, n in kept.items() if ptr not in params)
