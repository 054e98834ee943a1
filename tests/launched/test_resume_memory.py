"""A resume in bounded host memory (issue 57): engine.load_checkpoint of the 70B preset's optimizer settings (ZeRO-3,
CoatAdamW, states on the host, bf16_sr master) on 2 CPU ranks (tests/ds_scripts/resume_job.py), at two sizes.

Each rank's optimizer file is read once, memory-mapped, and copied into place one tensor at a time
(coat_ds/deepspeed/checkpoint/files.py read_mapped, load.py): the host peak over the load is what the built engine
holds (its partition and host states) plus the file's largest tensor and a small constant, the same excess at both
sizes, which is why this stand-in speaks for 70B (docs/deepspeed.md, "Resuming 70B"). Before, coat_ds read the file
whole to check it and DeepSpeed read it whole again: the peak grew by twice the file."""
import json
import subprocess

import pytest
import torch

from coat_ds.deepspeed.memory import largest_sub_group, resume_host, zero_job
from harness import DS_SCRIPTS, ROOT, child_env, ranks_launcher

pytestmark = pytest.mark.slow

OVERHEAD = 16 * 2**20   # what a rank adds over its largest tensor whatever the size (measured: under 2 MiB)


def resume(tmp_path, layers: int, width: int = 1024) -> list[dict]:
    """Each rank's record of resume_job.py for a stack of `layers` layers of `width` on 2 ranks."""
    out = tmp_path / f"r{layers}.json"
    cmd = [*ranks_launcher(2), str(DS_SCRIPTS / "resume_job.py"), "--out", str(out), "--ckpt",
           str(tmp_path / f"ckpt{layers}"), "--layers", str(layers), "--width", str(width)]
    # glibc's mmap threshold fixed (as test_model_load.py does): freed tensors go back to the OS
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(MALLOC_MMAP_THRESHOLD_="131072"), capture_output=True,
                          text=True, timeout=600)
    paths = [tmp_path / f"r{layers}.json.rank{rank}" for rank in (0, 1)]
    assert proc.returncode == 0 and all(p.is_file() for p in paths), (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(p.read_text()) for p in paths]


def test_a_resume_holds_the_engine_plus_one_tensor_of_its_file(tmp_path):
    """Each rank's peak RSS over load_checkpoint is the engine it loads into (partition and host states, held before)
    plus at most its optimizer file's largest tensor and OVERHEAD, the same excess at 12 and 36 layers (a file of 26
    and 78 MB a rank); masters and states arrive as saved."""
    if torch.cuda.is_available():
        pytest.skip("CPU-accelerator runs: on GPUs the partitions are device memory (the gpu test below)")
    check_bounded(tmp_path, (12, 36), 1024, OVERHEAD)


@pytest.mark.gpu
def test_a_resume_on_two_gpus_holds_one_tensor_of_its_file(tmp_path):
    """The same on 2 GPUs (NCCL, pinned host states) at 70B's width, 8192: each layer of 67M values its own sub-group,
    its 67 MB bf16 master the largest tensor of a 0.55 / 1.7 GB file a rank; CUDA's staging of the pageable copies
    allowed for in a larger constant."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_bounded(tmp_path, (4, 12), 8192, 4 * OVERHEAD)


def check_bounded(tmp_path, sizes: tuple[int, int], width: int, overhead: int) -> None:
    """Both sizes' resumes bounded as the tests say; the planner's resume peak (memory.resume_host) is the rank's states
    (its host rows, within alignment) plus the largest tensor measured here."""
    excess = {}
    for layers in sizes:
        for r in resume(tmp_path, layers, width):
            assert r["world"] == 2 and r["as_saved"] and r["subgroups"] >= 3, r
            job, n = zero_job(r["config"], 2, 2.125, "bf16_sr", "release", "host"), layers * width * width
            assert job.host_states and r["states_bytes"] == pytest.approx(2.125 * n / 2, rel=0.01), r
            assert resume_host(job, n, 0.0, largest_sub_group([width * width] * layers, 2, job.sub_group)) == \
                r["largest_tensor"], r
            growth = r["peak"] - r["rss_before"]
            assert growth <= r["largest_tensor"] + overhead, (layers, growth, r)
            assert growth < 0.5 * r["file_bytes"], (layers, growth, r)   # a rank that read its file whole: >= 1x
            excess[layers, r["rank"]] = growth - r["largest_tensor"]
    for rank in (0, 1):   # nothing beyond the largest tensor grows with the file
        assert excess[sizes[1], rank] <= excess[sizes[0], rank] + 4 * 2**20, excess
