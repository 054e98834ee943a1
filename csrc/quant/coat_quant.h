// Launchers of the FP8 activation kernels (coat_ds/kernels/quant_reference.py is the source of truth).
// Raw pointers and a stream only: this header is shared by the CUDA file and the torch binding.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace coat_quant {

// out[m] = max_n |x[m, n]| (bf16 in, fp32 out); n % 8 == 0
void row_amax(const void* x, float* out, int64_t m, int64_t n, cudaStream_t s);

// Per-tensor FP8 of a bf16 [m, n] with the power-of-two scale *scale: out [m, n] and/or out_t [n, m]
// (out_t rows ld_t apart, so a weight's transpose can land in the columns of a fused operand)
void quant_tensor(const void* x, const float* scale, uint8_t* out, uint8_t* out_t, int64_t m, int64_t n,
                  int64_t ld_t, bool e5m2, cudaStream_t s);

// RMSNorm pass 1: x bf16 [m, n], w bf16 [n] -> xq [m, n], xs [m, n/16], rstd [m]; optional (nullptr: not
// written): ymax [m] (row maxima of the output rebuilt from xq), y bf16 [m, n] (the output, from x)
void rmsnorm_quant(const void* x, const void* w, float eps, uint8_t* xq, uint8_t* xs, float* rstd, float* ymax,
                   void* y, int64_t m, int64_t n, bool e5m2, cudaStream_t s);

// RMSNorm pass 2 (forward and backward): y = deq(xq) rstd w as per-tensor FP8, [m, n] and/or [n, m]
void rmsnorm_rebuild(const uint8_t* xq, const uint8_t* xs, const float* rstd, const void* w, const float* scale,
                     uint8_t* out, uint8_t* out_t, int64_t m, int64_t n, bool in_e5m2, bool out_e5m2,
                     cudaStream_t s);

// RMSNorm backward: dx = rstd (dy w - xh mean(dy w xh)) (+ dres), dw += sum_rows dy xh (dw zeroed by caller)
void rmsnorm_backward(const void* dy, const uint8_t* xq, const uint8_t* xs, const float* rstd, const void* w,
                      const void* dres, void* dx, float* dw, int64_t m, int64_t n, bool in_e5m2, cudaStream_t s);

// The gated activation act of act(gate) * up; values are indices into quant_reference.GATED_ACTS.
enum class GatedAct : int { kSilu = 0, kGeluTanh = 1 };

// act(g)*u pass 1 on gu bf16 [m, 2i] = [gate | up]: q [m, 2i], s [m, 2i/16], amax [m] of act(g) u
void silu_mul_quant(const void* gu, uint8_t* q, uint8_t* sc, float* amax, int64_t m, int64_t i, bool e5m2,
                    GatedAct act, cudaStream_t s);

// Group dequantisation: out bf16 [n] = fp8(q) 2^(s - bias), one uint8 exponent s per 16 codes; n % 16 == 0
void group_dequant(const uint8_t* q, const uint8_t* sc, void* out, int64_t n, bool e5m2, cudaStream_t s);

// act(g)*u pass 2: a = act(g) u as per-tensor FP8, [m, i] and/or [i, m]
void silu_mul_rebuild(const uint8_t* q, const uint8_t* sc, const float* scale, uint8_t* out, uint8_t* out_t,
                      int64_t m, int64_t i, bool in_e5m2, bool out_e5m2, GatedAct act, cudaStream_t s);

// act(g)*u backward: dgu bf16 [m, 2i] and its row maxima from da bf16 [m, i]
void silu_mul_backward(const void* da, const uint8_t* q, const uint8_t* sc, void* dgu, float* amax, int64_t m,
                       int64_t i, bool in_e5m2, GatedAct act, cudaStream_t s);

// The per-tensor scale 2^p from per-row maxima (reference.tensor_scale): one block, no host sync
void tensor_scale(const float* amax_rows, int64_t m, float* scale, bool e5m2, cudaStream_t s);

// RoPE on the fused q/k/v output: qkv [b*s, (nh + 2 nkv) hd] -> q [b, nh, s, hd], k, v [b, nkv, s, hd];
// cos/sin [b or 1, s, hd] (cs_batched: b). hd % 16 == 0.
void rope_qkv(const void* qkv, const void* cos, const void* sin, void* q, void* k, void* v, int64_t batch,
              int64_t seq, int nh, int nkv, int hd, bool cs_batched, cudaStream_t s);
void rope_qkv_backward(const void* dq, const void* dk, const void* dv, const void* cos, const void* sin, void* dqkv,
                       int64_t batch, int64_t seq, int nh, int nkv, int hd, bool cs_batched, cudaStream_t s);

// Cross-entropy of bf16 logits [m, n], n % 8 == 0: lse[i] = logsumexp(x[i]), picked[i] = x[i, target[i]]
void xent_forward(const void* x, const int64_t* target, float* lse, float* picked, int64_t m, int64_t n,
                  cudaStream_t s);
// Its gradient over the logits, in place: x[i, j] = (exp(x[i, j] - lse[i]) - [j == target[i]]) scale[i]
void xent_backward(void* x, const float* lse, const int64_t* target, const float* scale, int64_t m, int64_t n,
                   cudaStream_t s);

}  // namespace coat_quant
