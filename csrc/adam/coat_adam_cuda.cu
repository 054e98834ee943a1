// Fused FP8 AdamW step (dequantise m, v -> AdamW update -> per-group range -> re-quantise), plus group
// (de)quantisation, on CUDA. Memory-bound: one read and one write of every byte, nothing else.
//
// Layout: 256-thread blocks; a group of G values is handled by G/8 lanes of one warp, 8 values per thread
// (two chunks of 4, half a group apart, so every 16-byte access of a segment is contiguous), so a warp
// holds 256/G groups. The group's max/min reduce
// over its lanes with shuffles. Each segment finds its tensor in a device table (multi-tensor launch:
// one launch per param group), blocks are persistent and stride over the groups.
#include <cfloat>
#include <type_traits>

#include "coat_adam_cuda.h"
#include "coat_fp8.cuh"

namespace coat_cuda {
namespace {

using coat::AdamTensor;
using coat::DeviceMath;
using coat::DeviceMathFtz;  // the fused step (see coat_fp8.cuh); quantize/dequantize keep subnormals
using coat::Dtype;
using coat::GroupScale;
using coat::Master;

constexpr int kThreads = 256;

template <int G>
struct Tile {
    static constexpr int kVpt = 8;                  // values per thread: per-group work is shared by G/8 lanes
    static constexpr int kWords = kVpt / 4;        // 4-code words per thread
    static constexpr int kLanes = G / kVpt;        // lanes per group
    static constexpr int kGroupsPerBlock = kThreads / kLanes;
};

// Index of the tensor holding global group gid: the last entry whose group_begin <= gid.
__device__ __forceinline__ int find_tensor(const AdamTensor* __restrict__ t, int n, int64_t gid) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (__ldg(&t[mid].group_begin) <= gid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

__device__ __forceinline__ uint32_t code_at(const uint32_t* words, int j) { return (words[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

// Chunk access: 4 consecutive values at element `at`, of which n (0..4) exist. vec: all 4 exist and the
// pointer is aligned, so one vector access (streaming: every byte is touched once) does; else one per value.
// Every memory stream of the step goes through these, so the kernel body has no vector/scalar copies.

// Four values of dtype K, widened to fp32 (zeros past n).
template <Dtype K>
__device__ __forceinline__ void load4(const void* p, int64_t at, int n, bool vec, float out[4]) {
    if (vec) {
        if constexpr (K == Dtype::kF32) {
            const float4 x = coat::load_f32x4_stream(static_cast<const float*>(p) + at);
            out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
        } else {
            const uint2 u = __ldcs(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + at));
            out[0] = coat::to_f32<K>(u.x & 0xFFFFu), out[1] = coat::to_f32<K>(u.x >> 16);
            out[2] = coat::to_f32<K>(u.y & 0xFFFFu), out[3] = coat::to_f32<K>(u.y >> 16);
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) out[r] = r < n ? coat::load_value<K>(p, at + r) : 0.0f;
}

// Four raw 16-bit values, each in the low half of a word (zeros past n).
__device__ __forceinline__ void load4_u16(const uint16_t* p, int64_t at, int n, bool vec, uint32_t out[4]) {
    if (vec) {
        const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p + at));
        out[0] = u.x & 0xFFFFu, out[1] = u.x >> 16, out[2] = u.y & 0xFFFFu, out[3] = u.y >> 16;
        return;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) out[r] = r < n ? (uint32_t)p[at + r] : 0u;
}

// Four master values as fp32: a remainder master's bf16 high halves joined with its remainders (exact).
template <Master MS>
__device__ __forceinline__ void load_master4(const AdamTensor& t, int64_t at, int n, bool vec, float out[4]) {
    if constexpr (MS == Master::kF32Rem) {
        uint32_t hi[4], lo[4];
        load4_u16(static_cast<const uint16_t*>(t.param), at, n, vec, hi);
        load4_u16(t.remainder, at, n, vec, lo);
#pragma unroll
        for (int r = 0; r < 4; ++r) out[r] = __uint_as_float(coat::remainder_join(hi[r], lo[r]));
    } else {
        load4<coat::master_dtype(MS)>(t.param, at, n, vec, out);
    }
}

// Four raw values of dtype K (fp32 bits, or 16-bit ones in the low half).
template <Dtype K>
__device__ __forceinline__ void store4(void* p, int64_t at, int n, bool vec, const uint32_t b[4]) {
    if (vec) {
        if constexpr (K == Dtype::kF32) {
            __stcs(reinterpret_cast<uint4*>(static_cast<float*>(p) + at), make_uint4(b[0], b[1], b[2], b[3]));
        } else {
            __stcs(reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + at),
                   make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16)));
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        if (r >= n) continue;
        if constexpr (K == Dtype::kF32) {
            static_cast<uint32_t*>(p)[at + r] = b[r];
        } else {
            static_cast<uint16_t*>(p)[at + r] = (uint16_t)b[r];
        }
    }
}

// Four FP8 codes as one little-endian word (zeros past n).
__device__ __forceinline__ uint32_t load_codes4(const uint8_t* p, int64_t at, int n, bool vec) {
    if (vec) return coat::load_u8x4(p + at);
    uint32_t w = 0u;
#pragma unroll
    for (int r = 0; r < 4; ++r) w |= r < n ? (uint32_t)p[at + r] << (8 * r) : 0u;
    return w;
}

__device__ __forceinline__ void store_codes4(uint8_t* p, int64_t at, int n, bool vec, uint32_t w) {
    if (vec) {
        coat::store_u8x4(p + at, w);
        return;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        if (r < n) p[at + r] = (uint8_t)(w >> (8 * r));
    }
}

// One kernel body for every (group size, grad dtype, master): GD and MS only change how values are read and
// how the master is written back.
template <int G, Dtype GD, Master MS>
__global__ void __launch_bounds__(kThreads, 4) adam_kernel(const AdamTensor* __restrict__ tensors, int n_tensors,
                                                        int64_t total_groups, const coat::AdamCoefs c,
                                                        const float* __restrict__ grad_scale, uint32_t sr_prefix,
                                                        bool v_e5m2, bool expansion) {
    using T = Tile<G>;
    constexpr int V = T::kVpt;
    constexpr int W = T::kWords;
    constexpr Dtype PD = coat::master_dtype(MS);
    // chunk q (4 values) of a lane starts at q * G/W + 4 * lane within the group: each load/store
    // instruction of a segment covers one contiguous span (full 32-byte sectors, no holes)
    constexpr int kChunkStride = G / W;
    const float scale = grad_scale != nullptr ? __ldg(grad_scale) : c.grad_scale;  // on the device: no host sync
    if (!isfinite(scale)) return;  // the convention of a skipped step (every thread alike): change nothing
    __shared__ float s_log2_m[128];
    __shared__ float s_log2_v[128];
    for (int i = threadIdx.x; i < 128; i += blockDim.x) {
        s_log2_m[i] = coat::log2_abs_code_table(i, false);
        s_log2_v[i] = coat::log2_abs_code_table(i, v_e5m2);
    }
    __syncthreads();

    const int seg = threadIdx.x / T::kLanes;
    const int lane = threadIdx.x % T::kLanes;
    const int64_t stride = (int64_t)gridDim.x * T::kGroupsPerBlock;
    for (int64_t first = (int64_t)blockIdx.x * T::kGroupsPerBlock; first < total_groups; first += stride) {
        const int64_t gid = first + seg;
        const bool active = gid < total_groups;
        AdamTensor t = {};
        int64_t lg = 0, base = 0;
        int n_valid[W];  // valid values (0..4) of each chunk; 0 everywhere for an inactive lane
#pragma unroll
        for (int q = 0; q < W; ++q) n_valid[q] = 0;
        bool vec = false;
        float ms = 0.0f, me = 1.0f, vs = 0.0f, ve = 1.0f;
        if (active) {
            t = tensors[n_tensors == 1 ? 0 : find_tensor(tensors, n_tensors, gid)];  // an L1 hit after the first
            lg = gid - t.group_begin;
            const int64_t goff = lg * G;
            base = goff + 4 * lane;
#pragma unroll
            for (int q = 0; q < W; ++q) {
                const int64_t rem = t.numel - (base + q * kChunkStride);
                n_valid[q] = rem <= 0 ? 0 : (rem >= 4 ? 4 : (int)rem);
            }
            vec = t.vec_ok && t.numel - goff >= G;
            ms = t.m_scale[lg];
            me = t.m_expo[lg];
            vs = t.v_scale[lg];
            ve = t.v_expo[lg];
        }

        float p[V], g[V], m[V], v[V];
        uint32_t mw[W], vw[W];
#pragma unroll
        for (int q = 0; q < W; ++q) {
            const int64_t at = base + q * kChunkStride;
            load_master4<MS>(t, at, n_valid[q], vec, p + 4 * q);
            load4<GD>(t.grad, at, n_valid[q], vec, g + 4 * q);
            mw[q] = load_codes4(t.m_codes, at, n_valid[q], vec);
            vw[q] = load_codes4(t.v_codes, at, n_valid[q], vec);
        }

        // dequantise, update, and track each moment's largest / smallest non-zero magnitude
        const GroupScale sm = coat::stored_scale<DeviceMathFtz>(ms, me);
        const GroupScale sv = coat::stored_scale<DeviceMathFtz>(vs, ve);
        float m_big = 0.0f, m_small = COAT_F32_INF, v_big = 0.0f, v_small = COAT_F32_INF;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const uint32_t mc = code_at(mw, j), vc = code_at(vw, j);
            m[j] = coat::dequant_value<DeviceMathFtz>((uint8_t)mc, s_log2_m[mc & 0x7Fu], sm);
            v[j] = coat::dequant_value<DeviceMathFtz>((uint8_t)vc, s_log2_v[vc & 0x7Fu], sv);
            coat::adam_update<DeviceMathFtz>(p[j], coat::mul_rn(g[j], scale), m[j], v[j], c);
            // The MUFU math below flushes subnormals: a subnormal moment kept as the group's smallest
            // value would read as log2 = -inf, drive k to its minimum and d below FLT_MIN (0), zeroing the
            // whole group next step (v = 0 under a live m: an m/eps update). Flush such moments here.
            m[j] = fabsf(m[j]) < FLT_MIN ? 0.0f : m[j];
            v[j] = v[j] < FLT_MIN ? 0.0f : v[j];
            if ((j & 3) < n_valid[j >> 2]) {
                const float am = fabsf(m[j]), av = fabsf(v[j]);
                m_big = fmaxf(m_big, am);
                v_big = fmaxf(v_big, av);
                m_small = fminf(m_small, am > 0.0f ? am : COAT_F32_INF);
                v_small = fminf(v_small, av > 0.0f ? av : COAT_F32_INF);
            }
        }

        // the master in its dtype (a bf16 one rounded here), and the bf16 copy
        const uint32_t key = MS == Master::kBf16Sr ? coat::sr_key(sr_prefix, (uint64_t)t.sr_stream) : 0u;
        // (vec as a compile-time constant here: ptxas keeps this part in registers only then)
        auto store_master = [&](auto vec_c) {
#pragma unroll
            for (int q = 0; q < W; ++q) {
                const int64_t at = base + q * kChunkStride;
                uint32_t b[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) b[r] = coat::master_bits<MS>(p[4 * q + r], key, (uint64_t)(t.sr_offset + at + r));
                if constexpr (MS == Master::kF32Rem) {  // low halves to the remainder, high halves to the param
                    uint32_t lo[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) lo[r] = b[r] & 0xFFFFu;
                    store4<Dtype::kBf16>(t.remainder, at, n_valid[q], decltype(vec_c)::value, lo);
#pragma unroll
                    for (int r = 0; r < 4; ++r) b[r] = coat::remainder_hi(b[r]);
                    store4<PD>(t.param, at, n_valid[q], decltype(vec_c)::value, b);
                    if (t.bf16_out != nullptr) store4<Dtype::kBf16>(t.bf16_out, at, n_valid[q], decltype(vec_c)::value, b);
                    continue;
                }
                store4<PD>(t.param, at, n_valid[q], decltype(vec_c)::value, b);
                if (t.bf16_out != nullptr) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) b[r] = coat::bf16_copy<MS>(b[r]);
                    store4<Dtype::kBf16>(t.bf16_out, at, n_valid[q], decltype(vec_c)::value, b);
                }
            }
        };
        vec ? store_master(std::true_type{}) : store_master(std::false_type{});

