"""Compiled kernels behind reference-compatible signatures (falls back to the reference)."""
from .adam import adamw_step, dequantize, quantize
from .loader import load_op

__all__ = ["adamw_step", "dequantize", "quantize", "load_op"]
