// Torch bindings of the CUDA FP8 AdamW op: checks, the cached device table of a multi-tensor step, launches.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <list>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "coat_adam_common.h"
#include "coat_adam_cuda.h"

namespace {

void check_cuda(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, "coat_adam: ", what, " failed: ", cudaGetErrorString(err));
}

// Device copies of AdamTensor tables, keyed on everything they hold (pointers, sizes, rounding streams,
// group size): an optimizer that steps the same tensors every iteration uploads its table once. A few
// entries, since each param group (and grad dtype / master) of an optimizer has its own.
class TableCache {
  public:
    const coat::AdamTensor* get(const std::vector<coat::AdamTensor>& host, int64_t group_size,
                                     const torch::Device& device, cudaStream_t stream) {
        std::vector<int64_t> key;
        key.reserve(host.size() * 13 + 2);
        key.push_back(group_size);
        key.push_back(device.index());
        for (const auto& t : host) {
            const void* ptrs[] = {t.param, t.grad, t.m_codes, t.m_scale, t.m_expo, t.v_codes, t.v_scale, t.v_expo,
                                  t.bf16_out, t.remainder};
            for (const void* p : ptrs) key.push_back(reinterpret_cast<int64_t>(p));
            key.push_back(t.numel);
            key.push_back(t.sr_stream);
            key.push_back(t.sr_offset);
        }
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = entries_.begin(); it != entries_.end(); ++it) {
            if (it->first == key) {
                entries_.splice(entries_.begin(), entries_, it);  // most recently used first
                return static_cast<const coat::AdamTensor*>(entries_.front().second.data_ptr());
            }
        }
        const int64_t bytes = (int64_t)(host.size() * sizeof(coat::AdamTensor));
        torch::Tensor dev = torch::empty({bytes}, torch::dtype(torch::kUInt8).device(device));
        // pageable source: the copy is staged before this call returns, so `host` may go away
        check_cuda(cudaMemcpyAsync(dev.data_ptr(), host.data(), bytes, cudaMemcpyHostToDevice, stream),
                   "table upload");
        entries_.emplace_front(std::move(key), dev);
        if (entries_.size() > kMaxEntries) entries_.pop_back();
        return static_cast<const coat::AdamTensor*>(dev.data_ptr());
    }

  private:
    static constexpr size_t kMaxEntries = 16;
    std::list<std::pair<std::vector<int64_t>, torch::Tensor>> entries_;
    std::mutex mutex_;
};

TableCache& table_cache() {
    static TableCache* cache = new TableCache();  // never destroyed: CUDA may be gone at exit
    return *cache;
}

// One launch for the tensors of one (grad dtype, master): the kernel is specialised on both.
void launch_group(const std::vector<coat::AdamTensor>& refs, coat::Dtype grad_dtype, coat::Master master,
                  const coat::AdamCoefs& c, const float* grad_scale, uint32_t sr_prefix, int64_t group_size,
                  bool v_e5m2, bool expansion, const torch::Device& device, cudaStream_t stream) {
    std::vector<coat::AdamTensor> host;
    int64_t groups = 0;
    for (const auto& r : refs) {
        if (r.grad_dtype != grad_dtype || r.master != master || r.numel == 0) continue;
        coat::AdamTensor t = r;
        t.group_begin = groups;
        t.vec_ok = coat_cuda::adam_vector_aligned(t) ? 1 : 0;
        host.push_back(t);
        groups += (r.numel + group_size - 1) / group_size;
    }
    if (host.empty()) return;
    const coat::AdamTensor* table = table_cache().get(host, group_size, device, stream);
    check_cuda(coat_cuda::adam_step(table, (int)host.size(), groups, (int)group_size, grad_dtype, master, c,
                                    grad_scale, sr_prefix, v_e5m2, expansion, stream),
               "adam_step launch");
}

void adam_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<torch::Tensor>& m_q, const std::vector<torch::Tensor>& m_scale,
               const std::vector<torch::Tensor>& m_expo, const std::vector<torch::Tensor>& v_q,
               const std::vector<torch::Tensor>& v_scale, const std::vector<torch::Tensor>& v_expo,
               const std::vector<torch::Tensor>& bf16_out, const std::vector<torch::Tensor>& remainders, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, int64_t group_size, bool v_e5m2, bool expansion,
               const std::optional<torch::Tensor>& grad_scale_t, double grad_scale,
               const std::vector<int64_t>& sr_keys, int64_t sr_seed) {
    const auto refs = coat_ops::check_adam_args(params, grads, m_q, m_scale, m_expo, v_q, v_scale, v_expo, bf16_out,
                                                remainders, sr_keys, group_size, /*cuda=*/true);
    if (refs.empty()) return;
    coat_ops::check_grad_scale(grad_scale_t, params);
    // a tensor scale stays on the device (the kernel reads it: no host sync); a float travels in the coefs
    const coat::AdamCoefs c = coat_ops::adam_coefs(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    const float* scale_ptr = grad_scale_t.has_value() ? grad_scale_t->data_ptr<float>() : nullptr;
    const uint32_t sr_prefix = coat::sr_prefix((uint64_t)sr_seed, (uint64_t)step);
    const torch::Device device = params[0].device();
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    // one launch per (grad dtype, master) present, in the order they first appear
    std::vector<std::pair<coat::Dtype, coat::Master>> kinds;
    for (const auto& r : refs) {
        const std::pair<coat::Dtype, coat::Master> k{r.grad_dtype, r.master};
        if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
    }
    for (const auto& [gd, ms] : kinds) {
        launch_group(refs, gd, ms, c, scale_ptr, sr_prefix, group_size, v_e5m2, expansion, device, stream);
    }
}

void quantize(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
              const torch::Tensor& expo, int64_t group_size, bool e5m2, bool expansion) {
    coat_ops::check_quant_args(x, codes, scale, expo, group_size, /*cuda=*/true);
    const c10::cuda::CUDAGuard guard(x.device());
    check_cuda(coat_cuda::quantize(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                   expo.data_ptr<float>(), x.numel(), (int)group_size, e5m2, expansion,
                                   c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "quantize launch");
}

void dequantize(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& expo,
                const torch::Tensor& out, int64_t group_size, bool e5m2) {
    coat_ops::check_dequant_args(codes, scale, expo, out, group_size, /*cuda=*/true);
    const c10::cuda::CUDAGuard guard(codes.device());
    check_cuda(coat_cuda::dequantize(codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), expo.data_ptr<float>(),
                                     out.data_ptr<float>(), codes.numel(), (int)group_size, e5m2,
                                     c10::cuda::getCurrentCUDAStream(codes.device().index()).stream()),
               "dequantize launch");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "coat_ds FP8 AdamW step and group (de)quantisation (CUDA)";
    m.def("adam_step", &adam_step,
          "Fused FP8 AdamW step over lists of tensors (in place, one launch per (grad dtype, master dtype))");
    m.def("quantize", &quantize, "Group-quantise fp32 x into FP8 codes + per-group scale and exponent");
    m.def("dequantize", &dequantize, "FP8 codes + per-group scale and exponent -> fp32");
}
