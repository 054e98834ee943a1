import glob
import os

import pytest
import torch

# inductor's compiled graphs land in one cache per checkout, shared by every test process (the launcher's ranks
# too): torch's default inductor cache is one folder per user, and a graph compiled from another checkout's custom
# ops (another signature) was reused here. JIT builds stay where a plain process looks (TORCH_EXTENSIONS_DIR, else
# torch's default), where .ci/setup built them (.ci/build_ops)
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"
_SHM_AT_START = set(glob.glob(SHM_BUFFERS))   # another job's buffers: never touched


@pytest.fixture(autouse=True)
def _remove_leaked_shm_buffers():
    """DeepSpeed's CPU accelerator leaves a 69 MB shared-memory allreduce buffer in /dev/shm for every rank
    of a `deepspeed` launch; /dev/shm is RAM, and a day of test runs filled a 24 GiB machine until 2-rank
    launches failed. After each test, the buffers made since this session started (by its launches, which
    are subprocesses that have exited, module fixtures' included) and mapped by no live process are removed."""
    yield
    leaked = set(glob.glob(SHM_BUFFERS)) - _SHM_AT_START
    if not leaked:
        return
    mapped = ""
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as fh:
                mapped += fh.read()
        except OSError:   # a process that ended meanwhile, or not ours to read
            pass
    for path in leaked:
        if path not in mapped:
            try:
                os.unlink(path)
            except OSError:
                pass
