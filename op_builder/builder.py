"""Base classes of coat_ds's op builders, on top of DeepSpeed's OpBuilder / CUDAOpBuilder.

What they add to DeepSpeed's: absolute source paths from this package (DeepSpeed resolves relative ones
against its own install), a prebuilt-module import for `COAT_BUILD_OPS=1` installs (DeepSpeed's `load()`
only imports modules it built itself), JIT builds that a stopped one cannot block (jit_lock.py), the reason an
op cannot build here (for the loader's warning and `python -m coat_ds.report`), and a TORCH_CUDA_ARCH_LIST parser
that accepts `9.0a` and `9.0+PTX` (DeepSpeed 0.19.8's `compute_capability_args` raises on them)."""
from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

from .jit_lock import build_lock

# csrc/ sits beside op_builder/: at the checkout's top, in coat_ds/ (links to those) and in an install
CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

DEFAULT_CUDA_ARCHS = "8.0;9.0"
_ARCH_RE = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?", re.IGNORECASE)


def csrc(*parts: str) -> str:
    """Absolute path of a file under csrc/."""
    return os.path.join(CSRC_DIR, *parts)


def parse_cuda_arch_list(text: str) -> list[tuple[int, int, str, bool]]:
    """`8.0;9.0a 9.0+PTX` -> sorted unique (major, minor, suffix, ptx); suffix is '' or 'a'/'f'."""
    found: dict[tuple[int, int, str], bool] = {}
    for token in re.split(r"[;,\s]+", text.strip()):
        if not token:
            continue
        m = _ARCH_RE.fullmatch(token)
        if m is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {token!r} is not understood; "
                             "allowed forms: 9.0, 9.0a, 9.0+PTX, 9.0a+PTX")
        key = (int(m.group(1)), int(m.group(2)), m.group(3).lower())
        found[key] = found.get(key, False) or m.group(4) is not None
    if not found:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={text!r} names no architecture")
    return [(*key, ptx) for key, ptx in sorted(found.items())]


def gencode_flags(archs: list[tuple[int, int, str, bool]]) -> list[str]:
    """nvcc -gencode flags: SASS for each arch, PTX where asked (`9.0a` -> sm_90a / compute_90a)."""
    flags = []
    for major, minor, suffix, ptx in archs:
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


class CoatBuilderMixin:
    """Naming and loading shared by every coat_ds builder (NAME is set by each subclass)."""

    NAME: str

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return f"coat_ds.kernels.{self.NAME}_op"

    def incompatibility(self) -> str | None:
        """Why this op cannot build on this machine, or None if it can."""
        if super().is_compatible(verbose=False):
            return None
        return self.error_log or "DeepSpeed reports it incompatible"

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = self.incompatibility()
        if reason is not None and verbose:
            self.warning(f"{self.name}: {reason}")
        return reason is None

    def prebuilt(self) -> bool:
        """Whether a `COAT_BUILD_OPS=1` install holds this op's module (found, not imported)."""
        return importlib.util.find_spec(self.absolute_name()) is not None

    def jit_dir(self) -> str:
        """Where torch JIT-builds this op (its own layout under TORCH_EXTENSIONS_DIR; made if missing)."""
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(self.name, verbose=False)

    def jit_cached(self) -> str | None:
        """The module an earlier JIT build left in jit_dir(), or None (ninja still rechecks it on load)."""
        found = sorted(glob.glob(os.path.join(self.jit_dir(), f"{self.name}*.so")))
        return found[-1] if found else None

    def load(self, verbose: bool = False):
        """The prebuilt module if `COAT_BUILD_OPS=1` installed one that imports, else DeepSpeed's JIT build."""
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        try:
            module = importlib.import_module(self.absolute_name())
        except ImportError:
            with build_lock(self.jit_dir(), self.name):   # a build stopped mid-way leaves no lock behind
                return self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module


class CoatCPUOpBuilder(CoatBuilderMixin, OpBuilder):
    """C++ + OpenMP op, flags as DeepSpeed's CPU builders use them (-O3 -march=native -fopenmp)."""

    def cxx_args(self) -> list[str]:
        # -fno-math-errno / -fno-trapping-math let sqrtf and the branch-free selects vectorise without
        # changing a single result; no -ffast-math: results must track the reference
        return ["-O3", "-std=c++20", "-g", "-Wno-reorder", self.cpu_arch(), "-fopenmp", "-fno-math-errno",
                "-fno-trapping-math"]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]


class CoatCUDAOpBuilder(CoatBuilderMixin, CUDAOpBuilder):
    """CUDA op: no --use_fast_math (it flushes denormals, which the FP8 states round-trip exactly)."""

    def incompatibility(self) -> str | None:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME

        if torch.version.cuda is None:
            return "PyTorch is built without CUDA"
        if CUDA_HOME is None:
            return "no CUDA toolkit found (nvcc; set CUDA_HOME)"
        return super().incompatibility()

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        text = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() or (cross_compile_archs or "").strip()
        if not text:
            text = self._device_archs() or DEFAULT_CUDA_ARCHS
        archs = parse_cuda_arch_list(text)
        if not any(ptx for *_, ptx in archs):  # PTX of the newest arch keeps newer GPUs working
            archs[-1] = (*archs[-1][:3], True)
        self.enable_bf16 = all(major >= 8 for major, *_ in archs)
        return gencode_flags(archs)

    @staticmethod
    def _device_archs() -> str:
        import torch

        if not torch.cuda.is_available():
            return ""
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))

    @staticmethod
    def portable_nvcc_flags() -> list[str]:
        """nvcc flags that need neither torch nor a GPU (tests/test_nvcc_compile.py uses them too)."""
        return ["-O3", "-std=c++17", "-lineinfo", f"-I{csrc('includes')}"]

    def nvcc_args(self) -> list[str]:
        threads = max(1, min(os.cpu_count() or 1, 8))
        return self.portable_nvcc_flags() + [f"--threads={threads}"] + self.compute_capability_args()

    def cxx_args(self) -> list[str]:
        return ["-O3", "-std=c++20", "-g", "-Wno-reorder"]
