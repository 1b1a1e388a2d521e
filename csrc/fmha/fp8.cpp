#include "fmha/fp8.h"

#include <vector>

#include "fmha/numeric.h"
#include "fmha/score.h"
#include "fmha/threads.h"

namespace fmha {
namespace {

// One float8 operand (q, k or v) and where its float32 copy goes: (entries, rows, heads, dim)
// contiguous, entries = batch (1 when varlen: one packed batch).
struct Operand {
  const uint8_t* codes;
  int64_t batch_stride, row_stride, head_stride;  // bytes (one per code)
  int heads, dim;
  const float* descale;
  int64_t descale_batch_stride, descale_head_stride;
  int heads_per_factor;  // q: the heads_q / heads_kv query heads that share a kv head's factor
  int64_t rows;          // rows per entry: seqlen, or the packed total when varlen
  std::vector<float> widened;

  int64_t entry_elems() const { return rows * heads * dim; }
};

// Rows [first, first + n) of head h of batch entry b (varlen: of the packed batch, b being the
// sequence they belong to), widened and multiplied by (b, h)'s factor.
void widen(Operand& t, bool varlen, int b, int h, int64_t first, int64_t n, DecodeCodes decode) {
  const int entry = varlen ? 0 : b;
  const float f = descale_at(t.descale, t.descale_batch_stride, t.descale_head_stride, b,
                             h / t.heads_per_factor);
  for (int64_t r = first; r < first + n; ++r) {
    const uint8_t* src = t.codes + entry * t.batch_stride + r * t.row_stride + h * t.head_stride;
    float* dst = t.widened.data() + entry * t.entry_elems() + (r * t.heads + h) * t.dim;
    decode(int(KvCode::kE4M3), src, dst, t.dim);
    for (int i = 0; i < t.dim; ++i) dst[i] *= f;
  }
}

}  // namespace

void cpu_forward_fp8(const FwdParams& p, void (*forward_f32)(const FwdParams&),
                     DecodeCodes decode) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int entries = varlen ? 1 : p.batch;
  const int group = p.heads_q / p.heads_kv;
  Operand q{static_cast<const uint8_t*>(p.q), p.q_batch_stride, p.q_row_stride,
            p.q_head_stride, p.heads_q, p.head_dim, p.q_descale, p.q_descale_batch_stride,
            p.q_descale_head_stride, group, varlen ? p.total_q : p.seqlen_q, {}};
  Operand k{static_cast<const uint8_t*>(p.k), p.k_batch_stride, p.k_row_stride,
            p.k_head_stride, p.heads_kv, p.head_dim, p.k_descale, p.k_descale_batch_stride,
            p.k_descale_head_stride, 1, varlen ? p.total_k : p.seqlen_k, {}};
  Operand v{static_cast<const uint8_t*>(p.v), p.v_batch_stride, p.v_row_stride,
            p.v_head_stride, p.heads_kv, p.head_dim_v, p.v_descale, p.v_descale_batch_stride,
            p.v_descale_head_stride, 1, varlen ? p.total_k : p.seqlen_k, {}};
  // Rows outside every sequence (varlen) are never read: zeros.
  for (Operand* t : {&q, &k, &v}) t->widened.assign(size_t(entries * t->entry_elems()), 0.0f);
  std::vector<float> out(size_t(int64_t(entries) * q.rows * p.heads_q * p.head_dim_v), 0.0f);

  // Each sequence's rows are the kernels' own (score::seq_of clamps varlen offsets to the
  // packed rows), so every row the forward reads is widened with its sequence's factors.
  const int64_t per_task = int64_t(q.rows) * (p.head_dim + p.head_dim_v);  // ~1 ns an element
  parallel_for(int64_t(p.batch) * p.heads_q, p.num_threads,
               [&](int64_t task) {
                 const int b = int(task / p.heads_q), h = int(task % p.heads_q);
                 const score::Seq s = score::seq_of(p, b);
                 widen(q, varlen, b, h, s.q_first, s.sq, decode);
                 if (h % group != 0) return;  // each kv head once
                 widen(k, varlen, b, h / group, s.k_first, s.sk, decode);
                 widen(v, varlen, b, h / group, s.k_first, s.sk, decode);
               },
               int64_t(p.batch) * p.heads_q * per_task);

  FwdParams f = p;
  f.dtype = DType::kFloat32;
  f.q_descale = f.k_descale = f.v_descale = nullptr;
  const auto point = [](const Operand& t, const void*& ptr, int64_t& bs, int64_t& rs,
                        int64_t& hs) {
    ptr = t.widened.data();
    bs = t.entry_elems();
    rs = int64_t(t.heads) * t.dim;
    hs = t.dim;
  };
  point(q, f.q, f.q_batch_stride, f.q_row_stride, f.q_head_stride);
  point(k, f.k, f.k_batch_stride, f.k_row_stride, f.k_head_stride);
  point(v, f.v, f.v_batch_stride, f.v_row_stride, f.v_head_stride);
  f.o = out.data();
  f.o_row_stride = int64_t(p.heads_q) * p.head_dim_v;
  f.o_head_stride = p.head_dim_v;
  f.o_batch_stride = q.rows * f.o_row_stride;
  forward_f32(f);

  // out in o_dtype, rounded to nearest even; only the rows the forward wrote.
  const bool bf16 = p.o_dtype == DType::kBFloat16;
  parallel_for(int64_t(p.batch) * p.heads_q, p.num_threads, [&](int64_t task) {
    const int b = int(task / p.heads_q), h = int(task % p.heads_q);
    const score::Seq s = score::seq_of(p, b);
    const int entry = varlen ? 0 : b;
    for (int64_t r = s.q_first; r < s.q_first + s.sq; ++r) {
      const float* src = out.data() + entry * f.o_batch_stride + r * f.o_row_stride +
                         h * f.o_head_stride;
      uint16_t* dst = static_cast<uint16_t*>(p.o) + entry * p.o_batch_stride +
                      r * p.o_row_stride + h * p.o_head_stride;
      for (int i = 0; i < p.head_dim_v; ++i)
        dst[i] = bf16 ? float_to_bf16(src[i]) : float_to_f16(src[i]);
    }
  });
}

}  // namespace fmha
