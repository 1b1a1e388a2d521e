// Probes of this ISA's building blocks, for fmha-bench and the tests:
// - the machine's FMA peak, measured: independent FMA chains on VecF, enough of them to cover
//   the FMA latency, on `threads` threads at once; fmha-bench reports kernel speed against it;
// - the softmax's exp exactly as the kernels evaluate it (vectors, then a scalar tail), so its
//   accuracy can be tested against std::exp.
#pragma once

#include <algorithm>
#include <chrono>

#include "cpu/simd.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

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
  parallel_for(threads, threads, body);  // warm-up (clocks, thread start)
  // The best of five: a peak is what the machine can do, and a shared machine only ever
  // makes a single measurement slower.
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    parallel_for(threads, threads, body);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(threads) * double(iters) * kChains * kW * 2.0 / secs / 1e9);
  }
  return best;
}

void exp_array(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vexp(VecF::load(x + i)).store(y + i);
  for (; i < n; ++i) y[i] = exp_approx(x[i]);
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
