// The CPU backward: FlashAttention-2 (Dao 2023, Algorithm 2) restructured for threads
// without atomics.
//
// P is never stored: every pass recomputes a tile of it from the forward's lse,
//   P = exp(S - lse),  dP = (dO Vᵀ) ∘ Z,  dS = P ∘ (dP - D),  D = rowsum(dO ∘ O)
// (Z: the dropout mask scaled by 1/(1-p)). Passes, each writing disjoint outputs in a fixed
// order, so gradients are bitwise identical for any thread count:
//   0. D for every row                      tasks: (batch, query head, query tile)
//   1. dK, dV for one key tile, summed over the query heads of its GQA group
//                                           tasks: (batch, kv head, key tile)
//   2. dQ for one query tile                tasks: (batch, query head, query tile)
//   3. dbias (only when asked), reduced over the bias's broadcast dimensions
//                                           tasks: (dbias batch, dbias head, row tile, col tile)
// Passes 1 and 2 both recompute S and dP: one more QKᵀ and dO Vᵀ than a single pass with
// atomic dQ, the price of determinism and of parallelism beyond batch x heads.
//
// Orientation: a task packs (transposes, converts) the side it keeps fixed once and reads the
// streamed side in place. Pass 1 keeps a key tile and works on S (rows x keys); passes 2 and
// 3 keep a query tile and work on Sᵀ (keys x rows), as the forward does. Either way every
// element of S is the same chain of FMAs over head_dim followed by one multiply by the scale,
// and every dQ element the same chain over the keys in increasing order, so the orientation
// (and the choice between the pass structures below) never changes a bit of the result.
//
// When there are enough (batch, kv head) pairs to keep every thread busy, one pass per pair
// (single_pass_task) does the work of passes 1 and 2 with five GEMMs per tile instead of
// seven, accumulating dQ for the whole sequence in float (O(seqlen · head_dim) per thread,
// like FlashAttention-2's dq_accum).
#pragma once

#include <algorithm>

#include "cpu/bf16_pairs.h"
#include "cpu/forward.h"  // rows_as_acc
#include "cpu/softmax.h"
#include "cpu/tile.h"
#include "fmha/api.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// The bfloat16 pair products (A, B as pair words, gemm.h's layouts): AVX512-BF16's dot
// products, or at the amx level AMX tiles (amx_gemm.h; the hardware's where usable and built,
// the model's otherwise), configured by the task (run_task). Every pair product of the
// backward goes through here, so that its orientations and pass structures still agree to the
// bit at either level.
template <bool kAcc>
inline void pair_gemm(int M, int N, int K, const uint32_t* A, int64_t a_rs, int64_t a_cs,
                      const uint32_t* B, int64_t ldb, float* C, int64_t ldc) {
#if defined(FMHA_CPU_AMX_LEVEL)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles_on_hardware())
    return tile_gemm_pairs<amx::HardwareTiles, kAcc>(M, N, K, A, a_rs, a_cs, B, ldb, C, ldc);
#endif
  tile_gemm_pairs<amx::ModelTiles, kAcc>(M, N, K, A, a_rs, a_cs, B, ldb, C, ldc);
#else
  gemm<kAcc>(M, N, K, A, a_rs, a_cs, B, ldb, C, ldc);
#endif
}

// Runs one task of the backward; at the amx level with this thread's tiles configured for its
// pair products and released at its end (TileScope, as a forward task does).
template <class F>
inline void run_task(F&& f) {
#if defined(FMHA_CPU_AMX_LEVEL)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles_on_hardware()) {
    TileScope<amx::HardwareTiles> scope;
    return f();
  }
#endif
  TileScope<amx::ModelTiles> scope;
  f();
#else
  f();
#endif
}

// Dense tiles of one task, in the accumulation type. Row buffers that serve as a GEMM B
// operand are padded to the vector width (ldq, ldv).
template <typename A>
struct BwdBuffers {
  int ldq, ldv;
  A *qT, *doT;          // query side, transposed: (head_dim, kBr)       [passes 2, 3]
  A *q_rows, *do_rows;  // query side, rows: (kBr, ldq), (kBr, ldv)      [pass 1, converted]
  A *kT, *vT;           // key side, transposed: (head_dim, kBc)         [pass 1]
  A *k_rows, *v_rows;   // key side, rows: (kBc, ldq), (kBc, dv)         [passes 2, 3, converted]
  A *S, *dP, *Tcap;     // one score tile in either orientation: kBr * kBc each
  A *Lref, *Dr;         // the query tile's lse (+inf for rows with no key) and D
  A* acc;               // the task's gradient accumulator
  // bfloat16 pair words for the AVX512-BF16 path (see BwdHead::pairs):
  uint32_t *kT2, *vT2;     // Kᵀ, Vᵀ pairs along head_dim: B of S = Q Kᵀ, dP = dO Vᵀ
  uint32_t *K2c;           // K pairs along keys: B of dQ += dS K
  uint32_t *Q2r, *dO2r;    // Q, dO pairs along rows: B of dK += dSᵀ Q, dV += Pᵀ dO
  uint32_t *Q2, *dO2;      // Qᵀ, dOᵀ pairs along head_dim: B of Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
  uint32_t *P2, *dS2, *dSq;  // P, dS rounded into pairs: A operands

