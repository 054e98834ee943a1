// Launchers of the CUDA FP8 AdamW kernels: raw pointers and a stream, no torch (the .cu includes CUDA
// headers only; coat_adam_frontend.cpp binds these to torch tensors).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "coat_fp8_math.h"

namespace coat_cuda {

// One tensor of a multi-tensor step; the frontend uploads an array of these once per set of tensors.
struct AdamTensor {
    void* param;       // the master: fp32, or bf16 (raw bits), as the launch says
    const void* grad;  // fp32, bf16 or fp16 (raw bits), as the launch says
    uint8_t* m_codes;
    float* m_scale;
    float* m_expo;
    uint8_t* v_codes;
    float* v_scale;
    float* v_expo;
    uint16_t* bf16_out;   // nullptr: no bf16 copy
    int64_t numel;
    int64_t group_begin;  // index of this tensor's first group among all groups of the launch
    int64_t vec_ok;       // 1 when every pointer is aligned for the vector loads/stores
    int64_t sr_stream;    // stochastic rounding of a bf16 master: the parameter's stream and this tensor's
    int64_t sr_offset;    //   offset in it (the value at position i uses the bits of index sr_offset + i)
};

// Alignment the vector path needs (bytes): fp32 param/grad 16, 16-bit ones and the bf16 copy 8, codes 4.
bool adam_vector_aligned(const AdamTensor& t, coat::Dtype grad_dtype, coat::Master master);

// tensors: device array of n_tensors entries covering total_groups groups of group_size values, all with
// this grad dtype and master. grad_scale: a device fp32 scalar read by the kernel, or nullptr (then
// coefs.grad_scale). sr_prefix: coat::sr_prefix(seed, step), for a stochastically rounded master.
cudaError_t adam_step(const AdamTensor* tensors, int n_tensors, int64_t total_groups, int group_size,
                      coat::Dtype grad_dtype, coat::Master master, const coat::AdamCoefs& coefs,
                      const float* grad_scale, uint32_t sr_prefix, bool v_e5m2, bool expansion, cudaStream_t stream);

cudaError_t quantize(const float* x, uint8_t* codes, float* scale, float* expo, int64_t numel, int group_size,
                     bool e5m2, bool expansion, cudaStream_t stream);

cudaError_t dequantize(const uint8_t* codes, const float* scale, const float* expo, float* out, int64_t numel,
                       int group_size, bool e5m2, cudaStream_t stream);

}  // namespace coat_cuda
