"""Builders of the FP8 AdamW ops: a fused CUDA kernel and its C++/OpenMP twin for CPU-only and Offload."""
from __future__ import annotations

from .builder import CoatCPUOpBuilder, CoatCUDAOpBuilder, csrc


class CoatAdamBuilder(CoatCUDAOpBuilder):
    """FP8 AdamW step of CUDA tensors."""

    BUILD_VAR = "COAT_BUILD_ADAM"
    NAME = "coat_adam"

    def sources(self) -> list[str]:
        return [csrc("adam", "coat_adam_frontend.cpp"), csrc("adam", "coat_adam_cuda.cu")]

    def include_paths(self) -> list[str]:
        return [csrc("includes"), csrc("adam")]


class CPUCoatAdamBuilder(CoatCPUOpBuilder):
    """FP8 AdamW step of CPU tensors (CPU-only training, ZeRO-Offload)."""

    BUILD_VAR = "COAT_BUILD_CPU_ADAM"
    NAME = "coat_cpu_adam"

    def sources(self) -> list[str]:
        return [csrc("adam", "coat_adam_cpu.cpp")]

    def include_paths(self) -> list[str]:
        return [csrc("includes"), csrc("adam")]