  BwdBuffers(const FwdParams& p, int64_t acc_elems) {
    const int d = p.head_dim, dv = p.head_dim_v;
    ldq = padded<A>(d);
    ldv = padded<A>(dv);
    using W = Workspace;
    Workspace& ws = thread_workspace();
    ws.begin(W::bytes<A>(int64_t(d) * kBr) + W::bytes<A>(int64_t(dv) * kBr) +
             W::bytes<A>(int64_t(kBr) * ldq) + W::bytes<A>(int64_t(kBr) * ldv) +
             W::bytes<A>(int64_t(d) * kBc) + W::bytes<A>(int64_t(dv) * kBc) +
             W::bytes<A>(int64_t(kBc) * ldq) + W::bytes<A>(int64_t(kBc) * dv) +
             3 * W::bytes<A>(kBr * kBc) + 2 * W::bytes<A>(kBr) + W::bytes<A>(acc_elems) +
             W::bytes<uint32_t>(int64_t((d + 1) / 2) * (kBc + kBr)) +
             W::bytes<uint32_t>(int64_t((dv + 1) / 2) * (kBc + kBr)) +
             W::bytes<uint32_t>(int64_t(kBc / 2) * ldq) + W::bytes<uint32_t>(int64_t(kBr / 2) * ldq) +
             W::bytes<uint32_t>(int64_t(kBr / 2) * ldv) + 3 * W::bytes<uint32_t>(kBr / 2 * kBc));
    qT = ws.take<A>(int64_t(d) * kBr);
    doT = ws.take<A>(int64_t(dv) * kBr);
    q_rows = ws.take<A>(int64_t(kBr) * ldq);
    do_rows = ws.take<A>(int64_t(kBr) * ldv);
    kT = ws.take<A>(int64_t(d) * kBc);
    vT = ws.take<A>(int64_t(dv) * kBc);
    k_rows = ws.take<A>(int64_t(kBc) * ldq);
    v_rows = ws.take<A>(int64_t(kBc) * dv);
    S = ws.take<A>(kBr * kBc);
    dP = ws.take<A>(kBr * kBc);
    Tcap = ws.take<A>(kBr * kBc);
    Lref = ws.take<A>(kBr);
    Dr = ws.take<A>(kBr);
    acc = ws.take<A>(acc_elems);
    fill(acc, acc_elems, A(0));
    kT2 = ws.take<uint32_t>(int64_t((d + 1) / 2) * kBc);
    Q2 = ws.take<uint32_t>(int64_t((d + 1) / 2) * kBr);
    vT2 = ws.take<uint32_t>(int64_t((dv + 1) / 2) * kBc);
    dO2 = ws.take<uint32_t>(int64_t((dv + 1) / 2) * kBr);
    K2c = ws.take<uint32_t>(int64_t(kBc / 2) * ldq);
    Q2r = ws.take<uint32_t>(int64_t(kBr / 2) * ldq);
    dO2r = ws.take<uint32_t>(int64_t(kBr / 2) * ldv);
    P2 = ws.take<uint32_t>(kBr / 2 * kBc);
    dS2 = ws.take<uint32_t>(kBr / 2 * kBc);
    dSq = ws.take<uint32_t>(kBr / 2 * kBc);
  }
};

// One (batch, query head): where its tensors are, and the tile steps of every pass.
template <typename T, typename A>
struct BwdHead {
  const BwdParams& p;
  Seq s;
  int b, h, hk;
  const A* D;    // rowsum(dO∘O) of this (b, h), indexed by query row
  const A* lse;  // lse of this (b, h), indexed by query row (element stride lse_row_stride)
  // bfloat16 with AVX512-BF16: all five products as pair dot products (twice the float FMA
  // rate), Q, dO, K, V read in place where they are the A operand; P and dS are rounded to
  // bfloat16 for the three gradient products, as on a GPU; accumulation stays float. The
  // same for every pass and every call, so results stay independent of the thread count.
  bool pairs = false;  // (set for bfloat16 at the avx512bf16 level, whatever the layout)
  // Q's and dO's rows (A of S = Q Kᵀ and dP = dO Vᵀ, B of dK and dV) read in place or copied
  // dense per query tile: a choice per microarchitecture (kernels.h), the same bits either way.
  bool dense_b = copies_b_rows_dense();

  BwdHead(const BwdParams& p_, int b_, int h_, const A* D_all)
      : p(p_), s(seq_of(p_, b_)), b(b_), h(h_), hk(h_ / (p_.heads_q / p_.heads_kv)) {
    D = D_all + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
    lse = static_cast<const A*>(p.lse) + h * p.lse_head_stride +
          (p.cu_seqlens_q ? s.q_first * p.lse_row_stride : b * p.lse_batch_stride);
    pairs = std::is_same_v<T, bf16_t> && kBf16Dot;
  }

