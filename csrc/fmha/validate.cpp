#include "fmha/validate.h"

#include <cmath>
#include <string>

#include "fmha/error.h"

namespace fmha {

std::string dtype_list(const BackendCaps& c) {
  std::string out;
  for (int i = 0; i < c.num_dtypes; ++i) (out += i ? "/" : "") += dtype_name(c.dtypes[i]);
  return out;
}

namespace {

// Which tensors a call touches: the query side (q, out, lse; dout, dq) when some query row
// exists, the key side (k, v; dk, dv) when some key row exists -- the backward writes dk, dv
// (zeros) even without query rows. An empty array's data pointer may be null (it often is),
// so only what is touched must be non-null. Varlen: seqlen_q / seqlen_k are 0 exactly when
// the packed batch has no query / key row (the bindings set them so).
bool has_query_rows(const FwdParams& p) {
  return p.batch > 0 && p.heads_q > 0 && p.seqlen_q > 0;
}
bool has_key_rows(const FwdParams& p) { return p.batch > 0 && p.heads_kv > 0 && p.seqlen_k > 0; }

// Sizes: the shape rules (>= 0, heads_q a multiple of heads_kv) hold on every backend; the
// head-dim range is the backend's (capability table).
void check_sizes(const FwdParams& p, Backend backend) {
  // Empty calls are valid on every backend (docs/errors.md, "Empty inputs"): no query row
  // writes nothing but the backward's zero dk, dv (and dbias); no key row writes out 0,
  // lse -inf and a zero dq. Each backend's entry handles them before any kernel tile exists.
  FMHA_CHECK_ARG(p.batch >= 0 && p.heads_q >= 0 && p.heads_kv >= 0,
                 "batch, heads_q, heads_kv: must be >= 0, got ", p.batch, ", ", p.heads_q,
                 " and ", p.heads_kv);
  // heads_q = heads_kv = 0 is an empty call; otherwise each kv head serves heads_q / heads_kv
  // query heads.
  FMHA_CHECK_ARG(p.heads_kv > 0 ? p.heads_q % p.heads_kv == 0 : p.heads_q == 0, "heads_q (",
                 p.heads_q, ") must be a multiple of heads_kv (", p.heads_kv, ")");
  FMHA_CHECK_ARG(p.seqlen_q >= 0 && p.seqlen_k >= 0, "seqlen_q, seqlen_k: must be >= 0, got ",
                 p.seqlen_q, " and ", p.seqlen_k);
  const BackendCaps& c = caps(backend);
  FMHA_CHECK_ARG(p.head_dim >= c.head_dim_min && p.head_dim <= c.head_dim_max &&
                     p.head_dim_v >= c.head_dim_min && p.head_dim_v <= c.head_dim_max,
                 "head_dim, head_dim_v: expected ", c.head_dim_min, "..", c.head_dim_max, " on ",
                 c.label, ", got ", p.head_dim, " and ", p.head_dim_v);
}

// A feature the call uses must be one the backend runs (Support::kYes) or accepts without
// effect (Support::kIgnored); `what` names the argument that asks for it.
void check_feature(Backend backend, Feature f, bool used, const char* what) {
  if (!used || support(backend, f) != Support::kNo) return;
  throw InvalidArgument(concat(what, ": ", kFeatures[int(f)].title, " is not supported on ",
                               caps(backend).label));
}

void check_forward_features(const FwdParams& p, Backend backend) {
  check_feature(backend, Feature::kForward, true, "q");
  check_feature(backend, Feature::kVarlen, p.cu_seqlens_q != nullptr, "cu_seqlens_q");
  check_feature(backend, Feature::kCausalWindow, p.window_left >= 0 || p.window_right >= 0,
                "window_left, window_right");
  check_feature(backend, Feature::kBias, p.bias.ptr != nullptr, "bias");
  check_feature(backend, Feature::kMask, p.mask.ptr != nullptr, "mask");
  check_feature(backend, Feature::kAlibi, p.alibi_slopes != nullptr, "alibi_slopes");
  check_feature(backend, Feature::kSoftcap, p.softcap != 0.0, "softcap");
  check_feature(backend, Feature::kDropout, p.dropout_p != 0.0, "dropout_p");
  check_feature(backend, Feature::kGqa, p.heads_kv > 0 && p.heads_q != p.heads_kv, "heads_kv");
  check_feature(backend, Feature::kBlockMask, p.block_mask.index != nullptr, "block_mask");
  check_feature(backend, Feature::kKvCache, p.cache_seqlens != nullptr, "cache_seqlens");
  check_feature(backend, Feature::kPagedKvCache, p.block_table != nullptr, "block_table");
  check_feature(backend, Feature::kKvCache8Bit, p.kv_code != KvCode::kNone, "kv_code");
  check_feature(backend, Feature::kNumSplits, p.num_splits > 0, "num_splits");
}

// FP8 inputs (FwdParams, "FP8 inputs"): a forward-only dtype with its own output dtype and
// descale factors, which no other dtype takes.
void check_fp8(const FwdParams& p) {
  const bool fp8 = p.dtype == DType::kFloat8E4M3;
  FMHA_CHECK_ARG(fp8 || (!p.q_descale && !p.k_descale && !p.v_descale),
                 "q_descale, k_descale, v_descale: only with float8_e4m3fn inputs, got dtype ",
                 dtype_name(p.dtype));
  if (!fp8) return;
  FMHA_CHECK_ARG(p.o_dtype == DType::kBFloat16 || p.o_dtype == DType::kFloat16,
                 "out dtype: float8_e4m3fn inputs write out as bfloat16 or float16, got ",
                 dtype_name(p.o_dtype));
  FMHA_CHECK_ARG(!p.cache_seqlens,
                 "cache_seqlens: KV caches are not supported with float8_e4m3fn inputs");
  FMHA_CHECK_ARG(p.dropout_p == 0.0,
                 "dropout_p: float8_e4m3fn inputs are forward-only (inference), dropout is not "
                 "supported with them");
}

}  // namespace

void check_params(const FwdParams& p, Backend backend) {
  const BackendCaps& c = caps(backend);
  FMHA_CHECK_ARG(takes_input_dtype(backend, p.dtype), "dtype ", dtype_name(p.dtype), ": the ",
                 c.label, " kernels take ", dtype_list(c));
  check_fp8(p);
  check_sizes(p, backend);
  check_forward_features(p, backend);
  if (has_query_rows(p)) {
    FMHA_CHECK_ARG(p.q && p.o, "q and out must be non-null");
    FMHA_CHECK_ARG(p.lse || support(backend, Feature::kLseOptional) == Support::kYes,
                   "lse must be non-null on ", c.label, " (the ", c.label,
                   " forward always writes it)");
    if (has_key_rows(p)) FMHA_CHECK_ARG(p.k && p.v, "k and v must be non-null");
  }
  FMHA_CHECK_ARG(!p.cu_seqlens_q == !p.cu_seqlens_k,
                 "cu_seqlens_q, cu_seqlens_k: give both or neither");
  // The kernels clamp every sequence to the packed rows (score::seq_of): they must be known.
  if (p.cu_seqlens_q)
    FMHA_CHECK_ARG(p.total_q >= 0 && p.total_k >= 0,
                   "total_q, total_k: the packed row counts are required with cu_seqlens, got ",
                   p.total_q, " and ", p.total_k);
  FMHA_CHECK_ARG(std::isfinite(p.scale), "scale: expected a finite number, got ", p.scale);
  FMHA_CHECK_ARG(p.softcap >= 0.0 && std::isfinite(p.softcap), "softcap: expected >= 0, got ",
                 p.softcap);
  FMHA_CHECK_ARG(p.dropout_p >= 0.0 && p.dropout_p < 1.0, "dropout_p: expected [0, 1), got ",
                 p.dropout_p);
  FMHA_CHECK_ARG(p.window_left >= -1 && p.window_right >= -1,
                 "window_left, window_right: expected >= -1 (-1 = unbounded), got ",
                 p.window_left, " and ", p.window_right);
  FMHA_CHECK_ARG(p.q_position >= 0 && p.k_position >= 0 && p.head_position >= 0,
                 "q_position, k_position, head_position: expected >= 0, got ", p.q_position,
                 ", ", p.k_position, " and ", p.head_position);
  FMHA_CHECK_ARG(p.heads_total == 0 || p.heads_total >= p.head_position + p.heads_q,
                 "heads_total: expected 0 or >= head_position + heads_q (",
                 p.head_position + p.heads_q, "), got ", p.heads_total);
  // A Philox draw decides four consecutive keys (score::dropout_draw): a block must start on
  // one of those groups to draw the whole attention's mask.
  FMHA_CHECK_ARG(p.dropout_p == 0.0 || p.k_position % 4 == 0,
                 "k_position: expected a multiple of 4 with dropout, got ", p.k_position);
  if (p.cache_seqlens) {
    FMHA_CHECK_ARG(p.q_position == 0 && p.k_position == 0 && p.head_position == 0 &&
                       p.heads_total == 0,
                   "KV caches (cache_seqlens): q_position, k_position, head_position and "
                   "heads_total do not apply");
    FMHA_CHECK_ARG(!p.cu_seqlens_q && !p.bias.ptr && !p.mask.ptr && p.dropout_p == 0.0,
                   "KV caches (cache_seqlens): cu_seqlens, bias, mask and dropout do not apply");
    FMHA_CHECK_ARG(p.seqlen_new >= 0 && p.seqlen_new <= p.seqlen_k,
                   "seqlen_new: expected 0..", p.seqlen_k, " (the capacity), got ", p.seqlen_new);
    FMHA_CHECK_ARG(p.seqlen_new == 0 || (p.k_new && p.v_new) || p.heads_kv == 0 || p.batch == 0,
                   "k_new and v_new must be non-null when seqlen_new > 0");
    if (p.block_table)
      FMHA_CHECK_ARG(p.block_size >= 1 && p.num_blocks >= 0 && p.seqlen_k % p.block_size == 0,
                     "block_size: expected >= 1 dividing seqlen_k, got ", p.block_size);
    if (p.kv_code != KvCode::kNone) {
      FMHA_CHECK_ARG(takes_kv_code(backend, p.kv_code), "kv_code: ", kv_code_name(p.kv_code),
                     " caches are not supported on ", c.label);
      FMHA_CHECK_ARG(p.k_scale && p.v_scale, "k_scale, v_scale: required with 8-bit caches");
      FMHA_CHECK_ARG(p.head_dim <= c.kv8_head_dim_max && p.head_dim_v <= c.kv8_head_dim_max,
                     "head_dim, head_dim_v: 8-bit caches take up to ", c.kv8_head_dim_max,
                     " on ", c.label, ", got ", p.head_dim, " and ", p.head_dim_v);
    }
  } else {
    FMHA_CHECK_ARG(!p.block_table && p.seqlen_new == 0 && p.kv_code == KvCode::kNone,
                   "block_table, seqlen_new, kv_code: only with cache_seqlens");
  }
  if (p.block_mask.index) {
    const BlockSparse& m = p.block_mask;
    // No backend defines block masks over KV caches or packed batches (the table's note).
    FMHA_CHECK_ARG(!p.cache_seqlens && !p.cu_seqlens_q,
                   "block_mask: not supported with KV caches or variable-length batches");
    FMHA_CHECK_ARG(m.block_q >= 1 && m.block_k >= 1 && m.num_partial >= 0 &&
                       m.q_blocks == (p.seqlen_q + m.block_q - 1) / m.block_q &&
                       m.k_blocks == (p.seqlen_k + m.block_k - 1) / m.block_k,
                   "block_mask: ", m.q_blocks, " x ", m.k_blocks, " blocks of ", m.block_q,
                   " x ", m.block_k, " do not tile seqlen_q x seqlen_k = ", p.seqlen_q, " x ",
                   p.seqlen_k);
    FMHA_CHECK_ARG(m.num_partial == 0 || m.partial, "block_mask: partial masks are null");
  }
  // Read by the CUDA forward only; a negative count is wrong on any backend.
  FMHA_CHECK_ARG(p.num_splits >= 0, "num_splits: expected >= 0 (0 = heuristic), got ",
                 p.num_splits);
}

void check_params(const BwdParams& p, Backend backend) {
  FMHA_CHECK_ARG(p.dtype != DType::kFloat8E4M3,
                 "dtype float8_e4m3fn: float8 inputs are forward-only, there is no backward");
  check_params(static_cast<const FwdParams&>(p), backend);
  check_feature(backend, Feature::kBackward, true, "dout");
  check_feature(backend, Feature::kDbias, p.dbias != nullptr, "dbias");
  check_feature(backend, Feature::kLseGrad, p.dlse != nullptr, "dlse");
  check_feature(backend, Feature::kDeterministicBackward, p.deterministic, "deterministic");
  if (has_query_rows(p)) FMHA_CHECK_ARG(p.dout && p.dq, "dout and dq must be non-null");
  if (has_query_rows(p)) FMHA_CHECK_ARG(p.lse, "lse must be non-null (the backward reads it)");
  if (has_key_rows(p))
    FMHA_CHECK_ARG(p.k && p.v && p.dk && p.dv, "k, v, dk and dv must be non-null");
  // An empty call reads no bias (whose empty view may well have a null pointer) and writes
  // dbias = 0.
  FMHA_CHECK_ARG(!p.dbias || p.bias.ptr || !(has_query_rows(p) && has_key_rows(p)),
                 "dbias: given without bias");
}

}  // namespace fmha
