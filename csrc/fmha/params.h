// The single contract between the Python layer and every kernel (CPU, CUDA, emulated CUDA).
//
// Everything is raw pointers, element strides and sizes: the core knows nothing of Python,
// torch or DLPack. One struct describes a forward call; the backward extends it with the
// gradient tensors. Semantics (one definition, every backend) are in docs/semantics.md, in
// csrc/fmha/score.h (the per-score functions every kernel calls) and in
// python/fmha/reference.py, the executable form of that definition.
#pragma once

#include <cstdint>

// Functions compiled for the host and, by nvcc, for the device (the CPU kernels, the CUDA
// kernels and their emulator share them).
#if defined(__CUDACC__)
#define FMHA_HD __host__ __device__ __forceinline__
#else
#define FMHA_HD inline
#endif

namespace fmha {

// kFloat8E4M3 (float8_e4m3fn: 1 sign, 4 exponent, 3 mantissa bits, no infinities, NaN =
// S.1111.111; decoded by kvq::decode, fmha/kvquant.h) is an input dtype of the forward only:
// q, k, v hold one-byte codes, each scaled by its descale factor (FwdParams, "FP8 inputs").
enum class DType : int {
  kFloat64 = 0,
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  kFloat8E4M3 = 4
};

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat64: return "float64";
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "?";
}

// A broadcastable (batch, heads, seqlen_q, seqlen_k) operand: bias (float) or mask (bool).
// A broadcast dimension has stride 0, so a key-padding mask (batch, 1, 1, seqlen_k) costs
// batch*seqlen_k bytes, never batch*heads*seqlen_q*seqlen_k.
struct Broadcast4 {
  const void* ptr = nullptr;  // nullptr: absent
  DType dtype = DType::kFloat32;  // bias only; a mask is always one byte per element (0/1)
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;
};

// The one-byte encodings of 8-bit KV caches (fmha/kvquant.h, python/fmha/kvquant.py).
enum class KvCode : int { kNone = 0, kInt8 = 1, kE4M3 = 2, kE5M2 = 3 };

// A block-sparse mask (fmha.BlockMask, python/fmha/block_mask.py): the (seqlen_q, seqlen_k)
// plane of each (batch, query head) cut into blocks of block_q rows x block_k keys, each
// empty (no pair may attend), full (every pair may) or partial (its own element mask). The
// kernels skip the tiles that meet only empty blocks, read no element mask in tiles that
// meet only full ones, and test pairs in the rest (score::block_tile_kind,
// score::block_mask_allows). Work is proportional to the non-empty blocks.
constexpr int32_t kBlockEmpty = -1, kBlockFull = -2;
struct BlockSparse {
  // (B, H, q_blocks, k_blocks), B in {1, batch}, H in {1, heads_q} (stride 0 when 1), the
  // last two dimensions contiguous: kBlockEmpty, kBlockFull, or n >= 0, the block's element
  // mask partial[n]. nullptr: absent.
  const int32_t* index = nullptr;
  // (num_partial, block_q, block_k) contiguous bytes, nonzero = may attend.
  const uint8_t* partial = nullptr;
  int64_t batch_stride = 0, head_stride = 0;
  int q_blocks = 0, k_blocks = 0, block_q = 0, block_k = 0, num_partial = 0;
};

struct FwdParams {
  // --- tensors (layout (batch, seqlen, heads, head_dim), any element strides) ---
  const void* q = nullptr;  // (b, seqlen_q, heads_q, head_dim)
  const void* k = nullptr;  // (b, seqlen_k, heads_kv, head_dim)
  const void* v = nullptr;  // (b, seqlen_k, heads_kv, head_dim_v)
  void* o = nullptr;        // (b, seqlen_q, heads_q, head_dim_v), dtype out_dtype(*this)
  // (b, heads_q, seqlen_q), or (heads_q, total_q) when varlen: natural-log logsumexp of
  // each row; float32, float64 for float64 inputs (the backward recomputes P from it);
  // float32 for float8 inputs.
  // The CPU forward takes nullptr for "not wanted" and then skips computing it.
  void* lse = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 1;
  // The last dimension of q, k, v, o is contiguous (the Python layer guarantees it).

  // --- sizes ---
  int batch = 0, heads_q = 0, heads_kv = 0;
  int seqlen_q = 0, seqlen_k = 0;  // maxima when varlen
  int head_dim = 0, head_dim_v = 0;
  DType dtype = DType::kFloat32;

