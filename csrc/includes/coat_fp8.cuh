// Shared CUDA helpers for coat_ds's FP8 kernels: device exp2/log2, FP8 encode (hardware cvt on sm_89+,
// RNE + saturation), single-value FP8 casts and power-of-two scales (the activation kernels), the
// log2|code| tables, segment (sub-warp) reductions and vector load/store types.
// CUDA headers only: the torch bindings live in .cpp files.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "coat_fp8_math.h"

namespace coat {

// Hardware ex2 / lg2 / rcp / sqrt (MUFU) and approximate division, all non-ftz: subnormal inputs and
// results are kept, as the reference keeps them. A few ulp from IEEE; the IEEE sequences cost ~4x the
// instructions, and instruction issue, not memory, limited the fused step with them.
struct DeviceMath {
    static __device__ __forceinline__ float div(float a, float b) {
        float y;
        asm("div.approx.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
        return y;
    }
    static __device__ __forceinline__ float rcp(float a) {
        float y;
        asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(a));
        return y;
    }
    static __device__ __forceinline__ float sqrt(float a) {
        float y;
        asm("sqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(a));
        return y;
    }
    static __device__ __forceinline__ float exp2(float x) {
        float y;
        asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
    static __device__ __forceinline__ float log2(float x) {
        float y;
        asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
};

// The same with .ftz: values below FLT_MIN (1.2e-38) flush to zero, which saves the subnormal fix-up
// instructions around every MUFU op (~4x fewer instructions each). For the fused AdamW step, where a
// moment that small changes nothing (eps = 1e-8 dominates sqrt(v) long before); the standalone
// (de)quantisation keeps DeviceMath so that subnormals round-trip exactly.
struct DeviceMathFtz {
    static __device__ __forceinline__ float div(float a, float b) {
        float y;
        asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
        return y;
    }
    static __device__ __forceinline__ float rcp(float a) {
        float y;
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
        return y;
    }
    static __device__ __forceinline__ float sqrt(float a) {
        float y;
        asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
        return y;
    }
    static __device__ __forceinline__ float exp2(float x) {
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
    static __device__ __forceinline__ float log2(float x) {
        float y;
        asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
};

// Two floats -> two FP8 codes (lo in the low byte), round to nearest even, saturating to +-max, NaN kept.
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x2_encode(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    if (E5M2) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    }
    return r;
#else
    return (uint32_t)fp8_encode<E5M2>(lo) | ((uint32_t)fp8_encode<E5M2>(hi) << 8);
#endif
}

// Four floats -> four FP8 codes packed little-endian in one 32-bit word.
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x4_encode(float a, float b, float c, float d) {
    return fp8x2_encode<E5M2>(a, b) | (fp8x2_encode<E5M2>(c, d) << 16);
}

__device__ __forceinline__ uint32_t fp8x4_encode(float a, float b, float c, float d, bool e5m2) {
    return e5m2 ? fp8x4_encode<true>(a, b, c, d) : fp8x4_encode<false>(a, b, c, d);
}

// One value, through cuda_fp8.h: saturating round to nearest even (on sm_89+ the cvt of fp8x2_encode;
// below it cuda_fp8.h's software path, which gives every NaN the positive NaN code), and the exact decode.
template <bool E5M2>
__device__ __forceinline__ uint8_t fp8_cast(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, E5M2 ? __NV_E5M2 : __NV_E4M3);
}

template <bool E5M2>
__device__ __forceinline__ float fp8_to_f32(uint8_t c) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, E5M2 ? __NV_E5M2 : __NV_E4M3);
    return __half2float(__half(h));
}

// Power-of-two scales 2^p, p in [-kPow2Bias, kPow2Bias], stored per group as the byte p + kPow2Bias.
constexpr int kPow2Bias = 127;

__device__ __forceinline__ float exp2i(int p) { return ldexpf(1.0f, p); }
__device__ __forceinline__ uint8_t pow2_byte(int p) { return (uint8_t)(p + kPow2Bias); }
__device__ __forceinline__ float pow2_of_byte(uint8_t b) { return exp2i((int)b - kPow2Bias); }

// p of the smallest power of two 2^p that maps amax into the format: with amax = m 2^e (frexp) and the
// format's largest value kMaxFrac 2^kMaxExp, p = e - kMaxExp + (m > kMaxFrac); -kPow2Bias for 0 or NaN
// (coat_ds/kernels/quant_reference.py's pow2_exponent).
template <bool E5M2>
__device__ __forceinline__ int pow2_exponent(float amax) {
    using L = Fp8Layout<E5M2>;
    if (!(amax > 0.0f)) return -kPow2Bias;
    int e;
    const float m = frexpf(amax, &e);
    const int p = e - L::kMaxExp + (m > L::kMaxFrac ? 1 : 0);
    return p < -kPow2Bias ? -kPow2Bias : (p > kPow2Bias ? kPow2Bias : p);
}

// log2|value| of the 128 FP8 magnitudes (see coat_fp8_math.h). Copy them to shared memory before
// indexing with per-thread codes: constant memory serialises divergent reads.
static __constant__ float kLog2AbsE4M3Dev[128] = COAT_LOG2_ABS_E4M3_TABLE;
static __constant__ float kLog2AbsE5M2Dev[128] = COAT_LOG2_ABS_E5M2_TABLE;

__device__ __forceinline__ float log2_abs_code_table(int i, bool e5m2) {
    return e5m2 ? kLog2AbsE5M2Dev[i] : kLog2AbsE4M3Dev[i];
}

// Reductions over aligned segments of WIDTH lanes (WIDTH a power of two <= 32); every lane of the warp
// must call them (full mask), each gets its own segment's result.
template <int WIDTH>
__device__ __forceinline__ float segment_max(float x) {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
    return x;
}

template <int WIDTH>
__device__ __forceinline__ float segment_min(float x) {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
    return x;
}

template <int WIDTH>
__device__ __forceinline__ float segment_sum(float x) {
#pragma unroll
    for (int o = WIDTH / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
    return x;
}

// Vector memory access: 16 B of fp32, 8 B of bf16 (as raw bits), 4 B of FP8 codes.
__device__ __forceinline__ float4 load_f32x4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store_f32x4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// Streaming variants for data read or written once per kernel (evict-first: keeps L2 for the rest).
__device__ __forceinline__ float4 load_f32x4_stream(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ void store_f32x4_stream(float* p, float4 v) { __stcs(reinterpret_cast<float4*>(p), v); }

__device__ __forceinline__ void load_bf16x4(const uint16_t* p, float out[4]) {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    out[0] = __uint_as_float(u.x << 16);
    out[1] = __uint_as_float(u.x & 0xFFFF0000u);
    out[2] = __uint_as_float(u.y << 16);
    out[3] = __uint_as_float(u.y & 0xFFFF0000u);
}

__device__ __forceinline__ void store_bf16x4(uint16_t* p, float a, float b, float c, float d) {
    uint2 u;
    u.x = (uint32_t)f32_to_bf16(a) | ((uint32_t)f32_to_bf16(b) << 16);
    u.y = (uint32_t)f32_to_bf16(c) | ((uint32_t)f32_to_bf16(d) << 16);
    __stcs(reinterpret_cast<uint2*>(p), u);
}

__device__ __forceinline__ uint32_t load_u8x4(const uint8_t* p) { return __ldcs(reinterpret_cast<const unsigned int*>(p)); }
__device__ __forceinline__ void store_u8x4(uint8_t* p, uint32_t v) { __stcs(reinterpret_cast<unsigned int*>(p), v); }

}  // namespace coat
