// CPU FP8 AdamW step and group (de)quantisation: C++ with OpenMP over groups.
// Same math and semantics as coat_ds/optim/reference.py (shared with the CUDA kernels via coat_fp8_math.h).
// With AVX-512 (the build passes -march=native) the hot paths use the intrinsics of coat_cpu_avx512.h on
// blocks of 16 groups (per-group scales 16 at a time, values 16 per instruction); elsewhere the portable
// loops below, which GCC auto-vectorises.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "coat_adam_common.h"
#include "coat_fp8_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define COAT_CPU_AVX512 1
#include "coat_cpu_avx512.h"
#endif

namespace {

using coat::GroupScale;
using coat::HostMath;

constexpr int kMaxGroup = 256;

inline const float* log2_table(bool e5m2) { return e5m2 ? coat::kLog2AbsE5M2 : coat::kLog2AbsE4M3; }

inline uint8_t encode(float y, bool e5m2) {
    return e5m2 ? coat::fp8_encode<true>(y) : coat::fp8_encode<false>(y);
}

// Largest and smallest non-zero magnitude of buf[0..n).
inline void magnitude_range(const float* buf, int n, float& big, float& small) {
    float b = 0.0f, s = INFINITY;
#pragma omp simd reduction(max : b) reduction(min : s)
    for (int i = 0; i < n; ++i) {
        const float a = std::fabs(buf[i]);
        b = std::max(b, a);
        s = std::min(s, a > 0.0f ? a : INFINITY);
    }
    big = b;
    small = s;
}

inline void quantize_buf(const float* buf, int n, const GroupScale& s, bool e5m2, uint8_t* codes) {
    if (e5m2) {
#pragma omp simd
        for (int i = 0; i < n; ++i) codes[i] = coat::fp8_encode<true>(coat::expand_value<HostMath>(buf[i], s));
    } else {
#pragma omp simd
        for (int i = 0; i < n; ++i) codes[i] = coat::fp8_encode<false>(coat::expand_value<HostMath>(buf[i], s));
    }
}

inline void dequantize_buf(const uint8_t* codes, int n, const GroupScale& s, bool e5m2, float* out) {
    const float* tab = log2_table(e5m2);
#pragma omp simd
    for (int i = 0; i < n; ++i) out[i] = coat::dequant_value<HostMath>(codes[i], tab[codes[i] & 0x7F], s);
}

// Re-quantise buf into codes + (scale, expo) of one group.
inline void requantize_group(const float* buf, int n, bool e5m2, bool expansion, uint8_t* codes, float* scale,
                             float* expo) {
    float big, small;
    magnitude_range(buf, n, big, small);
    const GroupScale s = coat::group_scale<HostMath>(big, small, e5m2, expansion);
    *scale = s.d;
    *expo = s.k;
    quantize_buf(buf, n, s, e5m2, codes);
}

template <typename GradT>
inline float grad_value(const GradT* g, int64_t i);
template <>
inline float grad_value<float>(const float* g, int64_t i) { return g[i]; }
template <>
inline float grad_value<uint16_t>(const uint16_t* g, int64_t i) { return coat::bf16_to_f32(g[i]); }

template <typename GradT>
void adam_tensor(const coat_ops::AdamTensorRefs& t, const coat::AdamCoefs& c, int group_size, bool v_e5m2,
                 bool expansion) {
    const GradT* grad = static_cast<const GradT*>(t.grad);
    const int64_t n_groups = (t.numel + group_size - 1) / group_size;
    const float* m_tab = log2_table(false);
    const float* v_tab = log2_table(v_e5m2);
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
        const int64_t off = gi * group_size;
        const int n = (int)std::min<int64_t>(group_size, t.numel - off);
        float m[kMaxGroup], v[kMaxGroup];
        const GroupScale sm = coat::stored_scale<HostMath>(t.m_scale[gi], t.m_expo[gi]);
        const GroupScale sv = coat::stored_scale<HostMath>(t.v_scale[gi], t.v_expo[gi]);
        float* p = t.param + off;
        const uint8_t* mq = t.m_codes + off;
        const uint8_t* vq = t.v_codes + off;
#pragma omp simd
        for (int i = 0; i < n; ++i) {
            float mi = coat::dequant_value<HostMath>(mq[i], m_tab[mq[i] & 0x7F], sm);
            float vi = coat::dequant_value<HostMath>(vq[i], v_tab[vq[i] & 0x7F], sv);
            float pi = p[i];
            coat::adam_update<HostMath>(pi, grad_value(grad, off + i), mi, vi, c);
            p[i] = pi;
            m[i] = mi;
            v[i] = vi;
        }
        if (t.bf16_out != nullptr) {
            uint16_t* o = t.bf16_out + off;
#pragma omp simd
            for (int i = 0; i < n; ++i) o[i] = coat::f32_to_bf16(p[i]);
        }
        requantize_group(m, n, false, expansion, t.m_codes + off, t.m_scale + gi, t.m_expo + gi);
        requantize_group(v, n, v_e5m2, expansion, t.v_codes + off, t.v_scale + gi, t.v_expo + gi);
    }
}

