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

// log2|x|: |x| = 2^e m, m in [0.75, 1.5) (vgetmant, sign dropped), log2 m = u P(u), u = m - 1, P a degree-7
// Chebyshev fit (abs error 1.7e-7, below the fp32 rounding of log2|x| itself for the |x| << 1 of Adam
// moments). 0 -> -inf (vgetexp gives -inf), inf -> inf, NaN -> NaN, subnormals exact.
inline V log2(V x) {
    const V m = _mm512_getmant_ps(x, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_zero);
    V e = _mm512_getexp_ps(x);
    e = _mm512_mask_add_ps(e, _mm512_cmp_ps_mask(m, splat(1.0f), _CMP_LT_OQ), e, splat(1.0f));
    const V u = _mm512_sub_ps(m, splat(1.0f));
    V p = splat(-0.09616397321224213f);
    p = _mm512_fmadd_ps(p, u, splat(0.20412734150886536f));
    p = _mm512_fmadd_ps(p, u, splat(-0.2506521940231323f));
    p = _mm512_fmadd_ps(p, u, splat(0.29007357358932495f));
    p = _mm512_fmadd_ps(p, u, splat(-0.3603352904319763f));
    p = _mm512_fmadd_ps(p, u, splat(0.4808475077152252f));
    p = _mm512_fmadd_ps(p, u, splat(-0.7213506698608398f));
    p = _mm512_fmadd_ps(p, u, splat(1.4426952600479126f));
    return _mm512_fmadd_ps(p, u, e);
}

inline V abs(V x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), splati(0x7FFFFFFFu))); }

// Decoding one group: x = sign(q) 2^(log2|q| / k + log2 d) splits along the code's bits into
// A[sign, e] = +-2^((max(e, 1) - bias) / k + log2 d) and B[j] = (1 + j/2^mb)^(1/k) (normal) or (j/2^mb)^(1/k)
// (subnormal), so x = A * B: the group's 16-32 + 16 table entries cost 2-3 vector exp2, and each value a few
// register permutes and one multiply. Inf / NaN codes are patched in from a third table.
template <bool E5M2>
struct Decoder {
    using L = Fp8Layout<E5M2>;
    static constexpr int kMB = L::kMantBits;
    V a0, a1;  // E4M3: a0 = +A[e], a1 = -A[e] (index = code >> 3); E5M2: A[0..15], A[16..31] (index = code >> 2)
    V bn, bs;  // B of normal / subnormal codes, lane l holds j = l mod 2^mb (index = code & 15)

    struct Consts {
        float ea[32];     // max(e, 1) - bias
        float lb[16];     // log2(1 + j/2^mb) in lanes 0..7, log2(j/2^mb) in lanes 8..15 (j = l mod 2^mb)
        int rep_n[16], rep_s[16];
    };
    static const Consts& consts() {
        static const Consts c = [] {
            Consts k{};
            for (int e = 0; e < 32; ++e) k.ea[e] = (float)((e < 1 ? 1 : e) - L::kBias);
            const int nm = 1 << kMB;
            for (int l = 0; l < 8; ++l) {
                const int j = l % nm;
                k.lb[l] = (float)std::log2(1.0 + (double)j / nm);
                k.lb[8 + l] = j == 0 ? -COAT_F32_INF : (float)std::log2((double)j / nm);
            }
            for (int l = 0; l < 16; ++l) {
                k.rep_n[l] = l % nm;
                k.rep_s[l] = 8 + l % nm;
            }
            return k;
        }();
        return c;
    }

