#include "fmha/kvcache.h"

#include <cstring>
#include <vector>

#include "fmha/error.h"
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

void append_kv(const FwdParams& p) {
  if (p.seqlen_new == 0 || p.heads_kv == 0) return;
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