        m_big = coat::segment_max<T::kLanes>(m_big);
        v_big = coat::segment_max<T::kLanes>(v_big);
        m_small = coat::segment_min<T::kLanes>(m_small);
        v_small = coat::segment_min<T::kLanes>(v_small);
        const GroupScale qm = coat::group_scale<DeviceMathFtz>(m_big, m_small, false, expansion);
        const GroupScale qv = coat::group_scale<DeviceMathFtz>(v_big, v_small, v_e5m2, expansion);
        if (active && lane == 0) {
            t.m_scale[lg] = qm.d;
            t.m_expo[lg] = qm.k;
            t.v_scale[lg] = qv.d;
            t.v_expo[lg] = qv.k;
        }

#pragma unroll
        for (int q = 0; q < W; ++q) {
            const int64_t at = base + q * kChunkStride;
            store_codes4(t.m_codes, at, n_valid[q], vec,
                              coat::fp8x4_encode<false>(coat::expand_value<DeviceMathFtz>(m[4 * q], qm),
                                                        coat::expand_value<DeviceMathFtz>(m[4 * q + 1], qm),
                                                        coat::expand_value<DeviceMathFtz>(m[4 * q + 2], qm),
                                                        coat::expand_value<DeviceMathFtz>(m[4 * q + 3], qm)));
            store_codes4(t.v_codes, at, n_valid[q], vec,
                              coat::fp8x4_encode(coat::expand_value<DeviceMathFtz>(v[4 * q], qv),
                                                 coat::expand_value<DeviceMathFtz>(v[4 * q + 1], qv),
                                                 coat::expand_value<DeviceMathFtz>(v[4 * q + 2], qv),
                                                 coat::expand_value<DeviceMathFtz>(v[4 * q + 3], qv), v_e5m2));
        }
    }
}

