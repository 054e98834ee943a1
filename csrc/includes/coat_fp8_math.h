// FP8 group-quantization math shared by the CPU op (plain C++) and the CUDA kernels (through coat_fp8.cuh).
//
// Everything here mirrors coat_ds/formats/group_quant.py, the source of truth:
//   k = clamp(floor(16 log2(R) / log2(M/m)) / 16, 1/16, 16),  R = F^2/2  (k = 1 without expansion)
//   d = 2^(log2 M - log2 F / k)
//   q = FP8(sign(x) 2^(k (log2|x| - log2 d)))          x = sign(q) 2^(log2|q| / k + log2 d)
// An all-zero group stores d = 0, k = 1. No CUDA or torch headers: the CPU op includes this file alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define COAT_HD __host__ __device__ __forceinline__
#else
#define COAT_HD inline
#endif

#define COAT_F32_INF __builtin_inff()
#define COAT_F32_NAN __builtin_nanf("")

namespace coat {

constexpr float kKSteps = 16.0f;
constexpr float kKMin = 1.0f / 16.0f;
constexpr float kKMax = 16.0f;

// Per-format constants, rounded to fp32 exactly as the reference's Python scalars are.
COAT_HD float fp8_log2_max(bool e5m2) { return e5m2 ? 15.807354927062988f : 8.807354927062988f; }
// K_STEPS * log2(F^2 / 2)
COAT_HD float fp8_k_numer(bool e5m2) { return e5m2 ? 489.83535750584333f : 265.83535750584333f; }

COAT_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    return u;
#endif
}

COAT_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
#endif
}

// Round to nearest integer, ties to even, for 0 <= x < 2^22 (the FP8 subnormal path).
COAT_HD float round_half_even_small(float x) {
#if defined(__CUDA_ARCH__)
    return rintf(x);
#else
    const float magic = 8388608.0f;  // 2^23: adding it pushes the fraction out under round-to-nearest-even
    return (x + magic) - magic;
#endif
}

// FP8 bit layout: E4M3 (bias 7, no inf, 0x7F NaN, max 448 = 0x7E) and E5M2 (bias 15, max 57344 = 0x7B).
template <bool E5M2>
struct Fp8Layout {
    static constexpr int kMantBits = E5M2 ? 2 : 3;
    static constexpr int kBias = E5M2 ? 15 : 7;
    static constexpr uint32_t kMaxCode = E5M2 ? 0x7Bu : 0x7Eu;
    static constexpr uint32_t kNanCode = 0x7Fu;
    static constexpr float kMinNormal = E5M2 ? 6.103515625e-05f : 0.015625f;  // 2^(1 - bias)
    static constexpr float kSubnormalInvStep = E5M2 ? 65536.0f : 512.0f;      // 2^(bias - 1 + mant_bits)
    // The largest finite value in frexp's form kMaxFrac 2^kMaxExp (0.875 2^9 = 448, 0.875 2^16 = 57344).
    static constexpr int kMaxExp = (int)(kMaxCode >> kMantBits) - kBias + 1;
    static constexpr float kMaxFrac = 0.5f + (float)(kMaxCode & ((1u << kMantBits) - 1u)) / (float)(2u << kMantBits);
    static constexpr float kMax = kMaxFrac * (float)(1u << kMaxExp);
};
static_assert(Fp8Layout<false>::kMax == 448.0f && Fp8Layout<true>::kMax == 57344.0f, "FP8 layouts");

COAT_HD float fp8_max(bool e5m2) { return e5m2 ? Fp8Layout<true>::kMax : Fp8Layout<false>::kMax; }

