// Tile machinery shared by the CPU forward and backward: loading tiles into the accumulation
// type, and the score pipeline of csrc/fmha/score.h
//   S = scale * Q Kᵀ  ->  softcap  ->  + bias + ALiBi  ->  mask (-inf)
// applied to one (rows x cols) tile. Included once per ISA (FMHA_CPU_ISA_NS) so every loop
// here is compiled, and vectorised, with that ISA's flags.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/vexp.h"
#include "fmha/numeric.h"
#include "fmha/params.h"
#include "fmha/score.h"

#ifndef FMHA_CPU_ISA_NS
#error "include through csrc/cpu/instantiate_<isa>.cpp"
#endif

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// Tile shape. Br query rows share every K/V tile loaded, so larger Br means fewer K/V
// conversions per flop; Br x Bc floats of S (8 KiB) plus the Q, K, V tiles stay in L1/L2 for
// head_dim <= 128.
constexpr int kBr = 64;
constexpr int kBc = 64;

// The sequence, window bounds, softcap, ALiBi and dropout draws of the score semantics
// (csrc/fmha/score.h), shared with the CUDA kernels.
using score::Seq;
using score::seq_of;
using score::key_lo;
using score::key_hi;
using score::query_lo;
using score::query_hi;

// Element offset of row `i` of sequence b in a (batch, seqlen, heads, dim) tensor.
inline int64_t row_offset(const FwdParams& p, int b, int64_t batch_stride, int64_t row_stride,
                          int64_t first_row_of_seq, int i) {
  return p.cu_seqlens_q ? (first_row_of_seq + i) * row_stride
                        : b * batch_stride + int64_t(i) * row_stride;
}

// ---- key/value rows, from ordinary k/v, contiguous caches and paged caches alike.
// `base` points at the kv head's row 0 (head offset applied); batch_stride / row_stride are
// the tensor's (for a paged cache, batch_stride steps from one block to the next).

// Element offset of key row j of sequence b.
inline int64_t key_row_offset(const FwdParams& p, const Seq& s, int b, int64_t batch_stride,
                              int64_t row_stride, int j) {
  if (p.block_table) {
    const int32_t* table = p.block_table + b * p.block_table_stride;
    // The host checked the table; clamping keeps a stray entry inside the pool regardless.
    const int block = score::clamp_to(table[j / p.block_size], 0, p.num_blocks - 1);
    return block * batch_stride + int64_t(j % p.block_size) * row_stride;
  }
  return row_offset(p, b, batch_stride, row_stride, s.k_first, j);
}

// Key rows [j0, j0 + n) of sequence b as n rows `*stride` elements apart: in place when they
// are equally spaced in memory (always, but for a paged cache whose rows cross into a block
// that does not follow the previous one), else gathered into `stage` (n x dim). The values,
// hence every result, are the same either way: paged and contiguous caches holding the same
// rows give bitwise-equal outputs.
template <typename T>
inline const T* key_rows(const FwdParams& p, const Seq& s, int b, const T* base,
                         int64_t batch_stride, int64_t row_stride, int j0, int n, int dim,
                         T* stage, int64_t* stride) {
  *stride = row_stride;
  if (!p.block_table) return base + row_offset(p, b, batch_stride, row_stride, s.k_first, j0);
  const int bs = p.block_size, first = j0 / bs, last = (j0 + n - 1) / bs;
  bool in_place = first == last || batch_stride == bs * row_stride;
  const int32_t* table = p.block_table + b * p.block_table_stride;
  for (int i = first + 1; in_place && i <= last; ++i) in_place = table[i] == table[i - 1] + 1;
  if (in_place) return base + key_row_offset(p, s, b, batch_stride, row_stride, j0);
  for (int r = 0; r < n; ++r)
    std::memcpy(stage + int64_t(r) * dim,
                base + key_row_offset(p, s, b, batch_stride, row_stride, j0 + r),
                size_t(dim) * sizeof(T));
  *stride = dim;
  return stage;
}