template <int G>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const float* __restrict__ x, uint8_t* __restrict__ codes,
                                                            float* __restrict__ scale, float* __restrict__ expo,
                                                            int64_t numel, int64_t n_groups, bool e5m2,
                                                            bool expansion) {
    using T = Tile<G>;
    constexpr int V = T::kVpt;
    const int seg = threadIdx.x / T::kLanes;
    const int lane = threadIdx.x % T::kLanes;
    const int64_t stride = (int64_t)gridDim.x * T::kGroupsPerBlock;
    for (int64_t first = (int64_t)blockIdx.x * T::kGroupsPerBlock; first < n_groups; first += stride) {
        const int64_t gid = first + seg;
        const int64_t off = gid * G + (int64_t)lane * V;
        const int64_t rem = gid < n_groups ? numel - off : 0;
        const int n_valid = rem <= 0 ? 0 : (rem >= V ? V : (int)rem);
        float xv[V];
        float big = 0.0f, small = COAT_F32_INF;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            xv[j] = j < n_valid ? x[off + j] : 0.0f;
            const float a = fabsf(xv[j]);
            big = fmaxf(big, a);
            small = fminf(small, a > 0.0f ? a : COAT_F32_INF);
        }
        big = coat::segment_max<T::kLanes>(big);
        small = coat::segment_min<T::kLanes>(small);
        const GroupScale s = coat::group_scale<DeviceMath>(big, small, e5m2, expansion);
        if (gid < n_groups && lane == 0) {
            scale[gid] = s.d;
            expo[gid] = s.k;
        }
#pragma unroll
        for (int q = 0; q < T::kWords; ++q) {
            const uint32_t w = coat::fp8x4_encode(
                coat::expand_value<DeviceMath>(xv[4 * q], s), coat::expand_value<DeviceMath>(xv[4 * q + 1], s),
                coat::expand_value<DeviceMath>(xv[4 * q + 2], s), coat::expand_value<DeviceMath>(xv[4 * q + 3], s),
                e5m2);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                if (4 * q + b < n_valid) codes[off + 4 * q + b] = (uint8_t)(w >> (8 * b));
            }
        }
    }
}

