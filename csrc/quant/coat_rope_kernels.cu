// Rotary embedding of the fused q/k/v GEMM output, in one pass each way.
//
// Forward: qkv [B*S, (nh + 2 nkv) hd] bf16 (row = one token) and HF's cos/sin [B or 1, S, hd] ->
// q [B, S, nh, hd], k and v [B, S, nkv, hd] contiguous bf16, which Python hands to attention as
// [B, h, S, hd] views: the same strides as HF's own q/k/v, so the attention backend lays its output out as
// HF's path does and o_proj can keep a reference to attention's saved output instead of a copy.
// x_out[d] = x[d] cos[d] + rotate_half(x)[d] sin[d], rotate_half(x) = [-x2, x1] (HF's formula), in fp32
// with one bf16 rounding. Backward: the transpose of that map, written straight into d(qkv), so neither the
// split's cat nor the copies of the unfused version run.
#include "coat_quant.h"

#include <cuda_bf16.h>

namespace coat_quant {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int V = 8;  // bf16 per 16-byte vector

struct Vec8 {
    float v[V];
};

__device__ __forceinline__ Vec8 ld8(const bf16* p) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const bf16* pa = reinterpret_cast<const bf16*>(&a);
    Vec8 r;
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = __bfloat162float(pa[j]);
    return r;
}

__device__ __forceinline__ void st8(bf16* p, const Vec8& x) {
    alignas(16) bf16 o[V];
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = __float2bfloat16_rn(x.v[j]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(o);
}

// BACKWARD = false: src is qkv rows, dst the [B, H, S, hd] tensors; true: the other way round.
template <bool BACKWARD>
__global__ void rope_k(bf16* qkv, bf16* q, bf16* k, bf16* v, const bf16* cos, const bf16* sin, int64_t seq,
                       int nh, int nkv, int hd, bool cs_batched) {
    const int64_t tok = blockIdx.x;
    const int64_t b = tok / seq, s = tok % seq;
    const int width = (nh + 2 * nkv) * hd;
    bf16* row = qkv + tok * width;
    const int64_t cs_off = ((cs_batched ? b : 0) * seq + s) * hd;
    const int h2 = hd / 2, per_head = h2 / V;
    const int n_rot = (nh + nkv) * per_head;
    for (int c = threadIdx.x; c < n_rot; c += kThreads) {
        const int head = c / per_head, d = (c % per_head) * V;
        const bool is_q = head < nh;
        const int hh = is_q ? head : head - nh, nheads = is_q ? nh : nkv;
        bf16* dst = (is_q ? q : k) + (tok * nheads + hh) * hd;
        bf16* src = row + head * hd;  // q heads then k heads: k starts at nh * hd
        const Vec8 c1 = ld8(cos + cs_off + d), c2 = ld8(cos + cs_off + d + h2);
        const Vec8 s1 = ld8(sin + cs_off + d), s2 = ld8(sin + cs_off + d + h2);
        Vec8 o1, o2;
        if (!BACKWARD) {
            const Vec8 x1 = ld8(src + d), x2 = ld8(src + d + h2);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                o1.v[j] = x1.v[j] * c1.v[j] - x2.v[j] * s1.v[j];
                o2.v[j] = x2.v[j] * c2.v[j] + x1.v[j] * s2.v[j];
            }
            st8(dst + d, o1);
            st8(dst + d + h2, o2);
        } else {
            const Vec8 g1 = ld8(dst + d), g2 = ld8(dst + d + h2);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                o1.v[j] = g1.v[j] * c1.v[j] + g2.v[j] * s2.v[j];
                o2.v[j] = g2.v[j] * c2.v[j] - g1.v[j] * s1.v[j];
            }
            st8(src + d, o1);
            st8(src + d + h2, o2);
        }
    }
    const int n_v = nkv * hd / V;
    for (int c = threadIdx.x; c < n_v; c += kThreads) {
        const int hh = c / (hd / V), d = (c % (hd / V)) * V;
        bf16* vv = v + (tok * nkv + hh) * hd + d;
        bf16* src = row + (nh + nkv) * hd + hh * hd + d;
        if (!BACKWARD)
            *reinterpret_cast<uint4*>(vv) = *reinterpret_cast<const uint4*>(src);
        else
            *reinterpret_cast<uint4*>(src) = *reinterpret_cast<const uint4*>(vv);
    }
}

}  // namespace

void rope_qkv(const void* qkv, const void* cos, const void* sin, void* q, void* k, void* v, int64_t batch,
              int64_t seq, int nh, int nkv, int hd, bool cs_batched, cudaStream_t s) {
    if (batch * seq == 0) return;
    rope_k<false><<<(unsigned)(batch * seq), kThreads, 0, s>>>(
        const_cast<bf16*>(static_cast<const bf16*>(qkv)), static_cast<bf16*>(q), static_cast<bf16*>(k),
        static_cast<bf16*>(v), static_cast<const bf16*>(cos), static_cast<const bf16*>(sin), seq, nh, nkv, hd,
        cs_batched);
}

void rope_qkv_backward(const void* dq, const void* dk, const void* dv, const void* cos, const void* sin, void* dqkv,
                       int64_t batch, int64_t seq, int nh, int nkv, int hd, bool cs_batched, cudaStream_t s) {
    if (batch * seq == 0) return;
    rope_k<true><<<(unsigned)(batch * seq), kThreads, 0, s>>>(
        static_cast<bf16*>(dqkv), const_cast<bf16*>(static_cast<const bf16*>(dq)),
        const_cast<bf16*>(static_cast<const bf16*>(dk)), const_cast<bf16*>(static_cast<const bf16*>(dv)),
        static_cast<const bf16*>(cos), static_cast<const bf16*>(sin), seq, nh, nkv, hd, cs_batched);
}

}  // namespace coat_quant
