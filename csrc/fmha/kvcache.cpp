#include "fmha/kvcache.h"

#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "fmha/capabilities.h"
#include "fmha/error.h"
#include "fmha/kvquant.h"
#include "fmha/numeric.h"
#include "fmha/score.h"

namespace fmha {

namespace {

int element_bytes(DType t) {
  switch (t) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    default: return 2;
  }
}

}  // namespace

void check_kvcache_host(const FwdParams& p) {
  const int capacity = p.seqlen_k;
  if (p.kv_code != KvCode::kNone && p.scale_row_stride == 0) {  // static scales, per kv head
    using Named = std::pair<const char*, const float*>;
    for (const Named& scales : {Named{"k_scale", p.k_scale}, Named{"v_scale", p.v_scale}})
      for (int h = 0; h < p.heads_kv; ++h) {
        const float x = scales.second[h * p.scale_head_stride];  // NaN fails x > 0
        FMHA_CHECK_ARG(x > 0.0f && x <= std::numeric_limits<float>::max(), scales.first,
                       ": static scales must be finite and > 0, got ", x, " for kv head ", h);
      }
  }
  for (int b = 0; b < p.batch; ++b) {
    const int64_t len = p.cache_seqlens[b];
    FMHA_CHECK_ARG(len >= 0, "cache_seqlens: entry ", b, " is ", len, ", expected >= 0");
    FMHA_CHECK_ARG(len + p.seqlen_new <= capacity, "cache_seqlens: entry ", b, " is ", len,
                   "; with the ", p.seqlen_new, " new rows that exceeds the cache's capacity of ",
                   capacity, p.block_table ? " rows (max_blocks * block_size)" : " rows");
  }
  if (!p.block_table || p.seqlen_new == 0) {
    if (p.block_table)
      for (int b = 0; b < p.batch; ++b)
        for (int i = 0; int64_t(i) * p.block_size < p.cache_seqlens[b]; ++i) {
          const int block = p.block_table[b * p.block_table_stride + i];
          FMHA_CHECK_ARG(block >= 0 && block < p.num_blocks, "block_table: entry [", b, ", ",
                         i, "] is ", block, ", expected a block of the cache in [0, ",
                         p.num_blocks, ")");
        }
    return;
  }
  // writer[block]: 1 + the table slot (b * max_blocks + i) whose rows the append writes
  // into it, 0 if none. A block written through one slot must not be read or written
  // through any other, of this sequence or another: the append would change rows that
  // slot stands for (or two writers would race).
  const int64_t max_blocks = p.seqlen_k / p.block_size;
  std::vector<int64_t> writer(size_t(p.num_blocks), 0);
  for (int pass = 0; pass < 2; ++pass) {
    for (int b = 0; b < p.batch; ++b) {
      const int len = p.cache_seqlens[b], end = len + p.seqlen_new;
      const int32_t* table = p.block_table + b * p.block_table_stride;
      for (int i = 0; int64_t(i) * p.block_size < end; ++i) {
        const int block = table[i];
        const int64_t slot = b * max_blocks + i + 1;
        if (pass == 0) {
          FMHA_CHECK_ARG(block >= 0 && block < p.num_blocks, "block_table: entry [", b, ", ", i,
                         "] is ", block, ", expected a block of the cache in [0, ", p.num_blocks,
                         ")");
          if (int64_t(i + 1) * p.block_size <= len) continue;  // read only
          FMHA_CHECK_ARG(writer[block] == 0, "block_table: block ", block,
                         " is appended to through entries [", (writer[block] - 1) / max_blocks,
                         ", ", (writer[block] - 1) % max_blocks, "] and [", b, ", ", i,
                         "] in one call");
          writer[block] = slot;
        } else {
          FMHA_CHECK_ARG(writer[block] == 0 || writer[block] == slot, "block_table: block ",
                         block, " is read through entry [", b, ", ", i,
                         "] and appended to through entry [", (writer[block] - 1) / max_blocks,
                         ", ", (writer[block] - 1) % max_blocks,
                         "] in one call (copy it before appending)");
        }
      }
    }
  }
}

