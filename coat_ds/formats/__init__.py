"""FP8 formats, group quantization and bf16 rounding: plain-PyTorch reference math, no kernels."""
from .fp8 import E4M3, E5M2, FORMATS, FP8Format, cast_to_fp8, get_format
from .group_quant import (GROUP_SIZES, K_MAX, K_MIN, GroupQuantized, check_group_size, dequantize, group_params,
                          n_groups, quantize, relative_error)
from .moment import Fp8Moment, state_keys
from .remainder import bf16_weight, join as join_remainder, split as split_remainder
from .rounding import round_bf16, sr_bits, stream_key

__all__ = ["E4M3", "E5M2", "FORMATS", "FP8Format", "cast_to_fp8", "get_format", "GROUP_SIZES", "K_MAX", "K_MIN",
           "Fp8Moment", "GroupQuantized", "check_group_size", "dequantize", "group_params", "n_groups", "quantize",
           "relative_error", "bf16_weight", "join_remainder", "round_bf16", "split_remainder", "sr_bits", "state_keys",
           "stream_key"]
