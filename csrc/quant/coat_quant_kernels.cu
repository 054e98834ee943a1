// FP8 activation kernels of COAT's precision flow. Mirrors coat_ds/kernels/quant_reference.py exactly:
// power-of-two scales (frexp), saturating round-to-nearest-even casts, the same fp32 order of operations.
//
// Row kernels (one block per row, a thread owns whole 1 x 16 groups, so a group's maximum never leaves
// its thread): rmsnorm_quant, silu_mul_quant, rmsnorm_backward, silu_mul_backward, row_amax.
// Tile kernel (64 x 64 tiles, 256 threads, a thread owns one 16-wide group of one row): per-tensor FP8
// quantization of a value produced on the fly (bf16 input, RMSNorm output rebuilt from its saved FP8
// input, act(gate) * up rebuilt from saved FP8 gate/up), written row-major and/or transposed through shared
// memory, so GEMM operands of either layout come out of the quantizing kernel itself.
// The silu_mul_* kernels take the gated activation as a template parameter (GatedAct): SiLU (SwiGLU) or
// tanh-GELU (GeGLU).
#include "coat_quant.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "coat_fp8.cuh"

namespace coat_quant {
namespace {

using bf16 = __nv_bfloat16;
using coat::exp2i;
using coat::fp8_cast;  // FP8 casts and power-of-two scales: coat_fp8.cuh
using coat::fp8_to_f32;
using coat::kPow2Bias;
using coat::pow2_byte;
using coat::pow2_exponent;
using coat::pow2_of_byte;
constexpr int G = 16;
constexpr int kThreads = 256;
constexpr int kTile = 64;

__device__ __forceinline__ void load16(const bf16* p, float* v) {
    const uint4 a = reinterpret_cast<const uint4*>(p)[0];
    const uint4 b = reinterpret_cast<const uint4*>(p)[1];
    const bf16* pa = reinterpret_cast<const bf16*>(&a);
    const bf16* pb = reinterpret_cast<const bf16*>(&b);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        v[j] = __bfloat162float(pa[j]);
        v[8 + j] = __bfloat162float(pb[j]);
    }
}

__device__ __forceinline__ void store16(bf16* p, const bf16* v) {
    reinterpret_cast<uint4*>(p)[0] = reinterpret_cast<const uint4*>(v)[0];
    reinterpret_cast<uint4*>(p)[1] = reinterpret_cast<const uint4*>(v)[1];
}

__device__ __forceinline__ void load_codes(const uint8_t* p, uint8_t* c) {
    *reinterpret_cast<uint4*>(c) = *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void store_codes(uint8_t* p, const uint8_t* c) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(c);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// act(g) and the backward of act(g) * u, each in the reference's fp32 order of operations
// (quant_reference._act, silu_mul_backward; tanh-GELU's forward as PyTorch's gelu(approximate="tanh")).
template <GatedAct A>
struct Gated;

template <>
struct Gated<GatedAct::kSilu> {
    static __device__ __forceinline__ float act(float g) { return g * sigmoid(g); }
    static __device__ __forceinline__ void backward(float d, float g, float u, float& dg, float& du) {
        const float s = sigmoid(g);
        dg = d * u * s * (1.0f + g * (1.0f - s));
        du = d * g * s;
    }
};

template <>
struct Gated<GatedAct::kGeluTanh> {
    static constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
    static constexpr float kKappa = 0.044715f, kKappa3 = 0.134145f;  // 3 kKappa rounded once, as the reference
    // The expression of PyTorch's CUDA gelu(approximate="tanh"), so that nvcc fuses it as it does there.
    static __device__ __forceinline__ float act(float g) {
        return 0.5f * g * (1.0f + tanhf(kBeta * (g + kKappa * (g * g * g))));
    }
    // The reference's _act_grad is one PyTorch op per step: the _rn intrinsics keep nvcc from fusing them
    // into FMAs (near tanh = -1, one ulp of the tanh argument moves 1 + t by a large fraction).
    static __device__ __forceinline__ void backward(float d, float g, float u, float& dg, float& du) {
        const float g3 = __fmul_rn(__fmul_rn(g, g), g);
        const float t = tanhf(__fmul_rn(kBeta, __fadd_rn(g, __fmul_rn(kKappa, g3))));
        const float slope = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, g), __fsub_rn(1.0f, __fmul_rn(t, t))), kBeta);
        const float grad = __fadd_rn(__fmul_rn(0.5f, __fadd_rn(1.0f, t)),
                                     __fmul_rn(slope, __fadd_rn(1.0f, __fmul_rn(__fmul_rn(kKappa3, g), g))));
        dg = d * u * grad;
        du = d * act(g);
    }
};

