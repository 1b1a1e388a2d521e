// The CPU forward: FlashAttention-2 (Dao 2023, Algorithm 1) on the CPU.
//
// One task = one tile of kBr query rows of one (batch, query head). The task streams the
// key/value tiles its rows can see, keeping the running row maximum m, the running
// normaliser l and the unnormalised output O in the accumulation type (the online softmax,
// Milakov & Gimelshein 2018), and normalises once at the end. Extra memory is O(tile) per
// thread; no seqlen_q x seqlen_k buffer exists.
#pragma once

#include "cpu/tile.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

template <typename T>
void forward_task(const FwdParams& p, int64_t task) {
  using A = acc_t<T>;
  const int n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int b = int(task / (int64_t(p.heads_q) * n_qblocks));
  const int h = int(task / n_qblocks % p.heads_q);
  const int i0 = int(task % n_qblocks) * kBr;
  const Seq s = seq_of(p, b);
  if (i0 >= s.sq) return;  // varlen: this sequence is shorter than the longest
  const int nr = std::min(kBr, s.sq - i0);
  const int hk = h / (p.heads_q / p.heads_kv);  // GQA: query head h reads kv head hk
  const int d = p.head_dim, dv = p.head_dim_v;
  const int ldq = padded<A>(d), ldv = padded<A>(dv);

  Workspace& ws = thread_workspace();
  ws.begin(Workspace::bytes<A>(int64_t(kBr) * ldq) + Workspace::bytes<A>(int64_t(kBc) * d) +
           Workspace::bytes<A>(int64_t(kBc) * ldv) + Workspace::bytes<A>(kBr * kBc) +
           Workspace::bytes<A>(int64_t(kBr) * ldv) + 2 * Workspace::bytes<A>(kBr));
  A* Qi = ws.take<A>(int64_t(kBr) * ldq);  // scale * Q, so that S = Qi Kjᵀ is scaled
  A* KjT = ws.take<A>(int64_t(kBc) * d);   // Kᵀ: (head_dim, kBc)
  A* Vj = ws.take<A>(int64_t(kBc) * ldv);
  A* S = ws.take<A>(kBr * kBc);            // scores, then P in place
  A* O = ws.take<A>(int64_t(kBr) * ldv);
  A* m = ws.take<A>(kBr);
  A* l = ws.take<A>(kBr);

  const T* q = static_cast<const T*>(p.q) + h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + hk * p.v_head_stride;
  load_rows(q + row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, i0),
            p.q_row_stride, nr, d, Qi, ldq);
  scale_rows(Qi, nr, d, ldq, A(p.scale));
  for (int r = 0; r < nr; ++r) { m[r] = neg_inf<A>(); l[r] = A(0); }
  fill(O, int64_t(nr) * ldv, A(0));

  // Rows i0..i0+nr-1 together see keys [key_lo(i0), key_hi(last row)].
  const int j_begin = key_lo(p, s, i0), j_end = key_hi(p, s, i0 + nr - 1) + 1;
  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0), ncp = padded<A>(nc);
    load_rows_t(k + row_offset(p, b, p.k_batch_stride, p.k_row_stride, s.k_first, j0),
                p.k_row_stride, nc, d, KjT, kBc);
    load_rows(v + row_offset(p, b, p.v_batch_stride, p.v_row_stride, s.k_first, j0),
              p.v_row_stride, nc, dv, Vj, ldv);
    gemm<false>(nr, ncp, d, Qi, ldq, 1, KjT, kBc, S, kBc);  // S = scale · Q Kᵀ
    finish_scores(p, s, b, h, i0, nr, j0, nc, S, kBc, static_cast<A*>(nullptr));

    for (int r = 0; r < nr; ++r) {
      A* Sr = S + r * kBc;
      const A m_new = std::max(m[r], row_max(Sr, nc));
      if (m_new == neg_inf<A>()) {  // nothing visible to this row yet: P = 0
        fill(Sr, nc, A(0));
        continue;
      }
      // Rescale what was accumulated under the old maximum (exp(-inf) = 0 the first time).
      const A alpha = exp_acc(m[r] - m_new);
      l[r] = l[r] * alpha + exp_sub_sum(Sr, nc, m_new);  // S becomes P (unnormalised); the
      m[r] = m_new;                                      // normaliser counts dropped entries
      if (p.dropout_p > 0) dropout_row(p, b, h, i0 + r, j0, nc, Sr);
      if (alpha != A(1)) scale_rows(O + int64_t(r) * ldv, 1, dv, ldv, alpha);
    }
    gemm<true>(nr, ldv, nc, S, kBc, 1, Vj, ldv, O, ldv);  // O += P V
  }

  // Normalise once; a row that saw no key gets out = 0 and lse = -inf (never NaN).
  T* o = static_cast<T*>(p.o) + h * p.o_head_stride +
         row_offset(p, b, p.o_batch_stride, p.o_row_stride, s.q_first, i0);
  A* lse = static_cast<A*>(p.lse) + h * p.lse_head_stride +
           (p.cu_seqlens_q ? (s.q_first + i0) * p.lse_row_stride
                           : b * p.lse_batch_stride + int64_t(i0) * p.lse_row_stride);
  for (int r = 0; r < nr; ++r) {
    A* Or = O + int64_t(r) * ldv;
    scale_rows(Or, 1, dv, ldv, l[r] > 0 ? A(1) / l[r] : A(0));
    store_row(Or, dv, o + r * p.o_row_stride);
    lse[r * p.lse_row_stride] = l[r] > 0 ? m[r] + std::log(l[r]) : neg_inf<A>();
  }
}

template <typename T>
void forward_typed(const FwdParams& p) {
  const int64_t n_qblocks = (p.seqlen_q + kBr - 1) / kBr;
  const int64_t n_tasks = int64_t(p.batch) * p.heads_q * n_qblocks;
  parallel_for(n_tasks, p.num_threads, [&](int64_t t) { forward_task<T>(p, t); });
}

void forward(const FwdParams& p) {
  switch (p.dtype) {
    case DType::kFloat64: return forward_typed<double>(p);
    case DType::kFloat32: return forward_typed<float>(p);
    case DType::kBFloat16: return forward_typed<bf16_t>(p);
    case DType::kFloat16: return forward_typed<f16_t>(p);
  }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
