// The CPU backward: FlashAttention-2 (Dao 2023, Algorithm 2) restructured for threads
// without atomics.
//
// P is never stored: every pass recomputes a tile of it from the forward's lse,
//   P = exp(S - lse),  dP = (dO Vᵀ) ∘ Z,  dS = P ∘ (dP - D),  D = rowsum(dO ∘ O)
// (Z: the dropout mask scaled by 1/(1-p)). Three passes, each writing disjoint outputs in a
// fixed order, so gradients are bitwise identical for any thread count:
//   0. D for every row                      tasks: (batch, query head, query tile)
//   1. dK, dV for one key tile, summed over the query heads of its GQA group
//                                           tasks: (batch, kv head, key tile)
//   2. dQ for one query tile                tasks: (batch, query head, query tile)
//   3. dbias (only when asked), reduced over the bias's broadcast dimensions
//                                           tasks: (dbias batch, dbias head, row tile, col tile)
// Passes 1 and 2 both recompute S and dP: one more QKᵀ and dO Vᵀ than a single pass with
// atomic dQ, the price of determinism and of parallelism beyond batch x heads.
#pragma once

#include "cpu/forward.h"  // rows_as_acc
#include "cpu/softmax.h"
#include "cpu/tile.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// Dense tiles of one task, in the accumulation type. Row buffers that serve as a GEMM B
// operand are padded to the vector width (ldq, ldv).
template <typename A>
struct BwdBuffers {
  int ldq, ldv;
  A *QiT, *dOiT, *Qi, *dOi, *Kbuf, *Vbuf, *ST, *dPT, *Tcap, *Lref, *Dr, *acc;

  BwdBuffers(const FwdParams& p, int64_t acc_elems) {
    const int d = p.head_dim, dv = p.head_dim_v;
    ldq = padded<A>(d);
    ldv = padded<A>(dv);
    Workspace& ws = thread_workspace();
    ws.begin(Workspace::bytes<A>(int64_t(d) * kBr) + Workspace::bytes<A>(int64_t(dv) * kBr) +
             Workspace::bytes<A>(int64_t(kBr) * ldq) + Workspace::bytes<A>(int64_t(kBr) * ldv) +
             Workspace::bytes<A>(int64_t(kBc) * ldq) + Workspace::bytes<A>(int64_t(kBc) * dv) +
             3 * Workspace::bytes<A>(kBc * kBr) + 2 * Workspace::bytes<A>(kBr) +
             Workspace::bytes<A>(acc_elems));
    QiT = ws.take<A>(int64_t(d) * kBr);    // (scale Q)ᵀ: B of Sᵀ = K Qᵀ
    dOiT = ws.take<A>(int64_t(dv) * kBr);  // dOᵀ: B of dPᵀ = V dOᵀ
    Qi = ws.take<A>(int64_t(kBr) * ldq);   // scale Q rows: B of dK += dSᵀ Q
    dOi = ws.take<A>(int64_t(kBr) * ldv);  // dO rows: B of dV += Pᵀ dO
    Kbuf = ws.take<A>(int64_t(kBc) * ldq); // K rows: A of Sᵀ, B of dQ += dS K
    Vbuf = ws.take<A>(int64_t(kBc) * dv);  // V rows: A of dPᵀ
    ST = ws.take<A>(kBc * kBr);            // Sᵀ, then Pᵀ (∘ Z)
    dPT = ws.take<A>(kBc * kBr);           // dPᵀ, then dSᵀ
    Tcap = ws.take<A>(kBc * kBr);          // tanh(raw / softcap)ᵀ
    Lref = ws.take<A>(kBr);                // lse of the tile rows, +inf for rows with no key
    Dr = ws.take<A>(kBr);                  // D of the tile rows
    acc = ws.take<A>(acc_elems);           // the task's gradient accumulator
    fill(acc, acc_elems, A(0));
  }
};

// The tensors of one (batch, query head) needed to rebuild P and dS on a tile.
template <typename T, typename A>
struct BwdTile {
  const BwdParams& p;
  Seq s;
  int b, h, hk;
  const A* D;    // rowsum(dO∘O) of this (b, h), indexed by query row
  const A* lse;  // lse of this (b, h), indexed by query row (element stride lse_row_stride)
  int64_t lse_stride;

