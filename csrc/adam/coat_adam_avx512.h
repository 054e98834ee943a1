// The CPU op's kernels on AVX-512 (fused AdamW step, group quantise / dequantise), built from the
// primitives of coat_cpu_avx512.h. Work is cut into blocks of 16 groups: the block's stored scales are
// decoded 16 at once, its values are stepped 16 per instruction into a per-thread buffer (tracking each
// group's magnitude range), the 16 new scales are computed in one vector, then the buffer is encoded.
// No torch headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "coat_adam_tensor.h"
#include "coat_cpu_avx512.h"

namespace coat::avx512 {

constexpr int kMaxGroup = 256;

constexpr int kBlockGroups = 16;  // groups whose scales are computed together, one per lane
// OpenMP hands out 4 blocks (2K-16K values) at a time: dynamic, so a core slowed by other work (a shared
// host, ZeRO-Offload's own threads) does not hold the whole step back; 4 keeps the hand-out cost negligible.
#define COAT_OMP_BLOCKS _Pragma("omp parallel for schedule(dynamic, 4)")

inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

// body(i, mask) over the 16-value chunks of [0, n): full chunks with a constant all-lanes mask (no mask
// arithmetic in the hot loop), then the short tail of a tensor's last group, if any.
template <class F>
__attribute__((always_inline)) inline void for_chunks(int n, F&& body) {
    int i = 0;
    for (; i + 16 <= n; i += 16) body(i, (__mmask16)0xFFFF);
    if (i < n) body(i, lanes(n - i));
}

inline V load_bf16(const uint16_t* p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// 16 values (a gradient's or a master's) from position at, widened to fp32 (exactly).
template <coat::Dtype K>
inline V load_values(const void* p, int64_t at, __mmask16 k) {
    if constexpr (K == coat::Dtype::kF32) {
        return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + at);
    } else if constexpr (K == coat::Dtype::kBf16) {
        return load_bf16(static_cast<const uint16_t*>(p) + at, k);
    } else {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + at));
    }
}

// 16 master values from position at, as fp32 (a remainder master's bf16 high halves joined with rem, exactly).
template <coat::Master MS>
inline V load_master(const void* p, const uint16_t* rem, int64_t at, __mmask16 k) {
    if constexpr (MS == coat::Master::kF32Rem) {
        const VI hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + at));
        const VI lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, rem + at));
        const VI top = _mm512_and_si512(_mm512_sub_epi32(hi, _mm512_srli_epi32(lo, 15)), splati(0xFFFFu));
        return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(top, 16), lo));
    } else {
        return load_values<coat::master_dtype(MS)>(p, at, k);
    }
}

// coat::remainder_hi of 16 fp32 patterns, in the low halves of the lanes.
inline VI remainder_hi(VI u) {
    const VI hi = _mm512_and_si512(_mm512_add_epi32(_mm512_srli_epi32(u, 16),
                                                    _mm512_and_si512(_mm512_srli_epi32(u, 15), splati(1u))),
                                   splati(0xFFFFu));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, splati(0x7FFFFFFFu)), splati(0x7F800000u));
    return _mm512_mask_mov_epi32(hi, nan, splati(0x7FC0u));
}

// Writes the updated master (and the bf16 copy, when out is set); index: position of lane 0 in its parameter.
template <coat::Master MS>
inline void store_master(void* p, uint16_t* rem, uint16_t* out, int64_t at, __mmask16 k, V x, uint32_t sr_key,
                         uint64_t index) {
    __m256i b;
    if constexpr (MS == coat::Master::kF32Rem) {
        const VI u = _mm512_castps_si512(x);
        b = _mm512_cvtepi32_epi16(remainder_hi(u));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + at, k, b);
        _mm256_mask_storeu_epi16(rem + at, k, _mm512_cvtepi32_epi16(u));  // vpmovdw keeps the low halves
    } else if constexpr (MS == coat::Master::kF32) {
        _mm512_mask_storeu_ps(static_cast<float*>(p) + at, k, x);
        if (out == nullptr) return;
        b = _mm512_cvtepi32_epi16(remainder_hi(_mm512_castps_si512(x)));  // coat::bf16_copy: the split's high half
    } else {
        b = MS == coat::Master::kBf16Rn ? to_bf16(x) : to_bf16_sr(x, sr_bits16(sr_key, index));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + at, k, b);
    }
    if (out != nullptr) _mm256_mask_storeu_epi16(out + at, k, b);
}

