// Moving tiles between global memory, shared memory and registers, for every CUDA kernel:
// one definition each, written with the wrappers of cuda/primitives.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/primitives.cuh"

namespace fmha {
namespace gpu {
namespace tile {

// Writes a warp's 16 x (kNTiles * 8) mma accumulator tile times `scale` as T: c[2r + e] of
// n-tile j is row row_lo + 8r, column c_base + 8j + 2t + e (t = lane % 4). Rows >= rows and
// columns >= cols (padding of the tile) are not written.
template <typename T, int kNTiles>
FMHA_DEVICE void store_acc(T* g, int64_t ld, const float (&acc)[kNTiles][4], int row_lo,
                           int rows, int c_base, int cols, int t, float scale) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    if (row >= rows) continue;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = c_base + j * 8 + 2 * t + e;
        if (col < cols) g[int64_t(row) * ld + col] = from_float<T>(acc[j][2 * r + e] * scale);
      }
  }
}

// How a tile's rows lie in shared memory: element (r, c) at offset(r, c). Both layouts keep
// every 16-byte chunk of 8 elements whole and 16-byte aligned (cp.async, ldmatrix), and put
// the 8 rows one ldmatrix matrix reads -- one chunk column of 8 consecutive rows -- in the 8
// different 16-byte bank groups of 128 bytes, as well as the 8 chunks one cp.async phase
// stores when they are 128 bytes of one row:
//  - Padded<kStride>: rows kStride elements apart, the rest of each row padding (8 elements:
//    row strides of 80, 144, 208, 272 and 528 bytes step through the 32 banks);
//  - Swizzled<kCols>: rows packed, chunk c of row r stored as chunk c ^ (r % 8) (CUTLASS's
//    XOR swizzle). No padding: the d = 128 forward's K and V tiles take 64 KiB, not 68, and
//    two of its CTAs fit an sm_80 SM. Needs rows of whole 8-chunk groups (kCols % 64 == 0).
// Row r + 8i of a column lies 8i rows of kStride below row r in both (offset(r + 8i, c) ==
// offset(r, c) + 8i kStride): the constant offsets the copies use.
//
// ldmatrix sweeps take base = (the tile's offset) + offset(r, c) once, for the lane's row r and
// column c, then element (r + R, c + C) at at(base, R, C): a constant added, and in the swizzled
// layout one XOR of the base by a constant. Preconditions: the tile's offset, R and C are
// multiples of 64 elements, 8 and 8 (C % 8 is dropped), and c and C share no chunk bit
// (c & C & 56 == 0, e.g. c < 8 or C a multiple of 64).
template <int kStride_, bool kPairRows_ = true>
struct Padded {
  static constexpr int kStride = kStride_;
  static constexpr bool kPadded = true;
  static constexpr bool kPairRows = kPairRows_;  // FullBlock's copy order at tile 32 (below)
  FMHA_DEVICE static constexpr int offset(int r, int c) { return r * kStride + c; }
  FMHA_DEVICE static constexpr int at(int base, int R, int C) { return base + R * kStride + C; }
};
template <int kCols>
struct Swizzled {
  static constexpr int kStride = kCols;
  static constexpr bool kPadded = false;
  static constexpr bool kPairRows = false;
  static_assert(kCols % 64 == 0, "rows of whole 8-chunk groups");
  // Bits 3-5 of c are its chunk within an 8-chunk group of 128 bytes.
  FMHA_DEVICE static constexpr int offset(int r, int c) { return r * kCols + (c ^ ((r & 7) << 3)); }
  FMHA_DEVICE static constexpr int at(int base, int R, int C) {
    return (base ^ (C & 56)) + R * kCols + (C & ~63);
  }
};

// The steady-state copy of `load` below: rows [row0, row0 + kRows) all inside the matrix,
// cols == kCols and 16-byte aligned rows (`load` checks), so every chunk is whole. A thread
// copies chunk column tid % kChunksPerRow of rows row_of(tid) + i * kRowsPerPass: one pointer
// add and one cp.async per chunk, no bounds test, and the shared offsets constant.
// kUsable is false where the threads do not tile the block that way (96-wide rows): those
// configs keep `load` for every block.
template <typename T, int kRows, int kCols, typename Layout, int kThreads>
struct FullBlock {
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr bool kUsable = kThreads % kChunksPerRow == 0 && kRowsPerPass > 0 &&
                                  kRows % kRowsPerPass == 0 &&
                                  (Layout::kPadded || kRowsPerPass % 8 == 0);
  // Rows of 4 chunks padded to 80 bytes (the 32 tile): an 8-lane phase of cp.async stores two
  // rows, which rows r and r + 1 would put on 16 shared bytes of the same banks (2 wavefronts).
  // Rows r and r + 4 of each 8 lie 320 bytes apart, in the two halves of the 32 banks: the
  // phases take rows (0, 4), (1, 5), (2, 6), (3, 7) of each 8, and still read 64 whole bytes of
  // each row from global memory. A layout may keep the rows in order (Padded<.., false>).
  // `load`'s checked copy and strong_zero.cuh's has_nonfinite take the same order (row_of),
  // so every thread still reads back only the chunks it copied itself.
  static constexpr bool kPairRows = kChunksPerRow == 4 && Layout::kPairRows &&
                                    Layout::kStride == 40 && kRowsPerPass % 8 == 0 &&
                                    kRows % 8 == 0;

