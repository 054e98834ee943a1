"""Ahead-of-time builds for `COAT_BUILD_OPS=1 pip install --no-build-isolation .` (like DS_BUILD_OPS).

`extensions()` turns every op in ALL_OPS into a setuptools extension through the builder's own `builder()`
(DeepSpeed's mechanism), so prebuilt and JIT-built ops get the same flags. An op is skipped when its
BUILD_VAR is set to 0 or when it cannot build here (a CUDA op without a CUDA toolkit); `load()` then
JIT-builds it on first use as usual. setup.py imports this module from the checkout (as op_builder.prebuild)."""
from __future__ import annotations

import os

from . import ALL_OPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _relative(paths: list[str]) -> list[str]:
    # setuptools wants sources relative to setup.py's directory
    return [os.path.relpath(p, ROOT) if os.path.abspath(p).startswith(ROOT + os.sep) else p for p in paths]


def extensions() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for setup()."""
    from torch.utils.cpp_extension import BuildExtension

    ext_modules = []
    for builder in (cls() for cls in ALL_OPS.values()):
        if os.environ.get(builder.BUILD_VAR, "1") == "0":
            print(f"coat_ds: {builder.BUILD_VAR}=0, not prebuilding {builder.NAME}")
            continue
        reason = builder.incompatibility()
        if reason is not None:
            print(f"coat_ds: not prebuilding {builder.NAME}: {reason} (it JIT-builds on first use where it can)")
            continue
        ext = builder.builder()
        ext.sources = _relative(ext.sources)
        ext_modules.append(ext)
        print(f"coat_ds: prebuilding {builder.NAME} as {builder.absolute_name()}")
    return ext_modules, {"build_ext": BuildExtension.with_options(use_ninja=True)}