// Runs f(std::integral_constant<GatedAct, A>{}) for the activation A named at run time.
template <class F>
void with_act(GatedAct act, F&& f) {
    if (act == GatedAct::kGeluTanh)
        f(std::integral_constant<GatedAct, GatedAct::kGeluTanh>{});
    else
        f(std::integral_constant<GatedAct, GatedAct::kSilu>{});
}

// Block-wide sum / max over kThreads threads; safe to call repeatedly (syncs before reusing smem).
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v) {
    __shared__ float part[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = part[0];
#pragma unroll
    for (int k = 1; k < kThreads / 32; ++k) v = MAX ? fmaxf(v, part[k]) : v + part[k];
    return v;
}

// ------------------------------------------------------------------------------------------ row kernels

// The threads that work on one row: a whole block (wide rows), or one warp (rows of <= 32 groups, as per-head
// q/k norms have: a block per row would leave 15 of 16 threads idle and sync the block twice a row).
template <bool WARP>
struct RowTeam {
    static constexpr int kSize = WARP ? 32 : kThreads;
    static constexpr int kRowsPerBlock = kThreads / kSize;
    __device__ static int tid() { return WARP ? (threadIdx.x & 31) : threadIdx.x; }
    __device__ static int64_t first_row() {
        return (int64_t)blockIdx.x * kRowsPerBlock + (WARP ? (threadIdx.x >> 5) : 0);
    }
    __device__ static int64_t row_stride() { return (int64_t)gridDim.x * kRowsPerBlock; }
    template <bool MAX>
    __device__ static float reduce(float v) {
        if (!WARP) return block_reduce<MAX>(v);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = MAX ? fmaxf(v, w) : v + w;
        }
        return v;
    }
};

constexpr int kWarpRowGroups = 32;  // rows of at most this many groups take a warp each


__global__ void row_amax_k(const bf16* x, float* out, int64_t n) {
    const bf16* xr = x + blockIdx.x * n;
    float m = 0.0f;
    for (int64_t c = threadIdx.x * 8; c < n; c += kThreads * 8) {
        const uint4 a = *reinterpret_cast<const uint4*>(xr + c);
        const bf16* pa = reinterpret_cast<const bf16*>(&a);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(__bfloat162float(pa[j])));
    }
    m = block_reduce<true>(m);
    if (threadIdx.x == 0) out[blockIdx.x] = m;
}

// y (optional): the norm's output in bf16, (x rstd) w in fp32 as the reference's rmsnorm_output; ymax (optional):
// the row maxima of the output rebuilt from the FP8 input (a GEMM operand's scale)
template <bool E5M2, bool WARP>
__global__ void rmsnorm_quant_k(const bf16* x, const bf16* w, float eps, uint8_t* xq, uint8_t* xs, float* rstd,
                                float* ymax, bf16* y, int64_t m, int64_t n) {
    using Team = RowTeam<WARP>;
    const int64_t row = Team::first_row();
    if (row >= m) return;  // a whole warp (WARP) or block: no sync is skipped by part of a team
    const int ng = (int)(n / G);
    const bf16* xr = x + row * n;
    float v[G];
    float ss = 0.0f;
    for (int g = Team::tid(); g < ng; g += Team::kSize) {
        load16(xr + g * G, v);
#pragma unroll
        for (int j = 0; j < G; ++j) ss += v[j] * v[j];
    }
    ss = Team::template reduce<false>(ss);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    if (Team::tid() == 0) rstd[row] = r;
    float ym = 0.0f;
    for (int g = Team::tid(); g < ng; g += Team::kSize) {
        load16(xr + g * G, v);
        float wv[G];
        load16(w + g * G, wv);
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < G; ++j) amax = fmaxf(amax, fabsf(v[j]));
        const int p = pow2_exponent<E5M2>(amax);
        const float inv = exp2i(-p), sc = exp2i(p);
        alignas(16) uint8_t c[G];
        alignas(16) bf16 o[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            c[j] = fp8_cast<E5M2>(v[j] * inv);
            ym = fmaxf(ym, fabsf(fp8_to_f32<E5M2>(c[j]) * sc * r * wv[j]));
            o[j] = __float2bfloat16_rn(v[j] * r * wv[j]);
        }
        store_codes(xq + row * n + g * G, c);
        xs[row * ng + g] = pow2_byte(p);
        if (y != nullptr) store16(y + row * n + g * G, o);
    }
    if (ymax == nullptr) return;
    ym = Team::template reduce<true>(ym);
    if (Team::tid() == 0) ymax[row] = ym;
}