// float -> FP8 code: round to nearest even with subnormals, saturating to +-max (like the reference's
// clamp-then-cast), NaN -> NaN. Branch-free so the CPU loops vectorise.
template <bool E5M2>
COAT_HD uint8_t fp8_encode(float x) {
    using L = Fp8Layout<E5M2>;
    const uint32_t u = f32_bits(x);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    const float af = bits_f32(a);
    // subnormal range: the code is the number of subnormal steps (2^mant_bits lands on the min normal code)
    const float sub_f = (af < L::kMinNormal ? af : L::kMinNormal) * L::kSubnormalInvStep;
    const uint32_t sub = (uint32_t)round_half_even_small(sub_f);
    // normal range: round the fp32 mantissa to mant_bits, then rebias the exponent
    constexpr int shift = 23 - L::kMantBits;
    const uint32_t r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    const uint32_t rebias = (uint32_t)(127 - L::kBias) << L::kMantBits;
    uint32_t normal = r > rebias ? r - rebias : 0u;
    normal = normal > L::kMaxCode ? L::kMaxCode : normal;
    uint32_t code = af < L::kMinNormal ? sub : normal;
    code = a > 0x7F800000u ? L::kNanCode : code;
    return (uint8_t)(sign | code);
}

// FP8 code -> float (exact).
template <bool E5M2>
COAT_HD float fp8_decode(uint8_t c) {
    using L = Fp8Layout<E5M2>;
    const uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    const uint32_t mag = c & 0x7Fu;
    const uint32_t e = mag >> L::kMantBits;
    const uint32_t m = mag & ((1u << L::kMantBits) - 1u);
    float v;
    if (e == 0) {
        v = (float)m / L::kSubnormalInvStep;
    } else if (!E5M2 && mag == 0x7Fu) {
        v = COAT_F32_NAN;
    } else if (E5M2 && e == 31) {
        v = m == 0 ? COAT_F32_INF : COAT_F32_NAN;
    } else {
        v = bits_f32(((e + 127u - L::kBias) << 23) | (m << (23 - L::kMantBits)));
    }
    return bits_f32(f32_bits(v) | sign);
}

// log2|value| of the 128 FP8 magnitudes, each correctly rounded to fp32 (generated in double precision):
// dequantisation becomes one exp2 per value. -inf for zero, NaN/inf for the special codes.
#define COAT_LOG2_ABS_E4M3_TABLE { \
    -COAT_F32_INF, -9.0f, -8.0f, -7.415037631988525f, -7.0f, -6.678071975708008f, -6.415037631988525f, -6.192645072937012f, \
    -6.0f, -5.830074787139893f, -5.678071975708008f, -5.5405683517456055f, -5.415037631988525f, -5.299560070037842f, -5.192645072937012f, -5.093109607696533f, \
    -5.0f, -4.830074787139893f, -4.678071975708008f, -4.5405683517456055f, -4.415037631988525f, -4.299560070037842f, -4.192645072937012f, -4.093109607696533f, \
    -4.0f, -3.8300750255584717f, -3.678071975708008f, -3.5405683517456055f, -3.4150373935699463f, -3.299560308456421f, -3.1926450729370117f, -3.093109369277954f, \
    -3.0f, -2.8300750255584717f, -2.678071975708008f, -2.5405683517456055f, -2.4150373935699463f, -2.299560308456421f, -2.1926450729370117f, -2.093109369277954f, \
    -2.0f, -1.8300750255584717f, -1.6780718564987183f, -1.5405683517456055f, -1.4150375127792358f, -1.299560308456421f, -1.1926450729370117f, -1.093109369277954f, \
    -1.0f, -0.8300750255584717f, -0.678071916103363f, -0.5405683517456055f, -0.41503751277923584f, -0.2995602786540985f, -0.19264507293701172f, -0.09310940653085709f, \
    0.0f, 0.1699250042438507f, 0.32192808389663696f, 0.45943161845207214f, 0.5849624872207642f, 0.7004396915435791f, 0.8073549270629883f, 0.9068905711174011f, \
    1.0f, 1.1699249744415283f, 1.3219281435012817f, 1.4594316482543945f, 1.5849624872207642f, 1.700439691543579f, 1.8073549270629883f, 1.906890630722046f, \
    2.0f, 2.1699249744415283f, 2.321928024291992f, 2.4594316482543945f, 2.5849626064300537f, 2.700439691543579f, 2.8073549270629883f, 2.906890630722046f, \
    3.0f, 3.1699249744415283f, 3.321928024291992f, 3.4594316482543945f, 3.5849626064300537f, 3.700439691543579f, 3.8073549270629883f, 3.906890630722046f, \
    4.0f, 4.169925212860107f, 4.321928024291992f, 4.4594316482543945f, 4.584962368011475f, 4.700439929962158f, 4.807354927062988f, 4.906890392303467f, \
    5.0f, 5.169925212860107f, 5.321928024291992f, 5.4594316482543945f, 5.584962368011475f, 5.700439929962158f, 5.807354927062988f, 5.906890392303467f, \
    6.0f, 6.169925212860107f, 6.321928024291992f, 6.4594316482543945f, 6.584962368011475f, 6.700439929962158f, 6.807354927062988f, 6.906890392303467f, \
    7.0f, 7.169925212860107f, 7.321928024291992f, 7.4594316482543945f, 7.584962368011475f, 7.700439929962158f, 7.807354927062988f, 7.906890392303467f, \
    8.0f, 8.16992473602295f, 8.321928024291992f, 8.459431648254395f, 8.584962844848633f, 8.700439453125f, 8.807354927062988f, COAT_F32_NAN \
}