  const T* q_at(int i) const {
    return static_cast<const T*>(p.q) + h * p.q_head_stride +
           row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, i);
  }
  const T* do_at(int i) const {
    return static_cast<const T*>(p.dout) + h * p.do_head_stride +
           row_offset(p, b, p.do_batch_stride, p.do_row_stride, s.q_first, i);
  }
  const T* k_at(int j) const {
    return static_cast<const T*>(p.k) + hk * p.k_head_stride +
           row_offset(p, b, p.k_batch_stride, p.k_row_stride, s.k_first, j);
  }
  const T* v_at(int j) const {
    return static_cast<const T*>(p.v) + hk * p.v_head_stride +
           row_offset(p, b, p.v_batch_stride, p.v_row_stride, s.k_first, j);
  }

  // lse and D of rows i0..i0+nr; rows that saw no key (and pad rows) get L = +inf, which
  // makes their P = exp(S - inf) exactly 0 and so their gradients too.
  void load_row_stats(int i0, int nr, BwdBuffers<A>& t) const {
    for (int r = 0; r < kBr; ++r) {
      const A L = r < nr ? lse[int64_t(i0 + r) * p.lse_row_stride] : neg_inf<A>();
      t.Lref[r] = L == neg_inf<A>() ? -neg_inf<A>() : L;
      t.Dr[r] = r < nr ? D[i0 + r] : A(0);
    }
  }

  // ---- pass 1 orientation: S (rows x keys) = Q (scale K)ᵀ, key tile fixed ----
  void pack_key_tile(int j0, int nc, BwdBuffers<A>& t) const {
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (pairs) {
        pack_pairs_t(k_at(j0), p.k_row_stride, nc, p.head_dim, t.kT2, kBc);
        pack_pairs_t(v_at(j0), p.v_row_stride, nc, p.head_dim_v, t.vT2, kBc);
        pack_row_pairs(k_at(j0), p.k_row_stride, nc, p.head_dim, t.K2c, t.ldq);
        return;
      }
    }
    load_rows_t(k_at(j0), p.k_row_stride, nc, p.head_dim, t.kT, kBc);
    load_rows_t(v_at(j0), p.v_row_stride, nc, p.head_dim_v, t.vT, kBc);
  }
  struct QRows {
    const A *q, *dout;  // row-major, padded: usable as GEMM A and B operands
    int64_t ldq, ldo;
  };
  QRows query_rows(int i0, int nr, BwdBuffers<A>& t) const {
    QRows x{};
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (pairs) {  // the A operands stay in place; pairs along the rows for dK, dV
        pack_row_pairs(q_at(i0), p.q_row_stride, nr, p.head_dim, t.Q2r, t.ldq);
        pack_row_pairs(do_at(i0), p.do_row_stride, nr, p.head_dim_v, t.dO2r, t.ldv);
        return x;
      }
    }
    x.q = rows_as_acc(q_at(i0), p.q_row_stride, nr, p.head_dim, t.q_rows, t.ldq, &x.ldq, true,
                      dense_b);
    x.dout = rows_as_acc(do_at(i0), p.do_row_stride, nr, p.head_dim_v, t.do_rows, t.ldv, &x.ldo,
                         true, dense_b);
    return x;
  }
  // S <- P ∘ Z (feeds dV), dP <- dS (through the softcap: feeds dK), row-major.
  void rebuild_rows(int i0, int nr, int j0, int nc, const QRows& x, BwdBuffers<A>& t) const {
    const int ncp = padded<A>(nc);
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (pairs) {
        int64_t ldq_w, ldo_w;
        const uint32_t* Qw = pair_rows(q_at(i0), p.q_row_stride, nr, p.head_dim, t.q_rows, &ldq_w);
        const uint32_t* dOw =
            pair_rows(do_at(i0), p.do_row_stride, nr, p.head_dim_v, t.do_rows, &ldo_w);
        pair_gemm<false>(nr, ncp, (p.head_dim + 1) / 2, Qw, ldq_w, 1, t.kT2, kBc, t.S, kBc);
        pair_gemm<false>(nr, ncp, (p.head_dim_v + 1) / 2, dOw, ldo_w, 1, t.vT2, kBc, t.dP, kBc);
      }
    }
    if (!pairs) {
      gemm<false>(nr, ncp, p.head_dim, x.q, x.ldq, 1, t.kT, kBc, t.S, kBc);         // Q Kᵀ
      gemm<false>(nr, ncp, p.head_dim_v, x.dout, x.ldo, 1, t.vT, kBc, t.dP, kBc);  // dO Vᵀ
    }
    scale_rows(t.S, nr, ncp, kBc, A(p.scale));
    finish_scores(p, s, b, h, i0, nr, j0, nc, t.S, kBc, 1, p.softcap > 0 ? t.Tcap : nullptr);
    if (p.dropout_p > 0)  // dP ∘ Z with the forward's very mask
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, t.dP + r * kBc);
    probs_and_dS_rows(t.S, t.dP, kBc, nr, ncp, t.Lref, t.Dr);
    finish_grads(nr * kBc, t, true);
    if (p.dropout_p > 0)  // P ∘ Z for dV
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, t.S + r * kBc);
  }

  // ---- passes 2-3 orientation: Sᵀ (keys x rows) = K (scale Q)ᵀ, query tile fixed ----
  void pack_query_tile(int i0, int nr, BwdBuffers<A>& t) const {
    load_row_stats(i0, nr, t);
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (pairs) {
        pack_pairs_t(q_at(i0), p.q_row_stride, nr, p.head_dim, t.Q2, kBr);
        pack_pairs_t(do_at(i0), p.do_row_stride, nr, p.head_dim_v, t.dO2, kBr);
        return;
      }
    }
    load_rows_t(q_at(i0), p.q_row_stride, nr, p.head_dim, t.qT, kBr);
    load_rows_t(do_at(i0), p.do_row_stride, nr, p.head_dim_v, t.doT, kBr);
  }
  struct KRows {
    const A *k, *v;
    int64_t ldk, ldv;
  };
  KRows key_rows(int j0, int nc, BwdBuffers<A>& t) const {
    KRows x{};
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (pairs) {  // K, V stay in place as A operands; K pairs along keys for dQ
        pack_row_pairs(k_at(j0), p.k_row_stride, nc, p.head_dim, t.K2c, t.ldq);
        return x;
      }
    }
    x.k = rows_as_acc(k_at(j0), p.k_row_stride, nc, p.head_dim, t.k_rows, t.ldq, &x.ldk, true);
    x.v = rows_as_acc(v_at(j0), p.v_row_stride, nc, p.head_dim_v, t.v_rows, p.head_dim_v,
                      &x.ldv, false);
    return x;
  }
  // Sᵀ <- Pᵀ, dPᵀ <- dSᵀ (through the softcap when `raw`; dS itself is dbias).
  void rebuild_T(int i0, int nr, int j0, int nc, const KRows& x, BwdBuffers<A>& t,
                 bool raw) const {
    const int nrp = padded<A>(nr);
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (pairs) {
        int64_t ldk_w, ldv_w;
        const uint32_t* Kw = pair_rows(k_at(j0), p.k_row_stride, nc, p.head_dim, t.k_rows, &ldk_w);
        const uint32_t* Vw =
            pair_rows(v_at(j0), p.v_row_stride, nc, p.head_dim_v, t.v_rows, &ldv_w);
        pair_gemm<false>(nc, nrp, (p.head_dim + 1) / 2, Kw, ldk_w, 1, t.Q2, kBr, t.S, kBr);
        pair_gemm<false>(nc, nrp, (p.head_dim_v + 1) / 2, Vw, ldv_w, 1, t.dO2, kBr, t.dP, kBr);
      }
    }
    if (!pairs) {
      gemm<false>(nc, nrp, p.head_dim, x.k, x.ldk, 1, t.qT, kBr, t.S, kBr);         // K Qᵀ
      gemm<false>(nc, nrp, p.head_dim_v, x.v, x.ldv, 1, t.doT, kBr, t.dP, kBr);   // V dOᵀ
    }
    scale_rows(t.S, nc, nrp, kBr, A(p.scale));
    finish_scores(p, s, b, h, i0, nr, j0, nc, t.S, 1, kBr, p.softcap > 0 ? t.Tcap : nullptr);
    if (p.dropout_p > 0)
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, t.dP + r, kBr);
    probs_and_dS_T(t.S, t.dP, kBr, nc, nrp, t.Lref, t.Dr);
    finish_grads(nc * kBr, t, raw);
  }

  // dS through the softcap: d softcap·tanh(s/softcap) / ds = 1 - tanh². A zero dS stays
  // zero (strong zero: the tanh of a masked pair's raw score may be NaN).
  void finish_grads(int64_t n, BwdBuffers<A>& t, bool raw) const {
    if (raw && p.softcap > 0)
      for (int64_t e = 0; e < n; ++e)
        t.dP[e] = t.dP[e] == A(0) ? A(0) : t.dP[e] * score::softcap_grad(t.Tcap[e]);
  }
};

