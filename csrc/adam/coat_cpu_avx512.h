// AVX-512 building blocks of the CPU FP8 AdamW op: 16 values per instruction, no per-value branches.
//
// Why hand-written: the portable loops (coat_fp8_math.h's HostMath) leave GCC with 20-30 instructions per
// exp2/log2 and a 128-entry gather per decoded value. AVX-512 has the pieces for much cheaper forms:
// vgetexp/vgetmant split log2 into exponent + a short polynomial (subnormals, 0, inf, NaN included),
// vscalef applies 2^n with one rounding (subnormal and overflow results included), vpermt2ps reads a
// 32-entry table from two registers (the 128-entry log2|code| table is 4 of them + 2 blends).
// Accuracy: exp2 ~1.3 ulp, log2 ~2.5 ulp of log2(1+u) (tests allow one FP8 step / a few ulp).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "coat_fp8_math.h"

namespace coat::avx512 {

using V = __m512;
using VI = __m512i;
using M = __mmask16;

inline V splat(float x) { return _mm512_set1_ps(x); }
inline VI splati(uint32_t x) { return _mm512_set1_epi32((int)x); }

// 2^x: x = r + f, r integer, f in [-0.5, 0.5]; degree-6 Chebyshev fit of 2^f (1.3 ulp); vscalef
// rounds once into subnormals / overflows to inf. The clamp keeps -inf -> 0 and +inf -> inf (f would be
// NaN); its operand order lets NaN through (vmaxps/vminps return the second operand on NaN).
inline V exp2(V x) {
    x = _mm512_max_ps(splat(-512.0f), x);
    x = _mm512_min_ps(splat(512.0f), x);
    const V r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = _mm512_sub_ps(x, r);
    V p = splat(0.00015469732170458883f);
    p = _mm512_fmadd_ps(p, f, splat(0.0013400432653725147f));
    p = _mm512_fmadd_ps(p, f, splat(0.00961802527308464f));
    p = _mm512_fmadd_ps(p, f, splat(0.05550327152013779f));
    p = _mm512_fmadd_ps(p, f, splat(0.24022650718688965f));
    p = _mm512_fmadd_ps(p, f, splat(0.6931471824645996f));
    p = _mm512_fmadd_ps(p, f, splat(1.0f));
    return _mm512_scalef_ps(p, r);
}

// log2 x for x >= 0: x = 2^e m, m in [0.75, 1.5) (vgetmant), log2 m = u P(u), u = m - 1, P a degree-8
// Chebyshev fit (2.4 ulp). 0 -> -inf (vgetexp gives -inf), inf -> inf, NaN -> NaN, subnormals exact.
inline V log2(V x) {
    const V m = _mm512_getmant_ps(x, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_zero);
    V e = _mm512_getexp_ps(x);
    e = _mm512_mask_add_ps(e, _mm512_cmp_ps_mask(m, splat(1.0f), _CMP_LT_OQ), e, splat(1.0f));
    const V u = _mm512_sub_ps(m, splat(1.0f));
    V p = splat(0.07827980071306229f);
    p = _mm512_fmadd_ps(p, u, splat(-0.174443781375885f));
    p = _mm512_fmadd_ps(p, u, splat(0.21635855734348297f));
    p = _mm512_fmadd_ps(p, u, splat(-0.24270190298557281f));
    p = _mm512_fmadd_ps(p, u, splat(0.28818631172180176f));
    p = _mm512_fmadd_ps(p, u, splat(-0.3605765700340271f));
    p = _mm512_fmadd_ps(p, u, splat(0.48090222477912903f));
    p = _mm512_fmadd_ps(p, u, splat(-0.7213484644889832f));
    p = _mm512_fmadd_ps(p, u, splat(1.4426950216293335f));
    return _mm512_fmadd_ps(p, u, e);
}

inline V abs(V x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), splati(0x7FFFFFFFu))); }

// The 128-entry log2|code| table of one format in 8 registers; lookup(idx) for idx in [0, 128).
struct Log2Table {
    V t[8];
    explicit Log2Table(const float* tab) {
        for (int i = 0; i < 8; ++i) t[i] = _mm512_loadu_ps(tab + 16 * i);
    }
    V lookup(VI idx) const {
        const V a = _mm512_permutex2var_ps(t[0], idx, t[1]);  // entries 0-31 (index bits 0-4)
        const V b = _mm512_permutex2var_ps(t[2], idx, t[3]);  // 32-63
        const V c = _mm512_permutex2var_ps(t[4], idx, t[5]);  // 64-95
        const V d = _mm512_permutex2var_ps(t[6], idx, t[7]);  // 96-127
        const M bit5 = _mm512_test_epi32_mask(idx, splati(32));
        const M bit6 = _mm512_test_epi32_mask(idx, splati(64));
        return _mm512_mask_blend_ps(bit6, _mm512_mask_blend_ps(bit5, a, b), _mm512_mask_blend_ps(bit5, c, d));
    }
};