#define COAT_LOG2_ABS_E5M2_TABLE { \
    -COAT_F32_INF, -16.0f, -15.0f, -14.415037155151367f, -14.0f, -13.678071975708008f, -13.415037155151367f, -13.192645072937012f, \
    -13.0f, -12.678071975708008f, -12.415037155151367f, -12.192645072937012f, -12.0f, -11.678071975708008f, -11.415037155151367f, -11.192645072937012f, \
    -11.0f, -10.678071975708008f, -10.415037155151367f, -10.192645072937012f, -10.0f, -9.678071975708008f, -9.415037155151367f, -9.192645072937012f, \
    -9.0f, -8.678071975708008f, -8.415037155151367f, -8.192645072937012f, -8.0f, -7.678071975708008f, -7.415037631988525f, -7.192645072937012f, \
    -7.0f, -6.678071975708008f, -6.415037631988525f, -6.192645072937012f, -6.0f, -5.678071975708008f, -5.415037631988525f, -5.192645072937012f, \
    -5.0f, -4.678071975708008f, -4.415037631988525f, -4.192645072937012f, -4.0f, -3.678071975708008f, -3.4150373935699463f, -3.1926450729370117f, \
    -3.0f, -2.678071975708008f, -2.4150373935699463f, -2.1926450729370117f, -2.0f, -1.6780718564987183f, -1.4150375127792358f, -1.1926450729370117f, \
    -1.0f, -0.678071916103363f, -0.41503751277923584f, -0.19264507293701172f, 0.0f, 0.32192808389663696f, 0.5849624872207642f, 0.8073549270629883f, \
    1.0f, 1.3219281435012817f, 1.5849624872207642f, 1.8073549270629883f, 2.0f, 2.321928024291992f, 2.5849626064300537f, 2.8073549270629883f, \
    3.0f, 3.321928024291992f, 3.5849626064300537f, 3.8073549270629883f, 4.0f, 4.321928024291992f, 4.584962368011475f, 4.807354927062988f, \
    5.0f, 5.321928024291992f, 5.584962368011475f, 5.807354927062988f, 6.0f, 6.321928024291992f, 6.584962368011475f, 6.807354927062988f, \
    7.0f, 7.321928024291992f, 7.584962368011475f, 7.807354927062988f, 8.0f, 8.321928024291992f, 8.584962844848633f, 8.807354927062988f, \
    9.0f, 9.321928024291992f, 9.584962844848633f, 9.807354927062988f, 10.0f, 10.321928024291992f, 10.584962844848633f, 10.807354927062988f, \
    11.0f, 11.321928024291992f, 11.584962844848633f, 11.807354927062988f, 12.0f, 12.321928024291992f, 12.584962844848633f, 12.807354927062988f, \
    13.0f, 13.321928024291992f, 13.584962844848633f, 13.807354927062988f, 14.0f, 14.321928024291992f, 14.584962844848633f, 14.807354927062988f, \
    15.0f, 15.321928024291992f, 15.584962844848633f, 15.807354927062988f, COAT_F32_INF, COAT_F32_NAN, COAT_F32_NAN, COAT_F32_NAN \
}

