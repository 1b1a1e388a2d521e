// The CPU GEMM micro-kernel (csrc/cpu/gemm.h) alone, every operand in L1: a 64x64x64 product
// (C += A B, A rows 64 floats apart, everything 64-byte aligned) per register-block shape,
// best of 15 timings of 2000 products, next to the FMA probe the benchmarks use.
// docs/cpu_kernels.md ("Where the time goes") quotes it. Build and run, from the repository
// root, after a pip install of the repository (which leaves libfmha_core.a in its build folder,
// build/<wheel tag>/):
//
//   B=build/cp311-cp311-linux_x86_64
//   g++ -O3 -std=gnu++17 -fopenmp-simd -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma \
//       -mf16c -Icsrc benchmarks/micro/gemm_block_l1.cpp $B/libfmha_core.a \
//       $B/libfmha_validate.a $B/libfmha_core.a -lpthread -o /tmp/gemm_l1
//   /tmp/gemm_l1
#define FMHA_CPU_ISA_NS avx512
#include <chrono>
#include <cstdio>

#include "cpu/gemm.h"
#include "cpu/probes.h"

using namespace fmha::cpu::avx512;

namespace {

alignas(64) float A[64 * 64], B[64 * 64], C[64 * 64];

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// M = N = K = 64 in blocks of RB rows x NV vectors, the last rows in a smaller block.
template <int RB, int NV>
__attribute__((noinline)) void product() {
  for (int n0 = 0; n0 < 64; n0 += NV * kW) {
    int i = 0;
    for (; i + RB <= 64; i += RB)
      gemm_block<RB, NV, true>(64, A + i * 64, 64, 1, B + n0, 64, C + i * 64 + n0, 64);
    if (i < 64)
      gemm_row_tail<NV, true, RB - 1>(64 - i, 64, A + i * 64, 64, 1, B + n0, 64,
                                      C + i * 64 + n0, 64);
  }
}

template <int RB, int NV>
void bench() {
  double best = 1e9;
  for (int rep = 0; rep < 15; ++rep) {
    const double t0 = now();
    for (int it = 0; it < 2000; ++it) product<RB, NV>();
    const double t = (now() - t0) / 2000;
    best = t < best ? t : best;
  }
  std::printf("block %2dx%d: %6.1f GFLOP/s\n", RB, NV, 2.0 * 64 * 64 * 64 / best / 1e9);
}

}  // namespace

int main() {
  for (int i = 0; i < 64 * 64; ++i) A[i] = B[i] = 1e-3f;
  for (int round = 0; round < 2; ++round) {
    std::printf("FMA probe, 1 thread: %.1f GFLOP/s\n", fma_peak_gflops(1));
    bench<6, 4>();  // the shipped block (simd.h)
    bench<4, 4>();
    bench<8, 2>();
    bench<12, 2>();
  }
}
