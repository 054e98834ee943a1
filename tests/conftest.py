import os

import pytest
import torch

# JIT builds land in one cache per checkout, shared by every test process (the launcher's ranks too)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache",
                                                           "torch_extensions"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