namespace {

float element_as_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat64: return float(static_cast<const double*>(base)[i]);
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

// One new row (dim elements of the inputs' dtype at src) into cache row j of sequence b, kv
// head h of an 8-bit cache: codes at dst, and with dynamic scales the row's scale first
// (max |x| over its finite entries / qmax; fmha/kvquant.h).
void append_quantized_row(const FwdParams& p, const void* src, uint8_t* dst, float* scales,
                          int b, int j, int h, int dim) {
  // head_dim <= the 8-bit caches' limit, which check_params holds every backend to
  float x[caps(Backend::kCpu).kv8_head_dim_max];
  float top = 0.0f;
  for (int t = 0; t < dim; ++t) {
    x[t] = element_as_float(src, t, p.dtype);
    if (std::isfinite(x[t]) && std::fabs(x[t]) > top) top = std::fabs(x[t]);
  }
  float& scale = scales[kvq::scale_offset(p, b, j, h)];
  if (p.scale_row_stride != 0) scale = kvq::dynamic_scale(p.kv_code, top);
  for (int t = 0; t < dim; ++t) dst[t] = kvq::encode(p.kv_code, x[t] / scale);
}

}  // namespace

void append_kv(const FwdParams& p) {
  if (p.seqlen_new == 0 || p.heads_kv == 0) return;
  if (p.kv_code != KvCode::kNone) {
    uint8_t* k = static_cast<uint8_t*>(const_cast<void*>(p.k));
    uint8_t* v = static_cast<uint8_t*>(const_cast<void*>(p.v));
    const int64_t eb = element_bytes(p.dtype);
    for (int b = 0; b < p.batch; ++b)
      for (int t = 0; t < p.seqlen_new; ++t) {
        const int j = p.cache_seqlens[b] + t;
        const int64_t ko = score::cache_row_offset(p, b, p.k_batch_stride, p.k_row_stride, j);
        const int64_t vo = score::cache_row_offset(p, b, p.v_batch_stride, p.v_row_stride, j);
        for (int h = 0; h < p.heads_kv; ++h) {
          append_quantized_row(p, static_cast<const char*>(p.k_new) +
                                      (b * p.k_new_batch_stride + t * p.k_new_row_stride +
                                       h * p.k_new_head_stride) * eb,
                               k + ko + h * p.k_head_stride, p.k_scale, b, j, h, p.head_dim);
          append_quantized_row(p, static_cast<const char*>(p.v_new) +
                                      (b * p.v_new_batch_stride + t * p.v_new_row_stride +
                                       h * p.v_new_head_stride) * eb,
                               v + vo + h * p.v_head_stride, p.v_scale, b, j, h, p.head_dim_v);
        }
      }
    return;
  }
  const int64_t eb = element_bytes(p.dtype);
  char* k = static_cast<char*>(const_cast<void*>(p.k));
  char* v = static_cast<char*>(const_cast<void*>(p.v));
  const char* kn = static_cast<const char*>(p.k_new);
  const char* vn = static_cast<const char*>(p.v_new);
  for (int b = 0; b < p.batch; ++b)
    for (int t = 0; t < p.seqlen_new; ++t) {
      const int j = p.cache_seqlens[b] + t;
      const int64_t ko = score::cache_row_offset(p, b, p.k_batch_stride, p.k_row_stride, j);
      const int64_t vo = score::cache_row_offset(p, b, p.v_batch_stride, p.v_row_stride, j);
      for (int h = 0; h < p.heads_kv; ++h) {
        std::memcpy(k + (ko + h * p.k_head_stride) * eb,
                    kn + (b * p.k_new_batch_stride + t * p.k_new_row_stride +
                          h * p.k_new_head_stride) * eb,
                    size_t(p.head_dim * eb));
        std::memcpy(v + (vo + h * p.v_head_stride) * eb,
                    vn + (b * p.v_new_batch_stride + t * p.v_new_row_stride +
                          h * p.v_new_head_stride) * eb,
                    size_t(p.head_dim_v * eb));
      }
    }
}

}  // namespace fmha
