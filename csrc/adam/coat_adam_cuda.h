// Launchers of the CUDA FP8 AdamW kernels: raw pointers and a stream, no torch (the .cu includes CUDA
// headers only; coat_adam_frontend.cpp binds these to torch tensors).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "coat_adam_tensor.h"
#include "coat_fp8_math.h"

namespace coat_cuda {

// Alignment the vector path needs (bytes): fp32 param/grad 16, 16-bit ones and the bf16 copy 8, codes 4.
bool adam_vector_aligned(const coat::AdamTensor& t);

// tensors: device array (uploaded once per set of tensors by the frontend) of n_tensors entries, their
// group_begin and vec_ok set, covering total_groups groups of group_size values, all with this grad dtype
// and master. grad_scale: a device fp32 scalar read by the kernel, or nullptr (then coefs.grad_scale).
// sr_prefix: coat::sr_prefix(seed, step), for a stochastically rounded master.
cudaError_t adam_step(const coat::AdamTensor* tensors, int n_tensors, int64_t total_groups, int group_size,
                      coat::Dtype grad_dtype, coat::Master master, const coat::AdamCoefs& coefs,
                      const float* grad_scale, uint32_t sr_prefix, bool v_e5m2, bool expansion, cudaStream_t stream);

cudaError_t quantize(const float* x, uint8_t* codes, float* scale, float* expo, int64_t numel, int group_size,
                     bool e5m2, bool expansion, cudaStream_t stream);

cudaError_t dequantize(const uint8_t* codes, const float* scale, const float* expo, float* out, int64_t numel,
                       int group_size, bool e5m2, cudaStream_t stream);

}  // namespace coat_cuda