template <bool IN_E5M2, int GPT, bool WARP>
__global__ void rmsnorm_backward_k(const bf16* dy, const uint8_t* xq, const uint8_t* xs, const float* rstd,
                                   const bf16* w, const bf16* dres, bf16* dx, float* dw, int64_t m, int64_t n) {
    using Team = RowTeam<WARP>;
    const int ng = (int)(n / G);
    float acc[GPT][G];
#pragma unroll
    for (int k = 0; k < GPT; ++k)
#pragma unroll
        for (int j = 0; j < G; ++j) acc[k][j] = 0.0f;
    for (int64_t row = Team::first_row(); row < m; row += Team::row_stride()) {
        const float r = rstd[row];
        float dot = 0.0f;
        float d[G], wv[G], xh[G];
        alignas(16) uint8_t c[G];
#pragma unroll
        for (int k = 0; k < GPT; ++k) {
            const int g = Team::tid() + k * Team::kSize;
            if (g < ng) {
                load16(dy + row * n + g * G, d);
                load16(w + g * G, wv);
                load_codes(xq + row * n + g * G, c);
                const float sc = pow2_of_byte(xs[row * ng + g]);
#pragma unroll
                for (int j = 0; j < G; ++j) dot += (d[j] * wv[j]) * (fp8_to_f32<IN_E5M2>(c[j]) * sc * r);
            }
        }
        const float mean = Team::template reduce<false>(dot) / (float)n;
#pragma unroll
        for (int k = 0; k < GPT; ++k) {
            const int g = Team::tid() + k * Team::kSize;
            if (g < ng) {
                load16(dy + row * n + g * G, d);
                load16(w + g * G, wv);
                load_codes(xq + row * n + g * G, c);
                const float sc = pow2_of_byte(xs[row * ng + g]);
                float rs[G];
                if (dres != nullptr) {
                    load16(dres + row * n + g * G, rs);
                } else {
#pragma unroll
                    for (int j = 0; j < G; ++j) rs[j] = 0.0f;
                }
                alignas(16) bf16 o[G];
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    xh[j] = fp8_to_f32<IN_E5M2>(c[j]) * sc * r;
                    float v = r * (d[j] * wv[j] - xh[j] * mean);
                    if (dres != nullptr) v += rs[j];
                    o[j] = __float2bfloat16_rn(v);
                    acc[k][j] += d[j] * xh[j];
                }
                store16(dx + row * n + g * G, o);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < GPT; ++k) {
        const int g = Team::tid() + k * Team::kSize;
        if (g < ng)
#pragma unroll
            for (int j = 0; j < G; ++j) atomicAdd(dw + g * G + j, acc[k][j]);
    }
}

template <bool E5M2, GatedAct A>
__global__ void silu_mul_quant_k(const bf16* gu, uint8_t* q, uint8_t* sc, float* amax, int64_t i) {
    const int64_t row = blockIdx.x;
    const int ngi = (int)(i / G);
    const bf16* src = gu + row * 2 * i;
    float am = 0.0f;
    for (int g = threadIdx.x; g < ngi; g += kThreads) {
        float gv[G], uv[G];
        load16(src + g * G, gv);
        load16(src + i + g * G, uv);
        float mg = 0.0f, mu = 0.0f;
#pragma unroll
        for (int j = 0; j < G; ++j) {
            mg = fmaxf(mg, fabsf(gv[j]));
            mu = fmaxf(mu, fabsf(uv[j]));
        }
        const int pg = pow2_exponent<E5M2>(mg), pu = pow2_exponent<E5M2>(mu);
        const float ig = exp2i(-pg), iu = exp2i(-pu), sg = exp2i(pg), su = exp2i(pu);
        alignas(16) uint8_t cg[G];
        alignas(16) uint8_t cu[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            cg[j] = fp8_cast<E5M2>(gv[j] * ig);
            cu[j] = fp8_cast<E5M2>(uv[j] * iu);
            const float gd = fp8_to_f32<E5M2>(cg[j]) * sg, ud = fp8_to_f32<E5M2>(cu[j]) * su;
            am = fmaxf(am, fabsf(Gated<A>::act(gd) * ud));
        }
        store_codes(q + row * 2 * i + g * G, cg);
        store_codes(q + row * 2 * i + i + g * G, cu);
        sc[row * 2 * ngi + g] = pow2_byte(pg);
        sc[row * 2 * ngi + ngi + g] = pow2_byte(pu);
    }
    am = block_reduce<true>(am);
    if (threadIdx.x == 0) amax[row] = am;
}

// One thread per 16-value group, grid-stride: a code times a power of two is exact in bf16 (fp32's exponent range).
template <bool E5M2>
__global__ void group_dequant_k(const uint8_t* q, const uint8_t* sc, bf16* out, int64_t groups) {
    for (int64_t g = blockIdx.x * (int64_t)kThreads + threadIdx.x; g < groups; g += (int64_t)gridDim.x * kThreads) {
        alignas(16) uint8_t c[G];
        alignas(16) bf16 v[G];
        load_codes(q + g * G, c);
        const float scale = pow2_of_byte(sc[g]);
#pragma unroll
        for (int j = 0; j < G; ++j) v[j] = __float2bfloat16_rn(fp8_to_f32<E5M2>(c[j]) * scale);
        store16(out + g * G, v);
    }
}

template <bool IN_E5M2, GatedAct A>
__global__ void silu_mul_backward_k(const bf16* da, const uint8_t* q, const uint8_t* sc, bf16* dgu, float* amax,
                                    int64_t i) {
    const int64_t row = blockIdx.x;
    const int ngi = (int)(i / G);
    float am = 0.0f;
    for (int g = threadIdx.x; g < ngi; g += kThreads) {
        float d[G];
        load16(da + row * i + g * G, d);
        alignas(16) uint8_t cg[G];
        alignas(16) uint8_t cu[G];
        load_codes(q + row * 2 * i + g * G, cg);
        load_codes(q + row * 2 * i + i + g * G, cu);
        const float sg = pow2_of_byte(sc[row * 2 * ngi + g]), su = pow2_of_byte(sc[row * 2 * ngi + ngi + g]);
        alignas(16) bf16 og[G];
        alignas(16) bf16 ou[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const float gv = fp8_to_f32<IN_E5M2>(cg[j]) * sg, uv = fp8_to_f32<IN_E5M2>(cu[j]) * su;
            float dg, du;
            Gated<A>::backward(d[j], gv, uv, dg, du);
            og[j] = __float2bfloat16_rn(dg);
            ou[j] = __float2bfloat16_rn(du);
            am = fmaxf(am, fmaxf(fabsf(__bfloat162float(og[j])), fabsf(__bfloat162float(ou[j]))));
        }
        store16(dgu + row * 2 * i + g * G, og);
        store16(dgu + row * 2 * i + i + g * G, ou);
    }
    am = block_reduce<true>(am);
    if (threadIdx.x == 0) amax[row] = am;
}

// ------------------------------------------------------------------------------------------ tile kernel

struct Bf16Src {
    const bf16* x;
    int64_t n;
    __device__ __forceinline__ void load(int64_t r, int64_t c, float* v) const { load16(x + r * n + c, v); }
};

template <bool IN_E5M2>
struct NormSrc {
    const uint8_t* q;
    const uint8_t* s;
    const float* rstd;
    const bf16* w;
    int64_t n;
    __device__ __forceinline__ void load(int64_t r, int64_t c, float* v) const {
        alignas(16) uint8_t cd[G];
        load_codes(q + r * n + c, cd);
        float wv[G];
        load16(w + c, wv);
        const float sc = pow2_of_byte(s[r * (n / G) + c / G]), rs = rstd[r];
#pragma unroll
        for (int j = 0; j < G; ++j) v[j] = fp8_to_f32<IN_E5M2>(cd[j]) * sc * rs * wv[j];
    }
};

template <bool IN_E5M2, GatedAct A>
struct GatedSrc {
    const uint8_t* q;
    const uint8_t* s;
    int64_t i;  // output width; q rows are [gate | up] of 2i
    __device__ __forceinline__ void load(int64_t r, int64_t c, float* v) const {
        alignas(16) uint8_t cg[G];
        alignas(16) uint8_t cu[G];
        load_codes(q + r * 2 * i + c, cg);
        load_codes(q + r * 2 * i + i + c, cu);
        const int64_t ng = 2 * i / G;
        const float sg = pow2_of_byte(s[r * ng + c / G]), su = pow2_of_byte(s[r * ng + (i + c) / G]);
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const float g = fp8_to_f32<IN_E5M2>(cg[j]) * sg, u = fp8_to_f32<IN_E5M2>(cu[j]) * su;
            v[j] = Gated<A>::act(g) * u;
        }
    }
};