  BwdTile(const BwdParams& p_, int b_, int h_, const A* D_all)
      : p(p_), s(seq_of(p_, b_)), b(b_), h(h_), hk(h_ / (p_.heads_q / p_.heads_kv)) {
    D = D_all + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
    lse = static_cast<const A*>(p.lse) + h * p.lse_head_stride +
          (p.cu_seqlens_q ? s.q_first * p.lse_row_stride : b * p.lse_batch_stride);
    lse_stride = p.lse_row_stride;
  }

  // Query-side tiles of rows i0..i0+nr: (scale Q)ᵀ, dOᵀ, lse, D; the row forms when `rows`.
  void load_q(int i0, int nr, BwdBuffers<A>& t, bool rows) const {
    const T* q = static_cast<const T*>(p.q) + h * p.q_head_stride +
                 row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, i0);
    const T* g = static_cast<const T*>(p.dout) + h * p.do_head_stride +
                 row_offset(p, b, p.do_batch_stride, p.do_row_stride, s.q_first, i0);
    const A scale = A(p.scale);
    load_rows_t(q, p.q_row_stride, nr, p.head_dim, t.QiT, kBr);
    scale_rows(t.QiT, p.head_dim, kBr, kBr, scale);
    load_rows_t(g, p.do_row_stride, nr, p.head_dim_v, t.dOiT, kBr);
    if (rows) {
      load_rows(q, p.q_row_stride, nr, p.head_dim, t.Qi, t.ldq);
      scale_rows(t.Qi, nr, p.head_dim, t.ldq, scale);
      load_rows(g, p.do_row_stride, nr, p.head_dim_v, t.dOi, t.ldv);
    }
    for (int r = 0; r < kBr; ++r) {
      const A L = r < nr ? lse[int64_t(i0 + r) * lse_stride] : neg_inf<A>();
      t.Lref[r] = L == neg_inf<A>() ? -neg_inf<A>() : L;  // P = exp(S - inf) = 0: no key seen
      t.Dr[r] = r < nr ? D[i0 + r] : A(0);
    }
  }

  // Key-side rows of keys j0..j0+nc (in place when already the accumulation type).
  struct KV {
    const A *K, *V;
    int64_t ldk, ldv;
  };
  KV load_k(int j0, int nc, BwdBuffers<A>& t) const {
    const T* k = static_cast<const T*>(p.k) + hk * p.k_head_stride +
                 row_offset(p, b, p.k_batch_stride, p.k_row_stride, s.k_first, j0);
    const T* v = static_cast<const T*>(p.v) + hk * p.v_head_stride +
                 row_offset(p, b, p.v_batch_stride, p.v_row_stride, s.k_first, j0);
    KV kv;
    kv.K = rows_as_acc(k, p.k_row_stride, nc, p.head_dim, t.Kbuf, t.ldq, &kv.ldk, true);
    kv.V = rows_as_acc(v, p.v_row_stride, nc, p.head_dim_v, t.Vbuf, p.head_dim_v, &kv.ldv,
                       false);
    return kv;
  }

  // On the tile rows i0..i0+nr x keys j0..j0+nc (query tiles loaded, kv from load_k):
  //   ST  <- Pᵀ ∘ Z        (what multiplies V in the forward; feeds dV)
  //   dPT <- dSᵀ = P ∘ (dP ∘ Z - D), through the softcap's (1 - tanh²) when `raw`
  //          (dS itself is dbias; dS through the softcap feeds dQ and dK).
  void rebuild(int i0, int nr, int j0, int nc, BwdBuffers<A>& t, const KV& kv, bool raw) const {
    const int nrp = padded<A>(nr);
    gemm<false>(nc, nrp, p.head_dim, kv.K, kv.ldk, 1, t.QiT, kBr, t.ST, kBr);       // Sᵀ
    finish_scores(p, s, b, h, i0, nr, j0, nc, t.ST, 1, kBr, p.softcap > 0 ? t.Tcap : nullptr);
    gemm<false>(nc, nrp, p.head_dim_v, kv.V, kv.ldv, 1, t.dOiT, kBr, t.dPT, kBr);  // dPᵀ
    if (p.dropout_p > 0)  // dP ∘ Z with the forward's very mask
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, t.dPT + r, kBr);
    probs_and_dS_T(t.ST, t.dPT, kBr, nc, nrp, t.Lref, t.Dr);
    if (raw && p.softcap > 0)
      for (int64_t e = 0; e < int64_t(nc) * kBr; ++e) t.dPT[e] *= A(1) - t.Tcap[e] * t.Tcap[e];
    if (p.dropout_p > 0)  // P ∘ Z for dV
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, t.ST + r, kBr);
  }
};

