// The CPU forward: FlashAttention-2 (Dao 2023, Algorithm 1) on the CPU.
//
// One task = one tile of kBr query rows of one (batch, query head). The task streams the
// key/value tiles its rows can see, keeping the running row maximum m, the running
// normaliser l and the unnormalised output O in the accumulation type (the online softmax,
// Milakov & Gimelshein 2018), and normalises once at the end. Extra memory is O(tile) per
// thread; no seqlen_q x seqlen_k buffer exists.
#pragma once

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/amx_gemm.h"
#include "cpu/bf16_pairs.h"
#include "cpu/dequant.h"
#include "cpu/kernels.h"
#include "cpu/softmax.h"
#include "cpu/tile.h"
#include "fmha/api.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// Rows of the current tile as the accumulation type: read in place when the input already
// is (float32/float64 with a unit last stride), converted into `buf` (leading dimension `ld`)
// otherwise. A GEMM B operand is re-read once per row block of the micro-kernel, so it must
// have rows padded to the vector width, and (`dense`) stay in L1: then it is read in place
// only when it is already dense (stride == ld). In place at the usual strides of (batch,
// seq, heads, dim) tensors -- 2 KiB for 8 heads of 64 floats -- a 64-row tile falls into a
// few cache sets and evicts itself from L1 on every row block on some cores
// (docs/cpu_kernels.md, "The forward"). Either way the values are the same.
template <typename T, typename A>
inline const A* rows_as_acc(const T* src, int64_t stride, int n, int dim, A* buf, int ld,
                            int64_t* out_stride, bool b_operand, bool dense = true) {
  if constexpr (std::is_same_v<T, A>) {
    if (!b_operand || (dim == ld && (!dense || stride == ld))) {
      *out_stride = stride;
      return src;
    }
  }
  load_rows(src, stride, n, dim, buf, ld);
  *out_stride = ld;
  return buf;
}

// Where the lse of query i of head h lives: (batch, heads_q, seqlen_q), or (heads_q, total_q)
// when varlen.
template <typename A>
inline A* lse_at(const FwdParams& p, const Seq& s, int b, int h, int i) {
  return static_cast<A*>(p.lse) + h * p.lse_head_stride +
         (p.cu_seqlens_q ? (s.q_first + i) * p.lse_row_stride
                         : b * p.lse_batch_stride + int64_t(i) * p.lse_row_stride);
}

// The forward's softmax takes exp_lean (vexp.h) when the inputs are 16-bit: its 4e-6 relative
// error is far below their rounding, and the softmax bounds the 16-bit forward after its products.
template <typename T>
constexpr bool kLeanExp = sizeof(T) == 2;

// V's key tiles as pair words (the bfloat16 pair path's B of O += P V), kept by each thread
// across the query tiles of one (call, batch, kv head) that it runs back to back (a head's
// tasks are adjacent): packed once per key tile and thread instead of once per (query tile,
// key tile), which cost the bfloat16 forward ~5% (docs/cpu_kernels.md, "The
// forward"). A tile is the very words pack_row_pairs gives it, looked up by its
// start (a multiple of kBc) and its key count. A head whose tiles take more than
// kPackedVBytes is packed per tile as before; up to that much stays allocated per thread
// between calls, as the thread's workspace does.
struct PackedVTiles {
  uint64_t call = 0;
  int b = -1, hk = -1;
  std::vector<uint32_t> words;  // tile t at t * (kBc / 2) * ldv
  std::vector<int> keys;        // key count tile t was packed with; 0: not packed
};
constexpr int64_t kPackedVBytes = int64_t(4) << 20;
// Each call's tag for PackedVTiles: V may change between calls at the same address.
inline std::atomic<uint64_t> g_forward_calls{0};

// The pair words of V's key tile [j0, j0 + nc) of (b, hk) (rows vj, stride vs): from this
// thread's PackedVTiles when the tile can be kept there (V read where it lies: not an 8-bit
// cache's decoded rows, not a paged cache; a tile-aligned start; V small enough), else
// packed into `scratch` as every tile was before.
// pad_to: the pair rows the caller reads (the tiles' whole 16-row steps); rows past the
// tile's (nc + 1) / 2 up to it are zero.
template <typename T>
inline const uint32_t* v_pair_tile(const FwdParams& p, const Seq& s, int b, int hk, uint64_t call,
                                   int j0, int nc, const T* vj, int64_t vs, uint32_t* scratch,
                                   int ldv, int pad_to = 0) {
  auto zero_pad = [&](uint32_t* words) {
    for (int kp = (nc + 1) / 2; kp < pad_to; ++kp)
      std::memset(words + int64_t(kp) * ldv, 0, size_t(ldv) * sizeof(uint32_t));
    return words;
  };
  const int64_t tile_words = int64_t(kBc / 2) * ldv;
  const int64_t n_tiles = (int64_t(s.sk) + kBc - 1) / kBc;
  if (p.kv_code != KvCode::kNone || p.block_table || j0 % kBc != 0 ||
      n_tiles * tile_words * int64_t(sizeof(uint32_t)) > kPackedVBytes) {
    pack_row_pairs(vj, vs, nc, p.head_dim_v, scratch, ldv);
    return zero_pad(scratch);
  }
  thread_local PackedVTiles cache;
  if (cache.call != call || cache.b != b || cache.hk != hk) {
    cache.call = call;
    cache.b = b;
    cache.hk = hk;
    cache.keys.assign(size_t(n_tiles), 0);
    if (cache.words.size() < size_t(n_tiles * tile_words)) cache.words.resize(size_t(n_tiles * tile_words));
  }
  uint32_t* words = cache.words.data() + int64_t(j0 / kBc) * tile_words;
  int& packed = cache.keys[size_t(j0 / kBc)];
  if (packed != nc) {  // a tile is packed for one key count; another count packs it anew
    pack_row_pairs(vj, vs, nc, p.head_dim_v, words, ldv);
    packed = nc;
  }
  return zero_pad(words);
}

