// KV caches on the host: the checks of cache lengths and block tables that need their
// values, and the in-place append of new key/value rows. fmha.attention_with_kvcache on
// host arrays runs check_kvcache_host, then append_kv, then the forward, so that a call
// refused for any reason has written nothing (docs/semantics.md, "KV caches").
#pragma once

#include "fmha/params.h"

namespace fmha {

// The values of cache_seqlens and block_table (host memory): every length in
// [0, seqlen_k - seqlen_new], every block a sequence reads or writes in [0, num_blocks), and
// no block written by one sequence's append read or written by another's. Throws
// InvalidArgument naming the argument.
void check_kvcache_host(const FwdParams& p);

// Writes k_new / v_new into rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of each
// sequence's cache (through the block table when paged). Assumes check_kvcache_host passed.
void append_kv(const FwdParams& p);

}  // namespace fmha