#if !defined(__CUDA_ARCH__)
static constexpr float kLog2AbsE4M3[128] = COAT_LOG2_ABS_E4M3_TABLE;
static constexpr float kLog2AbsE5M2[128] = COAT_LOG2_ABS_E5M2_TABLE;
#endif

// exp2 / log2 in plain branch-free C++ (a few ulp, subnormals included) so that GCC vectorises the CPU
// loops; div / rcp / sqrt are IEEE, as in the reference. The CUDA side uses the hardware approximations
// instead (coat_fp8.cuh, DeviceMath): a few ulp apart, which the kernel tests allow for.
struct HostMath {
    static inline float div(float a, float b) { return a / b; }
    static inline float rcp(float a) { return 1.0f / a; }
    static inline float sqrt(float a) { return sqrtf(a); }

    static inline float exp2(float x) {
        const bool nan = x != x;
        x = x < -151.0f ? -151.0f : x;  // 2^-151 rounds to 0; -inf lands here too
        x = x > 129.0f ? 129.0f : x;    // overflows to inf below
        const float r = (x + 12582912.0f) - 12582912.0f;  // nearest integer (1.5 * 2^23 trick)
        const float f = x - r;                            // [-0.5, 0.5]
        // 2^f: Taylor series of e^(f ln2) to degree 7 (truncation < 1e-8 on [-0.5, 0.5])
        float p = 1.5252733804059841e-05f;
        p = p * f + 1.5403530393381610e-04f;
        p = p * f + 1.3333558146428443e-03f;
        p = p * f + 9.6181291076284772e-03f;
        p = p * f + 5.5504108664821580e-02f;
        p = p * f + 2.4022650695910072e-01f;
        p = p * f + 6.9314718055994531e-01f;
        p = p * f + 1.0f;
        const int n = (int)r;
        const int n1 = n >> 1, n2 = n - n1;  // two exact power-of-two factors reach the subnormals and inf
        const float y = p * bits_f32((uint32_t)(n1 + 127) << 23) * bits_f32((uint32_t)(n2 + 127) << 23);
        return nan ? x : y;
    }