// x = sign(q) 2^(log2|q| / k + log2 d) for 16 codes (as int32 lanes 0..255).
inline V dequant(VI codes, const Log2Table& tab, V inv_k, V log2d) {
    const V lg = tab.lookup(_mm512_and_si512(codes, splati(0x7Fu)));
    const V y = exp2(_mm512_fmadd_ps(lg, inv_k, log2d));
    // y | (code << 24 & sign bit): ternary-logic A | (B & C)
    const VI s = _mm512_slli_epi32(codes, 24);
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(y), s, splati(0x80000000u), 0xF8));
}

// FP8 magnitude code of y >= 0 (or NaN): round to nearest even with subnormals, saturate to max, NaN -> 0x7F.
// Same rule as coat::fp8_encode.
template <bool E5M2>
inline VI encode_magnitude(V y) {
    using L = Fp8Layout<E5M2>;
    constexpr int shift = 23 - L::kMantBits;
    const VI a = _mm512_castps_si512(y);
    const M sub = _mm512_cmp_ps_mask(y, splat(L::kMinNormal), _CMP_LT_OQ);
    const VI sub_code = _mm512_cvt_roundps_epi32(_mm512_mul_ps(y, splat(L::kSubnormalInvStep)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VI r = _mm512_add_epi32(a, splati((1u << (shift - 1)) - 1u));
    r = _mm512_add_epi32(r, _mm512_and_si512(_mm512_srli_epi32(a, shift), splati(1u)));
    r = _mm512_srli_epi32(r, shift);
    VI normal = _mm512_sub_epi32(r, splati((uint32_t)(127 - L::kBias) << L::kMantBits));
    normal = _mm512_min_epu32(normal, splati(L::kMaxCode));
    VI code = _mm512_mask_blend_epi32(sub, normal, sub_code);
    return _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(a, splati(0x7F800000u)), splati(L::kNanCode));
}

// q = FP8(sign(x) 2^(k (log2|x| - log2 d))), +0 for x = +-0 (the reference's torch.where).
template <bool E5M2>
inline VI quant(V x, V k, V log2d) {
    const V y = exp2(_mm512_mul_ps(k, _mm512_sub_ps(log2(abs(x)), log2d)));
    // x = 0 in an all-zero group (log2 d = -inf) gives NaN above: zero it; NaN x keeps its NaN code
    const VI mag = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                          encode_magnitude<E5M2>(y));
    return _mm512_mask_or_epi32(mag, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), mag, splati(0x80u));
}

// Per-group scale of 16 groups at once: coat::group_scale in lanes.
struct Scales16 {
    V k, inv_k, d, log2d;
};

inline Scales16 group_scales(V big, V small, bool e5m2, bool expansion) {
    const M live = _mm512_cmp_ps_mask(big, _mm512_setzero_ps(), _CMP_GT_OQ);  // else: all zero (or NaN)
    const V lb = log2(big);
    V k = splat(1.0f);
    if (expansion) {
        const V span = _mm512_sub_ps(lb, log2(small));
        V q = _mm512_div_ps(splat(fp8_k_numer(e5m2)), span);
        q = _mm512_mul_ps(_mm512_roundscale_ps(q, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), splat(1.0f / kKSteps));
        q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(span, _mm512_setzero_ps(), _CMP_GT_OQ), splat(kKMax), q);
        k = _mm512_min_ps(_mm512_max_ps(q, splat(kKMin)), splat(kKMax));
    }
    Scales16 s;
    s.k = _mm512_mask_blend_ps(live, splat(1.0f), k);
    s.inv_k = _mm512_div_ps(splat(1.0f), s.k);
    const V d = exp2(_mm512_sub_ps(lb, _mm512_div_ps(splat(fp8_log2_max(e5m2)), s.k)));
    s.d = _mm512_maskz_mov_ps(live, d);
    s.log2d = log2(s.d);
    return s;
}

// Stored (d, k) of 16 groups -> what dequantisation needs.
inline Scales16 stored_scales(V d, V k) {
    Scales16 s;
    s.k = k;
    s.inv_k = _mm512_div_ps(splat(1.0f), k);
    s.d = d;
    s.log2d = log2(d);
    return s;
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (coat::f32_to_bf16), 16 lanes.
inline __m256i to_bf16(V x) {
    const VI u = _mm512_castps_si512(x);
    VI r = _mm512_add_epi32(u, _mm512_add_epi32(splati(0x7FFFu), _mm512_and_si512(_mm512_srli_epi32(u, 16), splati(1u))));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), splati(0x7FC0u));
    return _mm512_cvtepi32_epi16(r);
}

}  // namespace coat::avx512
