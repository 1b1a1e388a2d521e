// Probes of this ISA's building blocks, for fmha-bench and the tests:
// - the machine's FMA peak, measured: independent FMA chains on VecF, enough of them to cover
//   the FMA latency, on `threads` threads at once; fmha-bench reports kernel speed against it;
// - the bfloat16 pair dot-product peak (vdpbf16ps chains, 64 FLOPs each), the rate the
//   avx512bf16 level's GEMMs run at; 0 on the other levels;
// - the AMX bfloat16 tile peak (TDPBF16PS chains on four accumulator tiles, cpu/amx.h), the
//   rate the AMX kernels will be judged by; 0 in a translation unit built without the AMX
//   instructions (the caller reaches this only when the CPU and OS allow AMX);
// - the machine's read bandwidth, measured: `threads` threads each summing their share of one
//   large buffer with vector loads (STREAM's "sum" without the write); decode, which reads
//   every K/V byte once and computes little, is reported against it;
// - the softmax's exp exactly as the kernels evaluate it (vectors, then a scalar tail), so its
//   accuracy can be tested against std::exp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "cpu/amx.h"
#include "cpu/dequant.h"
#include "cpu/simd.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// The best of five timed runs of `body` on `threads` threads (after one warm-up), as
// 1e9 units per second for `units_per_thread` (FLOPs, bytes): a peak is what the machine can
// do, and a shared machine only ever makes a single measurement slower.
template <typename F>
double best_rate(int threads, double units_per_thread, F&& body) {
  parallel_for(threads, threads, body);  // warm-up (clocks, thread start)
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    parallel_for(threads, threads, body);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(threads) * units_per_thread / secs / 1e9);
  }
  return best;
}

double fma_peak_gflops(int threads) {
  constexpr int kChains = 12;
  const long iters = 20000000L / kW + 1000000;
  auto body = [&](int64_t) {
    VecF acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = VecF::set1(1.0f + 1e-3f * float(i));
    const VecF a = VecF::set1(0.9999999f), c = VecF::set1(1e-7f);
    for (long it = 0; it < iters; ++it)
      for (int i = 0; i < kChains; ++i) acc[i] = fma(acc[i], a, c);
    VecF s = acc[0];
    for (int i = 1; i < kChains; ++i) s = s + acc[i];
    volatile float sink = hsum(s);
    (void)sink;
  };
  return best_rate(threads, double(iters) * kChains * kW * 2.0, body);
}

double bf16_dot_peak_gflops([[maybe_unused]] int threads) {
#if defined(__AVX512BF16__)
  constexpr int kChains = 12;
  const long iters = 10000000L / kW + 500000;
  auto body = [&](int64_t) {
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1e-3f * float(i));
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // (1.0, 1.0)
    const __m512bh b = (__m512bh)_mm512_set1_epi32(0x33D633D6);  // (1e-7, 1e-7)
    for (long it = 0; it < iters; ++it)
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __m512 s = acc[0];
    for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
  };
  return best_rate(threads, double(iters) * kChains * kW * 4.0, body);
#else
  return 0.0;
#endif
}

double amx_bf16_peak_gflops([[maybe_unused]] int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  constexpr long kIters = 100000;
  auto body = [&](int64_t) {
    alignas(64) uint16_t a[512], b[512];
    alignas(64) float c[1024];
    for (int i = 0; i < 512; ++i) {
      a[i] = 0x3F80;  // 1.0
      b[i] = 0x33D6;  // 1e-7: the sums stay finite
    }
    amx::tdpbf16ps_chain<amx::HardwareTiles>(kIters, a, b, c);
    volatile float sink = c[0] + c[1023];
    (void)sink;
  };
  return best_rate(threads, double(kIters) * 4 * amx::kTdpbf16psFlops, body);
#else
  return 0.0;
#endif
}

double read_bandwidth_gbs(int threads, int64_t bytes) {
  const int64_t n = std::max<int64_t>(bytes / int64_t(sizeof(float)) / (4 * kW), threads) * 4 * kW;
  std::vector<float> buf(size_t(n), 1.0f);  // written once: every page is mapped before timing
  const int64_t per = (n / (4 * kW) + threads - 1) / threads * (4 * kW);
  auto body = [&](int64_t t) {
    const float* x = buf.data();
    const int64_t lo = std::min(n, t * per), hi = std::min(n, lo + per);
    VecF a0 = VecF::zero(), a1 = VecF::zero(), a2 = VecF::zero(), a3 = VecF::zero();
    for (int64_t i = lo; i < hi; i += 4 * kW) {
      a0 = a0 + VecF::load(x + i);
      a1 = a1 + VecF::load(x + i + kW);
      a2 = a2 + VecF::load(x + i + 2 * kW);
      a3 = a3 + VecF::load(x + i + 3 * kW);
    }
    volatile float sink = hsum((a0 + a1) + (a2 + a3));
    (void)sink;
  };
  return best_rate(threads, double(n) * sizeof(float) / threads, body);
}

void exp_array(const float* x, float* y, int64_t n, bool lean) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const VecF v = VecF::load(x + i);
    (lean ? vexp_lean(v) : vexp(v)).store(y + i);
  }
  for (; i < n; ++i) y[i] = lean ? exp_lean(x[i]) : exp_approx(x[i]);
}

void decode_kv_codes(int code, const uint8_t* x, float* y, int64_t n) {
  with_code(KvCode(code), [&](auto c) { decode_codes<decltype(c)::kCode>(x, n, y); });
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