#if COAT_CPU_AVX512
namespace vec = coat::avx512;

constexpr int kBlockGroups = 16;  // groups whose scales are computed together, one per lane

inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

inline vec::V load_grad(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }
inline vec::V load_grad(const uint16_t* g, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, g)), 16));
}

inline vec::VI load_codes(const uint8_t* c, __mmask16 k) { return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, c)); }

inline void store_codes(uint8_t* c, __mmask16 k, vec::VI codes) { _mm512_mask_cvtepi32_storeu_epi8(c, k, codes); }

// Largest and smallest non-zero |x| of the group in buf[0..n), 16 lanes at a time (NaN ignored, as the
// portable magnitude_range does).
inline void magnitude_range16(const float* buf, int n, float& big, float& small) {
    vec::V b = _mm512_setzero_ps(), s = vec::splat(INFINITY);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n - i);
        const vec::V a = vec::abs(_mm512_maskz_loadu_ps(k, buf + i));
        b = _mm512_mask_max_ps(b, k, a, b);
        s = _mm512_mask_min_ps(s, _mm512_mask_cmp_ps_mask(k, a, _mm512_setzero_ps(), _CMP_GT_OQ), a, s);
    }
    big = _mm512_reduce_max_ps(b);
    small = _mm512_reduce_min_ps(s);
}

// Codes of one group of buf[0..n) under a group scale (k, log2 d) given as splats.
template <bool E5M2>
inline void quantize_group(const float* buf, int n, vec::V k, vec::V log2d, uint8_t* codes) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        store_codes(codes + i, m, vec::quant<E5M2>(_mm512_maskz_loadu_ps(m, buf + i), k, log2d));
    }
}

inline void quantize_group(const float* buf, int n, bool e5m2, vec::V k, vec::V log2d, uint8_t* codes) {
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
    const vec::Scales16 s = vec::group_scales(_mm512_maskz_loadu_ps(m, big),
                                              _mm512_mask_loadu_ps(vec::splat(INFINITY), m, small), e5m2, expansion);
    _mm512_mask_storeu_ps(d_out, m, s.d);
    _mm512_mask_storeu_ps(k_out, m, s.k);
    _mm512_storeu_ps(k_keep, s.k);
    _mm512_storeu_ps(log2d_keep, s.log2d);
}

// Stored (d, k) of the block's groups -> (1/k, log2 d) per group.
inline void block_stored(const float* d, const float* k, int nb, float* inv_k, float* log2d) {
    const __mmask16 m = lanes(nb);
    const vec::Scales16 s =
        vec::stored_scales(_mm512_maskz_loadu_ps(m, d), _mm512_mask_loadu_ps(vec::splat(1.0f), m, k));
    _mm512_storeu_ps(inv_k, s.inv_k);
    _mm512_storeu_ps(log2d, s.log2d);
}

