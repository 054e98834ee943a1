// Argument checks and AdamW scalars shared by the CPU op and the CUDA op's torch bindings.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <vector>

#include "coat_adam_tensor.h"
#include "coat_fp8_math.h"

namespace coat_ops {

inline void check_group_size(int64_t group_size) {
    TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
                      "group_size=", group_size, " is not supported; allowed: [32, 64, 128, 256]");
}

inline void check_tensor(const torch::Tensor& t, const char* what, size_t i, at::ScalarType dtype, int64_t numel,
                         const torch::Device& device) {
    TORCH_CHECK(t.scalar_type() == dtype, what, "[", i, "] must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), what, "[", i, "] must be contiguous");
    TORCH_CHECK(t.numel() == numel, what, "[", i, "] has ", t.numel(), " values, expected ", numel);
    TORCH_CHECK(t.device() == device, what, "[", i, "] is on ", t.device(), ", expected ", device);
}

// The step's tensors, checked, as raw pointers (group_begin and vec_ok are left 0: the CUDA launch sets them).
inline std::vector<coat::AdamTensor> check_adam_args(
    const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
    const std::vector<torch::Tensor>& m_q, const std::vector<torch::Tensor>& m_scale,
    const std::vector<torch::Tensor>& m_expo, const std::vector<torch::Tensor>& v_q,
    const std::vector<torch::Tensor>& v_scale, const std::vector<torch::Tensor>& v_expo,
    const std::vector<torch::Tensor>& bf16_out, const std::vector<torch::Tensor>& remainders,
    const std::vector<int64_t>& sr_keys, int64_t group_size, bool cuda) {
    check_group_size(group_size);
    const size_t n = params.size();
    TORCH_CHECK(grads.size() == n && m_q.size() == n && m_scale.size() == n && m_expo.size() == n &&
                    v_q.size() == n && v_scale.size() == n && v_expo.size() == n,
                "adam_step: every tensor list must have one entry per param (", n, ")");
    TORCH_CHECK(bf16_out.empty() || bf16_out.size() == n, "adam_step: bf16_out must be empty or one per param");
    TORCH_CHECK(remainders.empty() || remainders.size() == n,
                "adam_step: remainders must be empty or one per param (0 values: none)");
    TORCH_CHECK(sr_keys.empty() || sr_keys.size() == 2 * n,
                "adam_step: sr_keys must be empty or one (stream, offset) pair per param");
    std::vector<coat::AdamTensor> refs;
    refs.reserve(n);
    if (n == 0) return refs;
    const torch::Device device = params[0].device();
    TORCH_CHECK(device.is_cuda() == cuda, "adam_step: tensors are on ", device, ", this op runs on ",
                cuda ? "CUDA" : "CPU");
    for (size_t i = 0; i < n; ++i) {
        const int64_t numel = params[i].numel();
        const int64_t ng = (numel + group_size - 1) / group_size;
        const bool bf16_master = params[i].scalar_type() == at::kBFloat16;
        check_tensor(params[i], "params", i, bf16_master ? at::kBFloat16 : at::kFloat, numel, device);
        const at::ScalarType gt = grads[i].scalar_type();
        const coat::Dtype gk = gt == at::kBFloat16 ? coat::Dtype::kBf16
                                  : gt == at::kHalf   ? coat::Dtype::kF16
                                                      : coat::Dtype::kF32;
        check_tensor(grads[i], "grads", i, gt == at::kBFloat16 || gt == at::kHalf ? gt : at::kFloat, numel, device);
        const bool rem = !remainders.empty() && remainders[i].numel() > 0;
        TORCH_CHECK_VALUE(!rem || (bf16_master && sr_keys.empty()), "adam_step: remainders[", i,
                          "] needs a bf16 param and no sr_keys (it is an exact fp32 master)");
        const coat::Master master = rem               ? coat::Master::kF32Rem
                                    : !bf16_master    ? coat::Master::kF32
                                    : sr_keys.empty() ? coat::Master::kBf16Rn
                                                      : coat::Master::kBf16Sr;
        const int64_t stream = sr_keys.empty() ? 0 : sr_keys[2 * i];
        const int64_t offset = sr_keys.empty() ? 0 : sr_keys[2 * i + 1];
        TORCH_CHECK_VALUE(offset >= 0, "adam_step: sr_keys[", i, "] has offset ", offset, ", must be >= 0");
        check_tensor(m_q[i], "m_q", i, at::kByte, numel, device);
        check_tensor(v_q[i], "v_q", i, at::kByte, numel, device);
        check_tensor(m_scale[i], "m_scale", i, at::kFloat, ng, device);
        check_tensor(m_expo[i], "m_expo", i, at::kFloat, ng, device);
        check_tensor(v_scale[i], "v_scale", i, at::kFloat, ng, device);
        check_tensor(v_expo[i], "v_expo", i, at::kFloat, ng, device);
        uint16_t* out = nullptr;
        if (!bf16_out.empty()) {
            check_tensor(bf16_out[i], "bf16_out", i, at::kBFloat16, numel, device);
            out = reinterpret_cast<uint16_t*>(bf16_out[i].data_ptr());
        }
        uint16_t* rem_ptr = nullptr;
        if (rem) {
            check_tensor(remainders[i], "remainders", i, at::kShort, numel, device);
            rem_ptr = reinterpret_cast<uint16_t*>(remainders[i].data_ptr());
        }
        refs.push_back({params[i].data_ptr(), grads[i].data_ptr(), m_q[i].data_ptr<uint8_t>(),
                        m_scale[i].data_ptr<float>(), m_expo[i].data_ptr<float>(), v_q[i].data_ptr<uint8_t>(),
                        v_scale[i].data_ptr<float>(), v_expo[i].data_ptr<float>(), out, rem_ptr, numel,
                        /*group_begin=*/0,
                        /*vec_ok=*/0, stream, offset, gk, master});
    }
    return refs;
}

inline void check_quant_args(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                             const torch::Tensor& expo, int64_t group_size, bool cuda) {
    check_group_size(group_size);
    const torch::Device device = x.device();
    TORCH_CHECK(device.is_cuda() == cuda, "quantize: x is on ", device);
    const int64_t ng = (x.numel() + group_size - 1) / group_size;
    check_tensor(x, "x", 0, at::kFloat, x.numel(), device);
    check_tensor(codes, "codes", 0, at::kByte, x.numel(), device);
    check_tensor(scale, "scale", 0, at::kFloat, ng, device);
    check_tensor(expo, "expo", 0, at::kFloat, ng, device);
}

inline void check_dequant_args(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& expo,
                               const torch::Tensor& out, int64_t group_size, bool cuda) {
    check_group_size(group_size);
    const torch::Device device = codes.device();
    TORCH_CHECK(device.is_cuda() == cuda, "dequantize: codes are on ", device);
    const int64_t ng = (codes.numel() + group_size - 1) / group_size;
    check_tensor(codes, "codes", 0, at::kByte, codes.numel(), device);
    check_tensor(scale, "scale", 0, at::kFloat, ng, device);
    check_tensor(expo, "expo", 0, at::kFloat, ng, device);
    check_tensor(out, "out", 0, at::kFloat, codes.numel(), device);
}

// Python scalars -> fp32 coefficients, computed in double first as the reference does.
inline coat::AdamCoefs adam_coefs(double lr, double beta1, double beta2, double eps, double weight_decay,
                                  int64_t step, double grad_scale) {
    TORCH_CHECK_VALUE(step >= 1, "step=", step, " must be >= 1");
    const double bc1 = 1.0 - std::pow(beta1, (double)step);
    const double bc2 = 1.0 - std::pow(beta2, (double)step);
    coat::AdamCoefs c;
    c.grad_scale = (float)grad_scale;
    c.decay = (float)(1.0 - lr * weight_decay);
    c.beta1 = (float)beta1;
    c.one_minus_beta1 = (float)(1.0 - beta1);
    c.beta2 = (float)beta2;
    c.one_minus_beta2 = (float)(1.0 - beta2);
    c.step_size = (float)(-(lr / bc1));
    c.bc2_sqrt = (float)std::pow(bc2, 0.5);
    c.eps = (float)eps;
    return c;
}

// The grad scale's tensor, when given: one fp32 value on the params' device (the CUDA kernel reads it there).
inline void check_grad_scale(const std::optional<torch::Tensor>& t, const std::vector<torch::Tensor>& params) {
    if (!t.has_value() || params.empty()) return;
    check_tensor(*t, "grad_scale", 0, at::kFloat, 1, params[0].device());
}

}  // namespace coat_ops