  // --- variable-length batches: when set, sequence b owns rows [cu[b], cu[b+1]) of the
  // packed (total, heads, dim) tensors and batch strides are unused. ---
  const int32_t* cu_seqlens_q = nullptr;  // (batch + 1)
  const int32_t* cu_seqlens_k = nullptr;  // (batch + 1)
  // Rows of the packed q (and out, lse) and of the packed k (and v): required with
  // cu_seqlens (-1 = not given; check_params refuses it). Offsets in device memory are never
  // read on the host, so the kernels clamp each sequence to these rows and to the maxima
  // seqlen_q / seqlen_k (score::seq_of): whatever the offsets hold, no access leaves the
  // buffers. Saturated at INT32_MAX, which no int32 offset exceeds.
  int total_q = -1, total_k = -1;

  // --- score pipeline: s = scale*q.k -> softcap -> + bias + alibi -> mask -> softmax ---
  double scale = 1.0;
  double softcap = 0.0;  // 0: off; else s = softcap * tanh(s / softcap)
  Broadcast4 bias;      // float additive bias
  Broadcast4 mask;      // bool, nonzero = may attend
  BlockSparse block_mask;  // a block-sparse mask, ANDed with the bool mask
  const double* alibi_slopes = nullptr;  // adds -slope * |i + offset - j|
  int64_t alibi_batch_stride = 0, alibi_head_stride = 1;
  // Query i sees key j iff i + off - window_left <= j <= i + off + window_right, where
  // off = seqlen_k - seqlen_q (bottom_right) or 0 (top-left); a negative window is unbounded.
  // causal is window_right = 0.
  int window_left = -1, window_right = -1;
  bool bottom_right = true;

  // --- dropout on the probabilities: Philox4x32-10 keyed by (seed, offset), indexed by
  // (batch, head_q, i, j); see csrc/fmha/philox.h ---
  double dropout_p = 0.0;
  uint64_t seed = 0, offset = 0;

  // --- one block of a larger attention (fmha.distributed cuts one attention into blocks
  // over processes): q's row 0 is query position q_position and k's row 0 key position
  // k_position of the whole attention, and query head 0 is its head head_position of
  // heads_total (0 = heads_q). The diagonal offset of causal / window / ALiBi gains
  // q_position - k_position, and dropout draws at the whole attention's coordinates, so the
  // blocks' results merge into the whole's exactly. All zero for an ordinary call. ---
  int q_position = 0, k_position = 0, head_position = 0, heads_total = 0;

  // --- KV cache (forward only: fmha.attention_with_kvcache; docs/semantics.md, "KV caches").
  // When cache_seqlens is set, k and v are caches: sequence b's keys are its cache rows
  // [0, cache_seqlens[b] + seqlen_new), seqlen_k is the capacity (rows a sequence can hold),
  // and k_new / v_new (when seqlen_new > 0) are written into rows
  // [cache_seqlens[b], cache_seqlens[b] + seqlen_new) before attending. bias, mask, dropout
  // and varlen offsets are absent. ---
  const int32_t* cache_seqlens = nullptr;  // (batch): cached rows before this call
  const void* k_new = nullptr;             // (b, seqlen_new, heads_kv, head_dim)
  const void* v_new = nullptr;             // (b, seqlen_new, heads_kv, head_dim_v)
  int64_t k_new_batch_stride = 0, k_new_row_stride = 0, k_new_head_stride = 0;
  int64_t v_new_batch_stride = 0, v_new_row_stride = 0, v_new_head_stride = 0;
  int seqlen_new = 0;
  // Paged caches (vLLM's PagedAttention): k and v are pools of num_blocks blocks of
  // block_size rows, k_batch_stride / v_batch_stride the stride from one block to the next;
  // row j of sequence b is row j % block_size of block block_table[b][j / block_size].
  // seqlen_k = max_blocks * block_size. nullptr: contiguous caches, k_batch_stride per sequence.
  const int32_t* block_table = nullptr;  // (batch, max_blocks), row stride block_table_stride
  int64_t block_table_stride = 0;
  int block_size = 0, num_blocks = 0;
  // 8-bit caches (fmha/kvquant.h): with kv_code set, k and v hold one-byte codes (their
  // strides count bytes) and element t of cache row j, kv head h is decode(code) * scale,
  // scale = k_scale / v_scale[h * scale_head_stride + slot * scale_batch_stride + row *
  // scale_row_stride] -- slot, row: the cache row's sequence (block) and row in it; both row
  // strides 0 for static per-head scales. The append quantises k_new / v_new (and, with
  // per-row scales, writes each row's scale first).
  KvCode kv_code = KvCode::kNone;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  int64_t scale_batch_stride = 0, scale_row_stride = 0, scale_head_stride = 0;

