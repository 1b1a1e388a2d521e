// A tensor-core GEMM, C = A * B (A: M x K, B: K x N, both row-major f16 or bf16; C: M x N
// row-major f32), written only with the wrappers of cuda/primitives.cuh: ldmatrix +
// mma.sync m16n8k16 + a cp.async double-buffered pipeline. It is the pattern the attention
// kernels are built from, small enough to check exactly: it runs under the emulator in CI
// and is compared with NumPy for odd and even sizes.
//
// Tiling: a 128-thread block (2 x 2 warps) computes a 64 x 64 tile of C; each warp a 32 x 32
// sub-tile (2 x 4 mma tiles of 16 x 8), accumulating in 32 f32 registers per thread. K is
// consumed 32 at a time; tiles of A and B are staged in shared memory, two stages deep, so
// the copy of tile kt+1 is in flight while the tensor cores work on tile kt.
//
// Any M, N, K >= 1: rows and columns past the matrix are zero-filled in shared memory, so
// they add nothing. When every row of A and B starts 16-byte aligned (K and N multiples of 8,
// aligned bases) tiles move with cp.async, partial 16-byte chunks zero-filled by src-size;
// otherwise with guarded element loads.
#pragma once

#include <cstdint>

#include "cuda/testing/gemm_tc.h"
#include "cuda/primitives.cuh"

namespace fmha {
namespace gpu {

struct GemmTcConfig {
  static constexpr int kBlockM = 64, kBlockN = 64, kBlockK = 32;
  static constexpr int kWarpsM = 2, kWarpsN = 2, kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWarpM = kBlockM / kWarpsM, kWarpN = kBlockN / kWarpsN;  // 32 x 32
  static constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;                 // 2 x 4
  static constexpr int kStages = 2;
  // Rows padded by 8 elements (16 bytes): row starts stay 16-byte aligned (ldmatrix,
  // cp.async) and the 8 rows an ldmatrix reads fall in distinct banks (80- and 144-byte
  // strides step through all 32 banks).
  static constexpr int kPad = 8;
  static constexpr int kStrideA = kBlockK + kPad;  // elements per shared row of the A tile
  static constexpr int kStrideB = kBlockN + kPad;  // ... of the B tile
  static constexpr int kTileA = kBlockM * kStrideA, kTileB = kBlockK * kStrideB;
  static constexpr size_t kSmemBytes = size_t(kStages) * (kTileA + kTileB) * 2;  // 19 KiB

