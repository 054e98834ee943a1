"""Builder of the FP8 activation kernels (csrc/quant): RMSNorm / SiLU*mul / per-tensor quantization."""
from __future__ import annotations

from .builder import CoatCUDAOpBuilder, csrc


class CoatQuantBuilder(CoatCUDAOpBuilder):
    """FP8 activation kernels on CUDA: quantization, RMSNorm, SiLU*mul, RoPE, the LM head's cross-entropy."""

    BUILD_VAR = "COAT_BUILD_QUANT"
    NAME = "coat_quant"

    def sources(self) -> list[str]:
        return [csrc("quant", "coat_quant_frontend.cpp"), csrc("quant", "coat_quant_kernels.cu"),
                csrc("quant", "coat_rope_kernels.cu"), csrc("quant", "coat_xent_kernels.cu")]

    def include_paths(self) -> list[str]:
        return [csrc("includes"), csrc("quant")]