// Pass 0: D_i = rowsum(dO_i ∘ O_i), in the accumulation type.
template <typename T, typename A>
void d_task(const BwdParams& p, int64_t task, A* D_all) {
  const int n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int b = int(task / (int64_t(p.heads_q) * n_qblocks));
  const int h = int(task / n_qblocks % p.heads_q);
  const int i0 = int(task % n_qblocks) * kBr;
  const Seq s = seq_of(p, b);
  A* D = D_all + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
  for (int i = i0; i < std::min(i0 + kBr, s.sq); ++i) {
    const T* o = static_cast<const T*>(p.o) + h * p.o_head_stride +
                 row_offset(p, b, p.o_batch_stride, p.o_row_stride, s.q_first, i);
    const T* g = static_cast<const T*>(p.dout) + h * p.do_head_stride +
                 row_offset(p, b, p.do_batch_stride, p.do_row_stride, s.q_first, i);
    A acc = 0;
    for (int t = 0; t < p.head_dim_v; ++t) acc += to_acc<A>(o[t]) * to_acc<A>(g[t]);
    D[i] = acc;
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
  const int d = p.head_dim, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  const int ldq = padded<A>(d), ldv = padded<A>(dv);
  BwdBuffers<A> t(p, int64_t(kBc) * (ldq + ldv));
  A* dK = t.acc;                       // (nc, ldq): dSᵀ (scale Q) = scale · dSᵀ Q
  A* dV = t.acc + int64_t(kBc) * ldq;  // (nc, ldv)

  typename BwdTile<T, A>::KV kv{};
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const BwdTile<T, A> tile(p, b, h, D_all);
    if (h == hk * group) kv = tile.load_k(j0, nc, t);
    const int i_begin = query_lo(p, s, j0), i_end = query_hi(p, s, j0 + nc - 1) + 1;
    for (int i0 = i_begin; i0 < i_end; i0 += kBr) {
      const int nr = std::min(kBr, i_end - i0);
      tile.load_q(i0, nr, t, true);
      tile.rebuild(i0, nr, j0, nc, t, kv, true);
      gemm<true>(nc, ldv, nr, t.ST, kBr, 1, t.dOi, ldv, dV, ldv);  // dV += (P∘Z)ᵀ dO
      gemm<true>(nc, ldq, nr, t.dPT, kBr, 1, t.Qi, ldq, dK, ldq);  // dK += dSᵀ (scale Q)
    }
  }
  T* dk = static_cast<T*>(p.dk) + hk * p.dk_head_stride +
          row_offset(p, b, p.dk_batch_stride, p.dk_row_stride, s.k_first, j0);
  T* dvp = static_cast<T*>(p.dv) + hk * p.dv_head_stride +
           row_offset(p, b, p.dv_batch_stride, p.dv_row_stride, s.k_first, j0);
  for (int c = 0; c < nc; ++c) {
    store_row(dK + int64_t(c) * ldq, d, dk + c * p.dk_row_stride);
    store_row(dV + int64_t(c) * ldv, dv, dvp + c * p.dv_row_stride);
  }
}