  // The row of the block that chunk k (k = tid + i kThreads: thread tid's i-th) is in.
  FMHA_DEVICE static constexpr int row_of(int k) {
    const int q = k / kChunksPerRow;
    return kPairRows ? (q & ~7) | ((q & 1) << 2) | ((q >> 1) & 3) : q;
  }
  FMHA_DEVICE static void load(T* smem, const T* g, int64_t ld, int row0, int tid) {
    load_at(smem, g + int64_t(row0) * ld + thread_offset(ld, tid), ld, tid);
  }
  // The offset of this thread's first chunk from the block's first element.
  FMHA_DEVICE static int64_t thread_offset(int64_t ld, int tid) {
    return int64_t(row_of(tid)) * ld + (tid % kChunksPerRow) * 8;
  }
  // The offset of this thread's first chunk in the tile.
  FMHA_DEVICE static int smem_offset(int tid) {
    return Layout::offset(row_of(tid), (tid % kChunksPerRow) * 8);
  }
  // src: this thread's first chunk of the block (g + row0 * ld + thread_offset).
  FMHA_DEVICE static void load_at(T* smem, const T* src, int64_t ld, int tid) {
    load_to(smem + smem_offset(tid), src, ld);
  }
  // dst: this thread's first chunk of the tile (smem + smem_offset).
  FMHA_DEVICE static void load_to(T* dst, const T* src, int64_t ld) {
    load_stepping(dst, src, int64_t(kRowsPerPass) * ld);
  }
  // step: kRowsPerPass rows of the matrix (a caller may hold it in a register).
  FMHA_DEVICE static void load_stepping(T* dst, const T* src, int64_t step) {
    if constexpr (kUsable) {
#pragma unroll
      for (int i = 0; i < kRows / kRowsPerPass; ++i) {
        cp_async_16(dst + i * kRowsPerPass * Layout::kStride, src);
        src += step;
      }
    }
  }
};

// Copies rows [row0, row0 + kRows) x columns [0, kCols) of a (rows x cols) matrix with row
// stride ld into shared memory (laid out as Layout), zero outside the matrix. The zero rows of
// a tail block keep NaN/garbage out of the products (0 * NaN is NaN); the zero columns pad
// head_dim up to the tile width. vec: every row start is 16-byte aligned, so whole 16-byte
// chunks move by cp.async (a partial chunk reads only its valid bytes), and a block wholly
// inside the matrix by FullBlock (unless kWholeBlocks is false: a kernel whose registers do
// not fit the second path); otherwise element by element with plain loads and stores.
template <typename T, int kRows, int kCols, typename Layout, int kThreads, bool kWholeBlocks = true>
FMHA_DEVICE void load(T* smem, const T* g, int64_t ld, int rows, int cols, int row0, bool vec,
                      int tid) {
  constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks of 8 elements
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kCols % 8 == 0, "whole 16-byte chunks per row");
  using Full = FullBlock<T, kRows, kCols, Layout, kThreads>;
  if (kWholeBlocks && Full::kUsable && vec && cols == kCols && row0 + kRows <= rows) {
    Full::load(smem, g, ld, row0, tid);
  } else if (vec) {
#pragma unroll
    for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
      const int chunk = tid + i * kThreads;
      if (kChunks % kThreads != 0 && chunk >= kChunks) break;
      const int r = Full::row_of(chunk), c = (chunk % kChunksPerRow) * 8;
      const int gr = row0 + r;
      const int valid = (gr < rows && c < cols) ? min(cols - c, 8) : 0;
      // A chunk with nothing to read still needs a valid source address: the matrix base.
      const T* src = valid > 0 ? g + gr * ld + c : g;
      cp_async_16(smem + Layout::offset(r, c), src, valid * 2);
    }
  } else {
    const T zero = from_bits<T>(0);
#pragma unroll 4
    for (int i = tid; i < kRows * kCols; i += kThreads) {
      const int r = i / kCols, c = i % kCols;
      const int gr = row0 + r;
      smem[Layout::offset(r, c)] = (gr < rows && c < cols) ? g[gr * ld + c] : zero;
    }
  }
}

}  // namespace tile
}  // namespace gpu
}  // namespace fmha
