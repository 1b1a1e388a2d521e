// The CPU forward: FlashAttention-2 (Dao 2023, Algorithm 1) on the CPU.
//
// One task = one tile of kBr query rows of one (batch, query head). The task streams the
// key/value tiles its rows can see, keeping the running row maximum m, the running
// normaliser l and the unnormalised output O in the accumulation type (the online softmax,
// Milakov & Gimelshein 2018), and normalises once at the end. Extra memory is O(tile) per
// thread; no seqlen_q x seqlen_k buffer exists.
#pragma once

#include <type_traits>

#include "cpu/softmax.h"
#include "cpu/tile.h"
#include "fmha/threads.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// K/V rows of the current key tile as the accumulation type: read in place when the input
// already is (float32/float64 with a unit last stride), converted into `buf` otherwise. V is
// a GEMM B operand, whose rows must be padded to the vector width: in place only when
// head_dim_v already is.
template <typename T, typename A>
inline const A* rows_as_acc(const T* src, int64_t stride, int n, int dim, A* buf, int ld,
                            int64_t* out_stride, bool needs_padding) {
  if constexpr (std::is_same_v<T, A>) {
    if (!needs_padding || dim == ld) {
      *out_stride = stride;
      return src;
    }
  }
  load_rows(src, stride, n, dim, buf, ld);
  *out_stride = ld;
  return buf;
}

template <typename T>
void forward_task(const FwdParams& p, int64_t task) {
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

  Workspace& ws = thread_workspace();
  ws.begin(Workspace::bytes<A>(int64_t(d) * kBr) + Workspace::bytes<A>(int64_t(kBc) * d) +
           Workspace::bytes<A>(int64_t(kBc) * ldv) + Workspace::bytes<A>(kBc * kBr) +
           Workspace::bytes<A>(int64_t(kBr) * ldv) + 3 * Workspace::bytes<A>(kBr));
  A* QiT = ws.take<A>(int64_t(d) * kBr);   // Qᵀ: (head_dim, kBr), the B of Sᵀ = K Qᵀ
  A* Kbuf = ws.take<A>(int64_t(kBc) * d);  // K rows, when they need converting
  A* Vbuf = ws.take<A>(int64_t(kBc) * ldv);
  A* ST = ws.take<A>(kBc * kBr);           // Sᵀ: (keys, rows), then Pᵀ in place
  A* O = ws.take<A>(int64_t(kBr) * ldv);   // unnormalised output rows
  A* m = ws.take<A>(kBr);
  A* l = ws.take<A>(kBr);
  A* alpha = ws.take<A>(kBr);

  const T* q = static_cast<const T*>(p.q) + h * p.q_head_stride +
               row_offset(p, b, p.q_batch_stride, p.q_row_stride, s.q_first, i0);
  const T* k = static_cast<const T*>(p.k) + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + hk * p.v_head_stride;
  // The one transpose of the task: Q's tile. The scale is applied to S after the GEMM, not
  // folded into Q, so that the backward (which reads Q in place) rebuilds the very same S.
  load_rows_t(q, p.q_row_stride, nr, d, QiT, kBr);
  fill(m, kBr, neg_inf<A>());
  fill(l, kBr, A(0));
  fill(O, int64_t(kBr) * ldv, A(0));

  // Rows i0..i0+nr-1 together see keys [key_lo(i0), key_hi(last row)].
  const int j_begin = key_lo(p, s, i0), j_end = key_hi(p, s, i0 + nr - 1) + 1;
  for (int j0 = j_begin; j0 < j_end; j0 += kBc) {
    const int nc = std::min(kBc, j_end - j0);
    int64_t ldk, ldvj;
    const A* Kj = rows_as_acc(k + row_offset(p, b, p.k_batch_stride, p.k_row_stride, s.k_first, j0),
                              p.k_row_stride, nc, d, Kbuf, d, &ldk, false);
    const A* Vj = rows_as_acc(v + row_offset(p, b, p.v_batch_stride, p.v_row_stride, s.k_first, j0),
                              p.v_row_stride, nc, dv, Vbuf, ldv, &ldvj, true);
    gemm<false>(nc, nrp, d, Kj, ldk, 1, QiT, kBr, ST, kBr);  // Sᵀ = K Qᵀ, then · scale
    scale_rows(ST, nc, nrp, kBr, A(p.scale));
    finish_scores(p, s, b, h, i0, nr, j0, nc, ST, 1, kBr, static_cast<A*>(nullptr));
    online_softmax_T(ST, kBr, nc, nrp, m, l, alpha);  // Sᵀ becomes Pᵀ (unnormalised)
    if (p.dropout_p > 0)  // after the normaliser l, which counts dropped entries too
      for (int r = 0; r < nr; ++r) dropout_row(p, b, h, i0 + r, j0, nc, ST + r, kBr);
    for (int r = 0; r < nr; ++r)
      if (alpha[r] != A(1)) scale_rows(O + int64_t(r) * ldv, 1, dv, ldv, alpha[r]);
    gemm<true>(nr, ldv, nc, ST, 1, kBr, Vj, ldvj, O, ldv);  // O += P V
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