template <int G>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ codes,
                                                              const float* __restrict__ scale,
                                                              const float* __restrict__ expo, float* __restrict__ out,
                                                              int64_t numel, int64_t n_groups, bool e5m2) {
    using T = Tile<G>;
    constexpr int V = T::kVpt;
    __shared__ float s_log2[128];
    for (int i = threadIdx.x; i < 128; i += blockDim.x) s_log2[i] = coat::log2_abs_code_table(i, e5m2);
    __syncthreads();
    const int seg = threadIdx.x / T::kLanes;
    const int lane = threadIdx.x % T::kLanes;
    const int64_t stride = (int64_t)gridDim.x * T::kGroupsPerBlock;
    for (int64_t first = (int64_t)blockIdx.x * T::kGroupsPerBlock; first < n_groups; first += stride) {
        const int64_t gid = first + seg;
        if (gid >= n_groups) continue;  // no shuffles below: inactive lanes may leave
        const GroupScale s = coat::stored_scale<DeviceMath>(scale[gid], expo[gid]);
        const int64_t off = gid * G + (int64_t)lane * V;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (off + j < numel) {
                const uint8_t c = codes[off + j];
                out[off + j] = coat::dequant_value<DeviceMath>(c, s_log2[c & 0x7F], s);
            }
        }
    }
}

