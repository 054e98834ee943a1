"""Every registered family under ZeRO-3 with HF's zero.Init, on 2 ranks (tests/ds_scripts/families_job.py); the
in-process family contract is tests/test_families.py."""
import json
import subprocess
from pathlib import Path

import pytest

from coat_ds.hf import supported_model_types
from harness import DS_SCRIPTS, ROOT, child_env, ranks_launcher

FAMILIES = supported_model_types()


def test_zero3_zero_init_two_ranks(tmp_path):
    """Every family built under zero.Init, injected, trained by ZeRO-3 on 2 ranks (CPU accelerator, gloo):
    partitioned before the swap, FP8 leaf layers, losses within 2% of the same weights trained by torch AdamW."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "r.json"
    cmd = [*ranks_launcher(2), str(DS_SCRIPTS / "families_job.py"), "--out", str(out), *FAMILIES]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    for rank in (0, 1):
        path = Path(f"{out}.rank{rank}")
        assert path.is_file(), (proc.stdout + proc.stderr)[-6000:]
        result = json.loads(path.read_text())
        for model_type in FAMILIES:
            res = result[model_type]
            assert "error" not in res, (model_type, res.get("trace"))
            assert res["partitioned_before_inject"] and res["fp8"] and res["leaf"], (model_type, res)
            for loss, ref in res["losses"]:
                assert abs(loss - ref) / ref < 0.02, (model_type, res["losses"])
            assert res["losses"][-1][0] < res["losses"][0][0], (model_type, res["losses"])
