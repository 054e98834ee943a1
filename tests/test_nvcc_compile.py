"""Every CUDA source under csrc/ compiles for sm_90 with the flags our builders use (needs nvcc, no GPU)."""
import glob
import os
import shutil
import subprocess

import pytest

from coat_ds.op_builder.builder import CSRC_DIR, CoatCUDAOpBuilder

CU_FILES = sorted(glob.glob(os.path.join(CSRC_DIR, "**", "*.cu"), recursive=True))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("path", CU_FILES, ids=[os.path.relpath(p, CSRC_DIR) for p in CU_FILES])
def test_nvcc_compiles_for_sm90(path, tmp_path):
    cmd = ["nvcc", "-c", "-arch=sm_90", *CoatCUDAOpBuilder.portable_nvcc_flags(), f"-I{os.path.dirname(path)}", path,
           "-o", str(tmp_path / "out.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
