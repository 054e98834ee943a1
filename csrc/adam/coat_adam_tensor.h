// One tensor of an FP8 AdamW step as raw pointers: what the argument checks produce (coat_adam_common.h), what
// the CPU kernels read, and (as a device table) what the CUDA kernel reads. No torch or CUDA headers.
#pragma once

#include <cstdint>

#include "coat_fp8_math.h"

namespace coat {

struct AdamTensor {
    void* param;       // the master: fp32, or bf16 (raw bits; kF32Rem: the high halves), as `master` says
    const void* grad;  // fp32, bf16 or fp16 (raw bits), as `grad_dtype` says
    uint8_t* m_codes;
    float* m_scale;
    float* m_expo;
    uint8_t* v_codes;
    float* v_scale;
    float* v_expo;
    uint16_t* bf16_out;  // nullptr: no bf16 copy
    uint16_t* remainder;  // kF32Rem: the fp32 master's low halves (param holds the bf16 high halves); else nullptr
    int64_t numel;
    int64_t group_begin;  // CUDA launch: index of this tensor's first group among all groups of the launch
    int64_t vec_ok;       // CUDA launch: 1 when every pointer is aligned for the vector loads/stores
    int64_t sr_stream;    // stochastic rounding of a bf16 master: the parameter's stream and this tensor's
    int64_t sr_offset;    //   offset in it (the value at position i uses the bits of index sr_offset + i)
    Dtype grad_dtype;
    Master master;
};

}  // namespace coat
