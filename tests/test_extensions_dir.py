"""The ops .ci/setup JIT-builds (.ci/build_ops) are the ones a plain process loads: the README's main command sets no
TORCH_EXTENSIONS_DIR, and setup used to build into the checkout's .cache/torch_extensions, so the main job's first
step built both again into ~/.cache/torch_extensions (114 s on 2 cores). Here torch's default folder is a fresh one
(XDG_CACHE_HOME), TORCH_EXTENSIONS_DIR is unset for both processes, and the plain process, loading the ops as the
main job does (DeepSpeed's shm op as its CPU accelerator's comm does, coat_ds's CPU Adam through load_op), finds
them built: the same files, neither compiled nor linked again. ~1-2 min on 2 cores (two ops built from scratch)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

LOAD = """
import json
from deepspeed.comm.torch import build_shm_op
from coat_ds.kernels.loader import load_op
print("RESULT " + json.dumps({"shm": build_shm_op().__file__, "adam": load_op("CPUCoatAdamBuilder").__file__}))
"""


def built(folder: Path) -> dict[str, tuple[int, int]]:
    """{path: (inode, mtime)} of every object file and module under `folder`: a rebuild changes them."""
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.suffix in (".so", ".o")}


def test_the_setups_build_is_what_a_plain_process_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                                             env.get("PATH", "")]))
    setup = subprocess.Popen(["bash", ".ci/build_ops"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = setup.communicate(timeout=1800)
    finally:   # on a timeout, its builds too
        if setup.poll() is None:
            os.killpg(setup.pid, signal.SIGKILL)
            setup.wait()
    assert setup.returncode == 0, out[-3000:]
    default = tmp_path / "cache" / "torch_extensions"
    before = built(default)
    names = {Path(p).name for p in before}
    assert {"coat_cpu_adam.so", "deepspeed_shm_comm.so"} <= names, f"setup built elsewhere: {sorted(before)}"
    plain = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1800)
    results = [json.loads(ln[len("RESULT "):]) for ln in plain.stdout.splitlines() if ln.startswith("RESULT ")]
    assert plain.returncode == 0 and results, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert {Path(f).name for f in results[0].values()} == {"coat_cpu_adam.so", "deepspeed_shm_comm.so"}
    assert all(f in before for f in results[0].values()), (results, sorted(before))
    assert built(default) == before, "the plain process built again"
