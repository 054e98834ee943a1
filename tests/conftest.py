import glob
import os
import time

import pytest
import torch

# inductor's compiled graphs land in one cache per checkout, shared by every test process (the launcher's ranks
# too): torch's default inductor cache is one folder per user, and a graph compiled from another checkout's custom
# ops (another signature) was reused here. JIT builds stay where a plain process looks (TORCH_EXTENSIONS_DIR, else
# torch's default), where .ci/setup built them (.ci/build_ops)
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))


def pytest_collection_modifyitems(config, items):
    # the `install` tests first (a stable sort: the rest keep their order): .ci/run's second lane starts while setup's
    # ops still build, and these build the wheel's own op in a folder of their own (no wait for setup's builds)
    items.sort(key=lambda item: item.get_closest_marker("install") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"
_SHM_AT_START = set(glob.glob(SHM_BUFFERS))   # another job's buffers: never touched
# A rank creates its buffer (shm_open, write) and maps it a moment later: a buffer younger than this may be one a live
# job of another pytest process (CI's other lane) has made and not mapped yet, and removing it leaves that job's
# other rank waiting for it forever (seen in CI: a 2-rank launch hung 7 minutes in DeepSpeed's shm_initialize).
SHM_MIN_AGE_S = 5.0


def _remove_unmapped_buffers() -> None:
    """Remove the buffers made since this session started that no live process maps and that are old enough."""
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
        try:
            if path not in mapped and time.time() - os.stat(path).st_mtime >= SHM_MIN_AGE_S:
                os.unlink(path)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def _remove_leaked_shm_buffers():
    """DeepSpeed's CPU accelerator leaves a 69 MB shared-memory allreduce buffer in /dev/shm for every rank
    of a `deepspeed` launch; /dev/shm is RAM, and a day of test runs filled a 24 GiB machine until 2-rank
    launches failed. After each test, the buffers made since this session started (by its launches, which
    are subprocesses that have exited, module fixtures' included) and mapped by no live process are removed."""
    yield
    _remove_unmapped_buffers()


def pytest_sessionfinish(session, exitstatus):
    """The last tests' buffers too, once they are old enough to be told from a live job's being made: a wait only
    as long as the youngest needs (a flat 5 s idled each of CI's four sessions, a buffer being as old as its job)."""
    ages = []
    for path in set(glob.glob(SHM_BUFFERS)) - _SHM_AT_START:
        try:
            ages.append(time.time() - os.stat(path).st_mtime)
        except OSError:
            pass
    if ages:
        time.sleep(max(0.0, SHM_MIN_AGE_S - min(ages)))
        _remove_unmapped_buffers()