inline VI load_codes(const uint8_t* c, __mmask16 k) { return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, c)); }

// Unsigned saturation: Encoder's NaN lanes (> 0xFF) store as 0xFF.
inline void store_codes(uint8_t* c, __mmask16 k, VI codes) { _mm512_mask_cvtusepi32_storeu_epi8(c, k, codes); }

// Largest and smallest non-zero |x| of the group in buf[0..n), 16 lanes at a time (NaN ignored, as the
// portable magnitude_range does).
inline void magnitude_range16(const float* buf, int n, float& big, float& small) {
    V b = _mm512_setzero_ps(), s = splat(INFINITY);
    for_chunks(n, [&](int i, __mmask16 k) __attribute__((always_inline)) {
        const V a = abs(_mm512_maskz_loadu_ps(k, buf + i));
        b = _mm512_mask_max_ps(b, k, a, b);
        s = _mm512_mask_min_ps(s, _mm512_mask_cmp_ps_mask(k, a, _mm512_setzero_ps(), _CMP_GT_OQ), a, s);
    });
    big = _mm512_reduce_max_ps(b);
    small = _mm512_reduce_min_ps(s);
}

// Codes of one group of buf[0..n) under a group scale (k, log2 d) given as splats.
template <bool E5M2>
inline void quantize_group(const float* buf, int n, float k, float log2d, uint8_t* codes) {
    const Encoder<E5M2> enc(k, log2d);
    for_chunks(n, [&](int i, __mmask16 m) __attribute__((always_inline)) {
        store_codes(codes + i, m, enc.encode(_mm512_maskz_loadu_ps(m, buf + i)));
    });
}

inline void quantize_group(const float* buf, int n, bool e5m2, float k, float log2d, uint8_t* codes) {
    if (e5m2) {
        quantize_group<true>(buf, n, k, log2d, codes);
    } else {
        quantize_group<false>(buf, n, k, log2d, codes);
    }
}

// Scales of the block's moments from each group's (big, small); writes (d, k) out and keeps (k, log2 d).
inline void block_scales(const float* big, const float* small, int nb, bool e5m2, bool expansion, float* d_out,
                         float* k_out, float* k_keep, float* log2d_keep) {
    const __mmask16 m = lanes(nb);
    const Scales16 s = group_scales(_mm512_maskz_loadu_ps(m, big),
                                              _mm512_mask_loadu_ps(splat(INFINITY), m, small), e5m2, expansion);
    _mm512_mask_storeu_ps(d_out, m, s.d);
    _mm512_mask_storeu_ps(k_out, m, s.k);
    _mm512_storeu_ps(k_keep, s.k);
    _mm512_storeu_ps(log2d_keep, s.log2d);
}

// Stored (d, k) of the block's groups -> (1/k, log2 d) per group.
inline void block_stored(const float* d, const float* k, int nb, float* inv_k, float* log2d) {
    const __mmask16 m = lanes(nb);
    const Scales16 s =
        stored_scales(_mm512_maskz_loadu_ps(m, d), _mm512_mask_loadu_ps(splat(1.0f), m, k));
    _mm512_storeu_ps(inv_k, s.inv_k);
    _mm512_storeu_ps(log2d, s.log2d);
}