// Persistent grid: as many blocks as fit on the device at once, never more than there are tiles.
// blocks_per_sm caches the occupancy of this kernel (0: not asked yet).
template <typename Kernel>
cudaError_t grid_size(Kernel kernel, int64_t tiles, int& blocks_per_sm, int* grid) {
    if (blocks_per_sm == 0) {
        const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, 0);
        if (err != cudaSuccess) return err;
        if (blocks_per_sm < 1) blocks_per_sm = 1;
    }
    int dev = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    const int64_t resident = (int64_t)sms * blocks_per_sm;
    *grid = (int)(tiles < resident ? tiles : resident);
    return cudaSuccess;
}

template <int G, Dtype GD, Master MS>
cudaError_t launch_adam(const AdamTensor* tensors, int n_tensors, int64_t total_groups, const coat::AdamCoefs& c,
                        const float* grad_scale, uint32_t sr_prefix, bool v_e5m2, bool expansion, cudaStream_t stream) {
    int grid = 0;
    const int64_t tiles = (total_groups + Tile<G>::kGroupsPerBlock - 1) / Tile<G>::kGroupsPerBlock;
    static int occupancy = 0;
    cudaError_t err = grid_size(adam_kernel<G, GD, MS>, tiles, occupancy, &grid);
    if (err != cudaSuccess) return err;
    adam_kernel<G, GD, MS><<<grid, kThreads, 0, stream>>>(tensors, n_tensors, total_groups, c, grad_scale, sr_prefix,
                                                           v_e5m2, expansion);
    return cudaGetLastError();
}

template <int G>
cudaError_t launch_quantize(const float* x, uint8_t* codes, float* scale, float* expo, int64_t numel, bool e5m2,
                            bool expansion, cudaStream_t stream) {
    const int64_t n_groups = (numel + G - 1) / G;
    int grid = 0;
    static int occupancy = 0;
    cudaError_t err = grid_size(quantize_kernel<G>, (n_groups + Tile<G>::kGroupsPerBlock - 1) / Tile<G>::kGroupsPerBlock,
                                occupancy, &grid);
    if (err != cudaSuccess) return err;
    quantize_kernel<G><<<grid, kThreads, 0, stream>>>(x, codes, scale, expo, numel, n_groups, e5m2, expansion);
    return cudaGetLastError();
}