// Tiles: NoTiles, or the AMX backend (amx_gemm.h) whose tiles take S and P V of bfloat16
// inputs at the amx level; everything else (softmax, masks, every score.h feature, the strong
// zero, 8-bit caches' factors) is the same code either way.
template <typename T, class Tiles = NoTiles>
void forward_task(const FwdParams& p, int64_t task, bool dense_v, uint64_t call) {
  using A = acc_t<T>;
  const int n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int b = int(task / (int64_t(p.heads_q) * n_qblocks));
  const int h = int(task / n_qblocks % p.heads_q);
  const int i0 = int(task % n_qblocks) * kBr;
  const Seq s = seq_of(p, b);
  if (i0 >= s.sq) return;  // varlen: this sequence is shorter than the longest
  const int nr = std::min(kBr, s.sq - i0), nrp = padded<A>(nr);
  const int hk = h / (p.heads_q / p.heads_kv);  // GQA: query head h reads kv head hk
  const int d = p.head_dim, dv = p.head_dim_v, ldv = padded<A>(dv);

  constexpr bool tiles = !std::is_same_v<Tiles, NoTiles>;
  // The tiles' reduction runs in whole steps of 16 pairs: Q's pair rows (and K's repacked
  // words) padded with zeros to kpad.
  const int kpad = tiles ? tiles_for((d + 1) / 2) * kTilePairs : (d + 1) / 2;
  Workspace& ws = thread_workspace();
  ws.begin(Workspace::bytes<A>(int64_t(d) * kBr) + Workspace::bytes<A>(int64_t(kBc) * d) +
           Workspace::bytes<A>(int64_t(kBc) * ldv) + Workspace::bytes<A>(kBc * kBr) +
           Workspace::bytes<A>(int64_t(kBr) * ldv) + 3 * Workspace::bytes<A>(kBr) +
           Workspace::bytes<uint32_t>(int64_t(kpad) * kBr) +
           Workspace::bytes<uint32_t>(kBc / 2 * kBr) +
           Workspace::bytes<uint32_t>(int64_t(kBc / 2) * ldv) +
           Workspace::bytes<T>(int64_t(kBc) * d) + Workspace::bytes<T>(int64_t(kBc) * dv) +
           (tiles ? Workspace::bytes<uint32_t>(int64_t(kBc) * kpad) +
                        Workspace::bytes<uint32_t>(int64_t(kBr) * (kBc / 2))
                  : 0));
  A* QiT = ws.take<A>(int64_t(d) * kBr);   // Qᵀ: (head_dim, kBr), the B of Sᵀ = K Qᵀ
  A* Kbuf = ws.take<A>(int64_t(kBc) * d);  // K rows, when they need converting
  A* Vbuf = ws.take<A>(int64_t(kBc) * ldv);
  A* ST = ws.take<A>(kBc * kBr);           // Sᵀ: (keys, rows), then Pᵀ in place
  A* O = ws.take<A>(int64_t(kBr) * ldv);   // unnormalised output rows
  A* m = ws.take<A>(kBr);
  A* l = ws.take<A>(kBr);
  A* alpha = ws.take<A>(kBr);
  uint32_t* Q2 = ws.take<uint32_t>(int64_t(kpad) * kBr);  // bf16 pair path only
  uint32_t* P2 = ws.take<uint32_t>(kBc / 2 * kBr);
  uint32_t* V2 = ws.take<uint32_t>(int64_t(kBc / 2) * ldv);
  T* Kstage = ws.take<T>(int64_t(kBc) * d);  // paged cache rows, when gathered
  T* Vstage = ws.take<T>(int64_t(kBc) * dv);
  [[maybe_unused]] uint32_t* Kw = tiles ? ws.take<uint32_t>(int64_t(kBc) * kpad) : nullptr;
  [[maybe_unused]] uint32_t* Pw = tiles ? ws.take<uint32_t>(int64_t(kBr) * (kBc / 2)) : nullptr;
  // At the amx level: this thread's tiles configured for this task, released at its end.
  [[maybe_unused]] std::conditional_t<tiles, TileScope<Tiles>, NoTiles> tile_scope;

  const T* q = static_cast<const T*>(p.q) + h * p.q_head_stride +
               row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, i0);
  const T* k = static_cast<const T*>(p.k) + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + hk * p.v_head_stride;
  // bfloat16 with AVX512-BF16: S and P V as pair dot products (twice the float FMA rate).
  // K is read in place as pair words; Q and V are packed into pairs, P is rounded to
  // bfloat16 for P V (as on a GPU); everything accumulates in float.
  constexpr bool pairs = std::is_same_v<T, bf16_t> && kBf16Dot;
  // The one transpose of the task: Q's tile (as pair words for the pair products). The scale
  // is applied to S after the GEMM, not folded into Q, so that the backward (which reads Q
  // in place) rebuilds the very same S.
  if constexpr (pairs) {
    pack_pairs_t(q, p.q_row_stride, nr, d, Q2, kBr);
    for (int kp = (d + 1) / 2; kp < kpad; ++kp)  // the tiles' zero padding along d
      std::memset(Q2 + int64_t(kp) * kBr, 0, size_t(kBr) * sizeof(uint32_t));
  } else
    load_rows_t(q, p.q_row_stride, nr, d, QiT, kBr);
  fill(m, kBr, neg_inf<A>());
  fill(l, kBr, A(0));
  fill(O, int64_t(kBr) * ldv, A(0));

  // Rows i0..i0+nr-1 together see keys [key_lo(i0), key_hi(last row)].
  const int j_begin = key_lo(p, s, i0), j_end = key_hi(p, s, i0 + nr - 1) + 1;
  const bool quant = p.kv_code != KvCode::kNone;
  A kscale[kBc], vscale[kBc];  // 8-bit caches: each key's factors (dequant.h)
  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0);
    if (tile_skipped(p, b, h, i0, nr, j0, nc)) continue;
    int64_t ks = d, vs = dv;  // row strides of kj, vj
    const T* kj = Kstage;
    const T* vj = Vstage;
    if (quant) {  // 8-bit caches: the codes' values staged in T, scaled per key below
      decode_rows(p, s, b, hk, false, j0, nc, d, Kstage, d);
      decode_rows(p, s, b, hk, true, j0, nc, dv, Vstage, dv);
    } else {
      kj = key_rows(p, s, b, k, p.k_batch_stride, p.k_row_stride, j0, nc, d, Kstage, &ks);
      vj = key_rows(p, s, b, v, p.v_batch_stride, p.v_row_stride, j0, nc, dv, Vstage, &vs);
    }
    [[maybe_unused]] int64_t ldvj = ldv;
    [[maybe_unused]] const A* Vj = nullptr;
    [[maybe_unused]] const uint32_t* V2j = V2;  // V's pair words for this tile
    if constexpr (tiles) {  // Sᵀ = K Qᵀ on tiles: keys x query rows, 16 x 16 per C tile
      int64_t ldkw;
      const uint32_t* Kt = k_tile_words(kj, ks, nc, d, kpad, Kw, &ldkw);
      tile_gemm<Tiles>(tiles_for(nc), nrp / kTileRows, kpad / kTilePairs, Kt, ldkw, Q2, kBr, ST,
                       kBr, false);
      V2j = v_pair_tile(p, s, b, hk, call, j0, nc, vj, vs, V2, ldv,
                        tiles_for((nc + 1) / 2) * kTilePairs);
    } else if constexpr (pairs) {
      int64_t ldkw;
      const uint32_t* Kw = pair_rows(kj, ks, nc, d, Kbuf, &ldkw);
      gemm<false>(nc, nrp, (d + 1) / 2, Kw, ldkw, 1, Q2, kBr, ST, kBr);  // Sᵀ = K Qᵀ
      V2j = v_pair_tile(p, s, b, hk, call, j0, nc, vj, vs, V2, ldv);
    } else {
      int64_t ldk;
      const A* Kj = rows_as_acc(kj, ks, nc, d, Kbuf, d, &ldk, false);
      Vj = rows_as_acc(vj, vs, nc, dv, Vbuf, ldv, &ldvj, true, dense_v);
      gemm<false>(nc, nrp, d, Kj, ldk, 1, QiT, kBr, ST, kBr);  // Sᵀ = K Qᵀ
    }
    // The next tile's rows, asked for while this one computes: K's now, V's after P V (two
    // bursts, so that each finds the miss buffers free).
    const int n_next = quant || p.block_table ? 0 : std::min(kBc, j_end - j0 - kBc);
    if (n_next > 0) prefetch_rows(kj + kBc * ks, ks, n_next, d * int(sizeof(T)));
    // A tile whose scores nothing else touches (no softcap, bias, ALiBi or mask; inside the
    // window) takes the scale inside the softmax: the same scores, one pass fewer over Sᵀ.
    const A scale = A(p.scale);  // finite as a double; may round to inf as a float
    const bool fold_scale = !quant && scale > 0 && std::isfinite(scale) &&
                            scores_untouched(p, s, i0, nr, j0, nc);
    if (quant) {  // Sᵀ's row c times scale * k_scale of key c
      key_scales(p, b, hk, false, j0, nc, kscale);
      scale_each_row(ST, nc, nrp, kBr, kscale);
    } else if (!fold_scale) {
      scale_rows(ST, nc, nrp, kBr, A(p.scale));
    }
    if (!fold_scale)
      finish_scores(p, s, b, h, i0, nr, j0, nc, ST, 1, kBr, static_cast<A*>(nullptr));
    // Sᵀ becomes Pᵀ (unnormalised)
    online_softmax_T<kLeanExp<T>>(ST, kBr, nc, nrp, m, l, alpha, fold_scale ? scale : A(1));
    if (p.dropout_p > 0)  // after the normaliser l, which counts dropped entries too
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, ST + r, kBr);
    for (int r = 0; r < nr; ++r)
      if (alpha[r] != A(1)) scale_rows(O + int64_t(r) * ldv, 1, dv, ldv, alpha[r]);
    const bool may_zero = tile_may_zero(p, s, i0, nr, j0, nc);
    if (quant) key_scales(p, b, hk, true, j0, nc, vscale);
    auto excluded = [&](int r, int c) { return pair_excluded(p, s, b, h, i0 + r, j0 + c, true); };
    if (may_zero && quant && values_nonfinite(p, s, b, hk, j0, nc, vscale)) {
      dequant_rows(p, s, b, hk, j0, nc, dv, vscale, Vbuf, ldv);
      gemm_strong_zero(nr, dv, nc, ST, 1, kBr, Vbuf, ldv, O, ldv, excluded);  // O += P V
      continue;
    }
    if (quant) scale_each_row(ST, nc, nr, kBr, vscale);  // Pᵀ's row c times v_scale of key c
    if (may_zero && !quant && has_nonfinite(vj, vs, nc, dv)) {
      gemm_strong_zero(nr, dv, nc, ST, 1, kBr, vj, vs, O, ldv, excluded);  // O += P V
    } else if constexpr (tiles) {  // O += P V on tiles: P's rows as pair words along keys
      const int kpn = (nc + 1) / 2, kt = tiles_for(kpn), mt = tiles_for(nr);
      pack_float_pairs(ST, 1, kBr, nr, nc, P2, kBr);
      p_rows_words(P2, kBr, nr, kpn, mt, kt, Pw, kBc / 2);
      tile_gemm<Tiles>(mt, ldv / kTileRows, kt, Pw, kBc / 2, V2j, ldv, O, ldv, true);
    } else if constexpr (pairs) {
      pack_float_pairs(ST, 1, kBr, nr, nc, P2, kBr);
      gemm<true>(nr, ldv, (nc + 1) / 2, P2, 1, kBr, V2j, ldv, O, ldv);  // O += P V
    } else {
      gemm<true>(nr, ldv, nc, ST, 1, kBr, Vj, ldvj, O, ldv);  // O += P V
    }
    if (n_next > 0) prefetch_rows(vj + kBc * vs, vs, n_next, dv * int(sizeof(T)));
  }

  // Normalise once; a row that saw no key (l = 0) gets out = 0 and lse = -inf. A NaN l (a
  // NaN or Inf score) makes the row NaN.
  T* o = static_cast<T*>(p.o) + h * p.o_head_stride +
         row_offset(p, b, p.o_batch_stride, p.o_row_stride, s.q_first, i0);
  A* lse = p.lse ? lse_at<A>(p, s, b, h, i0) : nullptr;  // nullptr: not wanted
  for (int r = 0; r < nr; ++r) {
    A* Or = O + int64_t(r) * ldv;
    scale_rows(Or, 1, dv, ldv, l[r] != A(0) ? A(1) / l[r] : A(0));
    store_row(Or, dv, o + r * p.o_row_stride);
    if (lse) lse[r * p.lse_row_stride] = l[r] != A(0) ? m[r] + std::log(l[r]) : neg_inf<A>();
  }
}