template <coat::Dtype GK, coat::Master MS, bool VE5M2>
void adam_tensor(const coat::AdamTensor& t, const coat::AdamCoefs& c, uint32_t sr_key, int group_size,
                 bool expansion) {
    const char* grad = static_cast<const char*>(t.grad);  // for prefetching; loads take t.grad
    const char* param = static_cast<const char*>(t.param);
    constexpr int kGradBytes = GK == coat::Dtype::kF32 ? 4 : 2;
    constexpr int kParamBytes = MS == coat::Master::kF32 ? 4 : 2;
    const V grad_scale = splat(c.grad_scale);
    const int64_t n_groups = (t.numel + group_size - 1) / group_size;
    const int64_t n_blocks = (n_groups + kBlockGroups - 1) / kBlockGroups;
    const V decay = splat(c.decay), beta1 = splat(c.beta1), omb1 = splat(c.one_minus_beta1);
    const V beta2 = splat(c.beta2), omb2 = splat(c.one_minus_beta2);
    const V step_size = splat(c.step_size), inv_bc2 = splat(1.0f / c.bc2_sqrt), eps = splat(c.eps);
    const int64_t ahead = (int64_t)kBlockGroups * group_size;  // prefetch distance: one block
COAT_OMP_BLOCKS
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t g0 = b * kBlockGroups;
        const int nb = (int)std::min<int64_t>(kBlockGroups, n_groups - g0);
        alignas(64) float m_buf[kBlockGroups * kMaxGroup], v_buf[kBlockGroups * kMaxGroup];
        alignas(64) float m_inv_k[16], m_log2d[16], v_inv_k[16], v_log2d[16];
        alignas(64) float m_big[16], m_small[16], v_big[16], v_small[16];
        block_stored(t.m_scale + g0, t.m_expo + g0, nb, m_inv_k, m_log2d);
        block_stored(t.v_scale + g0, t.v_expo + g0, nb, v_inv_k, v_log2d);
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            const int n = (int)std::min<int64_t>(group_size, t.numel - off);
            const Decoder<false> mdec(m_inv_k[j], m_log2d[j]);
            const Decoder<VE5M2> vdec(v_inv_k[j], v_log2d[j]);
            float* mb = m_buf + j * group_size;
            float* vb = v_buf + j * group_size;
            V mbig = _mm512_setzero_ps(), msmall = splat(INFINITY);
            V vbig = _mm512_setzero_ps(), vsmall = splat(INFINITY);
            // one loop per (inf/NaN codes in the group?, bf16 copy?), so neither is tested per value
            auto step = [&](auto special, auto out_bf16) __attribute__((always_inline)) {
                constexpr bool kSpecial = decltype(special)::value;
                for_chunks(n, [&](int i, __mmask16 k) __attribute__((always_inline)) {
                    const int64_t at = off + i;
                    // the next block's inputs, into L2: this block's encode pass reads no new memory, so
                    // the hardware prefetchers alone would leave the next pass waiting on DRAM
                    _mm_prefetch(param + (at + ahead) * kParamBytes, _MM_HINT_T1);
                    _mm_prefetch(grad + (at + ahead) * kGradBytes, _MM_HINT_T1);
                    if constexpr (MS == coat::Master::kF32Rem) {
                        _mm_prefetch((const char*)(t.remainder + at + ahead), _MM_HINT_T1);
                    }
                    if ((i & 63) == 0) {
                        _mm_prefetch((const char*)(t.m_codes + at + ahead), _MM_HINT_T1);
                        _mm_prefetch((const char*)(t.v_codes + at + ahead), _MM_HINT_T1);
                    }
                    V m = mdec.template decode<kSpecial>(load_codes(t.m_codes + at, k));
                    V v = vdec.template decode<kSpecial>(load_codes(t.v_codes + at, k));
                    const V g = _mm512_mul_ps(load_values<GK>(t.grad, at, k), grad_scale);  // unscale first
                    // the reference's update with its mul+add pairs fused (one rounding fewer each, as
                    // nvcc contracts them in the CUDA kernel): 3 of the step's ~90 vector uops
                    m = _mm512_fmadd_ps(beta1, m, _mm512_mul_ps(omb1, g));
                    v = _mm512_fmadd_ps(beta2, v, _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
                    const V denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv_bc2, eps);
                    const V p = _mm512_fmadd_ps(load_master<MS>(t.param, t.remainder, at, k), decay,
                                                _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
                    store_master<MS>(t.param, t.remainder, decltype(out_bf16)::value ? t.bf16_out : nullptr, at, k,
                                     p, sr_key, (uint64_t)(t.sr_offset + at));
                    _mm512_store_ps(mb + i, m);
                    _mm512_store_ps(vb + i, v);
                    // max |x| and min non-zero |x| (vrangeps folds the |.| in and ignores a NaN operand)
                    mbig = _mm512_mask_range_ps(mbig, k, mbig, m, 0x0B);
                    vbig = _mm512_mask_range_ps(vbig, k, vbig, v, 0x0B);
                    msmall = _mm512_mask_range_ps(
                        msmall, _mm512_mask_cmp_ps_mask(k, m, _mm512_setzero_ps(), _CMP_NEQ_OQ), msmall, m, 0x0A);
                    vsmall = _mm512_mask_range_ps(
                        vsmall, _mm512_mask_cmp_ps_mask(k, v, _mm512_setzero_ps(), _CMP_NEQ_OQ), vsmall, v, 0x0A);
                });
            };
            const bool special = Decoder<false>::has_special_code(t.m_codes + off, n) ||
                                 Decoder<VE5M2>::has_special_code(t.v_codes + off, n);
            if (t.bf16_out != nullptr) {
                special ? step(std::true_type{}, std::true_type{}) : step(std::false_type{}, std::true_type{});
            } else {
                special ? step(std::true_type{}, std::false_type{}) : step(std::false_type{}, std::false_type{});
            }
            m_big[j] = _mm512_reduce_max_ps(mbig);
            m_small[j] = _mm512_reduce_min_ps(msmall);
            v_big[j] = _mm512_reduce_max_ps(vbig);
            v_small[j] = _mm512_reduce_min_ps(vsmall);
        }
        alignas(64) float m_k[16], v_k[16];
        block_scales(m_big, m_small, nb, false, expansion, t.m_scale + g0, t.m_expo + g0, m_k, m_log2d);
        block_scales(v_big, v_small, nb, VE5M2, expansion, t.v_scale + g0, t.v_expo + g0, v_k, v_log2d);
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            const int n = (int)std::min<int64_t>(group_size, t.numel - off);
            quantize_group<false>(m_buf + j * group_size, n, m_k[j], m_log2d[j], t.m_codes + off);
            quantize_group<VE5M2>(v_buf + j * group_size, n, v_k[j], v_log2d[j], t.v_codes + off);
        }
    }
}