    Decoder(float inv_k_s, float log2d_s) {
        const Consts& k = consts();
        const V inv_k = splat(inv_k_s), log2d = splat(log2d_s);
        a0 = exp2(_mm512_fmadd_ps(_mm512_loadu_ps(k.ea), inv_k, log2d));
        if (E5M2) {
            a1 = exp2(_mm512_fmadd_ps(_mm512_loadu_ps(k.ea + 16), inv_k, log2d));
        } else {
            a1 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a0), splati(0x80000000u)));
        }
        const V b = exp2(_mm512_mul_ps(_mm512_loadu_ps(k.lb), inv_k));
        bn = _mm512_permutexvar_ps(_mm512_loadu_si512(k.rep_n), b);
        bs = _mm512_permutexvar_ps(_mm512_loadu_si512(k.rep_s), b);
    }

    // 16 codes (int32 lanes 0..255) -> values. Special = false: the caller checked that the group holds
    // no inf / NaN code (has_special_code), which saves the patch-up on every value.
    template <bool Special = true>
    V decode(VI c) const {
        const V a = _mm512_permutex2var_ps(a0, _mm512_srli_epi32(c, kMB), a1);
        const M sub = _mm512_testn_epi32_mask(c, splati(0x7Fu & ~((1u << kMB) - 1u)));
        V b = _mm512_permutexvar_ps(c, bn);
        b = _mm512_mask_permutexvar_ps(b, sub, c, bs);
        V x = _mm512_mul_ps(a, b);
        if (Special) {
            const M special = _mm512_cmpgt_epu32_mask(_mm512_and_si512(c, splati(0x7Fu)), splati(L::kMaxCode));
            // E4M3: 0x7F NaN; E5M2: 0x7C inf, 0x7D-0x7F NaN (index = code & 15)
            const V spec = E5M2 ? _mm512_setr_ps(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, COAT_F32_INF, COAT_F32_NAN,
                                                 COAT_F32_NAN, COAT_F32_NAN)
                                : splat(COAT_F32_NAN);
            x = _mm512_mask_permutexvar_ps(x, special, c, spec);
        }
        if (E5M2) {  // x | (code << 24 & sign bit): ternary-logic A | (B & C)
            return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(x), _mm512_slli_epi32(c, 24),
                                                                 splati(0x80000000u), 0xF8));
        }
        return x;
    }

    // Whether codes[0..n) hold an inf / NaN code (64 per instruction).
    static bool has_special_code(const uint8_t* codes, int n) {
        for (int i = 0; i < n; i += 64) {
            const __mmask64 k = n - i >= 64 ? ~0ull : (1ull << (n - i)) - 1ull;
            const __m512i b = _mm512_and_si512(_mm512_maskz_loadu_epi8(k, codes + i), _mm512_set1_epi8(0x7F));
            if (_mm512_mask_cmpgt_epu8_mask(k, b, _mm512_set1_epi8((char)L::kMaxCode)) != 0) return true;
        }
        return false;
    }
};

// Encoding one group: q = FP8(sign(x) 2^(k (log2|x| - log2 d))), the reference's formula, for 16 values.
// log2|x| = e + log2 m (vgetexp, vgetmant in [1, 2)); m's top 4 bits pick c ~ m from a 16-entry table, so
// log2 m = log2 c + log2(1 + u), u = m / c - 1 in +-1/33, u times a quadratic (abs error 5.2e-8, far below
// the fp32 rounding of log2|x| itself). The group's table folds in k, log2 c, log2 d and the format's bias:
//   L = k (e + log2(1 + u)) + T[i],  T[i] = k (log2 c_i - log2 d) + bias - 1,
// and the exp2 is fused into the encoding: with r = floor(L), f = L - r, a normal code is
// round(2^mb r + 2^mb 2^f) (the mantissa's carry lands in the exponent by itself), a subnormal one
// (r < 0) round(2^mb 2^f 2^r); 2^f is a degree-5 fit (1.8e-7; a degree-4 fit saved one uop in ~95 but moved
// ~4 in 1e5 codes one step off the reference, for no gain measurable at 1e7). Round to nearest even,
// saturate to max, NaN -> a NaN code, +0 for x = +-0 (the reference's torch.where); log2d = +inf marks an
// all-zero group.
template <bool E5M2>
struct Encoder {
    using L = Fp8Layout<E5M2>;
    static constexpr float kS = (float)(1 << L::kMantBits);
    V k, t;

    struct Consts {
        float rcp[16], log2c[16];  // 1/c_i rounded to fp32, and -log2 of that rounded value
    };
    static const Consts& consts() {
        static const Consts c = [] {
            Consts q{};
            for (int i = 0; i < 16; ++i) {
                q.rcp[i] = (float)(1.0 / (1.0 + (i + 0.5) / 16.0));
                q.log2c[i] = (float)-std::log2((double)q.rcp[i]);
            }
            return q;
        }();
        return c;
    }

