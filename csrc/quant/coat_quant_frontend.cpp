// Torch bindings of the FP8 activation kernels (coat_quant.h). Python allocates every output
// (coat_ds/kernels/quant.py); these functions check shapes and hand raw pointers to the launchers.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "coat_quant.h"

namespace {

void check(const torch::Tensor& t, const char* name, c10::ScalarType dtype) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, " must be a contiguous CUDA tensor");
    TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

// Per-row vectors (targets, fp32 statistics) are read element by element: no alignment needed.
void check_rows(const torch::Tensor& t, const char* name, c10::ScalarType dtype, int64_t rows) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == rows, name,
                " must be a contiguous CUDA ", dtype, " tensor of ", rows, " elements");
}

uint8_t* opt_u8(torch::Tensor& t) { return t.numel() ? t.data_ptr<uint8_t>() : nullptr; }

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream(); }

// act: the index of the activation in quant_reference.GATED_ACTS (coat_quant::GatedAct).
coat_quant::GatedAct gated_act(int64_t act) {
    TORCH_CHECK(act == 0 || act == 1, "gated activation index ", act, " is not 0 (silu) or 1 (gelu_tanh)");
    return static_cast<coat_quant::GatedAct>(act);
}

void row_amax(torch::Tensor x, torch::Tensor out) {
    check(x, "x", at::kBFloat16);
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 8 == 0, "x must be [m, n] with n % 8 == 0");
    coat_quant::row_amax(x.data_ptr(), out.data_ptr<float>(), x.size(0), x.size(1), stream());
}

void quant_tensor(torch::Tensor x, torch::Tensor scale, torch::Tensor out, torch::Tensor out_t, bool e5m2,
                  int64_t ld_t) {
    check(x, "x", at::kBFloat16);
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 16 == 0 && x.size(0) % 16 == 0, "x must be [m, n], m, n % 16 == 0");
    TORCH_CHECK(ld_t % 16 == 0 && ld_t >= x.size(0), "ld_t must be >= m and a multiple of 16");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(out_t.data_ptr()) % 16 == 0, "out_t must be 16-byte aligned");
    coat_quant::quant_tensor(x.data_ptr(), scale.data_ptr<float>(), opt_u8(out), opt_u8(out_t), x.size(0),
                             x.size(1), ld_t, e5m2, stream());
}

// ymax, y: empty where not wanted
void rmsnorm_quant(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor xq, torch::Tensor xs,
                   torch::Tensor rstd, torch::Tensor ymax, torch::Tensor y, bool e5m2) {
    check(x, "x", at::kBFloat16);
    check(w, "w", at::kBFloat16);
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 16 == 0, "x must be [m, n] with n % 16 == 0");
    if (y.numel()) check(y, "y", at::kBFloat16);
    coat_quant::rmsnorm_quant(x.data_ptr(), w.data_ptr(), (float)eps, xq.data_ptr<uint8_t>(),
                              xs.data_ptr<uint8_t>(), rstd.data_ptr<float>(),
                              ymax.numel() ? ymax.data_ptr<float>() : nullptr, y.numel() ? y.data_ptr() : nullptr,
                              x.size(0), x.size(1), e5m2, stream());
}

void rmsnorm_rebuild(torch::Tensor xq, torch::Tensor xs, torch::Tensor rstd, torch::Tensor w, torch::Tensor scale,
                     torch::Tensor out, torch::Tensor out_t, bool in_e5m2, bool out_e5m2) {
    check(xq, "xq", at::kByte);
    check(w, "w", at::kBFloat16);
    TORCH_CHECK(xq.size(0) % 16 == 0 && xq.size(1) % 16 == 0, "xq must be [m, n], m, n % 16 == 0");
    coat_quant::rmsnorm_rebuild(xq.data_ptr<uint8_t>(), xs.data_ptr<uint8_t>(), rstd.data_ptr<float>(),
                                w.data_ptr(), scale.data_ptr<float>(), opt_u8(out), opt_u8(out_t), xq.size(0),
                                xq.size(1), in_e5m2, out_e5m2, stream());
}