template <typename GradT>
void adam_tensor_avx512(const coat_ops::AdamTensorRefs& t, const coat::AdamCoefs& c, int group_size, bool v_e5m2,
                        bool expansion) {
    const GradT* grad = static_cast<const GradT*>(t.grad);
    const int64_t n_groups = (t.numel + group_size - 1) / group_size;
    const int64_t n_blocks = (n_groups + kBlockGroups - 1) / kBlockGroups;
    const vec::Log2Table m_tab(log2_table(false)), v_tab(log2_table(v_e5m2));
    const vec::V decay = vec::splat(c.decay), beta1 = vec::splat(c.beta1), omb1 = vec::splat(c.one_minus_beta1);
    const vec::V beta2 = vec::splat(c.beta2), omb2 = vec::splat(c.one_minus_beta2);
    const vec::V step_size = vec::splat(c.step_size), inv_bc2 = vec::splat(1.0f / c.bc2_sqrt), eps = vec::splat(c.eps);
#pragma omp parallel for schedule(static)
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
            const vec::V mik = vec::splat(m_inv_k[j]), mld = vec::splat(m_log2d[j]);
            const vec::V vik = vec::splat(v_inv_k[j]), vld = vec::splat(v_log2d[j]);
            float* mb = m_buf + j * group_size;
            float* vb = v_buf + j * group_size;
            vec::V mbig = _mm512_setzero_ps(), msmall = vec::splat(INFINITY);
            vec::V vbig = _mm512_setzero_ps(), vsmall = vec::splat(INFINITY);
            for (int i = 0; i < n; i += 16) {
                const __mmask16 k = lanes(n - i);
                const int64_t at = off + i;
                vec::V m = vec::dequant(load_codes(t.m_codes + at, k), m_tab, mik, mld);
                vec::V v = vec::dequant(load_codes(t.v_codes + at, k), v_tab, vik, vld);
                const vec::V g = load_grad(grad + at, k);
                vec::V p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, t.param + at), decay);
                // the reference's order: each product rounded, then the sum
                m = _mm512_add_ps(_mm512_mul_ps(beta1, m), _mm512_mul_ps(omb1, g));
                v = _mm512_add_ps(_mm512_mul_ps(beta2, v), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
                const vec::V denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv_bc2, eps);
                p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
                _mm512_mask_storeu_ps(t.param + at, k, p);
                if (t.bf16_out != nullptr) _mm256_mask_storeu_epi16(t.bf16_out + at, k, vec::to_bf16(p));
                _mm512_store_ps(mb + i, m);
                _mm512_store_ps(vb + i, v);
                const vec::V ma = vec::abs(m), va = vec::abs(v);
                mbig = _mm512_mask_max_ps(mbig, k, ma, mbig);
                vbig = _mm512_mask_max_ps(vbig, k, va, vbig);
                msmall = _mm512_mask_min_ps(msmall, _mm512_mask_cmp_ps_mask(k, ma, _mm512_setzero_ps(), _CMP_GT_OQ),
                                            ma, msmall);
                vsmall = _mm512_mask_min_ps(vsmall, _mm512_mask_cmp_ps_mask(k, va, _mm512_setzero_ps(), _CMP_GT_OQ),
                                            va, vsmall);
            }
            m_big[j] = _mm512_reduce_max_ps(mbig);
            m_small[j] = _mm512_reduce_min_ps(msmall);
            v_big[j] = _mm512_reduce_max_ps(vbig);
            v_small[j] = _mm512_reduce_min_ps(vsmall);
        }
        alignas(64) float m_k[16], v_k[16];
        block_scales(m_big, m_small, nb, false, expansion, t.m_scale + g0, t.m_expo + g0, m_k, m_log2d);
        block_scales(v_big, v_small, nb, v_e5m2, expansion, t.v_scale + g0, t.v_expo + g0, v_k, v_log2d);
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            const int n = (int)std::min<int64_t>(group_size, t.numel - off);
            quantize_group<false>(m_buf + j * group_size, n, vec::splat(m_k[j]), vec::splat(m_log2d[j]),
                                  t.m_codes + off);
            quantize_group(v_buf + j * group_size, n, v_e5m2, vec::splat(v_k[j]), vec::splat(v_log2d[j]),
                           t.v_codes + off);
        }
    }
}

void quantize_avx512(const float* xp, uint8_t* cp, float* sp, float* ep, int64_t numel, int group_size, bool e5m2,
                     bool expansion) {
    const int64_t n_groups = (numel + group_size - 1) / group_size;
    const int64_t n_blocks = (n_groups + kBlockGroups - 1) / kBlockGroups;
#pragma omp parallel for schedule(static)
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
            quantize_group(xp + off, (int)std::min<int64_t>(group_size, numel - off), e5m2, vec::splat(k[j]),
                           vec::splat(log2d[j]), cp + off);
        }
    }
}