// One tensor's step: grads fp32, bf16 or fp16; master fp32, bf16 (rounded to nearest or stochastically,
// sr_key: coat::sr_key of its stream) or bf16 + remainder; v in E4M3 or E5M2.
inline void adam_tensor(const coat::AdamTensor& t, const coat::AdamCoefs& c, uint32_t sr_key, int group_size,
                        bool v_e5m2, bool expansion) {
    coat::with_step_types(t.grad_dtype, t.master, [&](auto gk, auto ms) {
        constexpr coat::Dtype GK = decltype(gk)::value;
        constexpr coat::Master MS = decltype(ms)::value;
        v_e5m2 ? adam_tensor<GK, MS, true>(t, c, sr_key, group_size, expansion)
               : adam_tensor<GK, MS, false>(t, c, sr_key, group_size, expansion);
    });
}

inline void quantize(const float* xp, uint8_t* cp, float* sp, float* ep, int64_t numel, int group_size, bool e5m2,
                     bool expansion) {
    const int64_t n_groups = (numel + group_size - 1) / group_size;
    const int64_t n_blocks = (n_groups + kBlockGroups - 1) / kBlockGroups;
COAT_OMP_BLOCKS
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t g0 = b * kBlockGroups;
        const int nb = (int)std::min<int64_t>(kBlockGroups, n_groups - g0);
        alignas(64) float big[16], small[16], k[16], log2d[16];
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            magnitude_range16(xp + off, (int)std::min<int64_t>(group_size, numel - off), big[j], small[j]);
        }
        block_scales(big, small, nb, e5m2, expansion, sp + g0, ep + g0, k, log2d);
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            quantize_group(xp + off, (int)std::min<int64_t>(group_size, numel - off), e5m2, k[j], log2d[j],
                           cp + off);
        }
    }
}

template <bool E5M2>
void dequantize(const uint8_t* cp, const float* sp, const float* ep, float* op, int64_t numel, int group_size) {
    const int64_t n_groups = (numel + group_size - 1) / group_size;
    const int64_t n_blocks = (n_groups + kBlockGroups - 1) / kBlockGroups;
COAT_OMP_BLOCKS
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t g0 = b * kBlockGroups;
        const int nb = (int)std::min<int64_t>(kBlockGroups, n_groups - g0);
        alignas(64) float inv_k[16], log2d[16];
        block_stored(sp + g0, ep + g0, nb, inv_k, log2d);
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            const int n = (int)std::min<int64_t>(group_size, numel - off);
            const Decoder<E5M2> dec(inv_k[j], log2d[j]);
            for_chunks(n, [&](int i, __mmask16 k) __attribute__((always_inline)) {
                _mm512_mask_storeu_ps(op + off + i, k, dec.decode(load_codes(cp + off + i, k)));
            });
        }
    }
}

inline void dequantize(const uint8_t* cp, const float* sp, const float* ep, float* op, int64_t numel, int group_size,
                       bool e5m2) {
    e5m2 ? dequantize<true>(cp, sp, ep, op, numel, group_size) : dequantize<false>(cp, sp, ep, op, numel, group_size);
}

}  // namespace coat::avx512