  // --- FP8 inputs (dtype == kFloat8E4M3; forward only, as flash-attn 3's fp8 forward;
  // docs/semantics.md, "FP8 inputs"). q, k and v hold e4m3 codes (their strides count
  // bytes); the attention is that of the dequantised tensors
  //   q = decode(q code) * q_descale[b, h / (heads_q / heads_kv)],  k = decode(k code) *
  //   k_descale[b, hk],  v = decode(v code) * v_descale[b, hk],
  // b the batch entry (varlen: the sequence), h the query head, hk the kv head; the softmax
  // scale applies on top. ---
  // o's dtype with float8 inputs: kBFloat16 (flash-attn 3's choice, the default) or
  // kFloat16. Not read for other inputs, whose o has their own dtype (out_dtype()).
  DType o_dtype = DType::kBFloat16;
  // Per-(batch, kv head) float32 descale factors, flash-attn 3's q_descale / k_descale /
  // v_descale of shape (batch, heads_kv): element [b, hk] at b * batch_stride + hk *
  // head_stride (a stride 0 broadcasts: one factor per tensor has both 0). nullptr: every
  // factor is 1. Only with float8 inputs (check_params refuses them otherwise).
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t q_descale_batch_stride = 0, q_descale_head_stride = 0;
  int64_t k_descale_batch_stride = 0, k_descale_head_stride = 0;
  int64_t v_descale_batch_stride = 0, v_descale_head_stride = 0;

  int num_threads = 0;  // CPU: 0 = library default
  // CUDA forward: split the keys of each (query block, head) over this many CTAs and merge
  // the partial results by their lse (FlashDecoding); 0 = pick by occupancy, 1 = no split.
  int num_splits = 0;
};

// The dtype of o: o_dtype with float8 inputs, the inputs' dtype otherwise.
FMHA_HD DType out_dtype(const FwdParams& p) {
  return p.dtype == DType::kFloat8E4M3 ? p.o_dtype : p.dtype;
}

// The descale factor of (batch entry b, kv head hk) in one of q_descale / k_descale /
// v_descale with its strides: 1 when the pointer is null.
FMHA_HD float descale_at(const float* d, int64_t batch_stride, int64_t head_stride, int b,
                        int hk) {
  return d ? d[b * batch_stride + hk * head_stride] : 1.0f;
}

struct BwdParams : FwdParams {
  const void* dout = nullptr;  // like o
  void* dq = nullptr;          // like q
  void* dk = nullptr;          // like k
  void* dv = nullptr;          // like v
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  // Gradient of the bias, reduced over its broadcast dimensions: contiguous, shape
  // (dbias_batch, dbias_heads, dbias_rows, dbias_cols), each extent the full size or 1;
  // float32, float64 for float64 inputs.
  void* dbias = nullptr;
  int dbias_batch = 0, dbias_heads = 0, dbias_rows = 0, dbias_cols = 0;
  // The gradient reaching lse (a differentiable lse), laid out like lse (its strides), or
  // nullptr for none. lse_i = log sum_j exp(s_ij) gives d lse_i / d s_ij = P_ij, so it folds
  // into the per-row term: dS = P o (dP - (D - dlse)), D = rowsum(dO o O).
  const void* dlse = nullptr;
  // CUDA: true = bitwise-reproducible gradients (dQ summed in a fixed order instead of by
  // atomics). The CPU backward is always deterministic.
  bool deterministic = false;
};

// A bias constant along the keys (dbias_cols == 1) adds the same amount to every visible
// score of a row, which softmax cancels: its gradient is exactly zero (sum_j dS_ij =
// sum_j P_ij dP_ij - D_i = 0, with masks, dropout, softcap and ALiBi too). Both backends
// write those zeros instead of summing dS, whose sum would be only the rounding error of D
// = rowsum(dO o O) taken from the stored low-precision O (see docs/cuda_kernels.md, "The backward").
// With a gradient through lse (dlse) the sum is dlse_i instead, for a row that sees a key:
// lse moves with the bias. Both backends then add those dlse_i, in a fixed order, to the
// zeros.
inline bool dbias_is_zero(const BwdParams& p) { return p.dbias != nullptr && p.dbias_cols == 1; }

}  // namespace fmha