// Asks for every 64-byte line of n rows of `bytes` bytes, `stride` elements apart, to be
// brought towards L2 ahead of use. One head's rows of a (batch, seq, heads, dim) tensor lie a
// whole row of all heads apart, often a page or more: the hardware prefetchers, which stop at
// page boundaries, do not follow them.
template <typename T>
inline void prefetch_rows(const T* src, int64_t stride, int n, int bytes) {
  for (int r = 0; r < n; ++r) {  // every line the row touches, wherever it starts
    const uintptr_t row = reinterpret_cast<uintptr_t>(src + r * stride);
    for (uintptr_t line = row & ~uintptr_t(63); line < row + uintptr_t(bytes); line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
  }
}

// A per-thread bump allocator for tile buffers: no allocation inside the loops, memory
// O(tile) per thread whatever the sequence length.
class Workspace {
 public:
  template <typename A>
  static int64_t bytes(int64_t n) { return (n * int64_t(sizeof(A)) + 63) / 64 * 64; }

  // Starts a task that will take at most `total` bytes: buffers never move while in use.
  void begin(int64_t total) {
    used_ = 0;
    if (total > int64_t(buf_.size()) * 64) buf_.resize(size_t(total / 64 + 1));
  }

  template <typename A>
  A* take(int64_t n) {
    const int64_t need = bytes<A>(n);
    if (used_ + need > int64_t(buf_.size()) * 64) std::abort();  // begin() sized it wrongly
    A* out = reinterpret_cast<A*>(reinterpret_cast<char*>(buf_.data()) + used_);
    used_ += need;
    return out;
  }

 private:
  struct alignas(64) Line { char b[64]; };
  std::vector<Line> buf_;
  int64_t used_ = 0;
};

inline Workspace& thread_workspace() {
  thread_local Workspace ws;
  return ws;
}

// Copies rows [0, n) of a (rows, dim) slice with element row stride `stride` into a dense
// (n, ld) buffer of the accumulation type, zero-filling columns [dim, ld).
template <typename T, typename A>
inline void load_rows(const T* src, int64_t stride, int n, int dim, A* dst, int ld) {
  for (int r = 0; r < n; ++r) {
    const T* s = src + r * stride;
    A* d = dst + int64_t(r) * ld;
#pragma omp simd
    for (int t = 0; t < dim; ++t) d[t] = to_acc<A>(s[t]);
    for (int t = dim; t < ld; ++t) d[t] = A(0);
  }
}

#if defined(FMHA_SIMD_AVX512)
// Sixteen elements as floats (exact widening).
inline __m512 floats16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 floats16(const bf16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 floats16(const f16_t* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

#endif

// Copies rows [0, n) of a (rows, dim) slice into the transposed dense buffer dst[t * ld + r]
// (the B operand of S = Q Kᵀ and dP = dO Vᵀ).
template <typename T, typename A>
inline void load_rows_t(const T* src, int64_t stride, int n, int dim, A* dst, int ld) {
  int r0 = 0;
#if defined(FMHA_SIMD_AVX512)
  if constexpr (std::is_same_v<A, float> && !std::is_same_v<T, double>) {
    for (; r0 + 16 <= n; r0 += 16) {  // 16 x 16 blocks through registers
      const T* s = src + r0 * stride;
      int t = 0;
      for (; t + 16 <= dim; t += 16) {
        __m512 x[16];
        for (int i = 0; i < 16; ++i) x[i] = floats16(s + i * stride + t);
        transpose16(x);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + int64_t(t + i) * ld + r0, x[i]);
      }
      for (; t < dim; ++t)
        for (int i = 0; i < 16; ++i) dst[int64_t(t) * ld + r0 + i] = to_acc<A>(s[i * stride + t]);
    }
  }
#endif
  for (int r = r0; r < n; ++r) {
    const T* s = src + r * stride;
    for (int t = 0; t < dim; ++t) dst[int64_t(t) * ld + r] = to_acc<A>(s[t]);
  }
  for (int t = 0; t < dim; ++t)
    for (int r = n; r < ld; ++r) dst[int64_t(t) * ld + r] = A(0);
}

// Multiplies rows [0, n) of a dense (n, ld) buffer by x.
template <typename A>
inline void scale_rows(A* buf, int n, int dim, int ld, A x) {
  for (int r = 0; r < n; ++r) {
    A* row = buf + int64_t(r) * ld;
#pragma omp simd
    for (int t = 0; t < dim; ++t) row[t] *= x;
  }
}

template <typename T, typename A>
inline void store_row(const A* src, int dim, T* dst) {
#pragma omp simd
  for (int t = 0; t < dim; ++t) dst[t] = Store<T>::from(src[t]);
}

template <typename A>
inline A neg_inf() { return -std::numeric_limits<A>::infinity(); }

// Own loops rather than std::fill: a std template instantiated in several ISA translation
// units is one symbol, and the linker may keep the AVX-512 copy for the portable kernels.
template <typename A>
inline void fill(A* x, int64_t n, A value) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

// Adds a broadcast bias tile (any float dtype) to S. A -inf bias masks its pair: the score
// becomes -inf even where q·k is +inf or NaN.
template <typename B, typename A>
inline void add_bias(const Broadcast4& bias, int b, int h, int i0, int nr, int j0, int nc,
                     A* S, int64_t rs, int64_t cs) {
  const B* base = static_cast<const B*>(bias.ptr) + b * bias.batch_stride + h * bias.head_stride;
  for (int r = 0; r < nr; ++r) {
    const B* row = base + int64_t(i0 + r) * bias.row_stride + int64_t(j0) * bias.col_stride;
    for (int c = 0; c < nc; ++c) {
      const A x = to_acc<A>(row[c * bias.col_stride]);
      A& y = S[r * rs + c * cs];
      y = x == neg_inf<A>() ? x : y + x;
    }
  }
}

// Whether the tile of rows i0..i0+nr, keys j0..j0+nc lies inside every row's window. Both
// window edges grow with the row, so it does iff it is inside the last row's left edge and
// the first row's right edge.
inline bool inside_window(const FwdParams& p, const Seq& s, int i0, int nr, int j0, int nc) {
  return j0 >= key_lo(p, s, i0 + nr - 1) && j0 + nc - 1 <= key_hi(p, s, i0);
}

// Non-finite inputs (docs/semantics.md): an excluded pair -- outside the row's window,
// masked, or given -inf by the bias -- contributes nothing, and neither does a dropped pair
// to P V and Pᵀ dO, even against a NaN or Inf row of the other operand, where a GEMM would
// make 0 * NaN = NaN. Only tiles that may hold such pairs need care, and only when the
// streamed operand holds a non-finite value, which `has_nonfinite` checks at the cost of one
// read of that tile. Those rare tiles take `gemm_strong_zero` instead of the GEMM.
// Whether finish_scores leaves the tile's scores as they are: no softcap, bias, ALiBi, block
// mask or mask, and the tile inside every row's window.
inline bool scores_untouched(const FwdParams& p, const Seq& s, int i0, int nr, int j0, int nc) {
  return !(p.softcap > 0) && !p.bias.ptr && !p.alibi_slopes && !p.block_mask.index &&
         !p.mask.ptr && inside_window(p, s, i0, nr, j0, nc);
}

inline bool tile_may_zero(const FwdParams& p, const Seq& s, int i0, int nr, int j0, int nc) {
  return p.bias.ptr || p.mask.ptr || p.block_mask.index || p.dropout_p > 0 ||
         !inside_window(p, s, i0, nr, j0, nc);
}

// Whether the block-sparse mask (params.h) leaves the tile of rows i0..i0+nr, keys
// j0..j0+nc of head h with nothing to attend: such a tile is skipped, its scores being -inf
// (which adds exact zeros to every sum: skipping it changes no bit).
inline bool tile_skipped(const FwdParams& p, int b, int h, int i0, int nr, int j0, int nc) {
  return p.block_mask.index && score::block_tile_kind(p.block_mask, b, h, i0, i0 + nr - 1, j0,
                                                      j0 + nc - 1) == score::kTileEmpty;
}

// Whether rows [0, n) x [0, dim) of x hold a NaN or Inf. Vectorised: it runs on every tile
// that may hold excluded pairs (a boolean mask makes that every tile). x - x is 0 for a
// finite x and NaN otherwise, so one sum per row tells.
inline bool has_nonfinite(const float* x, int64_t stride, int n, int dim) {
  const int dw = dim / kW * kW;
  VecF acc = VecF::zero();
  float tail = 0.f;
  for (int r = 0; r < n; ++r) {
    const float* row = x + r * stride;
    for (int t = 0; t < dw; t += kW) {
      const VecF v = VecF::load(row + t);
      acc = acc + (v - v);
    }
    for (int t = dw; t < dim; ++t) tail += row[t] - row[t];
  }
  const float sum = hsum(acc) + tail;
  return sum != sum;
}
inline bool has_nonfinite(const double* x, int64_t stride, int n, int dim) {
  double acc = 0;
  for (int r = 0; r < n; ++r)
    for (int t = 0; t < dim; ++t) acc += x[r * stride + t] - x[r * stride + t];
  return acc != acc;
}
// 16-bit floats: the exponent bits all set (Inf or NaN), checked on the bits.
// The maxima of 32 lanes are kept across rows and reduced once at the end: reduced per row
// (an omp simd reduction each), they made a dependent chain of ~20 cycles a row.
template <typename T>
inline bool has_nonfinite(const T* x, int64_t stride, int n, int dim) {
  constexpr uint16_t exp = std::is_same_v<T, bf16_t> ? 0x7f80 : 0x7c00;
  constexpr int kLanes = 32;
  const int dw = dim / kLanes * kLanes;
  uint16_t lanes[kLanes] = {};
  uint16_t top = 0;
  for (int r = 0; r < n; ++r) {
    const T* row = x + r * stride;
    for (int t = 0; t < dw; t += kLanes)
#pragma omp simd
      for (int l = 0; l < kLanes; ++l)
        lanes[l] = std::max<uint16_t>(lanes[l], row[t + l].bits & exp);
    for (int t = dw; t < dim; ++t) top = std::max<uint16_t>(top, row[t].bits & exp);
  }
  for (int l = 0; l < kLanes; ++l) top = std::max(top, lanes[l]);
  return top == exp;
}

inline double bias_value(const Broadcast4& bias, int b, int h, int i, int j) {
  const int64_t o = score::offset_of(bias, b, h, i, j);
  switch (bias.dtype) {
    case DType::kFloat64: return static_cast<const double*>(bias.ptr)[o];
    case DType::kFloat32: return static_cast<const float*>(bias.ptr)[o];
    case DType::kBFloat16: return to_acc<double>(static_cast<const bf16_t*>(bias.ptr)[o]);
    case DType::kFloat16: return to_acc<double>(static_cast<const f16_t*>(bias.ptr)[o]);
  }
  return 0;
}

// Whether pair (i, j) of head h is excluded; with `or_dropped`, also whether it is dropped.
inline bool pair_excluded(const FwdParams& p, const Seq& s, int b, int h, int i, int j,
                          bool or_dropped) {
  if (j < key_lo(p, s, i) || j > key_hi(p, s, i)) return true;
  if (p.mask.ptr && !score::mask_allows(p.mask, b, h, i, j)) return true;
  if (p.block_mask.index && !score::block_mask_allows(p.block_mask, b, h, i, j)) return true;
  if (p.bias.ptr && bias_value(p.bias, b, h, i, j) == -std::numeric_limits<double>::infinity())
    return true;
  return or_dropped && p.dropout_p > 0 &&
         !score::dropout_keep(p, dropout_threshold(p.dropout_p), b, h, i, j);
}

// C(m, :dim) += Σ_k W(m, k) B(k, :dim) for m < M, k < K (W(m, k) = W[m * rs + k * cs]),
// skipping the pairs for which skip(m, k) is true; B's rows are read in place from the
// input (row stride b_stride). Every other product is plain IEEE arithmetic.
template <typename T, typename A, typename Skip>
inline void gemm_strong_zero(int M, int dim, int K, const A* W, int64_t rs, int64_t cs,
                             const T* B, int64_t b_stride, A* C, int64_t ldc, Skip skip) {
  for (int m = 0; m < M; ++m) {
    A* out = C + int64_t(m) * ldc;
    for (int k = 0; k < K; ++k) {
      if (skip(m, k)) continue;
      const A w = W[m * rs + k * cs];
      const T* row = B + k * b_stride;
      for (int t = 0; t < dim; ++t) out[t] += w * to_acc<A>(row[t]);
    }
  }
}

// The block-sparse mask on a tile (S(r, c) = S[r * rs + c * cs], rows i0.., keys j0..): block
// by block, nothing where a block is full, -inf over an empty one, the element mask of a
// partial one.
template <typename A>
inline void apply_block_mask(const BlockSparse& m, int b, int h, int i0, int nr, int j0, int nc,
                             A* S, int64_t rs, int64_t cs) {
  for (int qb = i0 / m.block_q; qb * m.block_q < i0 + nr; ++qb) {
    const int r0 = std::max(qb * m.block_q, i0), r1 = std::min((qb + 1) * m.block_q, i0 + nr);
    for (int kb = j0 / m.block_k; kb * m.block_k < j0 + nc; ++kb) {
      const int c0 = std::max(kb * m.block_k, j0), c1 = std::min((kb + 1) * m.block_k, j0 + nc);
      const int32_t e = score::block_entry(m, b, h, qb, kb);
      if (e == kBlockFull) continue;
      const uint8_t* bits =
          e >= 0 && e < m.num_partial ? m.partial + int64_t(e) * m.block_q * m.block_k : nullptr;
      for (int i = r0; i < r1; ++i) {
        const uint8_t* row = bits ? bits + int64_t(i - qb * m.block_q) * m.block_k : nullptr;
        for (int j = c0; j < c1; ++j)
          if (!row || !row[j - kb * m.block_k]) S[(i - i0) * rs + (j - j0) * cs] = neg_inf<A>();
      }
    }
  }
}

// The score pipeline after S = scale * Q Kᵀ (a GEMM, gemm.h) on the tile rows i0..i0+nr of
// query head h, keys j0..j0+nc of sequence b: softcap, bias, ALiBi, then invisible entries
// to -inf. S(r, c) is S[r * rs + c * cs]: the forward keeps Sᵀ (rs = 1), so the softmax runs
// across rows in vectors. Each stage runs only when it is on, and the visibility pass is
// skipped for tiles that lie entirely inside every row's window. When softcap is on, Tcap
// (if given, same layout) receives tanh(raw / softcap) for the softcap gradient.
template <typename A>
inline void finish_scores(const FwdParams& p, const Seq& s, int b, int h, int i0, int nr, int j0,
                          int nc, A* S, int64_t rs, int64_t cs, A* Tcap) {
  if (p.softcap > 0) {
    const A cap = A(p.softcap);
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < nr; ++r) {
        A& x = S[r * rs + c * cs];
        A t;
        x = score::softcap(x, cap, t);
        if (Tcap) Tcap[r * rs + c * cs] = t;
      }
  }
  if (p.bias.ptr) {
    switch (p.bias.dtype) {
      case DType::kFloat64: add_bias<double>(p.bias, b, h, i0, nr, j0, nc, S, rs, cs); break;
      case DType::kFloat32: add_bias<float>(p.bias, b, h, i0, nr, j0, nc, S, rs, cs); break;
      case DType::kBFloat16: add_bias<bf16_t>(p.bias, b, h, i0, nr, j0, nc, S, rs, cs); break;
      case DType::kFloat16: add_bias<f16_t>(p.bias, b, h, i0, nr, j0, nc, S, rs, cs); break;
    }
  }
  if (p.alibi_slopes) {
    const A slope = A(score::alibi_slope(p, b, h));
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < nr; ++r) S[r * rs + c * cs] += score::alibi(slope, s, i0 + r, j0 + c);
  }
  // Visibility: the window (causal is its right edge at 0) and the boolean mask.
  if (!inside_window(p, s, i0, nr, j0, nc)) {
    for (int r = 0; r < nr; ++r) {
      const int i = i0 + r, lo = key_lo(p, s, i), hi = key_hi(p, s, i);
      for (int c = 0; c < nc; ++c) {
        const int j = j0 + c;
        if (j < lo || j > hi) S[r * rs + c * cs] = neg_inf<A>();
      }
    }
  }
  if (p.block_mask.index) apply_block_mask(p.block_mask, b, h, i0, nr, j0, nc, S, rs, cs);
  if (!p.mask.ptr) return;
  // score::mask_allows, with the tile's base address formed once.
  const uint8_t* m0 =
      static_cast<const uint8_t*>(p.mask.ptr) + score::offset_of(p.mask, b, h, 0, j0);
  if (p.mask.row_stride == 0) {
    // A key-padding mask (the same for every row): one look at the tile's keys, and masked
    // keys blank whole columns; a tile of all-visible keys costs a memchr.
    if (p.mask.col_stride == 1 && !std::memchr(m0, 0, size_t(nc))) return;
    for (int c = 0; c < nc; ++c)
      if (!m0[c * p.mask.col_stride])
        for (int r = 0; r < nr; ++r) S[r * rs + c * cs] = neg_inf<A>();
    return;
  }
  for (int r = 0; r < nr; ++r) {
    const uint8_t* m = m0 + int64_t(i0 + r) * p.mask.row_stride;
    for (int c = 0; c < nc; ++c)
      if (!m[c * p.mask.col_stride]) S[r * rs + c * cs] = neg_inf<A>();
  }
}

// Dropout on one tile row: multiplies P[c * stride] (key j0 + c of row i) by 1/(1-p) where
// kept and by 0 where dropped (score::dropout_keep), one Philox draw per four keys.
template <typename A>
inline void dropout_row(const FwdParams& p, int b, int h, int i, int j0, int nc, A* P,
                        int64_t stride = 1) {
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const A keep_scale = A(1.0 / (1.0 - p.dropout_p));
  int c = 0;
  while (c < nc) {
    const int j = j0 + c;
    const Philox4 r = score::dropout_draw(p, b, h, i, j);
    for (int w = j & 3; w < 4 && c < nc; ++w, ++c)
      P[c * stride] = r.x[w] >= threshold ? P[c * stride] * keep_scale : A(0);
  }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
