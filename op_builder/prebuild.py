"""Ahead-of-time builds for `COAT_BUILD_OPS=1 pip install --no-build-isolation .` (like DS_BUILD_OPS).

`extensions()` turns every builder exported by op_builder into a setuptools extension through the
builder's own `builder()` (DeepSpeed's mechanism), so prebuilt and JIT-built ops get the same flags. A
builder is skipped when its BUILD_VAR is set to 0, when it is a CUDA op and no CUDA toolkit is found, or
when it reports itself incompatible; `load()` then JIT-builds it on first use as usual."""
from __future__ import annotations

import os

import op_builder
from op_builder.builder import CoatCUDAOpBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _relative(paths: list[str]) -> list[str]:
    # setuptools wants sources relative to setup.py's directory
    return [os.path.relpath(p, ROOT) if os.path.abspath(p).startswith(ROOT + os.sep) else p for p in paths]


def _builders() -> list:
    classes = (getattr(op_builder, name) for name in op_builder.__all__)
    return [cls() for cls in classes if isinstance(cls, type) and getattr(cls, "NAME", None)]


def extensions() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for setup()."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension

    ext_modules = []
    for builder in _builders():
        if os.environ.get(builder.BUILD_VAR, "1") == "0":
            print(f"coat_ds: {builder.BUILD_VAR}=0, not prebuilding {builder.NAME}")
            continue
        if isinstance(builder, CoatCUDAOpBuilder) and (torch.version.cuda is None or CUDA_HOME is None):
            print(f"coat_ds: no CUDA toolkit, not prebuilding {builder.NAME} (it JIT-builds where CUDA exists)")
            continue
        if not builder.is_compatible(verbose=True):
            print(f"coat_ds: {builder.NAME} is not compatible here, not prebuilding it")
            continue
        ext = builder.builder()
        ext.sources = _relative(ext.sources)
        ext_modules.append(ext)
        print(f"coat_ds: prebuilding {builder.NAME} as {builder.absolute_name()}")
    return ext_modules, {"build_ext": BuildExtension.with_options(use_ninja=True)}
