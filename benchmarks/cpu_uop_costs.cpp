// What one 16-value AVX-512 instruction costs on this CPU, next to the CPU op's FP8 encoder and decoder: the
// figures behind the CPU step's compute floor (docs/notes_adam.md, issue 17). One thread, L1-resident
// data, 5 dependent instructions per 16 values, minimum over 7 repetitions; cycles are derived from an FMA
// chain (latency 4 cycles on both Zen 4 and Sapphire/Emerald Rapids).
//
//   g++ -O3 -std=c++20 -march=native -Icsrc/adam -Icsrc/includes benchmarks/cpu_uop_costs.cpp -o /tmp/uop_costs
//   /tmp/uop_costs > benchmarks/logs/cpu_uop_costs_<machine>.txt
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "coat_adam_avx512.h"

using namespace coat::avx512;

namespace {

constexpr int kN = 4096;
alignas(64) float x[kN], y[kN];
alignas(64) uint8_t q[kN];
double ns_per_cycle;

double now() {
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
void row(const char* name, int per16, F&& f) {
    double best = 1e30;
    for (int r = 0; r < 7; ++r) {
        const double s = now();
        for (int i = 0; i < 20000; ++i) {
            f();
            __asm__ volatile("" ::: "memory");
        }
        best = std::min(best, (now() - s) / 20000 / (kN / 16));
    }
    const double cyc = best / ns_per_cycle;
    printf("%-36s %8.2f %8.1f %10.2f\n", name, best, cyc, cyc / per16);
}

// 5 dependent applications of op per 16 values, loaded from x and stored to y (cycles/op: per application)
#define CHAIN(name, op)                                                 \
    row(name, 5, [&] {                                                 \
        for (int j = 0; j < kN; j += 16) {                              \
            V p = _mm512_load_ps(x + j);                                \
            for (int u = 0; u < 5; ++u) p = op;                         \
            _mm512_store_ps(y + j, p);                                  \
        }                                                               \
    })

}  // namespace

int main() {
    V a = splat(1.0f);
    const V b = splat(0.9999f), c = splat(0.0001f), k = splat(1.3f), t = splat(3.0f);
    const double t0 = now();
    for (int i = 0; i < 100000000; ++i) {
        a = _mm512_fmadd_ps(a, b, c);
        __asm__ volatile("" : "+v"(a));
    }
    ns_per_cycle = (now() - t0) / 1e8 / 4;
    printf("clock ~%.2f GHz (FMA latency 4)\n%-36s %8s %8s %10s\n", 1 / ns_per_cycle, "per 16 values", "ns",
           "cycles", "cycles/op");
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (float& v : x) v = nd(rng) * 1e-4f * std::exp(2 * nd(rng));
    CHAIN("fma", _mm512_fmadd_ps(p, k, t));
    CHAIN("add", _mm512_add_ps(p, k));
    CHAIN("max", _mm512_max_ps(p, k));
    CHAIN("getmant", _mm512_getmant_ps(p, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero));
    CHAIN("getexp", _mm512_getexp_ps(p));
    CHAIN("roundscale (floor)", _mm512_roundscale_ps(p, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    CHAIN("scalef", _mm512_scalef_ps(p, k));
    CHAIN("permps (16-entry table)", _mm512_permutexvar_ps(_mm512_castps_si512(p), t));
    CHAIN("permt2ps (32-entry table)", _mm512_permutex2var_ps(t, _mm512_castps_si512(p), k));
    CHAIN("srli (int shift)", _mm512_castsi512_ps(_mm512_srli_epi32(_mm512_castps_si512(p), 1)));
    CHAIN("paddd (int add)", _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_castps_si512(k))));
    CHAIN("sqrt", _mm512_sqrt_ps(p));
    CHAIN("div", _mm512_div_ps(k, p));
    CHAIN("rsqrt14", _mm512_rsqrt14_ps(p));
    const float big = 0.05f, log2d = std::log2(big) - coat::fp8_log2_max(false) / 1.3f;
    row("encoder (the op's, E4M3, k = 1.3)", 1, [&] {
        const Encoder<false> e(1.3f, log2d);
        for (int j = 0; j < kN; j += 16) store_codes(q + j, 0xFFFF, e.encode(_mm512_load_ps(x + j)));
    });
    row("decoder (the op's, E4M3)", 1, [&] {
        const Decoder<false> d(1 / 1.3f, log2d);
        for (int j = 0; j < kN; j += 16) _mm512_store_ps(y + j, d.decode<false>(load_codes(q + j, 0xFFFF)));
    });
}
