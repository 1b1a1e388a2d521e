// The strong zero of the NaN rule (docs/semantics.md, "Non-finite inputs") in the CUDA
// kernels' tensor-core products. A pair of zero weight -- excluded by the window, the
// sequence, a mask or a -inf bias, or (for out and dV) dropped -- contributes nothing, even
// against a NaN or Inf; but mma.sync computes 0 * NaN = NaN like any IEEE product. So, for a
// product D += A B whose B operand streams through shared memory (V for O += P V, dO for dV,
// Q for dK, K for dQ):
//
//  1. vote: once the tile has landed, each thread checks the chunks it copied itself
//     (tile::has_nonfinite) and the block ORs the answers at the barrier it waits at anyway
//     (__syncthreads_or). Only blocks that can hold a zero-weight pair ask: the window's
//     edge blocks (score::first_edge_block; the main backward's steps not inside the window),
//     and every block when a mask, a bias, dropout or a left window is set. Plain attention
//     and the interior of a causal one pay nothing; the others one scan of the tile per block;
//  2. poison (the rare block that voted yes): every accumulator element whose row takes part
//     in a pair with a non-finite B entry in its column becomes NaN, before the product --
//     NaN plus anything stays NaN. "Takes part" is asked again of the score semantics
//     (excluded / dropped), not read from A: a visible pair whose score is -inf has weight 0
//     yet must give 0 * NaN = NaN, as the reference does;
//  3. sanitise: after a barrier (every warp has read the raw tile), the non-finite entries
//     of the tile become 0 in shared memory, and after another the common product runs
//     unchanged on it.
// Everything the rare block adds runs outside the products, in loops that are not unrolled,
// and holds no register across them: it must not raise the kernels' register peak, which
// sits at ptxas's limit (docs/cuda_kernels.md). NaN stands for +-Inf in what it produces: the
// tests compare non-finite patterns.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/primitives.cuh"
#include "cuda/tile_io.cuh"  // FullBlock::row_of: the order tile::load copies chunks in

