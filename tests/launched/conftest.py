"""Every test under tests/launched/ starts jobs in other processes (the `deepspeed` or `accelerate` launcher, or an
example's training run) and is marked `slow`: `.ci/run` runs them in its second lane, `pytest -m "not slow"` skips
them."""
from pathlib import Path

import pytest

import harness

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def section_launch(request, tmp_path_factory) -> dict:
    """section_job.py's results on 2 ranks for every module of this session that reads them (harness.section_launch)."""
    return harness.section_launch(request.session, tmp_path_factory.mktemp("section_launch"))
