"""`python -m coat_ds.report`: one row per fact, exit 0, and no build unless `--build` is given."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import torch

import coat_ds
from coat_ds import op_builder
from coat_ds.deepspeed import fence
from coat_ds.kernels.loader import op_status


def _report(tmp_path, extensions_dir, *args: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COAT_DISABLE_OPS"}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions_dir),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]))  # its ninja
    proc = subprocess.run([sys.executable, "-m", "coat_ds.report", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    rows = dict(line[2:-2].split(" | ", 1) for line in lines[1:])
    return {item.strip(): value for item, value in rows.items()}


def test_report_rows_without_building(tmp_path):
    ext = tmp_path / "ext"
    rows = _report(tmp_path, ext)
    assert rows["coat_ds"] == f"{coat_ds.__version__} ({os.path.dirname(coat_ds.__file__)})"
    assert rows["torch"].startswith(f"{torch.__version__} (")
    assert rows["DeepSpeed"] == importlib.metadata.version("deepspeed")
    assert rows["DeepSpeed internals"] == (f"the {len(fence.METHODS)} methods coat_ds re-states, overrides or wraps "
                                           "match DeepSpeed "
                                           f"{rows['DeepSpeed']}'s")
    assert rows["transformers"] == importlib.metadata.version("transformers")
    assert rows["CUDA (PyTorch's)"] == (torch.version.cuda or "none: a CPU build of PyTorch")
    assert rows["JIT cache"] == str(ext) and rows["JIT locks"] == "none"
    assert rows["ninja (JIT builds)"] == "yes"
    assert rows["op coat_cpu_adam"].startswith("built: no; compatible: yes; runs: kernel, JIT-built on first use · ")
    if not torch.cuda.is_available():
        assert rows["accelerator"].startswith("cpu (DeepSpeed's; fp16: ")
        assert (rows["GPUs"], rows["FP8 GEMMs (sm_89+)"]) == ("none", "no GPU")
    if torch.version.cuda is None:
        for name in ("coat_adam", "coat_quant"):
            assert rows[f"op {name}"].startswith("built: no; compatible: no; runs: reference: PyTorch is built "
                                                 "without CUDA · ")
    assert set(op_builder.ALL_OPS) == {item[3:] for item in rows if item.startswith("op ")}
    assert not list(ext.rglob("*.so")), "the report built an op"


def test_report_names_a_jit_lock_left_in_the_cache(tmp_path):
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert _report(tmp_path, tmp_path / "ext")["JIT locks"].startswith(f"{lock}: a build running now, or one stopped")


def test_report_sees_a_jit_built_op_and_loads_it(tmp_path):
    op_builder.CPUCoatAdamBuilder().load()  # into this session's JIT cache (tests/conftest.py)
    rows = _report(tmp_path, os.path.dirname(op_builder.CPUCoatAdamBuilder().jit_dir()), "--build")
    assert rows["op coat_cpu_adam"].startswith("built: JIT cache; compatible: yes; runs: kernel (loaded), ")


def test_disabled_ops_run_the_reference(monkeypatch):
    monkeypatch.setenv("COAT_DISABLE_OPS", "1")
    status = op_status("CPUCoatAdamBuilder")
    assert (status.problem, status.runs) == (None, "reference: COAT_DISABLE_OPS=1")