// Pass 2: dQ of query tile i0..i0+nr of query head h.
template <typename T, typename A>
void dq_task(const BwdParams& p, int64_t task, const A* D_all) {
  const int n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int b = int(task / (int64_t(p.heads_q) * n_qblocks));
  const int h = int(task / n_qblocks % p.heads_q);
  const int i0 = int(task % n_qblocks) * kBr;
  const BwdTile<T, A> tile(p, b, h, D_all);
  const Seq& s = tile.s;
  if (i0 >= s.sq) return;
  const int nr = std::min(kBr, s.sq - i0);
  const int d = p.head_dim, ldq = padded<A>(d);
  BwdBuffers<A> t(p, int64_t(kBr) * ldq);
  A* dQ = t.acc;  // (nr, ldq)
  tile.load_q(i0, nr, t, false);

  const int j_begin = key_lo(p, s, i0), j_end = key_hi(p, s, i0 + nr - 1) + 1;
  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0);
    const auto kv = tile.load_k(j0, nc, t);
    tile.rebuild(i0, nr, j0, nc, t, kv, true);
    gemm<true>(nr, ldq, nc, t.dPT, 1, kBr, kv.K, kv.ldk, dQ, ldq);  // dQ += dS K
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
  BwdBuffers<A> t(p, kBr * kBc);

  const int b_lo = p.dbias_batch == 1 ? 0 : bb, b_hi = p.dbias_batch == 1 ? p.batch : bb + 1;
  const int h_lo = p.dbias_heads == 1 ? 0 : hh, h_hi = p.dbias_heads == 1 ? p.heads_q : hh + 1;
  for (int b = b_lo; b < b_hi; ++b) {
    for (int h = h_lo; h < h_hi; ++h) {
      const BwdTile<T, A> tile(p, b, h, D_all);
      const Seq& s = tile.s;
      // Rows/cols of this sequence that land on the output tile.
      const int i_lo = R == 1 ? 0 : out_r0, i_hi = std::min(s.sq, R == 1 ? s.sq : out_r0 + out_nr);
      const int j_lo = C == 1 ? 0 : out_c0, j_hi = std::min(s.sk, C == 1 ? s.sk : out_c0 + out_nc);
      for (int i0 = i_lo; i0 < i_hi; i0 += kBr) {
        const int nr = std::min(kBr, i_hi - i0);
        tile.load_q(i0, nr, t, false);
        for (int j0 = j_lo; j0 < j_hi; j0 += kBc) {
          const int nc = std::min(kBc, j_hi - j0);
          tile.rebuild(i0, nr, j0, nc, t, tile.load_k(j0, nc, t), false);
          for (int r = 0; r < nr; ++r)
            for (int c = 0; c < nc; ++c)
              t.acc[(R == 1 ? 0 : i0 + r - out_r0) * kBc + (C == 1 ? 0 : j0 + c - out_c0)] +=
                  t.dPT[c * kBr + r];
        }
      }
    }
  }
  A* out = static_cast<A*>(p.dbias) + ((int64_t(bb) * p.dbias_heads + hh) * R) * C;
  for (int r = 0; r < out_nr; ++r)
    for (int c = 0; c < out_nc; ++c)
      out[int64_t(out_r0 + r) * C + out_c0 + c] = t.acc[r * kBc + c];
}

template <typename T>
void backward_typed(const BwdParams& p) {
  using A = acc_t<T>;
  const int64_t n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int64_t n_kblocks = (p.seqlen_k + kBc - 1) / kBc;
  std::vector<A> D(size_t(p.batch) * p.heads_q * p.seqlen_q);  // O(n): one value per row
  const int64_t q_tasks = int64_t(p.batch) * p.heads_q * n_qblocks;
  parallel_for(q_tasks, p.num_threads, [&](int64_t t) { d_task<T, A>(p, t, D.data()); });
  parallel_for(int64_t(p.batch) * p.heads_kv * n_kblocks, p.num_threads,
               [&](int64_t t) { dkdv_task<T, A>(p, t, D.data()); });
  parallel_for(q_tasks, p.num_threads, [&](int64_t t) { dq_task<T, A>(p, t, D.data()); });
  if (p.dbias) {
    const int64_t n = int64_t(p.dbias_batch) * p.dbias_heads *
                      ((p.dbias_rows + kBr - 1) / kBr) * ((p.dbias_cols + kBc - 1) / kBc);
    parallel_for(n, p.num_threads, [&](int64_t t) { dbias_task<T, A>(p, t, D.data()); });
  }
}

void backward(const BwdParams& p) {
  switch (p.dtype) {
    case DType::kFloat64: return backward_typed<double>(p);
    case DType::kFloat32: return backward_typed<float>(p);
    case DType::kBFloat16: return backward_typed<bf16_t>(p);
    case DType::kFloat16: return backward_typed<f16_t>(p);
  }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