// Pass 0: D_i = rowsum(dO_i ∘ O_i) - dlse_i (dlse: the gradient through lse, when given), in
// the accumulation type.
template <typename T, typename A>
void d_task(const BwdParams& p, int64_t task, A* D_all) {
  const int n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int b = int(task / (int64_t(p.heads_q) * n_qblocks));
  const int h = int(task / n_qblocks % p.heads_q);
  const int i0 = int(task % n_qblocks) * kBr;
  const Seq s = seq_of(p, b);
  A* D = D_all + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
  const A* dlse = p.dlse ? static_cast<const A*>(p.dlse) + h * p.lse_head_stride +
                               (p.cu_seqlens_q ? s.q_first * p.lse_row_stride
                                               : b * p.lse_batch_stride)
                         : nullptr;
  for (int i = i0; i < std::min(i0 + kBr, s.sq); ++i) {
    const T* o = static_cast<const T*>(p.o) + h * p.o_head_stride +
                 row_offset(p, b, p.o_batch_stride, p.o_row_stride, s.q_first, i);
    const T* g = static_cast<const T*>(p.dout) + h * p.do_head_stride +
                 row_offset(p, b, p.do_batch_stride, p.do_row_stride, s.q_first, i);
    A acc = 0;
    for (int t = 0; t < p.head_dim_v; ++t) acc += to_acc<A>(o[t]) * to_acc<A>(g[t]);
    D[i] = dlse ? acc - dlse[int64_t(i) * p.lse_row_stride] : acc;
  }
}

// The key-stationary loop shared by pass 1 and the single pass: dK, dV of one key tile over
// every query head of the group and every query tile that sees it; with dQ_all (group x
// seqlen_q x ldq), dQ += dS K as well.
// Query rows of a key tile up to which the backward works on Sᵀ with K and V in place.
constexpr int kFewRowsBwd = 16;