template <int G>
cudaError_t launch_dequantize(const uint8_t* codes, const float* scale, const float* expo, float* out, int64_t numel,
                              bool e5m2, cudaStream_t stream) {
    const int64_t n_groups = (numel + G - 1) / G;
    int grid = 0;
    static int occupancy = 0;
    cudaError_t err = grid_size(dequantize_kernel<G>, (n_groups + Tile<G>::kGroupsPerBlock - 1) / Tile<G>::kGroupsPerBlock,
                                occupancy, &grid);
    if (err != cudaSuccess) return err;
    dequantize_kernel<G><<<grid, kThreads, 0, stream>>>(codes, scale, expo, out, numel, n_groups, e5m2);
    return cudaGetLastError();
}

bool aligned(const void* p, uintptr_t bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool adam_vector_aligned(const AdamTensor& t) {
    return aligned(t.param, t.master == Master::kF32 ? 16 : 8) && aligned(t.grad, t.grad_dtype == Dtype::kF32 ? 16 : 8) &&
           aligned(t.m_codes, 4) && aligned(t.v_codes, 4) && aligned(t.bf16_out, 8) && aligned(t.remainder, 8);
}

cudaError_t adam_step(const AdamTensor* tensors, int n_tensors, int64_t total_groups, int group_size,
                      Dtype grad_dtype, Master master, const coat::AdamCoefs& c, const float* grad_scale,
                      uint32_t sr_prefix, bool v_e5m2, bool expansion, cudaStream_t stream) {
    if (n_tensors == 0 || total_groups == 0) return cudaSuccess;
    cudaError_t err = cudaErrorInvalidValue;
    coat::with_step_types(grad_dtype, master, [&](auto gd, auto ms) {
        constexpr Dtype GD = decltype(gd)::value;
        constexpr Master MS = decltype(ms)::value;
        switch (group_size) {
#define COAT_ADAM_CASE(G)                                                                                       \
    case G:                                                                                                     \
        err = launch_adam<G, GD, MS>(tensors, n_tensors, total_groups, c, grad_scale, sr_prefix, v_e5m2, expansion, \
                                     stream);                                                                   \
        break;
            COAT_ADAM_CASE(32)
            COAT_ADAM_CASE(64)
            COAT_ADAM_CASE(128)
            COAT_ADAM_CASE(256)
#undef COAT_ADAM_CASE
            default:
                break;
        }
    });
    return err;
}

cudaError_t quantize(const float* x, uint8_t* codes, float* scale, float* expo, int64_t numel, int group_size,
                     bool e5m2, bool expansion, cudaStream_t stream) {
    if (numel == 0) return cudaSuccess;
    switch (group_size) {
        case 32: return launch_quantize<32>(x, codes, scale, expo, numel, e5m2, expansion, stream);
        case 64: return launch_quantize<64>(x, codes, scale, expo, numel, e5m2, expansion, stream);
        case 128: return launch_quantize<128>(x, codes, scale, expo, numel, e5m2, expansion, stream);
        case 256: return launch_quantize<256>(x, codes, scale, expo, numel, e5m2, expansion, stream);
        default: return cudaErrorInvalidValue;
    }
}

cudaError_t dequantize(const uint8_t* codes, const float* scale, const float* expo, float* out, int64_t numel,
                       int group_size, bool e5m2, cudaStream_t stream) {
    if (numel == 0) return cudaSuccess;
    switch (group_size) {
        case 32: return launch_dequantize<32>(codes, scale, expo, out, numel, e5m2, stream);
        case 64: return launch_dequantize<64>(codes, scale, expo, out, numel, e5m2, stream);
        case 128: return launch_dequantize<128>(codes, scale, expo, out, numel, e5m2, stream);
        case 256: return launch_dequantize<256>(codes, scale, expo, out, numel, e5m2, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace coat_cuda