  static_assert(kMmaM * 16 == kWarpM && kMmaN * 8 == kWarpN, "warp tile is whole mma tiles");
  static_assert(kMmaN % 2 == 0, "B fragments are loaded two n-tiles per ldmatrix.x4");
  static_assert(kBlockK % 16 == 0, "k steps of 16");
  static_assert((kBlockM * kBlockK / 8) % kThreads == 0, "A tile: whole 16-byte chunks per thread");
  static_assert((kBlockK * kBlockN / 8) % kThreads == 0, "B tile: whole 16-byte chunks per thread");
  static_assert((kStrideA * 2) % 16 == 0 && (kStrideB * 2) % 16 == 0, "16-byte aligned rows");
};

namespace gemm_detail {

using Cfg = GemmTcConfig;

// Copies the kBlockRows x kBlockCols tile at (row0, col0) of a rows x cols row-major matrix
// into shared memory (row stride kSmemStride), zero outside the matrix.
template <typename T, int kBlockRows, int kBlockCols, int kSmemStride>
FMHA_DEVICE void load_tile(T* smem, const T* g, int64_t ld, int rows, int cols, int row0,
                           int col0, bool vec, int tid) {
  constexpr int kChunksPerRow = kBlockCols / 8;  // 16-byte chunks of 8 elements
  constexpr int kChunks = kBlockRows * kChunksPerRow;
  if (vec) {
#pragma unroll
    for (int i = 0; i < kChunks / Cfg::kThreads; ++i) {
      const int chunk = tid + i * Cfg::kThreads;
      const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
      const int gr = row0 + r, gc = col0 + c;
      const int valid = (gr < rows && gc < cols) ? min(cols - gc, 8) : 0;
      // A chunk with nothing to read still needs a valid source address: the matrix base.
      const T* src = valid > 0 ? g + gr * ld + gc : g;
      cp_async_16(smem + r * kSmemStride + c, src, valid * 2);
    }
  } else {
    const T zero = from_bits<T>(0);
#pragma unroll 4
    for (int i = tid; i < kBlockRows * kBlockCols; i += Cfg::kThreads) {
      const int r = i / kBlockCols, c = i % kBlockCols;
      const int gr = row0 + r, gc = col0 + c;
      smem[r * kSmemStride + c] = (gr < rows && gc < cols) ? g[gr * ld + gc] : zero;
    }
  }
}

}  // namespace gemm_detail

template <typename T>
__global__ void __launch_bounds__(GemmTcConfig::kThreads) gemm_tc_kernel(GemmTcParams p, bool vec) {
  using Cfg = GemmTcConfig;
  FMHA_DYNAMIC_SHARED(T, smem);
  T* sA = smem;                                 // [kStages][kBlockM][kStrideA]
  T* sB = smem + Cfg::kStages * Cfg::kTileA;    // [kStages][kBlockK][kStrideB]
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int m0 = blockIdx.y * Cfg::kBlockM, n0 = blockIdx.x * Cfg::kBlockN;
  const int k_tiles = (p.k + Cfg::kBlockK - 1) / Cfg::kBlockK;

  float acc[Cfg::kMmaM][Cfg::kMmaN][4];
#pragma unroll
  for (int i = 0; i < Cfg::kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  auto load_stage = [&](int kt, int stage) {
    gemm_detail::load_tile<T, Cfg::kBlockM, Cfg::kBlockK, Cfg::kStrideA>(
        sA + stage * Cfg::kTileA, A, p.lda, p.m, p.k, m0, kt * Cfg::kBlockK, vec, tid);
    gemm_detail::load_tile<T, Cfg::kBlockK, Cfg::kBlockN, Cfg::kStrideB>(
        sB + stage * Cfg::kTileB, B, p.ldb, p.k, p.n, kt * Cfg::kBlockK, n0, vec, tid);
  };

  load_stage(0, 0);
  cp_async_commit();
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int stage = kt % Cfg::kStages;
    // Prefetch tile kt+1 into the other stage; its last readers (tile kt-1) finished at the
    // trailing __syncthreads of the previous iteration.
    if (kt + 1 < k_tiles) load_stage(kt + 1, (kt + 1) % Cfg::kStages);
    cp_async_commit();
    // All but the newest group (tile kt+1) retired: this thread's copies of tile kt landed.
    cp_async_wait<1>();
    // ... and every thread's: tile kt is complete in shared memory.
    __syncthreads();

    const T* tA = sA + stage * Cfg::kTileA;
    const T* tB = sB + stage * Cfg::kTileB;
#pragma unroll
    for (int kk = 0; kk < Cfg::kBlockK; kk += 16) {
      // A fragments: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), addressed by lanes 0-7,
      // 8-15, 16-23, 24-31 -- registers a0..a3 of the mma A layout.
      uint32_t a[Cfg::kMmaM][4];
#pragma unroll
      for (int i = 0; i < Cfg::kMmaM; ++i) {
        const int r = warp_m * Cfg::kWarpM + i * 16 + (lane % 16);
        const int c = kk + (lane / 16) * 8;
        ldmatrix<4>(a[i], tA + r * Cfg::kStrideA + c);
      }
      // B fragments, two n-tiles per ldmatrix.x4.trans: matrices (k 0-7, n 0-7),
      // (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) of the row-major k x n tile.
      uint32_t b[Cfg::kMmaN][2];
#pragma unroll
      for (int j = 0; j < Cfg::kMmaN; j += 2) {
        const int r = kk + (lane % 8) + ((lane / 8) % 2) * 8;
        const int c = warp_n * Cfg::kWarpN + j * 8 + (lane / 16) * 8;
        uint32_t t4[4];
        ldmatrix<4, true>(t4, tB + r * Cfg::kStrideB + c);
        b[j][0] = t4[0];
        b[j][1] = t4[1];
        b[j + 1][0] = t4[2];
        b[j + 1][1] = t4[3];
      }
#pragma unroll
      for (int i = 0; i < Cfg::kMmaM; ++i)
#pragma unroll
        for (int j = 0; j < Cfg::kMmaN; ++j) mma_m16n8k16<T>(acc[i][j], a[i], b[j], acc[i][j]);
    }
    // Every warp is done with this stage before the next iteration's prefetch overwrites it.
    __syncthreads();
  }
  cp_async_wait<0>();  // retire the trailing empty group

  // Accumulator fragment: c0, c1 at row g, columns 2t, 2t+1; c2, c3 at row g+8.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < Cfg::kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + warp_m * Cfg::kWarpM + i * 16 + g + (e / 2) * 8;
        const int col = n0 + warp_n * Cfg::kWarpN + j * 8 + 2 * t + (e % 2);
        if (row < p.m && col < p.n) p.c[row * p.ldc + col] = acc[i][j][e];
      }
}

// True when every 16-byte chunk of A's and B's rows is 16-byte aligned in memory.
inline bool gemm_tc_rows_aligned(const GemmTcParams& p) {
  auto aligned = [](const void* ptr, int64_t ld) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && ld % 8 == 0;
  };
  return aligned(p.a, p.lda) && aligned(p.b, p.ldb);
}

template <typename T>
void gemm_tc_launch(const GemmTcParams& p, Stream stream) {
  using Cfg = GemmTcConfig;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return;
  const dim3 grid((p.n + Cfg::kBlockN - 1) / Cfg::kBlockN, (p.m + Cfg::kBlockM - 1) / Cfg::kBlockM);
  auto kernel = &gemm_tc_kernel<T>;
  FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p,
              gemm_tc_rows_aligned(p));
}

}  // namespace gpu
}  // namespace fmha