    static inline float log2(float x) {
        const bool sub = x < 1.17549435e-38f;
        const float xs = sub ? x * 16777216.0f : x;  // 2^24 lifts subnormals
        const uint32_t u = f32_bits(xs);
        int e = (int)(u >> 23) - 127 - (sub ? 24 : 0);
        float m = bits_f32((u & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
        const bool hi = m > 1.41421356f;
        m = hi ? m * 0.5f : m;  // [0.707, 1.414]
        e += hi ? 1 : 0;
        // log2(m) = 2/ln2 atanh(t), t = (m-1)/(m+1) in [-0.172, 0.172]
        const float t = (m - 1.0f) / (m + 1.0f);
        const float t2 = t * t;
        float p = 1.0f / 9.0f;
        p = p * t2 + 1.0f / 7.0f;
        p = p * t2 + 1.0f / 5.0f;
        p = p * t2 + 1.0f / 3.0f;
        p = p * t2 + 1.0f;
        const float y = (float)e + (2.8853900817779268f * t) * p;
        const bool keep = (x != x) | (x == COAT_F32_INF);  // bitwise: no branch, the loop stays vectorised
        const float r = keep ? x : y;
        return x == 0.0f ? -COAT_F32_INF : r;
    }
};

// Scale d and exponent k of one group from its largest and smallest non-zero magnitudes (small = inf when
// the group is all zeros). log2d and inv_k are what (de)quantisation uses per value.
struct GroupScale {
    float k, inv_k, d, log2d;
};

template <class Math>
COAT_HD GroupScale group_scale(float big, float small, bool e5m2, bool expansion) {
    GroupScale s;
    if (!(big > 0.0f)) {
        s.k = 1.0f;
        s.inv_k = 1.0f;
        s.d = 0.0f;
        s.log2d = -COAT_F32_INF;
        return s;
    }
    const float lb = Math::log2(big);
    float k = 1.0f;
    if (expansion) {
        const float span = lb - Math::log2(small);
        // span == 0 (one magnitude): the reference's k = floor(C / 0) = inf clamps to K_MAX
        k = span > 0.0f ? floorf(Math::div(fp8_k_numer(e5m2), span)) * (1.0f / kKSteps) : kKMax;
        k = k < kKMin ? kKMin : (k > kKMax ? kKMax : k);
    }
    s.k = k;
    s.inv_k = Math::rcp(k);
    s.d = Math::exp2(lb - Math::div(fp8_log2_max(e5m2), k));
    s.log2d = Math::log2(s.d);
    return s;
}

// Stored (scale, expo) -> what dequantisation needs.
template <class Math>
COAT_HD GroupScale stored_scale(float d, float k) {
    GroupScale s;
    s.k = k;
    s.inv_k = Math::rcp(k);
    s.d = d;
    s.log2d = Math::log2(d);  // d = 0 -> -inf: every value of the group decodes to 0
    return s;
}

// x = sign(q) 2^(log2|q| / k + log2 d), from the log2 table of the code's format.
template <class Math>
COAT_HD float dequant_value(uint8_t code, float log2_abs_code, const GroupScale& s) {
    const float y = Math::exp2(log2_abs_code * s.inv_k + s.log2d);
    return bits_f32(f32_bits(y) | ((uint32_t)(code & 0x80u) << 24));
}

// The value to encode: sign(x) 2^(k (log2|x| - log2 d)); exact +0 for x = 0 (the reference's torch.where).
template <class Math>
COAT_HD float expand_value(float x, const GroupScale& s) {
    const float a = x < 0.0f ? -x : x;
    const float y = Math::exp2(s.k * (Math::log2(a) - s.log2d));
    const float r = bits_f32(f32_bits(y) | (f32_bits(x) & 0x80000000u));
    return x == 0.0f ? 0.0f : r;
}

// Per-step AdamW scalars, each rounded to fp32 from double the way torch does with Python scalars.
struct AdamCoefs {
    float grad_scale;  // every gradient value is multiplied by it first (1: none); CUDA may read it from memory
    float decay;       // 1 - lr * weight_decay
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float step_size;  // -lr / (1 - beta1^t)
    float bc2_sqrt;   // sqrt(1 - beta2^t)
    float eps;
};

// a * b rounded to fp32 on its own: never contracted into an FMA with what uses the product.
COAT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;  // a product that feeds only multiplies cannot be contracted
#endif
}

// The reference's update, in its order of operations; g is already scaled (mul_rn(g, c.grad_scale): the
// separate fp32 multiply of DeepSpeed's unscale/clip).
template <class Math>
COAT_HD void adam_update(float& p, float g, float& m, float& v, const AdamCoefs& c) {
    p = p * c.decay;
    m = c.beta1 * m + c.one_minus_beta1 * g;
    v = c.beta2 * v + c.one_minus_beta2 * g * g;
    const float denom = Math::div(Math::sqrt(v), c.bc2_sqrt) + c.eps;
    p = p + Math::div(c.step_size * m, denom);
}

COAT_HD float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

// Round to nearest even, NaN kept quiet (c10::BFloat16's rule).
COAT_HD uint16_t f32_to_bf16(float x) {
    const uint32_t u = f32_bits(x);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(x != x ? 0x7FC0u : r);
}

// fp16 bits -> float, exact (subnormals, inf and NaN included).
COAT_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const uint32_t em = h & 0x7FFFu;
    // em << 13 reads as 2^-112 times the half's magnitude (normal or subnormal): one exact multiply rebiases
    const float mag = bits_f32(em << 13) * 5.192296858534828e+33f;  // 2^112
    const float special = bits_f32(0x7F800000u | ((em & 0x3FFu) << 13));  // inf / NaN, payload kept
    return bits_f32(f32_bits(em >= 0x7C00u ? special : mag) | ((uint32_t)(h & 0x8000u) << 16));
#endif
}