// Row tiles stride over blockIdx.y: gridDim.y stops at 65535, 4,194,240 rows (a 4M-token micro-batch).
constexpr int64_t kMaxGridY = 65535;

template <bool OUT_E5M2, class Src>
__global__ void tile_quant_k(Src src, const float* scale, uint8_t* out, uint8_t* out_t, int64_t m, int64_t n,
                             int64_t ld_t) {
    __shared__ alignas(16) uint8_t tile[kTile][kTile + 16];  // [column][row]
    const int t = threadIdx.x;
    const int rr = t >> 2, cc = (t & 3) * G, tc = t >> 2, tr = (t & 3) * G;
    const int64_t c0 = (int64_t)blockIdx.x * kTile + cc, oc = (int64_t)blockIdx.x * kTile + tc;
    const int64_t row_tiles = (m + kTile - 1) / kTile;
    const float inv = 1.0f / *scale;  // a power of two: exact
    for (int64_t ty = blockIdx.y; ty < row_tiles; ty += gridDim.y) {  // the same trips for the whole block
        const int64_t r = ty * kTile + rr;
        if (r < m && c0 < n) {
            float v[G];
            src.load(r, c0, v);
            alignas(16) uint8_t c[G];
#pragma unroll
            for (int j = 0; j < G; ++j) c[j] = fp8_cast<OUT_E5M2>(v[j] * inv);
            if (out != nullptr) store_codes(out + r * n + c0, c);
            if (out_t != nullptr)
#pragma unroll
                for (int j = 0; j < G; ++j) tile[cc + j][rr] = c[j];
        }
        if (out_t == nullptr) continue;
        __syncthreads();
        const int64_t orow = ty * kTile + tr;
        if (oc < n && orow < m) store_codes(out_t + oc * ld_t + orow, &tile[tc][tr]);
        if (ty + gridDim.y < row_tiles) __syncthreads();  // read before the next row tile writes it
    }
}