namespace fmha {
namespace gpu {
namespace strong_zero {

// The exponent bits of a 16-bit float: all ones is NaN or Inf.
template <typename T>
FMHA_DEVICE constexpr uint32_t exponent_mask() {
  return std::is_same<T, half_t>::value ? 0x7C00u : 0x7F80u;
}

// Bit 0 / bit 1: the low / high 16-bit half of a packed pair is NaN or Inf.
template <typename T>
FMHA_DEVICE uint32_t nonfinite_bits(uint32_t x) {
  constexpr uint32_t kExp = exponent_mask<T>();
  return uint32_t((x & kExp) == kExp) | (uint32_t(((x >> 16) & kExp) == kExp) << 1);
}

// A packed pair with its non-finite halves replaced by +0.
template <typename T>
FMHA_DEVICE uint32_t finite_pair(uint32_t x) {
  const uint32_t bad = nonfinite_bits<T>(x);
  return x & ~((bad & 1u ? 0x0000FFFFu : 0u) | (bad & 2u ? 0xFFFF0000u : 0u));
}

// A 16-byte chunk of 16-bit floats in shared memory: its word's sign bits (0x80008000) are set
// where a half is NaN or Inf (has_nonfinite's test, below).
template <typename T>
FMHA_DEVICE uint32_t chunk_nonfinite_carry(const T* at) {
  constexpr uint32_t kExp = exponent_mask<T>();
  constexpr uint32_t kExp2 = kExp | (kExp << 16), kOne2 = (kExp & ~(kExp << 1)) * 0x00010001u;
  struct alignas(16) Chunk {
    uint32_t w[4];
  };
  const Chunk x = *reinterpret_cast<const Chunk*>(at);
  return ((x.w[0] & kExp2) + kOne2) | ((x.w[1] & kExp2) + kOne2) | ((x.w[2] & kExp2) + kOne2) |
         ((x.w[3] & kExp2) + kOne2);
}

// True when this thread's share of a tile that tile::load filled (same template arguments,
// same `vec`) holds a NaN or Inf: the chunks, or elements, it copied itself, which it may read
// once its cp_async_wait retired them -- the check needs no barrier of its own. Two integer
// operations per 32-bit word: adding the exponent's lowest bit to the exponent bits carries
// into the half's sign bit exactly when they are all ones.
template <typename T, int kRows, int kCols, typename Layout, int kThreads>
FMHA_DEVICE bool has_nonfinite(const T* smem, bool vec, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr uint32_t kExp = exponent_mask<T>();
  constexpr uint32_t kOne2 = (kExp & ~(kExp << 1)) * 0x00010001u;
  uint32_t carry = 0;
  if (vec) {
    // Chunk tid + i kThreads; when a pass of the threads covers whole rows (8 of them when
    // swizzled), it lies a fixed number of rows below chunk tid: constant offsets from one
    // address.
    constexpr bool kWholeRows = kThreads % kChunksPerRow == 0 &&
                                (Layout::kPadded || (kThreads / kChunksPerRow) % 8 == 0);
    // The row of chunk k, in the order tile::load copied it (tile_io.cuh, FullBlock::row_of).
    using Copy = tile::FullBlock<T, kRows, kCols, Layout, kThreads>;
    const T* first = smem + Layout::offset(Copy::row_of(tid), (tid % kChunksPerRow) * 8);
#pragma unroll 4
    for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
      const int chunk = tid + i * kThreads;
      if (kChunks % kThreads != 0 && chunk >= kChunks) break;
      const T* at = kWholeRows ? first + i * (kThreads / kChunksPerRow) * Layout::kStride
                               : smem + Layout::offset(Copy::row_of(chunk), (chunk % kChunksPerRow) * 8);
      carry |= chunk_nonfinite_carry<T>(at);
    }
  } else {
#pragma unroll 1
    for (int i = tid; i < kRows * kCols; i += kThreads)
      carry |= (bits_of<T>(smem[Layout::offset(i / kCols, i % kCols)]) & kExp) + (kOne2 & 0xFFFFu);
  }
  return (carry & 0x80008000u) != 0;
}

// Step 2. A warp's accumulator tile of D += A B: acc[j][2r + e] is row r (the thread's rows
// g and g + 8 of the warp's 16), column c_base + 8j + 2t + e; B is kK rows of shared memory
// (laid out as Layout). takes_part(r, k): the pair (row r, k) contributes to D.
template <typename T, int kNTiles, int kK, typename Layout, typename TakesPart>
FMHA_DEVICE void poison(float (&acc)[kNTiles][4], const T* b_tile, int c_base, int t,
                        TakesPart takes_part) {
  // n-tiles in groups of 16: two bits each (the thread's two columns) in one word.
  constexpr int kGroup = kNTiles < 16 ? kNTiles : 16;
  static_assert(kNTiles % kGroup == 0, "whole groups");
#pragma unroll
  for (int j0 = 0; j0 < kNTiles; j0 += kGroup) {
#pragma unroll 1
    for (int k = 0; k < kK; ++k) {
      // (Layout::at, cuda/tile_io.cuh: needs c_base's chunk bits clear of those of 8 (j0 + jj),
      // true for the padded layout always and for a swizzled one when c_base % 64 == 0.)
      const int row = Layout::offset(k, c_base + 2 * t);
      uint32_t bad = 0;
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) {
        const T* pair = b_tile + Layout::at(row, 0, (j0 + jj) * 8);
        bad |= nonfinite_bits<T>(*reinterpret_cast<const uint32_t*>(pair)) << (2 * jj);
      }
      if (bad == 0) continue;
      // One row at a time (not unrolled: takes_part may draw dropout's Philox, whose
      // registers must not double), then the accumulator by constant indices.
      uint32_t part = 0;
#pragma unroll 1
      for (int r = 0; r < 2; ++r) part |= uint32_t(takes_part(r, k)) << r;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!((part >> r) & 1u)) continue;
#pragma unroll
        for (int jj = 0; jj < kGroup; ++jj)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if ((bad >> (2 * jj + e)) & 1u) acc[j0 + jj][2 * r + e] = NAN;
      }
    }
  }
}

// Step 3: the non-finite entries of a kRows x kCols tile (laid out as Layout) become +0.
// Between two barriers: any thread may own any entry.
template <typename T, int kRows, int kCols, typename Layout, int kThreads>
FMHA_DEVICE void sanitise(T* tile, int tid) {
  constexpr int kPairsPerRow = kCols / 2;
#pragma unroll 1
  for (int i = tid; i < kRows * kPairsPerRow; i += kThreads) {
    uint32_t* w = reinterpret_cast<uint32_t*>(
        tile + Layout::offset(i / kPairsPerRow, (i % kPairsPerRow) * 2));
    *w = finite_pair<T>(*w);
  }
}

}  // namespace strong_zero
}  // namespace gpu
}  // namespace fmha