void rmsnorm_backward(torch::Tensor dy, torch::Tensor xq, torch::Tensor xs, torch::Tensor rstd, torch::Tensor w,
                      torch::Tensor dres, torch::Tensor dx, torch::Tensor dw, bool in_e5m2) {
    check(dy, "dy", at::kBFloat16);
    check(xq, "xq", at::kByte);
    check(dx, "dx", at::kBFloat16);
    TORCH_CHECK(dy.size(1) % 16 == 0 && dy.size(1) <= 16384, "hidden size must be a multiple of 16, <= 16384");
    if (dres.numel()) check(dres, "dres", at::kBFloat16);
    coat_quant::rmsnorm_backward(dy.data_ptr(), xq.data_ptr<uint8_t>(), xs.data_ptr<uint8_t>(),
                                 rstd.data_ptr<float>(), w.data_ptr(), dres.numel() ? dres.data_ptr() : nullptr,
                                 dx.data_ptr(), dw.data_ptr<float>(), dy.size(0), dy.size(1), in_e5m2, stream());
}

void silu_mul_quant(torch::Tensor gu, torch::Tensor q, torch::Tensor s, torch::Tensor amax, bool e5m2, int64_t act) {
    check(gu, "gu", at::kBFloat16);
    TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 32 == 0, "gu must be [m, 2i] with i % 16 == 0");
    coat_quant::silu_mul_quant(gu.data_ptr(), q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), amax.data_ptr<float>(),
                               gu.size(0), gu.size(1) / 2, e5m2, gated_act(act), stream());
}

void group_dequant(torch::Tensor q, torch::Tensor s, torch::Tensor out, bool e5m2) {
    check(q, "q", at::kByte);
    check(s, "s", at::kByte);
    check(out, "out", at::kBFloat16);
    TORCH_CHECK(q.numel() % 16 == 0 && s.numel() * 16 == q.numel() && out.numel() == q.numel(),
                "q must hold 16 codes per exponent in s, and out as many values as q");
    coat_quant::group_dequant(q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), out.data_ptr(), q.numel(), e5m2, stream());
}

void silu_mul_rebuild(torch::Tensor q, torch::Tensor s, torch::Tensor scale, torch::Tensor out, torch::Tensor out_t,
                      bool in_e5m2, bool out_e5m2, int64_t act) {
    check(q, "q", at::kByte);
    TORCH_CHECK(q.size(0) % 16 == 0 && q.size(1) % 32 == 0, "q must be [m, 2i], m, i % 16 == 0");
    coat_quant::silu_mul_rebuild(q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                 opt_u8(out), opt_u8(out_t), q.size(0), q.size(1) / 2, in_e5m2, out_e5m2,
                                 gated_act(act), stream());
}

void silu_mul_backward(torch::Tensor da, torch::Tensor q, torch::Tensor s, torch::Tensor dgu, torch::Tensor amax,
                       bool in_e5m2, int64_t act) {
    check(da, "da", at::kBFloat16);
    check(q, "q", at::kByte);
    check(dgu, "dgu", at::kBFloat16);
    coat_quant::silu_mul_backward(da.data_ptr(), q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), dgu.data_ptr(),
                                  amax.data_ptr<float>(), q.size(0), q.size(1) / 2, in_e5m2, gated_act(act), stream());
}

void tensor_scale(torch::Tensor amax, torch::Tensor scale, bool e5m2) {
    check(amax, "amax", at::kFloat);
    check(scale, "scale", at::kFloat);
    coat_quant::tensor_scale(amax.data_ptr<float>(), amax.numel(), scale.data_ptr<float>(), e5m2, stream());
}

void rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q, torch::Tensor k,
              torch::Tensor v, int64_t nh, int64_t nkv, int64_t hd) {
    for (auto* t : {&qkv, &cos, &sin, &q, &k, &v}) check(*t, "rope tensor", at::kBFloat16);
    TORCH_CHECK(hd % 16 == 0 && q.dim() == 4, "rope: head_dim % 16 == 0 and q [b, s, h, d]");
    coat_quant::rope_qkv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                         q.size(0), q.size(1), (int)nh, (int)nkv, (int)hd, cos.size(0) != 1, stream());
}

void rope_qkv_backward(torch::Tensor dq, torch::Tensor dk, torch::Tensor dv, torch::Tensor cos, torch::Tensor sin,
                       torch::Tensor dqkv, int64_t nh, int64_t nkv, int64_t hd) {
    for (auto* t : {&dq, &dk, &dv, &cos, &sin, &dqkv}) check(*t, "rope tensor", at::kBFloat16);
    coat_quant::rope_qkv_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                  dqkv.data_ptr(), dq.size(0), dq.size(1), (int)nh, (int)nkv, (int)hd,
                                  cos.size(0) != 1, stream());
}

void xent_forward(torch::Tensor x, torch::Tensor target, torch::Tensor lse, torch::Tensor picked) {
    check(x, "logits", at::kBFloat16);
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 8 == 0, "logits must be [m, n] with n % 8 == 0");
    check_rows(target, "target", at::kLong, x.size(0));
    check_rows(lse, "lse", at::kFloat, x.size(0));
    check_rows(picked, "picked", at::kFloat, x.size(0));
    coat_quant::xent_forward(x.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr<float>(), picked.data_ptr<float>(),
                             x.size(0), x.size(1), stream());
}

void xent_backward(torch::Tensor x, torch::Tensor lse, torch::Tensor target, torch::Tensor scale) {
    check(x, "logits", at::kBFloat16);
    TORCH_CHECK(x.dim() == 2 && x.size(1) % 8 == 0, "logits must be [m, n] with n % 8 == 0");
    check_rows(lse, "lse", at::kFloat, x.size(0));
    check_rows(target, "target", at::kLong, x.size(0));
    check_rows(scale, "scale", at::kFloat, x.size(0));
    coat_quant::xent_backward(x.data_ptr(), lse.data_ptr<float>(), target.data_ptr<int64_t>(), scale.data_ptr<float>(),
                              x.size(0), x.size(1), stream());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("row_amax", &row_amax, "per-row max |x| (bf16)");
    m.def("quant_tensor", &quant_tensor, "per-tensor FP8, row-major and/or transposed");
    m.def("rmsnorm_quant", &rmsnorm_quant, "RMSNorm pass 1: FP8 input, rstd, output row maxima");
    m.def("rmsnorm_rebuild", &rmsnorm_rebuild, "RMSNorm output as a per-tensor FP8 operand");
    m.def("rmsnorm_backward", &rmsnorm_backward, "RMSNorm backward from the saved FP8 input");
    m.def("silu_mul_quant", &silu_mul_quant, "act(g)*u pass 1: FP8 gate/up, output row maxima");
    m.def("group_dequant", &group_dequant, "bf16 of FP8 codes with one power-of-two exponent per 16");
    m.def("silu_mul_rebuild", &silu_mul_rebuild, "act(g) u as a per-tensor FP8 operand");
    m.def("silu_mul_backward", &silu_mul_backward, "act(g)*u backward from the saved FP8 gate/up");
    m.def("tensor_scale", &tensor_scale, "per-tensor power-of-two scale from row maxima");
    m.def("rope_qkv", &rope_qkv, "RoPE of the fused q/k/v output into [b, h, s, d] q, k, v");
    m.def("rope_qkv_backward", &rope_qkv_backward, "RoPE backward into d(qkv)");
    m.def("xent_forward", &xent_forward, "logsumexp and target logit of each row of bf16 logits");
    m.def("xent_backward", &xent_backward, "cross-entropy gradient over bf16 logits, in place");
}