template <class Src>
void launch_tile(Src src, const float* scale, uint8_t* out, uint8_t* out_t, int64_t m, int64_t n, bool e5m2,
                 cudaStream_t s, int64_t ld_t = -1) {
    const int64_t row_tiles = (m + kTile - 1) / kTile;
    const dim3 grid((unsigned)((n + kTile - 1) / kTile), (unsigned)std::min(row_tiles, kMaxGridY));
    if (ld_t < 0) ld_t = m;
    if (e5m2)
        tile_quant_k<true><<<grid, kThreads, 0, s>>>(src, scale, out, out_t, m, n, ld_t);
    else
        tile_quant_k<false><<<grid, kThreads, 0, s>>>(src, scale, out, out_t, m, n, ld_t);
}

// reference.tensor_scale on device. fmaxf drops NaNs, while the reference's max keeps them (and so gives
// 2^-127): NaNs are counted beside the max.
template <bool E5M2>
__global__ void tensor_scale_k(const float* amax, int64_t m, float* scale) {
    float v = 0.0f, nans = 0.0f;
    for (int64_t i = threadIdx.x; i < m; i += kThreads) {
        const float a = amax[i];
        v = fmaxf(v, a);
        nans += (a != a) ? 1.0f : 0.0f;
    }
    v = block_reduce<true>(v);
    nans = block_reduce<false>(nans);
    if (threadIdx.x == 0) *scale = exp2i(nans > 0.0f ? -kPow2Bias : pow2_exponent<E5M2>(v));
}