template <typename T, typename A>
void key_tile_grads(const BwdParams& p, int b, int hk, int j0, int nc, const A* D_all,
                    BwdBuffers<A>& t, A* dK, A* dV, A* dQ_all) {
  const Seq s = seq_of(p, b);
  const int group = p.heads_q / p.heads_kv, ldq = t.ldq, ldv = t.ldv;
  const int i_begin = query_lo(p, s, j0), i_end = query_hi(p, s, j0 + nc - 1) + 1;
  // Few query rows see this key tile (decode-like shapes): transposing K and V for the
  // row-major S would cost more than the products, so work on Sᵀ with K and V read in
  // place, as the query-stationary pass does. Same products, same order: same bits.
  const bool few_rows = i_end - i_begin <= kFewRowsBwd;
  // K's tile feeds dQ = dS K: checked once for the strong zero (tile.h), where it matters.
  const T* k_tile = static_cast<const T*>(p.k) + hk * p.k_head_stride +
                    row_offset(p, b, p.k_batch_stride, p.k_row_stride, s.k_first, j0);
  const bool k_bad = dQ_all && has_nonfinite(k_tile, p.k_row_stride, nc, p.head_dim);
  typename BwdHead<T, A>::KRows kr{};
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const BwdHead<T, A> head(p, b, h, D_all);
    if (h == hk * group) {
      if (!few_rows) head.pack_key_tile(j0, nc, t);
      if ((dQ_all && !head.pairs) || few_rows) kr = head.key_rows(j0, nc, t);
    }
    for (int i0 = i_begin; i0 < i_end; i0 += kBr) {
      const int nr = std::min(kBr, i_end - i0);
      if (i0 + kBr < i_end) {  // the next tile's rows of Q and dO, while this one runs
        const int nn = std::min(kBr, i_end - i0 - kBr);
        prefetch_rows(head.q_at(i0 + kBr), p.q_row_stride, nn, p.head_dim * int(sizeof(T)));
        prefetch_rows(head.do_at(i0 + kBr), p.do_row_stride, nn, p.head_dim_v * int(sizeof(T)));
        if (dQ_all)  // and its dQ rows, which dQ += dS K reads and writes (the sequence's)
          prefetch_rows(dQ_all + (int64_t(h - hk * group) * p.seqlen_q + i0 + kBr) * ldq, ldq, nn,
                        p.head_dim * int(sizeof(A)));
      }
      if (tile_skipped(p, b, h, i0, nr, j0, nc)) continue;
      A* dQ = dQ_all ? dQ_all + (int64_t(h - hk * group) * p.seqlen_q + i0) * ldq : nullptr;
      const auto x = head.query_rows(i0, nr, t);
      // The tile in one orientation: P∘Z and dS (row-major S, dP; or Sᵀ, dPᵀ), and the
      // strides of P(r, c) / dS(r, c) within it.
      int64_t rs = kBc, cs = 1;
      if (few_rows) {
        head.pack_query_tile(i0, nr, t);
        head.rebuild_T(i0, nr, j0, nc, kr, t, true);
        if (p.dropout_p > 0)  // P ∘ Z for dV
          for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, t.S + r, kBr);
        rs = 1;
        cs = kBr;
      } else {
        head.load_row_stats(i0, nr, t);
        head.rebuild_rows(i0, nr, j0, nc, x, t);
      }
      if (tile_may_zero(p, s, i0, nr, j0, nc) &&
          (k_bad || has_nonfinite(head.do_at(i0), p.do_row_stride, nr, p.head_dim_v) ||
           has_nonfinite(head.q_at(i0), p.q_row_stride, nr, p.head_dim))) {
        // The three products with the strong zero (tile.h), from the float P∘Z and dS.
        const auto skip_kr = [&](bool or_dropped) {
          return [&, or_dropped](int c, int r) {
            return pair_excluded(p, s, b, h, i0 + r, j0 + c, or_dropped);
          };
        };
        gemm_strong_zero(nc, p.head_dim_v, nr, t.S, cs, rs, head.do_at(i0), p.do_row_stride, dV,
                         ldv, skip_kr(true));  // dV += (P∘Z)ᵀ dO
        gemm_strong_zero(nc, p.head_dim, nr, t.dP, cs, rs, head.q_at(i0), p.q_row_stride, dK,
                         ldq, skip_kr(false));  // dK += dSᵀ Q
        if (dQ)
          gemm_strong_zero(nr, p.head_dim, nc, t.dP, rs, cs, head.k_at(j0), p.k_row_stride, dQ,
                           ldq, [&](int r, int c) {
                             return pair_excluded(p, s, b, h, i0 + r, j0 + c, false);
                           });  // dQ += dS K
        continue;
      }
      if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
        if (head.pairs) {
          const int rp = (nr + 1) / 2;
          // P, dS rounded into pairs along the rows: A(c, kp) = (X(2kp, c), X(2kp+1, c)).
          if (few_rows) {
            pack_rows_bf16(t.S, kBr, nc, nr, t.P2, kBr / 2);
            pack_rows_bf16(t.dP, kBr, nc, nr, t.dS2, kBr / 2);
          } else {
            pack_float_pairs(t.S, 1, kBc, nc, nr, t.P2, kBc);
            pack_float_pairs(t.dP, 1, kBc, nc, nr, t.dS2, kBc);
          }
          const int64_t a_rs = few_rows ? kBr / 2 : 1, a_cs = few_rows ? 1 : kBc;
          pair_gemm<true>(nc, ldv, rp, t.P2, a_rs, a_cs, t.dO2r, ldv, dV, ldv);   // dV += (P∘Z)ᵀ dO
          pair_gemm<true>(nc, ldq, rp, t.dS2, a_rs, a_cs, t.Q2r, ldq, dK, ldq);  // dK += dSᵀ Q
          if (dQ) {  // dQ += dS K, dS in pairs along the keys
            if (few_rows) {
              pack_float_pairs(t.dP, 1, kBr, nr, nc, t.dSq, kBr);
              pair_gemm<true>(nr, ldq, (nc + 1) / 2, t.dSq, 1, kBr, t.K2c, ldq, dQ, ldq);
            } else {
              pack_rows_bf16(t.dP, kBc, nr, nc, t.dSq, kBc / 2);
              pair_gemm<true>(nr, ldq, (nc + 1) / 2, t.dSq, kBc / 2, 1, t.K2c, ldq, dQ, ldq);
            }
          }
          continue;
        }
      }
      gemm<true>(nc, ldv, nr, t.S, cs, rs, x.dout, x.ldo, dV, ldv);  // dV += (P∘Z)ᵀ dO
      gemm<true>(nc, ldq, nr, t.dP, cs, rs, x.q, x.ldq, dK, ldq);    // dK += dSᵀ Q
      if (dQ) gemm<true>(nr, ldq, nc, t.dP, rs, cs, kr.k, kr.ldk, dQ, ldq);  // dQ += dS K
    }
  }
}