// ---- What a step reads and writes: gradient and master dtypes, stochastic rounding of a bf16 master.
// Random bits as coat_ds/formats/rounding.py defines them (the reference; its tests pin the constants):
//   key  = fold of lowbias32(h ^ word) over the 32-bit halves of seed, step, stream (from kSrKey0)
//   bits = lowbias32(key + lo(index) * kSrGolden + hi(index) * kSrGoldenHi) >> 16

enum class Dtype : int { kF32 = 0, kBf16 = 1, kF16 = 2 };     // of a gradient, or of a master
// fp32; bf16 rounded to nearest / stochastically; fp32 held as a bf16 high half + a 16-bit remainder (exact)
enum class Master : int { kF32 = 0, kBf16Rn = 1, kBf16Sr = 2, kF32Rem = 3 };

// The dtype of the param tensor (a remainder master's param is its bf16 high half).
COAT_HD constexpr Dtype master_dtype(Master m) { return m == Master::kF32 ? Dtype::kF32 : Dtype::kBf16; }

// ---- An fp32 master as a bf16 high half + a 16-bit remainder (coat_ds/formats/remainder.py is the reference):
// lo = the low 16 bits as they are, hi = the high 16 bits + lo's top bit (round to nearest, ties away from
// zero; integer arithmetic, so a carry into the exponent is exact). join undoes it bit for bit; a NaN splits
// into the canonical 0x7FC0 and joins back to a NaN. (Ties to even cannot be undone: an even bf16 value is
// the nearest-even rounding of 65,537 fp32 patterns.)
COAT_HD uint32_t remainder_hi(uint32_t u) {
    const uint32_t hi = ((u >> 16) + ((u >> 15) & 1u)) & 0xFFFFu;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : hi;
}

COAT_HD uint32_t remainder_join(uint32_t hi, uint32_t lo) {
    return (((hi - (lo >> 15)) & 0xFFFFu) << 16) | (lo & 0xFFFFu);
}

constexpr uint32_t kSrKey0 = 0x3C6EF372u;
constexpr uint32_t kSrGolden = 0x9E3779B9u;
constexpr uint32_t kSrGoldenHi = 0x7F4A7C15u;
constexpr uint32_t kSrMix1 = 0x7FEB352Du;  // lowbias32's multipliers
constexpr uint32_t kSrMix2 = 0x846CA68Bu;

COAT_HD uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= kSrMix1;
    x ^= x >> 15;
    x *= kSrMix2;
    return x ^ (x >> 16);
}

COAT_HD uint32_t sr_fold(uint32_t h, uint64_t word) {
    h = lowbias32(h ^ (uint32_t)word);
    return lowbias32(h ^ (uint32_t)(word >> 32));
}

// The key of (seed, step) before the stream is folded in: once per launch.
COAT_HD uint32_t sr_prefix(uint64_t seed, uint64_t step) { return sr_fold(sr_fold(kSrKey0, seed), step); }
COAT_HD uint32_t sr_key(uint32_t prefix, uint64_t stream) { return sr_fold(prefix, stream); }

// key + index's Weyl offset: the hash input of value `index` (lowbias32 of it, >> 16, is its bits).
COAT_HD uint32_t sr_weyl(uint32_t key, uint64_t index) {
    return key + (uint32_t)index * kSrGolden + (uint32_t)(index >> 32) * kSrGoldenHi;
}