int num_sms() {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms > 0 ? sms : 80;
}

}  // namespace

void row_amax(const void* x, float* out, int64_t m, int64_t n, cudaStream_t s) {
    if (m > 0) row_amax_k<<<(unsigned)m, kThreads, 0, s>>>(static_cast<const bf16*>(x), out, n);
}

void tensor_scale(const float* amax_rows, int64_t m, float* scale, bool e5m2, cudaStream_t s) {
    if (e5m2)
        tensor_scale_k<true><<<1, kThreads, 0, s>>>(amax_rows, m, scale);
    else
        tensor_scale_k<false><<<1, kThreads, 0, s>>>(amax_rows, m, scale);
}

void quant_tensor(const void* x, const float* scale, uint8_t* out, uint8_t* out_t, int64_t m, int64_t n,
                  int64_t ld_t, bool e5m2, cudaStream_t s) {
    launch_tile(Bf16Src{static_cast<const bf16*>(x), n}, scale, out, out_t, m, n, e5m2, s, ld_t);
}

void rmsnorm_quant(const void* x, const void* w, float eps, uint8_t* xq, uint8_t* xs, float* rstd, float* ymax,
                   void* y, int64_t m, int64_t n, bool e5m2, cudaStream_t s) {
    if (m == 0) return;
    auto xb = static_cast<const bf16*>(x);
    auto wb = static_cast<const bf16*>(w);
    auto yb = static_cast<bf16*>(y);
    auto launch = [&](auto e5m2_c, auto warp_c) {
        constexpr bool kWarp = decltype(warp_c)::value;
        const int64_t grid = (m + RowTeam<kWarp>::kRowsPerBlock - 1) / RowTeam<kWarp>::kRowsPerBlock;
        rmsnorm_quant_k<decltype(e5m2_c)::value, kWarp><<<(unsigned)grid, kThreads, 0, s>>>(xb, wb, eps, xq, xs, rstd,
                                                                                              ymax, yb, m, n);
    };
    const bool warp = n / G <= kWarpRowGroups;
    using T = std::true_type;
    using F = std::false_type;
    if (e5m2)
        warp ? launch(T{}, T{}) : launch(T{}, F{});
    else
        warp ? launch(F{}, T{}) : launch(F{}, F{});
}

void rmsnorm_rebuild(const uint8_t* xq, const uint8_t* xs, const float* rstd, const void* w, const float* scale,
                     uint8_t* out, uint8_t* out_t, int64_t m, int64_t n, bool in_e5m2, bool out_e5m2,
                     cudaStream_t s) {
    auto wb = static_cast<const bf16*>(w);
    if (in_e5m2)
        launch_tile(NormSrc<true>{xq, xs, rstd, wb, n}, scale, out, out_t, m, n, out_e5m2, s);
    else
        launch_tile(NormSrc<false>{xq, xs, rstd, wb, n}, scale, out, out_t, m, n, out_e5m2, s);
}

template <bool IN_E5M2>
static void launch_rms_bwd(const bf16* dy, const uint8_t* xq, const uint8_t* xs, const float* rstd, const bf16* w,
                           const bf16* dres, bf16* dx, float* dw, int64_t m, int64_t n, cudaStream_t s) {
    const int ng = (int)(n / G);
    const int64_t cap = 2 * num_sms();  // persistent blocks: each accumulates dw over its rows, then one atomic each
    if (ng <= kWarpRowGroups) {
        const int64_t grid = std::min<int64_t>((m + RowTeam<true>::kRowsPerBlock - 1) / RowTeam<true>::kRowsPerBlock,
                                               cap);
        rmsnorm_backward_k<IN_E5M2, 1, true><<<(unsigned)grid, kThreads, 0, s>>>(dy, xq, xs, rstd, w, dres, dx, dw,
                                                                                  m, n);
        return;
    }
    const unsigned grid = (unsigned)std::min<int64_t>(m, cap);
    if (ng <= kThreads)
        rmsnorm_backward_k<IN_E5M2, 1, false><<<grid, kThreads, 0, s>>>(dy, xq, xs, rstd, w, dres, dx, dw, m, n);
    else if (ng <= 2 * kThreads)
        rmsnorm_backward_k<IN_E5M2, 2, false><<<grid, kThreads, 0, s>>>(dy, xq, xs, rstd, w, dres, dx, dw, m, n);
    else
        rmsnorm_backward_k<IN_E5M2, 4, false><<<grid, kThreads, 0, s>>>(dy, xq, xs, rstd, w, dres, dx, dw, m, n);
}

