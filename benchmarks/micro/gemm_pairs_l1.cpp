// The bfloat16 pair GEMM (csrc/cpu/gemm.h, AVX512-BF16) alone, operands hot in cache, at the
// forward's two tile products for head_dim 64: Sᵀ = K Qᵀ (64 keys x 64 rows x 32 pairs, K's
// rows 1 KiB apart as in a (batch, seq, 8 heads, 64) tensor) and O += P V (64 rows x 64 columns
// x 32 pairs), each through the library's gemm<> entry, best of 10 timings of 4000 products,
// next to the dot-product probe the benchmarks use. docs/cpu_kernels.md ("Long sequences")
// quotes it. Build and run, from the repository root, after a pip install of the repository
// (which leaves libfmha_core.a in build/<wheel tag>/), on a CPU with AVX512-BF16:
//
//   B=build/cp311-cp311-linux_x86_64
//   g++ -O3 -std=gnu++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma \
//       -mf16c -Icsrc benchmarks/micro/gemm_pairs_l1.cpp $B/libfmha_core.a \
//       $B/libfmha_validate.a $B/libfmha_core.a -lpthread -o /tmp/gemm_pairs
//   /tmp/gemm_pairs
#define FMHA_CPU_ISA_NS avx512bf16
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "cpu/gemm.h"
#include "cpu/probes.h"

using namespace fmha::cpu::avx512bf16;

namespace {

alignas(64) uint32_t Q2[32 * 64], P2[32 * 64], V2[32 * 64], K[64 * 256];
alignas(64) float ST[64 * 64], O[64 * 64];

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Shapes passed at run time, as the forward passes them.
__attribute__((noinline)) void s_product(int n) { gemm<false>(n, n, n / 2, K, 256, 1, Q2, 64, ST, 64); }
__attribute__((noinline)) void pv_product(int n) { gemm<true>(n, n, n / 2, P2, 1, 64, V2, 64, O, 64); }

}  // namespace

int main(int argc, char**) {
  for (auto* a : {Q2, P2, V2}) std::fill(a, a + 32 * 64, 0x3c003c00u);  // bfloat16 pairs (1, 1)
  std::fill(K, K + 64 * 256, 0x3c003c00u);
  const int n = argc > 100 ? 0 : 64;  // opaque to the compiler
  for (int round = 0; round < 2; ++round) {
    std::printf("bf16 dot probe, 1 thread: %.1f GFLOP/s\n", bf16_dot_peak_gflops(1));
    for (int which = 0; which < 2; ++which) {
      double best = 1e9;
      for (int rep = 0; rep < 10; ++rep) {
        const double t0 = now();
        for (int it = 0; it < 4000; ++it) which ? pv_product(n) : s_product(n);
        best = std::min(best, (now() - t0) / 4000);
      }
      std::printf("%s: %6.1f GFLOP/s\n", which ? "O += P V" : "S^T = K Q^T", 4.0 * 64 * 64 * 32 / best / 1e9);
    }
  }
}