template <typename T, typename A>
void store_key_tile_grads(const BwdParams& p, int b, int hk, const Seq& s, int j0, int nc, A* dK,
                          A* dV, int ldq, int ldv) {
  const int d = p.head_dim, dv = p.head_dim_v;
  scale_rows(dK, nc, d, ldq, A(p.scale));
  T* dk = static_cast<T*>(p.dk) + hk * p.dk_head_stride +
          row_offset(p, b, p.dk_batch_stride, p.dk_row_stride, s.k_first, j0);
  T* dvp = static_cast<T*>(p.dv) + hk * p.dv_head_stride +
           row_offset(p, b, p.dv_batch_stride, p.dv_row_stride, s.k_first, j0);
  for (int c = 0; c < nc; ++c) {
    store_row(dK + int64_t(c) * ldq, d, dk + c * p.dk_row_stride);
    store_row(dV + int64_t(c) * ldv, dv, dvp + c * p.dv_row_stride);
  }
}

// Pass 1: dK, dV of key tile j0..j0+nc of kv head hk, over every query head of its group and
// every query tile that sees it.
template <typename T, typename A>
void dkdv_task(const BwdParams& p, int64_t task, const A* D_all) {
  const int n_kblocks = (p.seqlen_k + kBc - 1) / kBc;
  const int b = int(task / (int64_t(p.heads_kv) * n_kblocks));
  const int hk = int(task / n_kblocks % p.heads_kv);
  const int j0 = int(task % n_kblocks) * kBc;
  const Seq s = seq_of(p, b);
  if (j0 >= s.sk) return;
  const int nc = std::min(kBc, s.sk - j0);
  const int ldq = padded<A>(p.head_dim), ldv = padded<A>(p.head_dim_v);
  BwdBuffers<A> t(p, int64_t(kBc) * (ldq + ldv));
  A* dK = t.acc;                       // (nc, ldq): dSᵀ Q, scaled when stored
  A* dV = t.acc + int64_t(kBc) * ldq;  // (nc, ldv)
  key_tile_grads<T, A>(p, b, hk, j0, nc, D_all, t, dK, dV, nullptr);
  store_key_tile_grads<T, A>(p, b, hk, s, j0, nc, dK, dV, ldq, ldv);
}

// The single pass: everything of one (batch, kv head), key tile after key tile, dQ of the
// group's query heads accumulated in float until the end.
template <typename T, typename A>
void single_pass_task(const BwdParams& p, int64_t task, const A* D_all) {
  const int b = int(task / p.heads_kv), hk = int(task % p.heads_kv);
  const Seq s = seq_of(p, b);
  const int d = p.head_dim, group = p.heads_q / p.heads_kv;
  const int ldq = padded<A>(d), ldv = padded<A>(p.head_dim_v);
  BwdBuffers<A> t(p, int64_t(kBc) * (ldq + ldv) + int64_t(group) * p.seqlen_q * ldq);
  A* dK = t.acc;
  A* dV = dK + int64_t(kBc) * ldq;
  A* dQ_all = dV + int64_t(kBc) * ldv;  // (group, seqlen_q, ldq)
  for (int j0 = 0; j0 < s.sk; j0 += kBc) {
    const int nc = std::min(kBc, s.sk - j0);
    fill(dK, int64_t(kBc) * (ldq + ldv), A(0));
    key_tile_grads<T, A>(p, b, hk, j0, nc, D_all, t, dK, dV, dQ_all);
    store_key_tile_grads<T, A>(p, b, hk, s, j0, nc, dK, dV, ldq, ldv);
  }
  for (int g = 0; g < group; ++g) {
    const int h = hk * group + g;
    A* dQ = dQ_all + int64_t(g) * p.seqlen_q * ldq;
    scale_rows(dQ, s.sq, d, ldq, A(p.scale));
    T* dq = static_cast<T*>(p.dq) + h * p.dq_head_stride +
            row_offset(p, b, p.dq_batch_stride, p.dq_row_stride, s.q_first, 0);
    for (int i = 0; i < s.sq; ++i) store_row(dQ + int64_t(i) * ldq, d, dq + i * p.dq_row_stride);
  }
}