// Decode-shaped calls (a few query rows, long keys: seqlen_q · group <= kSmallRows) read
// K/V from memory and are bound by that, not by FMAs. One task then takes all query heads
// of a GQA group together, so each K/V row is read once for the whole group, and S is
// computed by dot products along head_dim: the row-vectorised GEMM would pad a single
// query row to a whole vector of rows. A task also takes several kv heads (up to
// kSmallTaskRows query rows in all): in the (batch, seqlen, heads, dim) layout of ordinary
// tensors and caches alike, one key's heads are adjacent, so the task reads whole
// contiguous rows that the hardware prefetchers stream, instead of one head's slice of each
// row (a 4 KiB stride for 8 heads of 128 floats: a new page per key).
constexpr int kSmallRows = 32;
constexpr int kSmallTaskRows = 128;

// Up to 16 rows always; 17..32 only for GQA/MQA, where the alternative (a task per query
// head) reads K/V once per query head; without groups the tiled path reads them once too and
// its GEMM was the faster product in a spot check (MHA, 32 queries against 4096 keys).
inline bool use_small_rows(const FwdParams& p) {
  const int64_t rows = int64_t(p.seqlen_q) * (p.heads_q / p.heads_kv);
  return rows <= 16 || (rows <= kSmallRows && p.heads_q > p.heads_kv);
}

// kv heads per small-rows task: the largest divisor of heads_kv within kSmallTaskRows rows.
inline int small_head_block(const FwdParams& p) {
  const int rows = p.seqlen_q * (p.heads_q / p.heads_kv);
  int hb = 1;
  for (int c = 2; c <= p.heads_kv; ++c)
    if (p.heads_kv % c == 0 && c * rows <= kSmallTaskRows) hb = c;
  return hb;
}

// Reads one byte of every 64-byte line of [src, src + bytes): brings them into the caches.
template <typename T>
inline void touch_lines(const T* src, int bytes) {
  const volatile char* p = reinterpret_cast<const volatile char*>(src);
  for (int o = 0; o < bytes; o += 64) (void)p[o];
}

// One score of dot_tile: Σ_t q[t] k[t], vectors along head_dim, then the scalar tail.
template <typename KT>
inline float dot_row(const float* q, const KT* k, int d, VecF acc) {
  float x = hsum(acc);
  // An explicit FMA: the same operation whatever K's type, not the compiler's choice.
  for (int t = d / kW * kW; t < d; ++t) x = std::fma(q[t], load_one(k + t), x);
  return x;
}

// Scores of RB query rows against four keys: RB x 4 independent FMA chains, each row's and
// each key's vectors loaded once per step (an FMA per half a load), reduced four at a time.
// Every score is the same chain (t ascending) then the same reduction, whatever RB is.
// K's elements are floats or 8-bit codes (dequant.h), widened as they are loaded.
constexpr int kDotRows = kW == 16 ? 4 : 2;  // AVX-512's 32 registers hold 4 x 4 chains
template <int RB, typename KT>
inline void dot_block(const float* Q, int64_t ldq, const KT* const* k, int d, float* S,
                      int64_t ld) {
  const int dv = d / kW * kW;
  // The loops over r and j unrolled before GCC's scalar replacement (the pragmas, as in
  // gemm_block): otherwise acc stays an array on the stack, stored and reloaded per call.
  VecF acc[RB][4];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = VecF::zero();
  for (int t = 0; t < dv; t += kW) {
    VecF kv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) kv[j] = load_vec(k[j] + t);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const VecF x = VecF::load(Q + r * ldq + t);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = fma(x, kv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
    float* out = S + r * ld;
    hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], out);
    const float* q = Q + r * ldq;
    for (int t = dv; t < d; ++t)
      for (int j = 0; j < 4; ++j) out[j] = std::fma(q[t], load_one(k[j] + t), out[j]);
  }
}

// S[m][c] = Σ_t Q[m][t] K[c][t] for m < M, c < nc (vectors along head_dim), K's rows given
// by pointers (a paged cache's rows are read where they lie). Four keys at a time: four
// independent FMA chains per query row hide the FMA latency that a single chain per score
// would wait on (every score is still the same chain, summed in the same order).
template <typename KT>
inline void dot_tile(int M, int nc, int d, const float* Q, int64_t ldq, const KT* const* K,
                     float* S, int64_t ld) {
  const int dv = d / kW * kW;
  int c = 0;
  for (; c + 4 <= nc; c += 4) {
    const KT* k[4] = {K[c], K[c + 1], K[c + 2], K[c + 3]};
    int m = 0;
    for (; m + kDotRows <= M; m += kDotRows) dot_block<kDotRows>(Q + m * ldq, ldq, k, d, S + m * ld + c, ld);
    for (; m < M; ++m) dot_block<1>(Q + m * ldq, ldq, k, d, S + m * ld + c, ld);
  }
  for (; c < nc; ++c) {
    const KT* k = K[c];
    for (int m = 0; m < M; ++m) {
      const float* q = Q + m * ldq;
      VecF acc = VecF::zero();
      for (int t = 0; t < dv; t += kW) acc = fma(VecF::load(q + t), load_vec(k + t), acc);
      S[m * ld + c] = dot_row(q, k, d, acc);
    }
  }
}
inline void dot_tile(int M, int nc, int d, const double* Q, int64_t ldq,
                     const double* const* K, double* S, int64_t ld) {
  for (int c = 0; c < nc; ++c)
    for (int m = 0; m < M; ++m) {
      double x = 0;
      for (int t = 0; t < d; ++t) x += Q[m * ldq + t] * K[c][t];
      S[m * ld + c] = x;
    }
}

