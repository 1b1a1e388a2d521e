// The per-score semantics of docs/semantics.md, one definition for every backend: the CPU
// tile code (csrc/cpu/tile.h) and the CUDA kernels (csrc/cuda/score.cuh) call these
// functions, host and device alike, so "which key may query i see", "what ALiBi adds" or
// "which dropout draw decides element (i, j)" is written once.
//
// For query row i and key j of one (batch, query head):
//   s = scale * q_i . k_j
//   s = softcap * tanh(s / softcap)            when softcap > 0
//   s = s + bias_ij - slope * |i + off - j|     additive bias, ALiBi
//   s = -inf unless visible(i, j) and mask_ij    window / causal, boolean mask
//   p = softmax_j(s), then dropout on p (kept values scaled by 1 / (1 - dropout_p))
// The kernels work in the log2 domain (exp(x) = exp2(x * log2 e)): kLog2e below.
#pragma once

#include <cmath>
#include <cstdint>

#include "fmha/params.h"
#include "fmha/philox.h"  // FMHA_HD, Philox4x32-10 and the per-ISA namespace tag

namespace fmha {
inline namespace FMHA_ISA_TAG {
namespace score {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;    // log(x) = log2(x) * kLn2

// One sequence of the batch: its lengths, where its rows start in the packed tensors
// (varlen) and the diagonal offset of causal / window / ALiBi. Positions inside the
// sequence (0..sq-1, 0..sk-1) are what the window, ALiBi, bias/mask and dropout see.
struct Seq {
  int sq = 0, sk = 0;
  int off = 0;  // sk - sq (bottom-right alignment) or 0 (top-left), + q_position - k_position
  int q_first = 0, k_first = 0;  // varlen: first packed row of q / k; else 0
};

FMHA_HD int clamp_to(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// ---- KV caches (docs/semantics.md, "KV caches"): sequence b holds cache_seqlens[b] +
// seqlen_new rows, the cached count clamped into [0, capacity - seqlen_new] like the varlen
// offsets (the host refuses other values before a kernel runs; the CUDA kernels, which do
// not read device memory on the host, refuse them on the device and must stay in bounds
// until they do).
FMHA_HD int cache_rows(const FwdParams& p, int b) {
  return clamp_to(p.cache_seqlens[b], 0, p.seqlen_k - p.seqlen_new) + p.seqlen_new;
}
// Element offset of cache row j of sequence b (head 0): b * batch_stride + j * row_stride
// for a contiguous cache; row j % block_size of block block_table[b][j / block_size] of a
// paged one (batch_stride then steps from block to block). Entries are trusted: callers
// check them first.
FMHA_HD int64_t cache_row_offset(const FwdParams& p, int b, int64_t batch_stride,
                                 int64_t row_stride, int j) {
  if (!p.block_table) return b * batch_stride + int64_t(j) * row_stride;
  const int block = p.block_table[b * p.block_table_stride + j / p.block_size];
  return block * batch_stride + int64_t(j % p.block_size) * row_stride;
}

// Varlen: offsets in device memory are never validated (reading them on the host would
// synchronise with the GPU), so each sequence is clamped here, once per CTA: first row into
// [0, total], end into [first, total], length capped at the maximum (seqlen_q / seqlen_k).
// Consistent offsets pass unchanged; with any others, every packed row a kernel touches
// exists and every per-sequence position stays below the maxima that size the bias, mask
// and scratch buffers. What the user gets: docs/semantics.md, "Variable-length batches".
FMHA_HD Seq seq_of(const FwdParams& p, int b) {
  Seq s;
  if (p.cu_seqlens_q) {
    s.q_first = clamp_to(p.cu_seqlens_q[b], 0, p.total_q);
    s.k_first = clamp_to(p.cu_seqlens_k[b], 0, p.total_k);
    const int q_end = clamp_to(p.cu_seqlens_q[b + 1], s.q_first, p.total_q);
    const int k_end = clamp_to(p.cu_seqlens_k[b + 1], s.k_first, p.total_k);
    s.sq = q_end - s.q_first < p.seqlen_q ? q_end - s.q_first : p.seqlen_q;
    s.sk = k_end - s.k_first < p.seqlen_k ? k_end - s.k_first : p.seqlen_k;
#if !defined(__CUDA_ARCH__)
  } else if (p.cache_seqlens) {
    // Host code only: the CUDA decode kernel (cuda/flash_decode.cuh) calls cache_rows itself,
    // and in the flash kernels, which never see a cache, the branch cost a register spill.
    s.sq = p.seqlen_q;
    s.sk = cache_rows(p, b);
#endif
  } else {
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
  }
  s.off = (p.bottom_right ? s.sk - s.sq : 0) + (p.q_position - p.k_position);
  return s;
}

// Element offset of row 0 of sequence s (batch index b) in a q-side / k-side tensor with
// these strides: packed rows when varlen (batch strides unused), else b * batch_stride.
// (Varlen is read from the params, not kept in Seq: on the GPU the params sit in the
// constant bank, and a flag kept live through a kernel's key loop costs a register.)
FMHA_HD int64_t q_base(const FwdParams& p, const Seq& s, int b, int64_t batch_stride,
                       int64_t row_stride) {
  return p.cu_seqlens_q ? int64_t(s.q_first) * row_stride : int64_t(b) * batch_stride;
}
FMHA_HD int64_t k_base(const FwdParams& p, const Seq& s, int b, int64_t batch_stride,
                       int64_t row_stride) {
  return p.cu_seqlens_q ? int64_t(s.k_first) * row_stride : int64_t(b) * batch_stride;
}

// ---- visibility: query i sees key j iff i + off - left <= j <= i + off + right, where
// left, right are the params' window_left, window_right (a negative side is unbounded;
// causal is right = 0), within the sequence. Two equivalent forms: a per-element test, and
// the row's key range. Each takes the window sides by value (kernels copy them into
// registers once) or reads them from the params.

// Key j is inside row i's window and the sequence's keys (the caller checks i < sq when
// rows past the sequence can reach it).
FMHA_HD bool key_visible(const Seq& s, int left, int right, int i, int j) {
  return j < s.sk && (left < 0 || j >= i + s.off - left) && (right < 0 || j <= i + s.off + right);
}
FMHA_HD bool visible(const FwdParams& p, const Seq& s, int i, int j) {
  return i < s.sq && key_visible(s, p.window_left, p.window_right, i, j);
}

// Keys visible to row i: [key_lo(i), key_hi(i)] (empty when lo > hi). Both bounds grow
// with i, so a block of rows visits one contiguous range of key blocks.
FMHA_HD int key_lo(const Seq& s, int left, int i) {
  const int lo = i + s.off - left;
  return left < 0 || lo < 0 ? 0 : lo;
}
FMHA_HD int key_hi(const Seq& s, int right, int i) {
  const int hi = i + s.off + right;
  return right < 0 || hi > s.sk - 1 ? s.sk - 1 : hi;
}
FMHA_HD int key_lo(const FwdParams& p, const Seq& s, int i) { return key_lo(s, p.window_left, i); }
FMHA_HD int key_hi(const FwdParams& p, const Seq& s, int i) { return key_hi(s, p.window_right, i); }
// Rows that see at least one key of [j0, j1]: [query_lo(j0), query_hi(j1)].
FMHA_HD int query_lo(const FwdParams& p, const Seq& s, int j0) {
  const int lo = j0 - s.off - p.window_right;
  return p.window_right < 0 || lo < 0 ? 0 : lo;
}
FMHA_HD int query_hi(const FwdParams& p, const Seq& s, int j1) {
  const int hi = j1 - s.off + p.window_left;
  return p.window_left < 0 || hi > s.sq - 1 ? s.sq - 1 : hi;
}

// ---- softcap (Gemma 2 / Grok logit capping): s = cap * tanh(s / cap). `t` receives
// tanh(s / cap), from which the backward forms d softcap / ds = 1 - t^2.
FMHA_HD float tanh_of(float x) { return tanhf(x); }
FMHA_HD double tanh_of(double x) { return tanh(x); }

template <typename A>
FMHA_HD A softcap(A x, A cap, A& t) {
  t = tanh_of(x / cap);
  return cap * t;
}
template <typename A>
FMHA_HD A softcap_grad(A t) { return A(1) - t * t; }

// ---- ALiBi (Press et al. 2022): the bias -slope * |i + off - j|, distance to the diagonal.
FMHA_HD double alibi_slope(const FwdParams& p, int b, int h) {
  return p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h * p.alibi_head_stride]
                        : 0.0;
}
template <typename A>
FMHA_HD A alibi(A slope, const Seq& s, int i, int j) {
  const A distance = A(i + s.off - j);
  return -slope * (distance < A(0) ? -distance : distance);
}

// ---- bias and mask: element offset of (b, h, i, j) in a broadcast operand (zero strides
// on its broadcast dimensions). A mask element allows attention iff it is nonzero.
FMHA_HD int64_t offset_of(const Broadcast4& x, int b, int h, int i, int j) {
  return b * x.batch_stride + h * x.head_stride + int64_t(i) * x.row_stride +
         int64_t(j) * x.col_stride;
}
FMHA_HD bool mask_allows(const Broadcast4& mask, int b, int h, int i, int j) {
  return static_cast<const uint8_t*>(mask.ptr)[offset_of(mask, b, h, i, j)] != 0;
}

// ---- block-sparse masks (params.h, BlockSparse): the entry of block (qb, kb) of (b, h).
// (32-bit offsets: the bindings keep the index and the partial masks under 2^31 elements,
// and the kernels call these per element, at their register limit.)
FMHA_HD int32_t block_entry(const BlockSparse& m, int b, int h, int qb, int kb) {
  return m.index[int(b * m.batch_stride + h * m.head_stride) + qb * m.k_blocks + kb];
}
// Whether pair (i, j) of (b, h) may attend under the block mask (i, j inside the sequence).
// An entry past the partial masks (the host checks host arrays; device ones are never read
// there) reads as empty: no access leaves the buffers.
FMHA_HD bool block_mask_allows(const BlockSparse& m, int b, int h, int i, int j) {
  const unsigned bq = unsigned(m.block_q), bk = unsigned(m.block_k);
  const unsigned qb = unsigned(i) / bq, kb = unsigned(j) / bk;
  const int32_t e = block_entry(m, b, h, int(qb), int(kb));
  if (e < 0 || e >= m.num_partial) return e == kBlockFull;
  return m.partial[(unsigned(e) * bq + (unsigned(i) - qb * bq)) * bk + (unsigned(j) - kb * bk)] != 0;
}
// What a kernel tile of rows [i0, i1] x keys [j0, j1] (inclusive, inside the sequence) meets:
// only empty blocks (skip it), only full ones (no element test), or some partial or mixed
// ones (test each pair with block_mask_allows). Empty ranges are empty tiles.
enum TileKind : int { kTileEmpty = 0, kTileFull = 1, kTilePartial = 2 };
FMHA_HD int block_tile_kind(const BlockSparse& m, int b, int h, int i0, int i1, int j0, int j1) {
  if (i1 < i0 || j1 < j0) return kTileEmpty;
  bool live = false, full = true;
  for (int qb = i0 / m.block_q; qb <= i1 / m.block_q; ++qb)
    for (int kb = j0 / m.block_k; kb <= j1 / m.block_k; ++kb) {
      const int32_t e = block_entry(m, b, h, qb, kb);
      live = live || e != kBlockEmpty;
      full = full && e == kBlockFull;
    }
  return !live ? kTileEmpty : full ? kTileFull : kTilePartial;
}

// ---- dropout: element (b, h, i, j) of query head h is kept iff word j % 4 of the
// Philox4x32-10 draw at counter (j / 4, i, b * heads_q + h, lo32(offset)), key
// (lo32(seed), hi32(seed) + hi32(offset)), is >= dropout_threshold(p). The mask is a pure
// function of its coordinates: the same on every backend, tiling and thread count
// (python/fmha/_philox.py implements the same and checks it against Random123's vectors).
// For a block of a larger attention (params.h: q_position, ...) the coordinates are the
// whole attention's: (j + k_position, i + q_position, b * heads_total + head_position + h);
// k_position is a multiple of 4 there (check_params), so a draw's four keys stay together.
//
// The draw that decides keys 4 * (j / 4) .. 4 * (j / 4) + 3 of row i. Key and counter are
// formed from the params at each draw: on the GPU the params sit in the constant bank, and
// holding them in registers instead cost the kernels registers.
FMHA_HD Philox4 dropout_draw(const FwdParams& p, int b, int h, int i, int j) {
  const uint32_t heads = uint32_t(p.heads_total ? p.heads_total : p.heads_q);
  const uint32_t bh = uint32_t(b) * heads + uint32_t(p.head_position + h);
  return philox4x32_10(uint32_t(j + p.k_position) >> 2, uint32_t(i + p.q_position), bh,
                       uint32_t(p.offset), uint32_t(p.seed),
                       uint32_t(p.seed >> 32) + uint32_t(p.offset >> 32));
}
// Word w (0..3) of a draw, by selects: a runtime index into the draw would put it in
// local memory on the GPU.
FMHA_HD uint32_t draw_word(const Philox4& r, int w) {
  return (w & 2) ? ((w & 1) ? r.x[3] : r.x[2]) : ((w & 1) ? r.x[1] : r.x[0]);
}
// threshold = dropout_threshold(p.dropout_p): a draw below it drops the element.
FMHA_HD bool dropout_keep(const FwdParams& p, uint32_t threshold, int b, int h, int i, int j) {
  return draw_word(dropout_draw(p, b, h, i, j), j & 3) >= threshold;
}
// Keys j and j + 1 (j even) of row i share one draw, words 0, 1 or 2, 3: bit 0 keeps j,
// bit 1 keeps j + 1.
FMHA_HD uint32_t dropout_keep_pair(const FwdParams& p, uint32_t threshold, int b, int h, int i,
                                   int j) {
  const Philox4 r = dropout_draw(p, b, h, i, j);
  const bool upper = (j & 2) != 0;
  return uint32_t((upper ? r.x[2] : r.x[0]) >= threshold) |
         (uint32_t((upper ? r.x[3] : r.x[1]) >= threshold) << 1);
}

}  // namespace score
}  // namespace FMHA_ISA_TAG
}  // namespace fmha