// Pass 2: dQ of query tile i0..i0+nr of query head h.
template <typename T, typename A>
void dq_task(const BwdParams& p, int64_t task, const A* D_all) {
  const int n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int b = int(task / (int64_t(p.heads_q) * n_qblocks));
  const int h = int(task / n_qblocks % p.heads_q);
  const int i0 = int(task % n_qblocks) * kBr;
  const BwdHead<T, A> head(p, b, h, D_all);
  const Seq& s = head.s;
  if (i0 >= s.sq) return;
  const int nr = std::min(kBr, s.sq - i0);
  const int d = p.head_dim, ldq = padded<A>(d);
  BwdBuffers<A> t(p, int64_t(kBr) * ldq);
  A* dQ = t.acc;  // (nr, ldq)
  head.pack_query_tile(i0, nr, t);

  // Key tiles start at even keys: the bf16 path pairs keys (2k, 2k+1) as the single pass
  // does, so both build dQ from the very same products in the same order. On AMX tiles the
  // sums are rounded once per step of 32 keys (amx_gemm.h): the tiles start at a multiple of
  // 32, as the single pass's key tiles do, so that the steps hold the same keys (a key before
  // key_lo adds an exact zero: its dS is 0).
#if defined(FMHA_CPU_AMX_LEVEL)
  constexpr int kKeyAlign = 2 * kTilePairs;
#else
  constexpr int kKeyAlign = 2;
#endif
  const int j_begin = key_lo(p, s, i0) & ~(kKeyAlign - 1), j_end = key_hi(p, s, i0 + nr - 1) + 1;
  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0);
    if (j0 + kBc < j_end) {  // the next tile's rows of K and V, while this one runs
      const int nn = std::min(kBc, j_end - j0 - kBc);
      prefetch_rows(head.k_at(j0 + kBc), p.k_row_stride, nn, d * int(sizeof(T)));
      prefetch_rows(head.v_at(j0 + kBc), p.v_row_stride, nn, p.head_dim_v * int(sizeof(T)));
    }
    if (tile_skipped(p, b, h, i0, nr, j0, nc)) continue;
    const auto x = head.key_rows(j0, nc, t);
    head.rebuild_T(i0, nr, j0, nc, x, t, true);
    if (tile_may_zero(p, s, i0, nr, j0, nc) &&
        has_nonfinite(head.k_at(j0), p.k_row_stride, nc, d)) {
      gemm_strong_zero(nr, d, nc, t.dP, 1, kBr, head.k_at(j0), p.k_row_stride, dQ, ldq,
                       [&](int r, int c) {
                         return pair_excluded(p, s, b, h, i0 + r, j0 + c, false);
                       });  // dQ += dS K
      continue;
    }
    if constexpr (std::is_same_v<T, bf16_t> && kBf16Dot) {
      if (head.pairs) {
        pack_float_pairs(t.dP, 1, kBr, nr, nc, t.dSq, kBr);
        pair_gemm<true>(nr, ldq, (nc + 1) / 2, t.dSq, 1, kBr, t.K2c, ldq, dQ, ldq);  // dQ += dS K
        continue;
      }
    }
    gemm<true>(nr, ldq, nc, t.dP, 1, kBr, x.k, x.ldk, dQ, ldq);  // dQ += dS K
  }
  scale_rows(dQ, nr, d, ldq, A(p.scale));
  T* dq = static_cast<T*>(p.dq) + h * p.dq_head_stride +
          row_offset(p, b, p.dq_batch_stride, p.dq_row_stride, s.q_first, i0);
  for (int r = 0; r < nr; ++r) store_row(dQ + int64_t(r) * ldq, d, dq + r * p.dq_row_stride);
}

// Pass 3: one (row tile x col tile) of dbias, summed over every (b, h, i, j) that the bias
// broadcasts onto it. A broadcast extent of 1 means "all of them".
template <typename T, typename A>
void dbias_task(const BwdParams& p, int64_t task, const A* D_all) {
  const int R = p.dbias_rows, C = p.dbias_cols;
  const int n_rt = (R + kBr - 1) / kBr, n_ct = (C + kBc - 1) / kBc;
  const int ct = int(task % n_ct), rt = int(task / n_ct % n_rt);
  const int hh = int(task / (int64_t(n_ct) * n_rt) % p.dbias_heads);
  const int bb = int(task / (int64_t(n_ct) * n_rt * p.dbias_heads));
  const int out_r0 = rt * kBr, out_nr = std::min(kBr, R - out_r0);
  const int out_c0 = ct * kBc, out_nc = std::min(kBc, C - out_c0);
  BwdBuffers<A> t(p, kBr * kBc);  // acc: (out rows, kBc)

  const int b_lo = p.dbias_batch == 1 ? 0 : bb, b_hi = p.dbias_batch == 1 ? p.batch : bb + 1;
  const int h_lo = p.dbias_heads == 1 ? 0 : hh, h_hi = p.dbias_heads == 1 ? p.heads_q : hh + 1;
  for (int b = b_lo; b < b_hi; ++b) {
    for (int h = h_lo; h < h_hi; ++h) {
      const BwdHead<T, A> head(p, b, h, D_all);
      const Seq& s = head.s;
      // Rows/cols of this sequence that land on the output tile.
      const int i_lo = R == 1 ? 0 : out_r0, i_hi = std::min(s.sq, R == 1 ? s.sq : out_r0 + out_nr);
      const int j_lo = C == 1 ? 0 : out_c0, j_hi = std::min(s.sk, C == 1 ? s.sk : out_c0 + out_nc);
      for (int i0 = i_lo; i0 < i_hi; i0 += kBr) {
        const int nr = std::min(kBr, i_hi - i0);
        head.pack_query_tile(i0, nr, t);
        for (int j0 = j_lo; j0 < j_hi; j0 += kBc) {
          const int nc = std::min(kBc, j_hi - j0);
          head.rebuild_T(i0, nr, j0, nc, head.key_rows(j0, nc, t), t, false);
          for (int r = 0; r < nr; ++r)
            for (int c = 0; c < nc; ++c)
              t.acc[(R == 1 ? 0 : i0 + r - out_r0) * kBc + (C == 1 ? 0 : j0 + c - out_c0)] +=
                  t.dP[c * kBr + r];
        }
      }
    }
  }
  A* out = static_cast<A*>(p.dbias) + ((int64_t(bb) * p.dbias_heads + hh) * R) * C;
  for (int r = 0; r < out_nr; ++r)
    for (int c = 0; c < out_nc; ++c)
      out[int64_t(out_r0 + r) * C + out_c0 + c] = t.acc[r * kBc + c];
}

