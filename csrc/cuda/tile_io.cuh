// Moving tiles between global and shared memory, and the per-element pieces of the score
// pipeline of design.md that the CUDA backward kernels share: one definition each, written
// with the wrappers of cuda/primitives.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/primitives.cuh"
#include "fmha/params.h"
#include "fmha/philox.h"

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

// Copies rows [row0, row0 + kRows) x columns [0, kCols) of a (rows x cols) matrix with row
// stride ld into shared memory (row stride kStride), zero outside the matrix. The zero rows of
// a tail block keep NaN/garbage out of the products (0 * NaN is NaN); the zero columns pad
// head_dim up to the tile width. vec: every row start is 16-byte aligned, so whole 16-byte
// chunks move by cp.async (a partial chunk reads only its valid bytes); otherwise element by
// element with plain loads and stores.
template <typename T, int kRows, int kCols, int kStride, int kThreads>
FMHA_DEVICE void load(T* smem, const T* g, int64_t ld, int rows, int cols, int row0, bool vec,
                      int tid) {
  constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks of 8 elements
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kCols % 8 == 0, "whole 16-byte chunks per row");
  if (vec) {
#pragma unroll
    for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
      const int chunk = tid + i * kThreads;
      if (kChunks % kThreads != 0 && chunk >= kChunks) break;
      const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
      const int gr = row0 + r;
      const int valid = (gr < rows && c < cols) ? min(cols - c, 8) : 0;
      // A chunk with nothing to read still needs a valid source address: the matrix base.
      const T* src = valid > 0 ? g + gr * ld + c : g;
      cp_async_16(smem + r * kStride + c, src, valid * 2);
    }
  } else {
    const T zero = from_bits<T>(0);
#pragma unroll 4
    for (int i = tid; i < kRows * kCols; i += kThreads) {
      const int r = i / kCols, c = i % kCols;
      const int gr = row0 + r;
      smem[r * kStride + c] = (gr < rows && c < cols) ? g[gr * ld + c] : zero;
    }
  }
}

// One element of a broadcast bias, as float, whatever its dtype.
FMHA_DEVICE float bias_at(const Broadcast4& bias, int64_t index) {
  switch (bias.dtype) {
    case DType::kFloat64: return float(static_cast<const double*>(bias.ptr)[index]);
    case DType::kFloat32: return static_cast<const float*>(bias.ptr)[index];
    case DType::kBFloat16: return to_float(static_cast<const bf16_t*>(bias.ptr)[index]);
    case DType::kFloat16: return to_float(static_cast<const half_t*>(bias.ptr)[index]);
  }
  return 0.0f;
}

// One sequence of the batch: its lengths, the first row of q / k in the packed tensors
// (varlen) and the diagonal offset of causal / window / ALiBi. Without cu_seqlens every
// sequence has the maximal lengths and the rows start at batch * batch_stride.
struct Seq {
  int sq, sk, off;
  int q_first, k_first;  // varlen: first packed row; else 0
  bool varlen;
  // Element offset of row 0 of sequence b in a tensor with these strides.
  FMHA_DEVICE int64_t q_base(int b, int64_t batch_stride, int64_t row_stride) const {
    return varlen ? int64_t(q_first) * row_stride : int64_t(b) * batch_stride;
  }
  FMHA_DEVICE int64_t k_base(int b, int64_t batch_stride, int64_t row_stride) const {
    return varlen ? int64_t(k_first) * row_stride : int64_t(b) * batch_stride;
  }
};

FMHA_DEVICE Seq seq(const FwdParams& p, int b) {
  Seq s;
  s.varlen = p.cu_seqlens_q != nullptr;
  if (s.varlen) {
    s.q_first = p.cu_seqlens_q[b];
    s.k_first = p.cu_seqlens_k[b];
    s.sq = p.cu_seqlens_q[b + 1] - s.q_first;
    s.sk = p.cu_seqlens_k[b + 1] - s.k_first;
  } else {
    s.q_first = s.k_first = 0;
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
  }
  s.off = p.bottom_right ? s.sk - s.sq : 0;
  return s;
}

// Query i sees key j: inside the sequence and inside the window (design.md).
FMHA_DEVICE bool in_window(const FwdParams& p, const Seq& s, int i, int j) {
  return i < s.sq && j < s.sk && (p.window_left < 0 || j >= i + s.off - p.window_left) &&
         (p.window_right < 0 || j <= i + s.off + p.window_right);
}

constexpr float kLog2e = 1.4426950408889634f;

// The score of (query i, key j) in the log2 domain, exactly as the forward formed it from
// acc = q.k: scale, softcap, bias, ALiBi; `visible` narrowed by the boolean mask. dcap is
// d softcap(x) / dx = 1 - tanh^2 (1 without softcap): the backward's chain rule needs it.
FMHA_DEVICE float score_log2(const FwdParams& p, const Seq& s, float acc, int b, int h, int i,
                             int j, float slope, bool& visible, float& dcap) {
  float x = acc * float(p.scale);
  dcap = 1.0f;
  if (p.softcap > 0.0) {
    const float th = tanhf(x / float(p.softcap));
    x = float(p.softcap) * th;
    dcap = 1.0f - th * th;
  }
  // Rows past seqlen_q have no bias / mask entries in memory: never read them.
  if (visible && p.bias.ptr)
    x += bias_at(p.bias, b * p.bias.batch_stride + h * p.bias.head_stride +
                             i * p.bias.row_stride + j * p.bias.col_stride);
  x -= slope * fabsf(float(i + s.off - j));  // ALiBi: distance to the diagonal
  if (visible && p.mask.ptr)
    visible = static_cast<const uint8_t*>(p.mask.ptr)[b * p.mask.batch_stride +
                                                     h * p.mask.head_stride +
                                                     i * p.mask.row_stride +
                                                     j * p.mask.col_stride] != 0;
  return x * kLog2e;
}

FMHA_DEVICE float alibi_slope(const FwdParams& p, int b, int h) {
  return p.alibi_slopes ? float(p.alibi_slopes[b * p.alibi_batch_stride + h * p.alibi_head_stride])
                        : 0.0f;
}

// Dropout's keep decision for (b, h, i, j): word j % 4 of the Philox4x32-10 draw at counter
// (j / 4, i, b * heads_q + h, offset), key (seed, seed >> 32 + offset >> 32) -- the same
// function of its coordinates as fmha/philox.h's DropoutKey on the CPU.
FMHA_DEVICE bool dropout_keep(const FwdParams& p, int b, int h, int i, int j,
                              uint32_t threshold) {
  const uint32_t bh = uint32_t(b) * uint32_t(p.heads_q) + uint32_t(h);
  const Philox4 r = philox4x32_10(uint32_t(j >> 2), uint32_t(i), bh, uint32_t(p.offset),
                                  uint32_t(p.seed), uint32_t(p.seed >> 32) + uint32_t(p.offset >> 32));
  // Selects, not a runtime index into the draw (that would put it in local memory).
  const uint32_t w = (j & 2) ? ((j & 1) ? r.x[3] : r.x[2]) : ((j & 1) ? r.x[1] : r.x[0]);
  return w >= threshold;
}

FMHA_DEVICE uint32_t dropout_threshold(double p) {
  return uint32_t(fmin(p * 4294967296.0, 4294967295.0));
}

}  // namespace tile
}  // namespace gpu
}  // namespace fmha