void rmsnorm_backward(const void* dy, const uint8_t* xq, const uint8_t* xs, const float* rstd, const void* w,
                      const void* dres, void* dx, float* dw, int64_t m, int64_t n, bool in_e5m2, cudaStream_t s) {
    if (m == 0) return;
    auto a = static_cast<const bf16*>(dy);
    auto wb = static_cast<const bf16*>(w);
    auto r = static_cast<const bf16*>(dres);
    auto o = static_cast<bf16*>(dx);
    if (in_e5m2)
        launch_rms_bwd<true>(a, xq, xs, rstd, wb, r, o, dw, m, n, s);
    else
        launch_rms_bwd<false>(a, xq, xs, rstd, wb, r, o, dw, m, n, s);
}

void silu_mul_quant(const void* gu, uint8_t* q, uint8_t* sc, float* amax, int64_t m, int64_t i, bool e5m2,
                    GatedAct act, cudaStream_t s) {
    if (m == 0) return;
    auto g = static_cast<const bf16*>(gu);
    with_act(act, [&](auto a) {
        if (e5m2)
            silu_mul_quant_k<true, decltype(a)::value><<<(unsigned)m, kThreads, 0, s>>>(g, q, sc, amax, i);
        else
            silu_mul_quant_k<false, decltype(a)::value><<<(unsigned)m, kThreads, 0, s>>>(g, q, sc, amax, i);
    });
}

void group_dequant(const uint8_t* q, const uint8_t* sc, void* out, int64_t n, bool e5m2, cudaStream_t s) {
    const int64_t groups = n / G;
    if (groups == 0) return;
    const int64_t want = (groups + kThreads - 1) / kThreads, cap = 16LL * num_sms();
    const unsigned grid = (unsigned)(want < cap ? want : cap);
    auto o = static_cast<bf16*>(out);
    if (e5m2)
        group_dequant_k<true><<<grid, kThreads, 0, s>>>(q, sc, o, groups);
    else
        group_dequant_k<false><<<grid, kThreads, 0, s>>>(q, sc, o, groups);
}

void silu_mul_rebuild(const uint8_t* q, const uint8_t* sc, const float* scale, uint8_t* out, uint8_t* out_t,
                      int64_t m, int64_t i, bool in_e5m2, bool out_e5m2, GatedAct act, cudaStream_t s) {
    with_act(act, [&](auto a) {
        if (in_e5m2)
            launch_tile(GatedSrc<true, decltype(a)::value>{q, sc, i}, scale, out, out_t, m, i, out_e5m2, s);
        else
            launch_tile(GatedSrc<false, decltype(a)::value>{q, sc, i}, scale, out, out_t, m, i, out_e5m2, s);
    });
}

void silu_mul_backward(const void* da, const uint8_t* q, const uint8_t* sc, void* dgu, float* amax, int64_t m,
                       int64_t i, bool in_e5m2, GatedAct act, cudaStream_t s) {
    if (m == 0) return;
    auto d = static_cast<const bf16*>(da);
    auto o = static_cast<bf16*>(dgu);
    with_act(act, [&](auto a) {
        if (in_e5m2)
            silu_mul_backward_k<true, decltype(a)::value><<<(unsigned)m, kThreads, 0, s>>>(d, q, sc, o, amax, i);
        else
            silu_mul_backward_k<false, decltype(a)::value><<<(unsigned)m, kThreads, 0, s>>>(d, q, sc, o, amax, i);
    });
}

}  // namespace coat_quant