// A bias constant along the keys gets dbias = Σ_j dS_ij = D_i - D_i = 0 without any pass (the
// caller fills the zeros), plus dlse_i for a row that sees a key when lse has a gradient;
// a row whose lse is NaN, or that sees keys and has a non-finite D, sums to NaN in IEEE
// arithmetic (docs/semantics.md, non-finite inputs): its dbias entry is NaN.
template <typename A>
void constant_bias_rows(const BwdParams& p, const A* D_all) {
  A* out = static_cast<A*>(p.dbias);
  for (int b = 0; b < p.batch; ++b) {
    const Seq s = seq_of(p, b);
    for (int h = 0; h < p.heads_q; ++h) {
      const A* lse = static_cast<const A*>(p.lse) + h * p.lse_head_stride +
                     (p.cu_seqlens_q ? s.q_first * p.lse_row_stride : b * p.lse_batch_stride);
      const A* D = D_all + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
      const A* dlse = p.dlse ? static_cast<const A*>(p.dlse) + (lse - static_cast<const A*>(p.lse))
                             : nullptr;
      for (int i = 0; i < s.sq; ++i) {
        const A L = lse[int64_t(i) * p.lse_row_stride];
        const int64_t at = (int64_t(p.dbias_batch == 1 ? 0 : b) * p.dbias_heads +
                            (p.dbias_heads == 1 ? 0 : h)) * p.dbias_rows +
                           (p.dbias_rows == 1 ? 0 : i);
        if (std::isnan(L) || (L != neg_inf<A>() && !std::isfinite(D[i])))
          out[at] = std::numeric_limits<A>::quiet_NaN();
        else if (dlse && L != neg_inf<A>())
          out[at] += dlse[int64_t(i) * p.lse_row_stride];  // rows in a fixed order
      }
    }
  }
}

// The single pass needs at least 4 (batch, kv head) tasks per thread to balance (causal rows
// make tasks unequal only across sequences of different lengths) and a dQ accumulator that
// fits comfortably. FMHA_CPU_BACKWARD=passes|single forces one (tests compare them: they
// must agree to the bit). 5 instead of 7 GEMMs per tile: ~25% faster where it applies.
inline bool use_single_pass(const BwdParams& p) {
  if (const char* force = std::getenv("FMHA_CPU_BACKWARD")) {
    if (!std::strcmp(force, "single")) return true;
    if (!std::strcmp(force, "passes")) return false;
  }
  const int threads = p.num_threads > 0 ? p.num_threads : hardware_threads();
  const int64_t dq_bytes = int64_t(p.heads_q / p.heads_kv) * p.seqlen_q *
                           padded<float>(p.head_dim) * 8;
  return int64_t(p.batch) * p.heads_kv >= 4 * int64_t(threads) && dq_bytes <= (int64_t(64) << 20);
}

template <typename T>
void backward_typed(const BwdParams& p) {
  using A = acc_t<T>;
  const int64_t n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int64_t n_kblocks = (p.seqlen_k + kBc - 1) / kBc;
  std::vector<A> D(size_t(p.batch) * p.heads_q * p.seqlen_q);  // O(n): one value per row
  const int64_t q_tasks = int64_t(p.batch) * p.heads_q * n_qblocks;
  // The passes over the keys repeat the forward's S (and P) and add dP, dS and three more
  // GEMMs: about twice its work; D is a row-wise dot product of dO and O.
  const int64_t work = cpu_work_estimate_ns(p, 2.0);
  const int64_t d_work =
      int64_t(double(p.cu_seqlens_q ? p.total_q : int64_t(p.batch) * p.seqlen_q) * p.heads_q *
              p.head_dim_v * 0.1);
  parallel_for(q_tasks, p.num_threads, [&](int64_t t) { d_task<T, A>(p, t, D.data()); },
               d_work);
  if (use_single_pass(p)) {
    parallel_for(int64_t(p.batch) * p.heads_kv, p.num_threads,
                 [&](int64_t t) { run_task([&] { single_pass_task<T, A>(p, t, D.data()); }); },
                 work);
  } else {
    parallel_for(int64_t(p.batch) * p.heads_kv * n_kblocks, p.num_threads,
                 [&](int64_t t) { run_task([&] { dkdv_task<T, A>(p, t, D.data()); }); }, work);
    parallel_for(q_tasks, p.num_threads,
                 [&](int64_t t) { run_task([&] { dq_task<T, A>(p, t, D.data()); }); }, work);
  }
  if (dbias_is_zero(p)) {
    std::fill_n(static_cast<A*>(p.dbias), int64_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows,
                A(0));
    constant_bias_rows(p, D.data());
  } else if (p.dbias) {
    const int64_t n = int64_t(p.dbias_batch) * p.dbias_heads *
                      ((p.dbias_rows + kBr - 1) / kBr) * ((p.dbias_cols + kBc - 1) / kBc);
    parallel_for(n, p.num_threads,
                 [&](int64_t t) { run_task([&] { dbias_task<T, A>(p, t, D.data()); }); }, work);
  }
}

#if defined(FMHA_CPU_AMX_LEVEL)
// The amx level (instantiate_amx.cpp): the bfloat16 backward with its pair products on tiles
// (pair_gemm); the other dtypes run the avx512bf16 level's code.
void backward(const BwdParams& p) {
  if (p.dtype == DType::kBFloat16) return backward_typed<bf16_t>(p);
  avx512bf16::backward(p);
}
#else
void backward(const BwdParams& p) {
  switch (p.dtype) {
    case DType::kFloat64: return backward_typed<double>(p);
    case DType::kFloat32: return backward_typed<float>(p);
    case DType::kBFloat16: return backward_typed<bf16_t>(p);
    case DType::kFloat16: return backward_typed<f16_t>(p);
    case DType::kFloat8E4M3: break;  // check_params refuses float8 inputs in the backward
  }
}
#endif

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