void dequantize_avx512(const uint8_t* cp, const float* sp, const float* ep, float* op, int64_t numel, int group_size,
                       bool e5m2) {
    const int64_t n_groups = (numel + group_size - 1) / group_size;
    const int64_t n_blocks = (n_groups + kBlockGroups - 1) / kBlockGroups;
    const vec::Log2Table tab(log2_table(e5m2));
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t g0 = b * kBlockGroups;
        const int nb = (int)std::min<int64_t>(kBlockGroups, n_groups - g0);
        alignas(64) float inv_k[16], log2d[16];
        block_stored(sp + g0, ep + g0, nb, inv_k, log2d);
        for (int j = 0; j < nb; ++j) {
            const int64_t off = (g0 + j) * group_size;
            const int n = (int)std::min<int64_t>(group_size, numel - off);
            const vec::V ik = vec::splat(inv_k[j]), ld = vec::splat(log2d[j]);
            for (int i = 0; i < n; i += 16) {
                const __mmask16 k = lanes(n - i);
                _mm512_mask_storeu_ps(op + off + i, k, vec::dequant(load_codes(cp + off + i, k), tab, ik, ld));
            }
        }
    }
}
#endif  // COAT_CPU_AVX512

void adam_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<torch::Tensor>& m_q, const std::vector<torch::Tensor>& m_scale,
               const std::vector<torch::Tensor>& m_expo, const std::vector<torch::Tensor>& v_q,
               const std::vector<torch::Tensor>& v_scale, const std::vector<torch::Tensor>& v_expo,
               const std::vector<torch::Tensor>& bf16_out, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, int64_t group_size, bool v_e5m2, bool expansion) {
    const auto refs = coat_ops::check_adam_args(params, grads, m_q, m_scale, m_expo, v_q, v_scale, v_expo, bf16_out,
                                                group_size, /*cuda=*/false);
    const coat::AdamCoefs c = coat_ops::adam_coefs(lr, beta1, beta2, eps, weight_decay, step);
    for (const auto& t : refs) {
#if COAT_CPU_AVX512
        if (t.grad_bf16) {
            adam_tensor_avx512<uint16_t>(t, c, (int)group_size, v_e5m2, expansion);
        } else {
            adam_tensor_avx512<float>(t, c, (int)group_size, v_e5m2, expansion);
        }
        continue;
#endif
        if (t.grad_bf16) {
            adam_tensor<uint16_t>(t, c, (int)group_size, v_e5m2, expansion);
        } else {
            adam_tensor<float>(t, c, (int)group_size, v_e5m2, expansion);
        }
    }
}

void quantize(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
              const torch::Tensor& expo, int64_t group_size, bool e5m2, bool expansion) {
    coat_ops::check_quant_args(x, codes, scale, expo, group_size, /*cuda=*/false);
    const float* xp = x.data_ptr<float>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* sp = scale.data_ptr<float>();
    float* ep = expo.data_ptr<float>();
    const int64_t numel = x.numel();
#if COAT_CPU_AVX512
    quantize_avx512(xp, cp, sp, ep, numel, (int)group_size, e5m2, expansion);
    return;
#endif
    const int64_t n_groups = (numel + group_size - 1) / group_size;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
        const int64_t off = gi * group_size;
        const int n = (int)std::min<int64_t>(group_size, numel - off);
        requantize_group(xp + off, n, e5m2, expansion, cp + off, sp + gi, ep + gi);
    }
}

void dequantize(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& expo,
                const torch::Tensor& out, int64_t group_size, bool e5m2) {
    coat_ops::check_dequant_args(codes, scale, expo, out, group_size, /*cuda=*/false);
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const float* sp = scale.data_ptr<float>();
    const float* ep = expo.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t numel = codes.numel();
#if COAT_CPU_AVX512
    dequantize_avx512(cp, sp, ep, op, numel, (int)group_size, e5m2);
    return;
#endif
    const int64_t n_groups = (numel + group_size - 1) / group_size;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
        const int64_t off = gi * group_size;
        const int n = (int)std::min<int64_t>(group_size, numel - off);
        dequantize_buf(cp + off, n, coat::stored_scale<HostMath>(sp[gi], ep[gi]), e5m2, op + off);
    }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "coat_ds FP8 AdamW step and group (de)quantisation (CPU, OpenMP)";
    m.def("adam_step", &adam_step, "Fused FP8 AdamW step over lists of tensors (in place)");
    m.def("quantize", &quantize, "Group-quantise fp32 x into FP8 codes + per-group scale and exponent");
    m.def("dequantize", &dequantize, "FP8 codes + per-group scale and exponent -> fp32");
}
