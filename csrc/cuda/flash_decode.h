// The host interface of the CUDA decode over KV caches (cuda/flash_decode.cuh): plain C++,
// so that bindings include it without CUDA or emulator headers.
#pragma once

#include "fmha/params.h"

namespace fmha {
namespace gpu {

// Bits of the device-side refusal code (docs/semantics.md, "KV caches"): which argument
// held a value the kernels refused. cache_seqlens, block_table and the scales of 8-bit caches
// live in device memory and are never read on the host, so they are checked by a kernel
// before the append.
enum KvCacheRefusal : int {
  kRefusedLength = 1,    // a cache_seqlens entry < 0
  kRefusedCapacity = 2,  // cache_seqlens[b] + seqlen_new > capacity
  kRefusedBlock = 4,     // a block_table entry a sequence reads or writes outside [0, num_blocks)
  kRefusedShared = 8,    // a block appended to through one table entry and read or written
                         // through another (of this sequence or another)
  kRefusedScale = 16,    // a static k_scale / v_scale (per kv head) not finite and > 0
};

// fmha.kvcache.attention_with_kvcache on CUDA memory (p.cache_seqlens set; float16 or
// bfloat16): checks the device-resident lengths and block table on the device, appends
// k_new / v_new in place, then attends (FlashDecoding: split-KV, the GQA group of each kv
// head in one CTA, pages read through the block table) and merges the splits. No host
// synchronisation: a call whose lengths or table the device check refuses writes nothing
// into the caches, fills out and lse with NaN, and ORs its KvCacheRefusal bits into the
// device's flag (kvcache_refusals). `stream`: a cudaStream_t on the GPU, ignored under
// emulation. Returns the number of key splits over the capacity (1 = none).
int launch_flash_decode(const FwdParams& p, void* stream = nullptr);

// The KvCacheRefusal bits ORed by every refused call on the current device since the last
// clear (0: none); clear = true resets them. Synchronises with the device (a blocking copy).
int kvcache_refusals(bool clear);

}  // namespace gpu
}  // namespace fmha