#if defined(__AVX512BF16__)
// 32 elements of a K row as bfloat16 pairs, lanes past `mask` zero: bfloat16 rows as they
// are, 8-bit codes widened (every code's value is exact in bfloat16, dequant.h).
inline __m512bh load_pairs(const bf16_t* x, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, x);
}

// dot_tile for bfloat16 Q and K read as they are (no conversion pass): vdpbf16ps takes 32
// elements per instruction as 16 pairs, products exact in float, accumulated in float (the
// AVX512-BF16 rules: a bfloat16 denormal reads as zero, as in the GEMM's pair path). K's
// elements are bfloat16 or 8-bit codes; the same sums either way, so a cache of codes gives
// bitwise the scores of a bfloat16 cache holding their values.
template <int RB, typename KT>
inline void dot_block_bf16(const bf16_t* Q, int64_t ldq, const KT* const* k, int d,
                           float* S, int64_t ld) {
  const int full = d / 32 * 32;
  const __mmask32 tail = d % 32 ? __mmask32((1u << (d % 32)) - 1) : 0;
  // Unrolled before GCC scalarises acc, as in pv_block: left as loops (this function not
  // inlined), acc stayed an array on the stack.
  __m512 acc[RB][4];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int t = 0; t < d; t += 32) {
    const __mmask32 mask = t < full ? __mmask32(~0u) : tail;
    __m512bh kv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) kv[j] = load_pairs(k[j] + t, mask);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(mask, Q + r * ldq + t);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, kv[j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    hsum4(VecF{acc[r][0]}, VecF{acc[r][1]}, VecF{acc[r][2]}, VecF{acc[r][3]}, S + r * ld);
}

template <typename KT>
inline void dot_tile_bf16(int M, int nc, int d, const bf16_t* Q, int64_t ldq,
                          const KT* const* K, float* S, int64_t ld) {
  const int full = d / 32 * 32;
  const __mmask32 tail = d % 32 ? __mmask32((1u << (d % 32)) - 1) : 0;
  int c = 0;
  for (; c + 4 <= nc; c += 4) {
    const KT* k[4] = {K[c], K[c + 1], K[c + 2], K[c + 3]};
    int m = 0;
    for (; m + 4 <= M; m += 4) dot_block_bf16<4>(Q + m * ldq, ldq, k, d, S + m * ld + c, ld);
    for (; m < M; ++m) dot_block_bf16<1>(Q + m * ldq, ldq, k, d, S + m * ld + c, ld);
  }
  for (; c < nc; ++c)
    for (int m = 0; m < M; ++m) {
      const bf16_t* q = Q + m * ldq;
      __m512 a = _mm512_setzero_ps();
      for (int t = 0; t < full; t += 32)
        a = _mm512_dpbf16_ps(a, load_pairs(q + t, __mmask32(~0u)), load_pairs(K[c] + t, __mmask32(~0u)));
      if (tail) a = _mm512_dpbf16_ps(a, load_pairs(q + full, tail), load_pairs(K[c] + full, tail));
      S[m * ld + c] = _mm512_reduce_add_ps(a);
    }
}
#endif

#if defined(FMHA_SIMD_AVX512)
// 16 elements of a V row from `x` as floats, lanes past `mask` zero.
inline __m512 load16(const float* x, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, x); }
inline __m512 load16(const bf16_t* x, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const f16_t* x, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x));
}

