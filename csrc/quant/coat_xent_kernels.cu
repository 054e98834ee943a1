// Cross-entropy of the LM head's logits as they come out of the GEMM, bf16 (coat_ds/activation/loss.py;
// reference: quant_reference.xent_forward / xent_backward). The unfused version casts every logit to fp32
// and makes five passes over them each way, which at a 128k-262k vocabulary is most of the loss's time.
// Forward: one read of each row (a block per row, an online max and sum of exponentials per thread,
// combined across the block): logsumexp and the target's logit, fp32.
// Backward: a [tokens, vocabulary slice] block of logits becomes its gradient in place,
// (exp(x - lse) - [column == target]) * scale, in fp32 with one bf16 rounding (the reference's order).
#include "coat_quant.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

namespace coat_quant {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int V = 8;  // bf16 per 16-byte vector

struct MaxSum {  // sum of exp(x - m) over some values, m their maximum
    float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, a.s + b.s};  // nothing seen yet on either side (exp(-inf - -inf) is NaN)
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ void load8(const bf16* p, float* v) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const bf16* pa = reinterpret_cast<const bf16*>(&a);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = __bfloat162float(pa[j]);
}

__device__ MaxSum block_combine(MaxSum x) {
    __shared__ MaxSum part[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = combine(x, {__shfl_xor_sync(0xffffffffu, x.m, o),
                                                     __shfl_xor_sync(0xffffffffu, x.s, o)});
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = x;
    __syncthreads();
    x = part[0];
#pragma unroll
    for (int k = 1; k < kThreads / 32; ++k) x = combine(x, part[k]);
    return x;
}

__global__ void xent_forward_k(const bf16* x, const int64_t* target, float* lse, float* picked, int64_t n) {
    const bf16* xr = x + blockIdx.x * n;
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t c = threadIdx.x * V; c < n; c += kThreads * V) {
        float v[V];
        load8(xr + c, v);
        MaxSum part{v[0], 0.0f};
#pragma unroll
        for (int j = 1; j < V; ++j) part.m = fmaxf(part.m, v[j]);
#pragma unroll
        for (int j = 0; j < V; ++j) part.s += part.m == -INFINITY ? 0.0f : expf(v[j] - part.m);
        acc = combine(acc, part);
    }
    acc = block_combine(acc);
    if (threadIdx.x == 0) {
        lse[blockIdx.x] = acc.m == INFINITY ? INFINITY : acc.m + logf(acc.s);
        const int64_t t = target[blockIdx.x];
        picked[blockIdx.x] = t >= 0 && t < n ? __bfloat162float(xr[t]) : NAN;  // the caller checks targets
    }
}

__global__ void xent_backward_k(bf16* x, const float* lse, const int64_t* target, const float* scale, int64_t m,
                                int64_t n) {
    const int64_t per_row = n / V, total = m * per_row;
    for (int64_t i = blockIdx.x * (int64_t)kThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kThreads) {
        const int64_t row = i / per_row, c0 = (i % per_row) * V;
        float v[V];
        load8(x + row * n + c0, v);
        const float l = lse[row], sc = scale[row];
        const int64_t hit = target[row] - c0;  // the target's index in this vector, if in [0, V)
        alignas(16) bf16 out[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            float p = expf(v[j] - l);
            if (j == hit) p = p + -1.0f;
            out[j] = __float2bfloat16_rn(p * sc);
        }
        *reinterpret_cast<uint4*>(x + row * n + c0) = *reinterpret_cast<const uint4*>(out);
    }
}

}  // namespace

void xent_forward(const void* x, const int64_t* target, float* lse, float* picked, int64_t m, int64_t n,
                  cudaStream_t s) {
    if (m == 0) return;
    xent_forward_k<<<(unsigned)m, kThreads, 0, s>>>(static_cast<const bf16*>(x), target, lse, picked, n);
}

void xent_backward(void* x, const float* lse, const int64_t* target, const float* scale, int64_t m, int64_t n,
                   cudaStream_t s) {
    const int64_t vectors = m * (n / V);
    if (vectors == 0) return;
    const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, 132 * 16);
    xent_backward_k<<<(unsigned)blocks, kThreads, 0, s>>>(static_cast<bf16*>(x), lse, target, scale, m, n);
}

}  // namespace coat_quant