// 16 random bits: lowbias32's last xor-shift only changes the low half, so the top 16 bits skip it.
COAT_HD uint32_t sr_bits(uint32_t key, uint64_t index) {
    uint32_t x = sr_weyl(key, index);
    x ^= x >> 16;
    x *= kSrMix1;
    x ^= x >> 15;
    x *= kSrMix2;
    return x >> 16;
}

// Stochastic rounding to bf16: 16 random bits added below the kept half, then truncation. NaN -> 0x7FC0;
// inf stays inf (its low half is zero); a value past the largest bf16 may round up to inf.
COAT_HD uint16_t f32_to_bf16_sr(float x, uint32_t bits16) {
    return (uint16_t)(x != x ? 0x7FC0u : (f32_bits(x) + bits16) >> 16);
}

// f(gk, ms) with the runtime (grad kind, master) as std::integral_constant types, so that every host-side
// launcher picks its template instantiation through one switch.
template <class F>
inline void with_step_types(Dtype gk, Master ms, F&& f) {
    auto by_master = [&](auto g) {
        switch (ms) {
            case Master::kBf16Rn: return f(g, std::integral_constant<Master, Master::kBf16Rn>{});
            case Master::kBf16Sr: return f(g, std::integral_constant<Master, Master::kBf16Sr>{});
            case Master::kF32Rem: return f(g, std::integral_constant<Master, Master::kF32Rem>{});
            default: return f(g, std::integral_constant<Master, Master::kF32>{});
        }
    };
    switch (gk) {
        case Dtype::kBf16: return by_master(std::integral_constant<Dtype, Dtype::kBf16>{});
        case Dtype::kF16: return by_master(std::integral_constant<Dtype, Dtype::kF16>{});
        default: return by_master(std::integral_constant<Dtype, Dtype::kF32>{});
    }
}

template <Dtype K>
COAT_HD float to_f32(uint32_t raw) {  // raw bits of a K value (16-bit ones in the low half)
    if constexpr (K == Dtype::kF32) {
        return bits_f32(raw);
    } else if constexpr (K == Dtype::kBf16) {
        return bf16_to_f32((uint16_t)raw);
    } else {
        return f16_to_f32((uint16_t)raw);
    }
}

template <Dtype K>
COAT_HD float load_value(const void* p, int64_t i) {
    if constexpr (K == Dtype::kF32) {
        return static_cast<const float*>(p)[i];
    } else {
        return to_f32<K>(static_cast<const uint16_t*>(p)[i]);
    }
}

// Master value i as fp32: param's value (fp32 or bf16), or its bf16 high half joined with `rem` (kF32Rem).
template <Master M>
COAT_HD float load_master(const void* param, const uint16_t* rem, int64_t i) {
    if constexpr (M == Master::kF32Rem) {
        return bits_f32(remainder_join(static_cast<const uint16_t*>(param)[i], rem[i]));
    } else {
        return load_value<master_dtype(M)>(param, i);
    }
}

// The updated master value as raw bits: fp32 bits (kF32, kF32Rem: split when stored), or bf16 bits in the low
// half; `index` is the value's position in its parameter (stochastic rounding only).
template <Master M>
COAT_HD uint32_t master_bits(float x, uint32_t sr_key, uint64_t index) {
    if constexpr (M == Master::kF32 || M == Master::kF32Rem) {
        return f32_bits(x);
    } else if constexpr (M == Master::kBf16Rn) {
        return f32_to_bf16(x);
    } else {
        return f32_to_bf16_sr(x, sr_bits(sr_key, index));
    }
}

// The bf16 copy of a master value given as master_bits returns it. An fp32 master's copy is the split's high
// half (nearest, ties away from zero), not the nearest-even cast: the one rounding a remainder master can
// undo, so "fp32" and "fp32_remainder" write the same bf16 weights and train bit-identically.
template <Master M>
COAT_HD uint16_t bf16_copy(uint32_t master) {
    if constexpr (M == Master::kF32 || M == Master::kF32Rem) return (uint16_t)remainder_hi(master);
    return (uint16_t)master;
}

}  // namespace coat