// O[r][0..dv) += Σ_c P[r][c] V[c][0..dv) for rows r0 .. r0 + MR of one 64-column strip, V's
// rows by pointer in their own type, widened in registers: no converted copy of V is made.
// The sums run over c in order, one FMA per term, as the GEMM's do.
template <int MR, typename T>
inline void pv_block(int nc, const float* P, int64_t ldp, const T* const* V, int n0,
                     const __mmask16* masks, float* O, int64_t ldo) {
  // The loops over r and j are unrolled before GCC scalarises acc: left to later passes,
  // acc stayed an array in memory and every FMA's result was also stored to the stack.
  __m512 acc[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_maskz_loadu_ps(masks[j], O + r * ldo + n0 + 16 * j);
  for (int c = 0; c < nc; ++c) {
    __m512 v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) v[j] = load16(V[c] + n0 + 16 * j, masks[j]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512 pr = _mm512_set1_ps(P[r * ldp + c]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(pr, v[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(O + r * ldo + n0 + 16 * j, masks[j], acc[r][j]);
}

// O (M x dv, row stride ldo) += P (M x nc, row stride ldp) V, V's nc rows by pointer.
template <typename T>
inline void pv_tile(int M, int nc, int dv, const float* P, int64_t ldp, const T* const* V,
                    float* O, int64_t ldo) {
  for (int n0 = 0; n0 < dv; n0 += 64) {
    __mmask16 masks[4];
    for (int j = 0; j < 4; ++j) {
      const int left = dv - n0 - 16 * j;
      masks[j] = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
    int m = 0;
    for (; m + 4 <= M; m += 4) pv_block<4>(nc, P + m * ldp, ldp, V, n0, masks, O + m * ldo, ldo);
    switch (M - m) {
      case 3: pv_block<3>(nc, P + m * ldp, ldp, V, n0, masks, O + m * ldo, ldo); break;
      case 2: pv_block<2>(nc, P + m * ldp, ldp, V, n0, masks, O + m * ldo, ldo); break;
      case 1: pv_block<1>(nc, P + m * ldp, ldp, V, n0, masks, O + m * ldo, ldo); break;
      default: break;
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// O (M x ldv) += P V as pair products, the tiled forward's P V under bfloat16 on this ISA: P
// (M x nc, row stride ldp) rounded to bfloat16 pairs along the keys, V's nc rows (by pointer,
// bfloat16 or 8-bit codes) interleaved two by two into pair words. P2 holds M x kBc/2 words,
// V2 kBc/2 x ldv.
template <typename VT>
inline void pv_pairs(int M, int nc, int dv, int ldv, const float* P, int64_t ldp,
                     const VT* const* V, uint32_t* P2, uint32_t* V2, float* O) {
  pack_rows_bf16(P, ldp, M, nc, P2, kBc / 2);
  pack_pairs_of_rows<VT>([&](int i) { return V[i]; }, nc, dv, V2, ldv);
  gemm<true>(M, ldv, (nc + 1) / 2, P2, kBc / 2, 1, V2, ldv, O, ldv);
}

// The decode path's two products on AMX tiles (the amx level, more than 4 rows: amx_gemm.h),
// on the same bfloat16 operands as dot_tile_bf16 and pv_pairs.
//
// S (M x nc, row stride lds) = Q Kᵀ: Q's M rows (bfloat16, ldq apart) as A, pair words along
// head_dim in Qa (tiles_for(M) * 16 rows of kpad words, zero-padded); K's nc rows (by pointer:
// a paged cache's rows where they lie) transposed into B's pair layout in Kb (kpad pair rows of
// kBc words; pack_pairs_t when the rows are equally spaced), zero past d and past nc. S gets
// tiles_for(M) * 16 rows of tiles_for(nc) * 16 scores: its buffer must hold them.
template <class Tiles>
inline void qk_tiles(int M, int nc, int d, const bf16_t* Q, int64_t ldq, const bf16_t* const* K,
                     uint32_t* Qa, uint32_t* Kb, float* S, int64_t lds) {
  const int kpn = (d + 1) / 2, kpad = tiles_for(kpn) * kTilePairs, mt = tiles_for(M);
  const int nt = tiles_for(nc);
  for (int i = 0; i < mt * kTileRows; ++i) {
    uint32_t* row = Qa + int64_t(i) * kpad;
    std::memset(row, 0, size_t(kpad) * 4);
    if (i < M) std::memcpy(row, Q + i * ldq, size_t(d) * sizeof(bf16_t));
  }
  bool spaced = true;
  for (int c = 2; c < nc && spaced; ++c) spaced = K[c] - K[c - 1] == K[1] - K[0];
  if (spaced) {
    pack_pairs_t(K[0], nc > 1 ? K[1] - K[0] : 0, nc, d, Kb, kBc);
  } else {
    for (int kp = 0; kp < kpn; ++kp) {
      for (int c = 0; c < nc; ++c) {
        const uint16_t hi = 2 * kp + 1 < d ? K[c][2 * kp + 1].bits : uint16_t(0);
        Kb[int64_t(kp) * kBc + c] = pair_word(K[c][2 * kp].bits, hi);
      }
      for (int c = nc; c < kBc; ++c) Kb[int64_t(kp) * kBc + c] = 0;
    }
  }
  for (int kp = kpn; kp < kpad; ++kp) std::memset(Kb + int64_t(kp) * kBc, 0, kBc * sizeof(uint32_t));
  tile_gemm<Tiles>(mt, nt, kpad / kTilePairs, Qa, kpad, Kb, kBc, S, lds, false);
}

// O (M x ldv) += P V: P (M x nc, row stride ldp) rounded to bfloat16 pair words along the keys
// as pv_pairs rounds it (P2: A's rows, kBc / 2 words each), V's nc rows interleaved into pair
// rows (V2, B), both zero-padded to whole tiles. The C tiles run on Ot (tiles_for(M) * 16 rows
// of ldv floats, O's rows copied in and out), so that no tile touches rows past O's M.
template <class Tiles, typename VT>
inline void pv_tiles(int M, int nc, int dv, int ldv, const float* P, int64_t ldp,
                     const VT* const* V, uint32_t* P2, uint32_t* V2, float* Ot, float* O) {
  constexpr int ldp2 = kBc / 2;
  const int kpn = (nc + 1) / 2, kt = tiles_for(kpn), mt = tiles_for(M);
  pack_rows_bf16(P, ldp, M, nc, P2, ldp2);
  const bool swap = amx::planted_fault() == amx::kPlantedRepackFault;  // a test hook (amx_model.h)
  for (int i = 0; i < mt * kTileRows; ++i) {
    uint32_t* row = P2 + int64_t(i) * ldp2;
    const int from = i < M ? kpn : 0;
    if (swap && i < M)
      for (int kp = 0; kp < kpn; ++kp) row[kp] = (row[kp] >> 16) | (row[kp] << 16);
    for (int kp = from; kp < kt * kTilePairs; ++kp) row[kp] = 0;
  }
  pack_pairs_of_rows<VT>([&](int i) { return V[i]; }, nc, dv, V2, ldv);
  for (int kp = kpn; kp < kt * kTilePairs; ++kp)
    std::memset(V2 + int64_t(kp) * ldv, 0, size_t(ldv) * sizeof(uint32_t));
  std::memcpy(Ot, O, size_t(M) * ldv * sizeof(float));
  std::memset(Ot + int64_t(M) * ldv, 0, size_t(mt * kTileRows - M) * ldv * sizeof(float));
  tile_gemm<Tiles>(mt, ldv / kTileRows, kt, P2, ldp2, V2, ldv, Ot, ldv, true);
  std::memcpy(O, Ot, size_t(M) * ldv * sizeof(float));
}
#endif

// Whether the decode path's P V reads V's rows in place (pv_tile: AVX-512, 16/32-bit types).
#if defined(FMHA_SIMD_AVX512)
template <typename T>
constexpr bool kPvInPlace = !std::is_same_v<T, double>;
#else
template <typename T>
constexpr bool kPvInPlace = false;
#endif

// Rows rows[0 .. n) (each `dim` elements) converted into a dense (n, ld) buffer of the
// accumulation type, columns [dim, ld) zero.
template <typename T, typename A>
inline void load_row_ptrs(const T* const* rows, int n, int dim, A* dst, int ld) {
#if defined(FMHA_SIMD_AVX512)
  if constexpr (std::is_same_v<A, float> && !std::is_same_v<T, float>) {  // 16-bit: widen
    for (int r = 0; r < n; ++r) {               // 16 at a time, in registers
      float* d = dst + int64_t(r) * ld;
      auto lanes = [](int left) {
        return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0)
                                                           : __mmask16((1u << left) - 1);
      };
      for (int t = 0; t < ld; t += 16)  // columns [dim, ld) get zeros, nothing past ld
        _mm512_mask_storeu_ps(d + t, lanes(ld - t), load16(rows[r] + t, lanes(dim - t)));
    }
    return;
  }
#endif
  for (int r = 0; r < n; ++r) load_rows(rows[r], 0, 1, dim, dst + int64_t(r) * ld, ld);
}

// Long key ranges are split into chunks of kSplitKeys keys at fixed positions (0, kSplitKeys,
// 2 kSplitKeys, ...), each a task of its own, and the chunks' partial results are merged
// by their lse (split-KV, as FlashDecoding does on GPUs): one sequence with one kv head
// still keeps every thread reading. The split depends on the positions alone, never on
// the thread count, the capacity of a cache or its paging, so results are bitwise the same
// for any of those.
constexpr int kSplitKeys = 2048;

// Where a small-rows task leaves its rows: the output (out, lse) when the call has one chunk
// per sequence, else its chunk's slot of the partial buffers, (rows, ldv) normalised outputs
// and (rows) lse per (batch, kv head, chunk), for merge_chunks.
template <typename A>
struct Partials {
  A* o = nullptr;
  A* lse = nullptr;
  int n_chunks = 1, rows = 0, ldv = 0;
  int64_t slot(int b, int hk, int heads_kv, int c) const {
    return (int64_t(b) * heads_kv + hk) * n_chunks + c;
  }
};

// The query rows of (batch b, kv heads hk0 .. hk0 + hb - 1) over keys [j_lo, j_hi) clipped to
// what they see: row g * sq + i of kv head hk is query i of head hk * group + g.
// Tiles: NoTiles, or (the amx level) the AMX backend whose tiles take S and P V of bfloat16
// inputs when a GQA group and the queries fill more than 4 rows per kv head; fewer rows keep
// the dot products of dot_tile_bf16 and pv_tile.
template <typename T, class Tiles = NoTiles>
void forward_small_task(const FwdParams& p, int b, int hk0, int hb, int chunk,
                        const Partials<acc_t<T>>& part) {
  using A = acc_t<T>;
  const Seq s = seq_of(p, b);
  const int group = p.heads_q / p.heads_kv, sq = s.sq, M = group * sq;
  if (sq == 0) return;
  if (part.n_chunks > 1 && chunk > 0 && chunk * kSplitKeys >= s.sk) return;  // past the keys
  const int d = p.head_dim, dv = p.head_dim_v, ldq = padded<A>(d), ldv = padded<A>(dv);
  const int j_begin = std::max(key_lo(p, s, 0), chunk * kSplitKeys);
  const int j_end = std::min(key_hi(p, s, sq - 1) + 1, (chunk + 1) * kSplitKeys);
  const int R = hb * M;  // rows of the task: kv head x, row r is row x * M + r
  constexpr bool tiles = !std::is_same_v<Tiles, NoTiles>;
  const bool use_tiles = tiles && M > 4;
  const int kpad = tiles_for((d + 1) / 2) * kTilePairs;

  Workspace& ws = thread_workspace();
  ws.begin(Workspace::bytes<A>(int64_t(R) * ldq) + Workspace::bytes<A>(int64_t(kBc) * d) +
           Workspace::bytes<A>(int64_t(kBc) * ldv) + Workspace::bytes<A>(kSmallRows * kBc) +
           Workspace::bytes<A>(int64_t(R) * ldv) + 2 * Workspace::bytes<A>(R) +
           Workspace::bytes<A>(kSmallRows) + Workspace::bytes<T>(int64_t(kBc) * dv) +
           Workspace::bytes<T>(int64_t(R) * d) + 2 * Workspace::bytes<A>(kBc) +
           Workspace::bytes<uint32_t>(kSmallRows * kBc / 2) +
           Workspace::bytes<uint32_t>(int64_t(kBc / 2) * ldv) +
           (use_tiles ? Workspace::bytes<uint32_t>(int64_t(kSmallRows) * kpad) +
                            Workspace::bytes<uint32_t>(int64_t(kpad) * kBc) +
                            Workspace::bytes<A>(int64_t(kSmallRows) * ldv)
                      : 0));
  A* Qr = ws.take<A>(int64_t(R) * ldq);
  A* Kbuf = ws.take<A>(int64_t(kBc) * d);
  A* Vbuf = ws.take<A>(int64_t(kBc) * ldv);
  A* S = ws.take<A>(kSmallRows * kBc);  // one kv head's (rows, keys), then P in place
  A* O = ws.take<A>(int64_t(R) * ldv);
  A* m = ws.take<A>(R);
  A* l = ws.take<A>(R);
  A* alpha = ws.take<A>(kSmallRows);
  T* Vstage = ws.take<T>(int64_t(kBc) * dv);  // paged V rows, for the strong zero
  // bfloat16 with AVX512-BF16: S from Q and K as they are, by pair dot products.
  constexpr bool pairs = std::is_same_v<T, bf16_t> && kBf16Dot;
  T* Qt = ws.take<T>(int64_t(R) * d);  // the rows of Q in T, dense (pairs only)
  uint32_t* P2 = ws.take<uint32_t>(kSmallRows * kBc / 2);  // P V as pairs (pv_pairs)
  uint32_t* V2 = ws.take<uint32_t>(int64_t(kBc / 2) * ldv);
  [[maybe_unused]] uint32_t* Qa = use_tiles ? ws.take<uint32_t>(int64_t(kSmallRows) * kpad) : nullptr;
  [[maybe_unused]] uint32_t* Kb = use_tiles ? ws.take<uint32_t>(int64_t(kpad) * kBc) : nullptr;
  [[maybe_unused]] A* Ot = use_tiles ? ws.take<A>(int64_t(kSmallRows) * ldv) : nullptr;
  // At the amx level with tiles: this thread's tiles configured for this task, released at
  // its end.
  std::optional<std::conditional_t<tiles, TileScope<Tiles>, NoTiles>> tile_scope;
  if (use_tiles) tile_scope.emplace();
  // The products of bfloat16 pairs: on tiles (use_tiles) or AVX512-BF16's dot products.
  [[maybe_unused]] auto scores_bf16 = [&](int nc, const bf16_t* Qx, const bf16_t* const* kr) {
#if defined(__AVX512BF16__)
    if constexpr (pairs) {
      if constexpr (tiles) {
        if (use_tiles) return qk_tiles<Tiles>(M, nc, d, Qx, d, kr, Qa, Kb, S, kBc);
      }
      dot_tile_bf16(M, nc, d, Qx, d, kr, S, kBc);
    }
#endif
  };
  // P V over more than 4 rows as bfloat16 pairs (V's rows bfloat16 or 8-bit codes).
  [[maybe_unused]] auto pv_bf16 = [&](int nc, const auto* const* vr, A* Ox) {
#if defined(__AVX512BF16__)
    if constexpr (tiles) {
      if (use_tiles) return pv_tiles<Tiles>(M, nc, dv, ldv, S, kBc, vr, P2, V2, Ot, Ox);
    }
    pv_pairs(M, nc, dv, ldv, S, kBc, vr, P2, V2, Ox);
#endif
  };
  // 8-bit caches: the products read the codes; each key's factors (dequant.h).
  const bool quant = p.kv_code != KvCode::kNone;
  A* kscale = ws.take<A>(kBc);
  A* vscale = ws.take<A>(kBc);

  for (int x = 0; x < hb; ++x)
    for (int g = 0; g < group; ++g) {
      const T* q = static_cast<const T*>(p.q) + ((hk0 + x) * group + g) * p.q_head_stride +
                   row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, 0);
      load_rows(q, p.q_row_stride, sq, d, Qr + (int64_t(x) * M + g * sq) * ldq, ldq);
      if constexpr (pairs)
        for (int i = 0; i < sq; ++i)
          std::memcpy(Qt + (int64_t(x) * M + g * sq + i) * d, q + i * p.q_row_stride,
                      size_t(d) * sizeof(T));
    }
  fill(m, R, neg_inf<A>());
  fill(l, R, A(0));
  fill(O, int64_t(R) * ldv, A(0));

  // The bytes of one key row of the head block, from head hk0's first element (heads are
  // adjacent in the usual layouts; otherwise at most hb rows' worth). Elements of 8-bit
  // caches are one byte.
  const int64_t esize = quant ? 1 : int64_t(sizeof(T));
  const char* k0 = static_cast<const char*>(p.k) + hk0 * p.k_head_stride * esize;
  const char* v0 = static_cast<const char*>(p.v) + hk0 * p.v_head_stride * esize;
  const int row_bytes_k = int(std::min<int64_t>((hb - 1) * p.k_head_stride + d, int64_t(hb) * d) * esize);
  const int row_bytes_v = int(std::min<int64_t>((hb - 1) * p.v_head_stride + dv, int64_t(hb) * dv) * esize);

  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0);
    // Where the tile's rows lie (head hk0; the other heads are a head stride further), and
    // whether V's are equally spaced (always, but for a paged cache whose blocks do not
    // follow each other), so that the P V product can read them in place.
    int64_t koff[kBc], voff[kBc];
    for (int r = 0; r < nc; ++r) {
      koff[r] = key_row_offset(p, s, b, p.k_batch_stride, p.k_row_stride, j0 + r);
      voff[r] = key_row_offset(p, s, b, p.v_batch_stride, p.v_row_stride, j0 + r);
    }
    bool v_spaced = true;
    for (int r = 2; r < nc && v_spaced; ++r) v_spaced = voff[r] - voff[r - 1] == voff[1] - voff[0];
    const int64_t vs = nc > 1 ? voff[1] - voff[0] : p.v_row_stride;
    // First read the tile's rows whole, in memory order (every head of the block): the
    // hardware's stream prefetcher follows sequential reads, not the per-head slices the
    // products below walk (one page per key).
    for (int r = 0; r < nc; ++r) {
      touch_lines(k0 + koff[r] * esize, row_bytes_k);
      touch_lines(v0 + voff[r] * esize, row_bytes_v);
    }
    for (int x = 0; x < hb; ++x) {
      const int hk = hk0 + x;
      A *Ox = O + int64_t(x) * M * ldv, *mx = m + x * M, *lx = l + x * M;
      const A* Qx = Qr + int64_t(x) * M * ldq;
      if (quant) {  // 8-bit caches: S from the codes, scaled per key (dequant.h)
        key_scales(p, b, hk, false, j0, nc, kscale);
        if constexpr (pairs) {  // bfloat16 q: pair products, as for a bfloat16 cache
#if defined(__AVX512BF16__)
          const T* Qxt = Qt + int64_t(x) * M * d;
          if (M <= 4) {  // each code is read once anyway: widened in the products
            with_code(p.kv_code, [&](auto c) {
              const decltype(c)* kc[kBc];
              code_rows(p.k, p.k_head_stride, hk, koff, nc, kc);
              dot_tile_bf16(M, nc, d, Qxt, d, kc, S, kBc);
            });
          } else {  // more rows: the codes widened once, into a bfloat16 tile
            T* Kt = reinterpret_cast<T*>(Kbuf);
            decode_rows(p, s, b, hk, false, j0, nc, d, Kt, d);
            const T* kr[kBc];
            for (int r = 0; r < nc; ++r) kr[r] = Kt + int64_t(r) * d;
            scores_bf16(nc, Qxt, kr);
          }
#endif
        } else {
          bool fused = false;
          if constexpr (std::is_same_v<A, float>) {
            fused = M <= kDotRows;  // each code is read once anyway: widened in the products
            if (fused)
              with_code(p.kv_code, [&](auto c) {
                const decltype(c)* kc[kBc];
                code_rows(p.k, p.k_head_stride, hk, koff, nc, kc);
                dot_tile(M, nc, d, Qx, ldq, kc, S, kBc);
              });
          }
          if (!fused) {  // more rows: the codes widened once, into Kbuf
            decode_rows(p, s, b, hk, false, j0, nc, d, Kbuf, d);
            const A* kr[kBc];
            for (int r = 0; r < nc; ++r) kr[r] = Kbuf + int64_t(r) * d;
            dot_tile(M, nc, d, Qx, ldq, kr, S, kBc);
          }
        }
        scale_columns(S, M, nc, kBc, kscale);
      } else {
        const T* k = static_cast<const T*>(p.k) + hk * p.k_head_stride;
        const T* krow[kBc];
        for (int r = 0; r < nc; ++r) krow[r] = k + koff[r];
#if defined(__AVX512BF16__)
        if constexpr (pairs) {
          scores_bf16(nc, Qt + int64_t(x) * M * d, krow);
        } else
#endif
        {
          const A* Krow[kBc];
          if constexpr (std::is_same_v<T, A>) {
            for (int r = 0; r < nc; ++r) Krow[r] = krow[r];
          } else {
            load_row_ptrs(krow, nc, d, Kbuf, d);
            for (int r = 0; r < nc; ++r) Krow[r] = Kbuf + int64_t(r) * d;
          }
          dot_tile(M, nc, d, Qx, ldq, Krow, S, kBc);
        }
        scale_rows(S, M, nc, kBc, A(p.scale));
      }
      for (int g = 0; g < group; ++g)
        finish_scores(p, s, b, hk * group + g, 0, sq, j0, nc, S + int64_t(g) * sq * kBc, kBc, 1,
                      static_cast<A*>(nullptr));
      for (int r = 0; r < M; ++r) {  // the online softmax, one row at a time
        A* Sr = S + r * kBc;
        const A m_new = std::max(mx[r], row_max(Sr, nc));
        const A m_ref = m_new == neg_inf<A>() ? A(0) : m_new;  // nothing visible yet: P = 0
        alpha[r] = softmax_exp<kLeanExp<T>>(mx[r] - m_ref);
        lx[r] = lx[r] * alpha[r] + exp_sub_sum<kLeanExp<T>>(Sr, nc, m_ref);
        mx[r] = m_new;
        if (p.dropout_p > 0) dropout_row(p, b, hk * group + r / sq, r % sq, j0, nc, Sr);
        if (alpha[r] != A(1)) scale_rows(Ox + int64_t(r) * ldv, 1, dv, ldv, alpha[r]);
      }
      // O += P V. The strong zero (rare: a tile with excluded pairs and a NaN or Inf in V)
      // reads V's rows equally spaced: gathered first when they are not.
      const bool may_zero = tile_may_zero(p, s, 0, sq, j0, nc);
      auto excluded = [&](int r, int c) {
        return pair_excluded(p, s, b, hk * group + r / sq, r % sq, j0 + c, true);
      };
      if (quant) {
        key_scales(p, b, hk, true, j0, nc, vscale);
        if (may_zero && values_nonfinite(p, s, b, hk, j0, nc, vscale)) {
          dequant_rows(p, s, b, hk, j0, nc, dv, vscale, Vbuf, ldv);
          gemm_strong_zero(M, dv, nc, S, kBc, 1, Vbuf, ldv, Ox, ldv, excluded);
          continue;
        }
        scale_columns(S, M, nc, kBc, vscale);  // P's columns times v_scale: P V from codes
#if defined(__AVX512BF16__)
        if constexpr (pairs) {
          if (M > 4) {  // as a bfloat16 cache's rows (below)
            with_code(p.kv_code, [&](auto c) {
              const decltype(c)* vc[kBc];
              code_rows(p.v, p.v_head_stride, hk, voff, nc, vc);
              pv_bf16(nc, vc, Ox);
            });
            continue;
          }
        }
#endif
        if constexpr (kPvInPlace<T>) {
          if (M <= 4) {  // pv_block's rows: each code is read once, widened in the product
            with_code(p.kv_code, [&](auto c) {
              const decltype(c)* vc[kBc];
              code_rows(p.v, p.v_head_stride, hk, voff, nc, vc);
              pv_tile(M, nc, dv, S, kBc, vc, Ox, ldv);
            });
          } else {  // more rows: the codes widened once, into Vbuf
            decode_rows(p, s, b, hk, true, j0, nc, dv, Vbuf, ldv);
            const A* vr[kBc];
            for (int r = 0; r < nc; ++r) vr[r] = Vbuf + int64_t(r) * ldv;
            pv_tile(M, nc, dv, S, kBc, vr, Ox, ldv);
          }
        } else {
          decode_rows(p, s, b, hk, true, j0, nc, dv, Vbuf, ldv);
          gemm<true>(M, ldv, nc, S, kBc, 1, Vbuf, ldv, Ox, ldv);
        }
        continue;
      }
      const T* v = static_cast<const T*>(p.v) + hk * p.v_head_stride;
      const T* vj = v + voff[0];
      int64_t vstride = vs;
      if (may_zero && !v_spaced) {
        for (int r = 0; r < nc; ++r)
          std::memcpy(Vstage + int64_t(r) * dv, v + voff[r], size_t(dv) * sizeof(T));
        vj = Vstage;
        vstride = dv;
      }
      if (may_zero && has_nonfinite(vj, vstride, nc, dv)) {
        gemm_strong_zero(M, dv, nc, S, kBc, 1, vj, vstride, Ox, ldv, excluded);
#if defined(__AVX512BF16__)
      } else if constexpr (pairs) {
        // Over more than 4 rows, P V as pair products, as in the tiled forward: the packing
        // of V's rows pays for itself there (an 8-bit cache: +15-19% at 8 and 16 rows; a
        // bfloat16 cache: -2.5% to +1.6%), and both caches take this path alike, so that a
        // cache of codes still gives bitwise a bfloat16 cache's result.
        const T* vrow[kBc];
        for (int r = 0; r < nc; ++r) vrow[r] = v + voff[r];
        if (M > 4)
          pv_bf16(nc, vrow, Ox);
        else
          pv_tile(M, nc, dv, S, kBc, vrow, Ox, ldv);
#endif
      } else if constexpr (kPvInPlace<T>) {  // AVX-512: V's rows multiplied where they lie
        const T* vrow[kBc];
        for (int r = 0; r < nc; ++r) vrow[r] = v + voff[r];
        pv_tile(M, nc, dv, S, kBc, vrow, Ox, ldv);
      } else if (std::is_same_v<T, A> && v_spaced && dv == ldv) {  // float, read in place
        gemm<true>(M, ldv, nc, S, kBc, 1, reinterpret_cast<const A*>(vj), vs, Ox, ldv);
      } else {  // converted into Vbuf for the GEMM
        const T* vrow[kBc];
        for (int r = 0; r < nc; ++r) vrow[r] = v + voff[r];
        load_row_ptrs(vrow, nc, dv, Vbuf, ldv);
        gemm<true>(M, ldv, nc, S, kBc, 1, Vbuf, ldv, Ox, ldv);
      }
    }
  }

  // Normalise once; a row that saw no key (l = 0) gets out = 0 and lse = -inf. A NaN l (a
  // NaN or Inf score) makes the row NaN.
  for (int x = 0; x < hb; ++x)
    for (int r = 0; r < M; ++r) {
      const int hk = hk0 + x, xr = x * M + r;
      A* Or = O + int64_t(xr) * ldv;
      scale_rows(Or, 1, dv, ldv, l[xr] != A(0) ? A(1) / l[xr] : A(0));
      // The row's lse: for merge_chunks, and for the caller when wanted (p.lse).
      const bool want_lse = part.n_chunks > 1 || p.lse;
      const A lse_r = !want_lse ? A(0) : l[xr] != A(0) ? m[xr] + std::log(l[xr]) : neg_inf<A>();
      if (part.n_chunks > 1) {
        const int64_t slot = part.slot(b, hk, p.heads_kv, chunk);
        std::memcpy(part.o + (slot * part.rows + r) * part.ldv, Or, size_t(dv) * sizeof(A));
        part.lse[slot * part.rows + r] = lse_r;
        continue;
      }
      const int h = hk * group + r / sq, i = r % sq;
      store_row(Or, dv, static_cast<T*>(p.o) + h * p.o_head_stride +
                            row_offset(p, b, p.o_batch_stride, p.o_row_stride, s.q_first, i));
      if (p.lse) *lse_at<A>(p, s, b, h, i) = lse_r;
    }
}

// out, lse of (batch b, kv head hk) from its chunks' partial results: lse = log Σ_c e^lse_c,
// out = Σ_c e^(lse_c - lse) out_c, summed in chunk order. A row no chunk saw gets out 0 and
// lse -inf; a lone chunk's result passes through unchanged (its weight is exactly 1).
template <typename T>
void merge_chunks(const FwdParams& p, int b, int hk, const Partials<acc_t<T>>& part) {
  using A = acc_t<T>;
  const Seq s = seq_of(p, b);
  const int group = p.heads_q / p.heads_kv, sq = s.sq, dv = p.head_dim_v;
  const int used = std::min(part.n_chunks, std::max(1, (s.sk + kSplitKeys - 1) / kSplitKeys));
  std::vector<A> acc(static_cast<size_t>(dv));
  auto lse_of = [&](int c, int r) { return part.lse[part.slot(b, hk, p.heads_kv, c) * part.rows + r]; };
  for (int r = 0; r < group * sq; ++r) {
    A mx = neg_inf<A>();
    bool nan = false;  // a chunk's NaN row (a NaN or Inf score) makes the whole row NaN
    for (int c = 0; c < used; ++c) {
      nan |= std::isnan(lse_of(c, r));
      mx = std::max(mx, lse_of(c, r));
    }
    A total = A(0);
    if (mx != neg_inf<A>())
      for (int c = 0; c < used; ++c) total += std::exp(lse_of(c, r) - mx);
    const A lse_r = nan ? std::numeric_limits<A>::quiet_NaN()
                        : mx == neg_inf<A>() ? mx : mx + std::log(total);
    fill(acc.data(), dv, nan ? lse_r : A(0));
    for (int c = 0; c < used && !nan && mx != neg_inf<A>(); ++c) {
      const A lc = lse_of(c, r);
      if (lc == neg_inf<A>()) continue;  // the chunk saw no key: it adds nothing
      const A w = std::exp(lc - lse_r);
      const A* oc = part.o + (part.slot(b, hk, p.heads_kv, c) * part.rows + r) * part.ldv;
      for (int t = 0; t < dv; ++t) acc[t] += w * oc[t];
    }
    const int h = hk * group + r / sq, i = r % sq;
    store_row(acc.data(), dv, static_cast<T*>(p.o) + h * p.o_head_stride +
                                  row_offset(p, b, p.o_batch_stride, p.o_row_stride, s.q_first, i));
    if (p.lse) *lse_at<A>(p, s, b, h, i) = lse_r;
  }
}

// The tiled forward: one task per (batch, query head, kBr query rows).
template <typename T, class Tiles = NoTiles>
void forward_tiled(const FwdParams& p) {
  const int64_t n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int64_t n_tasks = int64_t(p.batch) * p.heads_q * n_qblocks;
  const bool dense_v = copies_b_rows_dense();  // per microarchitecture (kernels.h)
  const uint64_t call = ++g_forward_calls;
  parallel_for(n_tasks, p.num_threads,
               [&](int64_t t) { forward_task<T, Tiles>(p, t, dense_v, call); },
               cpu_work_estimate_ns(p));
}

// Decode-shaped calls: tasks of (batch, kv head block, key chunk), then the chunks merged.
template <typename T, class Tiles = NoTiles>
void forward_small(const FwdParams& p) {
  using A = acc_t<T>;
  const int64_t work = cpu_work_estimate_ns(p);
  Partials<A> part;
  part.n_chunks = std::max(1, (p.seqlen_k + kSplitKeys - 1) / kSplitKeys);
  part.rows = p.heads_q / p.heads_kv * p.seqlen_q;
  part.ldv = p.head_dim_v;
  const int64_t heads = int64_t(p.batch) * p.heads_kv;
  std::vector<A> o_buf, lse_buf;
  if (part.n_chunks > 1) {
    o_buf.resize(size_t(heads * part.n_chunks * part.rows * part.ldv));
    lse_buf.assign(size_t(heads * part.n_chunks * part.rows), neg_inf<A>());
    part.o = o_buf.data();
    part.lse = lse_buf.data();
  }
  const int hb = small_head_block(p), blocks = p.heads_kv / hb;
  parallel_for(int64_t(p.batch) * blocks * part.n_chunks, p.num_threads, [&](int64_t t) {
    const int64_t bh = t / part.n_chunks;
    forward_small_task<T, Tiles>(p, int(bh / blocks), int(bh % blocks) * hb, hb,
                                 int(t % part.n_chunks), part);
  }, work);
  if (part.n_chunks > 1)
    parallel_for(heads, p.num_threads, [&](int64_t t) {
      merge_chunks<T>(p, int(t / p.heads_kv), int(t % p.heads_kv), part);
    }, work / 64 + 1);
}

template <typename T>
void forward_typed(const FwdParams& p) {
  if (use_small_rows(p)) return forward_small<T>(p);
  forward_tiled<T>(p);
}

#if defined(FMHA_CPU_AMX_LEVEL)
// The amx level (instantiate_amx.cpp): the tiled bfloat16 forward with S and P V on the
// tiles -- the hardware's where this process may use them and the build has the
// instructions, the software model's otherwise (FMHA_CPU_ISA=amx on a CPU without AMX, or
// with FMHA_AMX_DENY=1); decode-shaped calls take the tiles over more than 4 rows per kv head
// (forward_small_task). The other dtypes run the avx512bf16 level's code (docs/cpu_kernels.md,
// "The AMX kernels").
inline bool tiles_on_hardware() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_usable();
#else
  return false;
#endif
}

template <class Tiles>
void forward_bf16_on(const FwdParams& p) {
  if (use_small_rows(p)) return forward_small<bf16_t, Tiles>(p);
  forward_tiled<bf16_t, Tiles>(p);
}

void forward(const FwdParams& p) {
  if (p.dtype != DType::kBFloat16) return avx512bf16::forward(p);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles_on_hardware()) return forward_bf16_on<amx::HardwareTiles>(p);
#endif
  forward_bf16_on<amx::ModelTiles>(p);
}
#else
void forward(const FwdParams& p) {
  switch (p.dtype) {
    case DType::kFloat64: return forward_typed<double>(p);
    case DType::kFloat32: return forward_typed<float>(p);
    case DType::kBFloat16: return forward_typed<bf16_t>(p);
    case DType::kFloat16: return forward_typed<f16_t>(p);
    case DType::kFloat8E4M3: break;  // cpu_forward (fmha/dispatch.cpp) dequantises float8 inputs and calls the float32 kernels
  }
}
#endif

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