    Encoder(float k_s, float log2d_s) : k(splat(k_s)) {
        const V lc = _mm512_loadu_ps(consts().log2c);
        t = _mm512_fmadd_ps(k, _mm512_sub_ps(lc, splat(log2d_s)), splat((float)(L::kBias - 1)));
    }

    // 16 values -> codes in int32 lanes (sign in bit 7; NaN lanes hold a value > 0xFF: store with
    // unsigned saturation, it becomes 0xFF, a NaN code of both formats).
    VI encode(V x) const {
        const V m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
        const V e = _mm512_getexp_ps(x);
        const VI i = _mm512_srli_epi32(_mm512_castps_si512(m), 19);  // vpermps reads the low 4 bits
        const V u = _mm512_fmsub_ps(m, _mm512_permutexvar_ps(i, _mm512_loadu_ps(consts().rcp)), splat(1.0f));
        V lp = splat(0.4812731203610398f);
        lp = _mm512_fmadd_ps(lp, u, splat(-0.7216220464142745f));
        lp = _mm512_fmadd_ps(lp, u, splat(1.4426949401914182f));
        V l = _mm512_fmadd_ps(k, _mm512_fmadd_ps(lp, u, e), _mm512_permutexvar_ps(i, t));
        l = _mm512_max_ps(splat(-512.0f), l);  // x = 0: -inf -> a tiny subnormal -> code 0; NaN passes
        l = _mm512_min_ps(splat(64.0f), l);    // x = inf: saturates below; NaN passes
        const V r = _mm512_roundscale_ps(l, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const V f = _mm512_sub_ps(l, r);
        V p = splat(kS * 0.001895107291023944f);
        p = _mm512_fmadd_ps(p, f, splat(kS * 0.008946214666278473f));
        p = _mm512_fmadd_ps(p, f, splat(kS * 0.055863282659306956f));
        p = _mm512_fmadd_ps(p, f, splat(kS * 0.24014077009181947f));
        p = _mm512_fmadd_ps(p, f, splat(kS * 0.6931546200033036f));
        p = _mm512_fmadd_ps(p, f, splat(kS * 0.9999998957631347f));  // 2^mb 2^f
        const V rn = _mm512_max_ps(r, _mm512_setzero_ps());           // r < 0: subnormal, scaled by 2^r
        V c = _mm512_fmadd_ps(rn, splat(kS), _mm512_scalef_ps(p, _mm512_sub_ps(r, rn)));
        c = _mm512_min_ps(splat((float)L::kMaxCode), c);  // NaN passes, converts to 0x80000000
        const VI code = _mm512_cvt_roundps_epi32(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm512_mask_or_epi32(code, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), code,
                                    splati(0x80u));
    }
};

// Per-group scale of 16 groups at once: coat::group_scale in lanes (log2d as quant wants it).
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
    s.log2d = _mm512_mask_blend_ps(live, splat(COAT_F32_INF), log2(s.d));  // for quant: all-zero -> codes 0
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

// Stochastic rounding of 16 consecutive values: coat::sr_bits of positions index .. index + 15, in lanes.
inline VI sr_bits16(uint32_t key, uint64_t index) {
    const VI lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    VI x = _mm512_add_epi32(splati(coat::sr_weyl(key, index)), _mm512_mullo_epi32(lane, splati(kSrGolden)));
    // lanes whose position's low word wrapped past 2^32 carry one into the high word
    const VI lo = splati((uint32_t)index);
    x = _mm512_mask_add_epi32(x, _mm512_cmplt_epu32_mask(_mm512_add_epi32(lo, lane), lo), x, splati(kSrGoldenHi));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, splati(kSrMix1));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, splati(kSrMix2));
    return _mm512_srli_epi32(x, 16);
}

// fp32 -> bf16 bits by stochastic rounding with the given 16 bits per lane (coat::f32_to_bf16_sr).
inline __m256i to_bf16_sr(V x, VI bits16) {
    VI r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), bits16), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), splati(0x7FC0u));
    return _mm512_cvtepi32_epi16(r);
}

}  // namespace coat::avx512
