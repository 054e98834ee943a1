"""The ops .ci/setup JIT-builds (.ci/build_ops) are the ones a plain process loads: the README's main command sets no
TORCH_EXTENSIONS_DIR, and setup used to build into the checkout's .cache/torch_extensions, so the main job's first
step built both again into ~/.cache/torch_extensions (114 s on 2 cores). Here the setup's own build is checked, in the
environment setup ran in (TORCH_EXTENSIONS_DIR where set, else torch's default folder): the ops are in that folder,
built before this session's tests ran (before COAT_OPS_BUILT_BY, the time .ci/run sets once setup is done; else this
session's start), and a plain process, loading the ops as the main job does (DeepSpeed's shm op as its CPU
accelerator's comm does, coat_ds's CPU Adam through load_op), finds them built: the same files, neither compiled nor
linked again. This test used to run build_ops again into a fresh default folder: ~200 CPU seconds (95 s of CI's slow
lane) to build what setup had just built."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SESSION_START = time.time()   # at collection, before any test of this session ran

LOAD = """
import json
from deepspeed.comm.torch import build_shm_op
from coat_ds.kernels.loader import load_op
print("RESULT " + json.dumps({"shm": build_shm_op().__file__, "adam": load_op("CPUCoatAdamBuilder").__file__}))
"""


def built(folder: Path) -> dict[str, tuple[int, int]]:
    """{path: (inode, mtime)} of every object file and module under `folder`: a rebuild changes them."""
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.suffix in (".so", ".o")}


def test_the_setups_build_is_what_a_plain_process_loads():
    from torch.utils.cpp_extension import get_default_build_root

    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())   # where setup built
    before = built(folder)
    names = {Path(p).name: p for p in before}
    setup = ("coat_cpu_adam.so", "deepspeed_shm_comm.so", "cpu_adam.so")   # cpu_adam: DeepSpeed's CPUAdam (alst's)
    assert set(setup) <= set(names), \
        f"setup's ops are not in {folder} (built elsewhere, or not built: bash .ci/build_ops): {sorted(before)}"
    by = float(os.environ.get("COAT_OPS_BUILT_BY", SESSION_START))
    late = {n: before[names[n]][1] / 1e9 - by for n in setup if before[names[n]][1] / 1e9 > by}
    assert not late, f"built after setup, by a test (s after setup): {late}"
    plain = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=dict(os.environ), capture_output=True,
                           text=True, timeout=1800)
    results = [json.loads(ln[len("RESULT "):]) for ln in plain.stdout.splitlines() if ln.startswith("RESULT ")]
    assert plain.returncode == 0 and results, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert {Path(f).name for f in results[0].values()} == {"coat_cpu_adam.so", "deepspeed_shm_comm.so"}
    assert all(f in before for f in results[0].values()), (results, sorted(before))
    assert built(folder) == before, "the plain process built again"
