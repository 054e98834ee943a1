// CPU FP8 AdamW step and group (de)quantisation: C++ with OpenMP over groups.
// Same math and semantics as coat_ds/optim/reference.py (shared with the CUDA kernels via coat_fp8_math.h).
// With AVX-512 (the build passes -march=native) the hot paths use the intrinsics of coat_cpu_avx512.h on
// blocks of 16 groups (per-group scales 16 at a time, values 16 per instruction); elsewhere the portable
// loops below, which GCC auto-vectorises.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "coat_adam_common.h"
#include "coat_fp8_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define COAT_CPU_AVX512 1
#include "coat_adam_avx512.h"
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

// One tensor's step on the portable loops, one body per (grad dtype, master dtype / rounding).
template <coat::Dtype GK, coat::Master MS>
void adam_tensor(const coat::AdamTensor& t, const coat::AdamCoefs& c, uint32_t sr_key, int group_size,
                 bool v_e5m2, bool expansion) {
    const int64_t n_groups = (t.numel + group_size - 1) / group_size;
    const float* m_tab = log2_table(false);
    const float* v_tab = log2_table(v_e5m2);
    const uint64_t index0 = (uint64_t)t.sr_offset;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
        const int64_t off = gi * group_size;
        const int n = (int)std::min<int64_t>(group_size, t.numel - off);
        float m[kMaxGroup], v[kMaxGroup];
        uint32_t p_new[kMaxGroup];
        const GroupScale sm = coat::stored_scale<HostMath>(t.m_scale[gi], t.m_expo[gi]);
        const GroupScale sv = coat::stored_scale<HostMath>(t.v_scale[gi], t.v_expo[gi]);
        const uint8_t* mq = t.m_codes + off;
        const uint8_t* vq = t.v_codes + off;
#pragma omp simd
        for (int i = 0; i < n; ++i) {
            float mi = coat::dequant_value<HostMath>(mq[i], m_tab[mq[i] & 0x7F], sm);
            float vi = coat::dequant_value<HostMath>(vq[i], v_tab[vq[i] & 0x7F], sv);
            float pi = coat::load_master<MS>(t.param, t.remainder, off + i);
            const float gi = coat::mul_rn(coat::load_value<GK>(t.grad, off + i), c.grad_scale);
            coat::adam_update<HostMath>(pi, gi, mi, vi, c);
            p_new[i] = coat::master_bits<MS>(pi, sr_key, index0 + (uint64_t)(off + i));
            m[i] = mi;
            v[i] = vi;
        }
        if constexpr (MS == coat::Master::kF32) {
            std::memcpy(static_cast<float*>(t.param) + off, p_new, n * sizeof(float));
        } else if constexpr (MS == coat::Master::kF32Rem) {
            uint16_t* hi = static_cast<uint16_t*>(t.param) + off;
            uint16_t* lo = t.remainder + off;
#pragma omp simd
            for (int i = 0; i < n; ++i) {
                hi[i] = (uint16_t)coat::remainder_hi(p_new[i]);
                lo[i] = (uint16_t)p_new[i];
            }
        } else {
            uint16_t* p = static_cast<uint16_t*>(t.param) + off;
#pragma omp simd
            for (int i = 0; i < n; ++i) p[i] = (uint16_t)p_new[i];
        }
        if (t.bf16_out != nullptr) {
            uint16_t* o = t.bf16_out + off;
#pragma omp simd
            for (int i = 0; i < n; ++i) o[i] = coat::bf16_copy<MS>(p_new[i]);
        }
        requantize_group(m, n, false, expansion, t.m_codes + off, t.m_scale + gi, t.m_expo + gi);
        requantize_group(v, n, v_e5m2, expansion, t.v_codes + off, t.v_scale + gi, t.v_expo + gi);
    }
}

// Whether this call takes the AVX-512 kernels: COAT_CPU_ADAM_PORTABLE=1 forces the portable loops on an
// AVX-512 build, so one machine tests both paths (read per call: a test can switch it).
bool use_avx512() {
#if COAT_CPU_AVX512
    const char* v = std::getenv("COAT_CPU_ADAM_PORTABLE");
    return v == nullptr || v[0] == '\0' || (v[0] == '0' && v[1] == '\0');
#else
    return false;
#endif
}

std::string simd() { return use_avx512() ? "avx512" : "portable"; }

void adam_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<torch::Tensor>& m_q, const std::vector<torch::Tensor>& m_scale,
               const std::vector<torch::Tensor>& m_expo, const std::vector<torch::Tensor>& v_q,
               const std::vector<torch::Tensor>& v_scale, const std::vector<torch::Tensor>& v_expo,
               const std::vector<torch::Tensor>& bf16_out, const std::vector<torch::Tensor>& remainders, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, int64_t group_size, bool v_e5m2, bool expansion,
               const std::optional<torch::Tensor>& grad_scale_t, double grad_scale,
               const std::vector<int64_t>& sr_keys, int64_t sr_seed) {
    const auto refs = coat_ops::check_adam_args(params, grads, m_q, m_scale, m_expo, v_q, v_scale, v_expo, bf16_out,
                                                remainders, sr_keys, group_size, /*cuda=*/false);
    coat_ops::check_grad_scale(grad_scale_t, params);
    const coat::AdamCoefs c = coat_ops::adam_coefs(lr, beta1, beta2, eps, weight_decay, step,
                                                   grad_scale_t.has_value() ? grad_scale_t->item<float>() : grad_scale);
    if (!std::isfinite(c.grad_scale)) return;  // a non-finite grad scale skips the step: nothing is written
    const uint32_t sr_prefix = coat::sr_prefix((uint64_t)sr_seed, (uint64_t)step);
    [[maybe_unused]] const bool avx512 = use_avx512();
    for (const auto& t : refs) {
        const uint32_t key = coat::sr_key(sr_prefix, (uint64_t)t.sr_stream);
#if COAT_CPU_AVX512
        if (avx512) {
            coat::avx512::adam_tensor(t, c, key, (int)group_size, v_e5m2, expansion);
            continue;
        }
#endif
        coat::with_step_types(t.grad_dtype, t.master, [&](auto gk, auto ms) {
            adam_tensor<decltype(gk)::value, decltype(ms)::value>(t, c, key, (int)group_size, v_e5m2, expansion);
        });
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
    if (use_avx512()) return coat::avx512::quantize(xp, cp, sp, ep, numel, (int)group_size, e5m2, expansion);
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
    if (use_avx512()) return coat::avx512::dequantize(cp, sp, ep, op, numel, (int)group_size, e5m2);
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
    m.def("simd", &simd, "Which kernels the next call takes: 'avx512' or 'portable'");
}
