// The tensor-core GEMM (csrc/cuda/testing/gemm_tc.cuh: ldmatrix + mma.sync + cp.async double
// buffering) against a float64 reference, for even and odd sizes, in both 16-bit types.
// Built plainly, with AddressSanitizer and with the race checker: the same kernel must be
// correct, in bounds and race-free.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/emu/runtime.h"
#include "cuda/testing/gemm_tc.h"
#include "cuda/primitives.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::pass;
using emu_test::Result;

namespace {

template <typename T>
Result gemm_case(int m, int n, int k) {
  std::mt19937 rng(unsigned(m * 131 + n * 17 + k));
  std::normal_distribution<float> normal;
  // Exactly sized buffers: AddressSanitizer flags any read past an edge.
  std::vector<T> a(size_t(m) * k), b(size_t(k) * n);
  std::vector<double> fa(a.size()), fb(b.size());
  for (size_t i = 0; i < a.size(); ++i) fa[i] = to_float(a[i] = from_float<T>(normal(rng)));
  for (size_t i = 0; i < b.size(); ++i) fb[i] = to_float(b[i] = from_float<T>(normal(rng)));
  std::vector<float> c(size_t(m) * n);
  GemmTcParams p{a.data(), b.data(), c.data(), m, n, k, k, n, n};
  emu::reset_stats();
  gemm_tc(p, std::is_same<T, half_t>::value ? fmha::DType::kFloat16 : fmha::DType::kBFloat16,
          nullptr);
  const emu::Stats s = emu::stats();
  // f32 accumulation of k exact products: error <= ~k * 2^-24 * sum |a||b|; allow 4x.
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int q = 0; q < k; ++q) {
        ref += fa[size_t(i) * k + q] * fb[size_t(q) * n + j];
        mag += std::fabs(fa[size_t(i) * k + q] * fb[size_t(q) * n + j]);
      }
      const double got = c[size_t(i) * n + j];
      if (!(std::fabs(got - ref) <= 4.0 * (k + 2) * std::ldexp(mag, -24) + 1e-30)) {
        char buf[200];
        std::snprintf(buf, sizeof buf, "C[%d][%d] = %.9g, expected %.9g", i, j, got, ref);
        return fail(buf);
      }
    }
  // The kernel's structure, as the emulator saw it: one mma per 16x8x16 step of each warp
  // (counted per lane), cp.async double buffering when the rows are 16-byte aligned.
  const uint64_t blocks = uint64_t((m + 63) / 64) * ((n + 63) / 64), k_tiles = (k + 31) / 32;
  const uint64_t mma = blocks * 4 /*warps*/ * k_tiles * 2 /*k16 steps*/ * 8 /*tiles*/ * 32;
  if (s.mma != mma) return fail("mma.sync count " + std::to_string(s.mma) + ", expected " + std::to_string(mma));
  const bool aligned = k % 8 == 0 && n % 8 == 0;
  if (aligned && s.cp_async != blocks * k_tiles * 512)
    return fail("cp.async count " + std::to_string(s.cp_async));
  if (!aligned && s.cp_async != 0) return fail("cp.async used on unaligned rows");
  if (s.max_cp_async_groups_pending != 2) return fail("no double buffering (max groups in flight != 2)");
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s path, %llu blocks, %llu mma.sync, %llu cp.async (%llu zero-filled)",
                aligned ? "cp.async" : "element", (unsigned long long)s.blocks,
                (unsigned long long)s.mma / 32, (unsigned long long)s.cp_async,
                (unsigned long long)s.cp_async_zero_filled);
  return pass(buf);
}

#define GEMM_CITE "gemm_tc (ldmatrix + mma.sync m16n8k16 + cp.async double buffering) vs float64"
// even sizes: whole tiles, several k tiles
EMU_TEST("gemm.f16.64x64x64", GEMM_CITE) { return gemm_case<half_t>(64, 64, 64); }
EMU_TEST("gemm.bf16.64x64x64", GEMM_CITE) { return gemm_case<bf16_t>(64, 64, 64); }
EMU_TEST("gemm.f16.128x64x96", GEMM_CITE) { return gemm_case<half_t>(128, 64, 96); }
EMU_TEST("gemm.bf16.64x128x128", GEMM_CITE) { return gemm_case<bf16_t>(64, 128, 128); }
// aligned rows but partial tiles: cp.async with zero-filled chunks
EMU_TEST("gemm.f16.70x72x40", GEMM_CITE) { return gemm_case<half_t>(70, 72, 40); }
EMU_TEST("gemm.bf16.24x8x8", GEMM_CITE) { return gemm_case<bf16_t>(24, 8, 8); }
// odd sizes: element path
EMU_TEST("gemm.f16.1x1x1", GEMM_CITE) { return gemm_case<half_t>(1, 1, 1); }
EMU_TEST("gemm.bf16.17x33x29", GEMM_CITE) { return gemm_case<bf16_t>(17, 33, 29); }
EMU_TEST("gemm.f16.65x63x47", GEMM_CITE) { return gemm_case<half_t>(65, 63, 47); }
EMU_TEST("gemm.bf16.33x70x65", GEMM_CITE) { return gemm_case<bf16_t>(33, 70, 65); }

}  // namespace
