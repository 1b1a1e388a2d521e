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

#include "cpu/tile.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

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

  const T* q_rows(int i0) const {
    return static_cast<const T*>(p.q) + h * p.q_head_stride +
           row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, i0);
  }
  const T* do_rows(int i0) const {
    return static_cast<const T*>(p.dout) + h * p.do_head_stride +
           row_offset(p, b, p.do_batch_stride, p.do_row_stride, s.q_first, i0);
  }
  const T* k_rows(int j0) const {
    return static_cast<const T*>(p.k) + hk * p.k_head_stride +
           row_offset(p, b, p.k_batch_stride, p.k_row_stride, s.k_first, j0);
  }
  const T* v_rows(int j0) const {
    return static_cast<const T*>(p.v) + hk * p.v_head_stride +
           row_offset(p, b, p.v_batch_stride, p.v_row_stride, s.k_first, j0);
  }

  // On the tile rows i0..i0+nr x keys j0..j0+nc, from Qi, Kj, Vj, dOi (dense tiles):
  //   P  <- P ∘ Z           (what multiplies V in the forward; feeds dV)
  //   dS <- P ∘ (dP - D)    (the gradient of the final scores; it is dbias)
  //   dSraw <- dS ∘ (1 - tanh²) through the softcap (or dS itself): feeds dQ and dK.
  // Scratch: S, T (softcap) are overwritten. All buffers are (kBr x kBc).
  void rebuild(int i0, int nr, int j0, int nc, const A* Qi, const A* Kj, const A* Vj,
               const A* dOi, A* P, A* dS, A* dSraw, A* Tcap) const {
    const int d = p.head_dim, dv = p.head_dim_v;
    score_tile(p, s, b, h, i0, nr, j0, nc, Qi, Kj, d, P, kBc, p.softcap > 0 ? Tcap : nullptr);
    for (int r = 0; r < nr; ++r) {
      const A L = lse[int64_t(i0 + r) * lse_stride], Dr = D[i0 + r];
      A* Pr = P + r * kBc;
      A* dSr = dS + r * kBc;
      if (L == neg_inf<A>()) {  // the row saw no key: no probability, no gradient
        std::fill(Pr, Pr + nc, A(0));
        std::fill(dSr, dSr + nc, A(0));
        std::fill(dSraw + r * kBc, dSraw + r * kBc + nc, A(0));
        continue;
      }
      for (int c = 0; c < nc; ++c) Pr[c] = exp_acc(Pr[c] - L);
      const A* dor = dOi + int64_t(r) * dv;
      for (int c = 0; c < nc; ++c) {  // dP = dO Vᵀ
        const A* vc = Vj + int64_t(c) * dv;
        A acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int t = 0; t < dv; ++t) acc += dor[t] * vc[t];
        dSr[c] = acc;
      }
      if (p.dropout_p > 0) {  // dP ∘ Z, and P ∘ Z for dV, with the forward's very mask
        dropout_row(p, b, h, i0 + r, j0, nc, dSr);
        for (int c = 0; c < nc; ++c) dSr[c] = Pr[c] * (dSr[c] - Dr);
        dropout_row(p, b, h, i0 + r, j0, nc, Pr);
      } else {
        for (int c = 0; c < nc; ++c) dSr[c] = Pr[c] * (dSr[c] - Dr);
      }
      A* dSrawr = dSraw + r * kBc;
      if (p.softcap > 0) {
        const A* Tr = Tcap + r * kBc;
        for (int c = 0; c < nc; ++c) dSrawr[c] = dSr[c] * (A(1) - Tr[c] * Tr[c]);
      } else {
        std::copy(dSr, dSr + nc, dSrawr);
      }
    }
  }
};

template <typename A>
inline int64_t tile_bytes(int d, int dv) {
  return 2 * Workspace::bytes<A>(int64_t(kBr) * d) + 2 * Workspace::bytes<A>(int64_t(kBc) * d) +
         2 * Workspace::bytes<A>(int64_t(kBc) * dv) + Workspace::bytes<A>(int64_t(kBr) * dv) +
         4 * Workspace::bytes<A>(kBr * kBc);
}

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

  Workspace& ws = thread_workspace();
  ws.begin(tile_bytes<A>(d, dv) + Workspace::bytes<A>(int64_t(kBc) * (d + dv)));
  A* Qi = ws.take<A>(int64_t(kBr) * d);
  A* dOi = ws.take<A>(int64_t(kBr) * dv);
  A* Kj = ws.take<A>(int64_t(kBc) * d);
  A* Vj = ws.take<A>(int64_t(kBc) * dv);
  A* dK = ws.take<A>(int64_t(kBc) * d);
  A* dV = ws.take<A>(int64_t(kBc) * dv);
  A* P = ws.take<A>(kBr * kBc);
  A* dS = ws.take<A>(kBr * kBc);
  A* dSraw = ws.take<A>(kBr * kBc);
  A* Tcap = ws.take<A>(kBr * kBc);
  std::fill(dK, dK + int64_t(nc) * d, A(0));
  std::fill(dV, dV + int64_t(nc) * dv, A(0));

  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    const BwdTile<T, A> tile(p, b, h, D_all);
    if (h == hk * group) {
      load_rows(tile.k_rows(j0), p.k_row_stride, nc, d, Kj, d);
      load_rows(tile.v_rows(j0), p.v_row_stride, nc, dv, Vj, dv);
    }
    const int i_begin = query_lo(p, s, j0), i_end = query_hi(p, s, j0 + nc - 1) + 1;
    for (int i0 = i_begin; i0 < i_end; i0 += kBr) {
      const int nr = std::min(kBr, i_end - i0);
      load_rows(tile.q_rows(i0), p.q_row_stride, nr, d, Qi, d);
      load_rows(tile.do_rows(i0), p.do_row_stride, nr, dv, dOi, dv);
      tile.rebuild(i0, nr, j0, nc, Qi, Kj, Vj, dOi, P, dS, dSraw, Tcap);
      const A scale = A(p.scale);
      for (int r = 0; r < nr; ++r) {
        const A* dor = dOi + int64_t(r) * dv;
        const A* qr = Qi + int64_t(r) * d;
        for (int c = 0; c < nc; ++c) {
          const A pz = P[r * kBc + c], ds = dSraw[r * kBc + c] * scale;
          A* dVc = dV + int64_t(c) * dv;  // dV += (P∘Z)ᵀ dO
#pragma omp simd
          for (int t = 0; t < dv; ++t) dVc[t] += pz * dor[t];
          A* dKc = dK + int64_t(c) * d;  // dK += scale · dSᵀ Q
#pragma omp simd
          for (int t = 0; t < d; ++t) dKc[t] += ds * qr[t];
        }
      }
    }
  }
  T* dk = static_cast<T*>(p.dk) + hk * p.dk_head_stride +
          row_offset(p, b, p.dk_batch_stride, p.dk_row_stride, s.k_first, j0);
  T* dvp = static_cast<T*>(p.dv) + hk * p.dv_head_stride +
           row_offset(p, b, p.dv_batch_stride, p.dv_row_stride, s.k_first, j0);
  for (int c = 0; c < nc; ++c) {
    store_row(dK + int64_t(c) * d, d, dk + c * p.dk_row_stride);
    store_row(dV + int64_t(c) * dv, dv, dvp + c * p.dv_row_stride);
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
  const int d = p.head_dim, dv = p.head_dim_v;

  Workspace& ws = thread_workspace();
  ws.begin(tile_bytes<A>(d, dv) + Workspace::bytes<A>(int64_t(kBr) * d));
  A* Qi = ws.take<A>(int64_t(kBr) * d);
  A* dOi = ws.take<A>(int64_t(kBr) * dv);
  A* Kj = ws.take<A>(int64_t(kBc) * d);
  A* Vj = ws.take<A>(int64_t(kBc) * dv);
  A* dQ = ws.take<A>(int64_t(kBr) * d);
  A* P = ws.take<A>(kBr * kBc);
  A* dS = ws.take<A>(kBr * kBc);
  A* dSraw = ws.take<A>(kBr * kBc);
  A* Tcap = ws.take<A>(kBr * kBc);
  std::fill(dQ, dQ + int64_t(nr) * d, A(0));
  load_rows(tile.q_rows(i0), p.q_row_stride, nr, d, Qi, d);
  load_rows(tile.do_rows(i0), p.do_row_stride, nr, dv, dOi, dv);

  const int j_begin = key_lo(p, s, i0), j_end = key_hi(p, s, i0 + nr - 1) + 1;
  const A scale = A(p.scale);
  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0);
    load_rows(tile.k_rows(j0), p.k_row_stride, nc, d, Kj, d);
    load_rows(tile.v_rows(j0), p.v_row_stride, nc, dv, Vj, dv);
    tile.rebuild(i0, nr, j0, nc, Qi, Kj, Vj, dOi, P, dS, dSraw, Tcap);
    for (int r = 0; r < nr; ++r) {  // dQ += scale · dS K
      A* dQr = dQ + int64_t(r) * d;
      for (int c = 0; c < nc; ++c) {
        const A ds = dSraw[r * kBc + c] * scale;
        const A* kc = Kj + int64_t(c) * d;
#pragma omp simd
        for (int t = 0; t < d; ++t) dQr[t] += ds * kc[t];
      }
    }
  }
  T* dq = static_cast<T*>(p.dq) + h * p.dq_head_stride +
          row_offset(p, b, p.dq_batch_stride, p.dq_row_stride, s.q_first, i0);
  for (int r = 0; r < nr; ++r) store_row(dQ + int64_t(r) * d, d, dq + r * p.dq_row_stride);
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
  const int d = p.head_dim, dv = p.head_dim_v;
  const int out_r0 = rt * kBr, out_nr = std::min(kBr, R - out_r0);
  const int out_c0 = ct * kBc, out_nc = std::min(kBc, C - out_c0);

  Workspace& ws = thread_workspace();
  ws.begin(tile_bytes<A>(d, dv) + Workspace::bytes<A>(kBr * kBc));
  A* Qi = ws.take<A>(int64_t(kBr) * d);
  A* dOi = ws.take<A>(int64_t(kBr) * dv);
  A* Kj = ws.take<A>(int64_t(kBc) * d);
  A* Vj = ws.take<A>(int64_t(kBc) * dv);
  A* acc = ws.take<A>(kBr * kBc);
  A* P = ws.take<A>(kBr * kBc);
  A* dS = ws.take<A>(kBr * kBc);
  A* dSraw = ws.take<A>(kBr * kBc);
  A* Tcap = ws.take<A>(kBr * kBc);
  std::fill(acc, acc + kBr * kBc, A(0));

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
        load_rows(tile.q_rows(i0), p.q_row_stride, nr, d, Qi, d);
        load_rows(tile.do_rows(i0), p.do_row_stride, nr, dv, dOi, dv);
        for (int j0 = j_lo; j0 < j_hi; j0 += kBc) {
          const int nc = std::min(kBc, j_hi - j0);
          load_rows(tile.k_rows(j0), p.k_row_stride, nc, d, Kj, d);
          load_rows(tile.v_rows(j0), p.v_row_stride, nc, dv, Vj, dv);
          tile.rebuild(i0, nr, j0, nc, Qi, Kj, Vj, dOi, P, dS, dSraw, Tcap);
          for (int r = 0; r < nr; ++r)
            for (int c = 0; c < nc; ++c)
              acc[(R == 1 ? 0 : i0 + r - out_r0) * kBc + (C == 1 ? 0 : j0 + c - out_c0)] +=
                  dS[r * kBc + c];
        }
      }
    }
  }
  A* out = static_cast<A*>(p.dbias) + ((int64_t(bb) * p.dbias_heads + hh) * R) * C;
  for (int r = 0; r < out_nr; ++r)
    for (int c = 0; c < out_nc; ++c)
      out[int64_t(out_r0 + r) * C + out_c0 + c] = acc[r * kBc + c];
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
