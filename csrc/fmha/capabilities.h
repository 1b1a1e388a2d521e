// The capability table: what each backend's kernels take -- dtypes, head dims, 8-bit KV
// cache encodings and their head-dim limit, and which features they run.
//
// Declared once, here, as constexpr data (no allocation, no includes beyond params.h), so
// that every reader agrees: the C++ validation contract (fmha/validate.cpp) takes its
// numbers and dtype lists from it, fmha._C.capabilities() hands it to Python
// (bindings/capabilities.h), where python/fmha/_validate.py and python/fmha/_kvcache.py take
// their limits from it, and tools/capability_matrix.py writes docs/features.md from it.
// tests/api/test_capabilities.py walks it and checks both validators accept and refuse exactly
// at each entry.
//
// What is not here is a rule about the shape of a call rather than a backend's capability
// (sizes >= 0, heads_q a multiple of heads_kv, dropout_p in [0, 1), the argument
// combinations no backend defines); fmha/validate.cpp spells those where it checks them.
#pragma once

#include "cuda/head_dims.h"
#include "fmha/params.h"

namespace fmha {

enum class Backend { kCpu, kCuda };

// How a backend treats a feature: it runs it; it refuses it (an error naming the argument);
// or it accepts the argument and it has no effect there (num_splits on the CPU).
enum class Support { kNo, kYes, kIgnored };

// Features a call may use, in the order docs/features.md lists them.
enum class Feature : int {
  kForward,
  kBackward,
  kVarlen,
  kCausalWindow,
  kBias,
  kDbias,
  kMask,
  kAlibi,
  kSoftcap,
  kDropout,
  kGqa,
  kBlockMask,
  kKvCache,
  kPagedKvCache,
  kKvCache8Bit,
  kFp8Forward,
  kSinks,
  kLseGrad,
  kDeterministicBackward,
  kNumSplits,
  kLseOptional,
  kCount
};
constexpr int kNumFeatures = int(Feature::kCount);

// One feature: its key (the name Python sees), a short title, and each backend's support
// with a note (empty when "yes" says it all).
struct FeatureRow {
  Feature feature;
  const char* key;
  const char* title;
  Support cpu;
  const char* cpu_note;
  Support cuda;
  const char* cuda_note;
};

// One backend: its name, the dtypes of q/k/v/out and the gradients, the head_dim and
// head_dim_v range, the 8-bit KV cache encodings and the head-dim limit with them.
struct BackendCaps {
  Backend backend;
  const char* name;   // "cpu" | "cuda": Python's key
  const char* label;  // "CPU" | "CUDA": the wording of errors and docs
  DType dtypes[4];
  int num_dtypes;
  int head_dim_min, head_dim_max;  // head_dim and head_dim_v alike
  const char* head_dim_why;        // what sets head_dim_max
  KvCode kv_codes[3];
  int num_kv_codes;
  int kv8_head_dim_max;  // head_dim and head_dim_v with 8-bit caches
  const char* kv8_head_dim_why;
};

inline constexpr BackendCaps kBackendCaps[] = {
    {Backend::kCpu, "cpu", "CPU",
     {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16}, 4,
     1, 1024,
     "the CPU kernels size their tiles per call; past 1024 the per-thread workspace stops "
     "fitting in L2 and nothing is gained over a plain GEMM",
     {KvCode::kInt8, KvCode::kE4M3, KvCode::kE5M2}, 3,
     1024, "the decode of a cached row widens it into a 1024-float buffer (csrc/fmha/kvcache.cpp)"},
    {Backend::kCuda, "cuda", "CUDA",
     {DType::kFloat16, DType::kBFloat16}, 2,  // tensor-core mma.sync inputs
     1, gpu::kHeadDimTiles[gpu::kNumHeadDimTiles - 1],
     "the widest head-dim tile of the CUDA kernels (csrc/cuda/head_dims.h): a 256-wide row of Q, "
     "K and V tiles is what fits in one SM's shared memory next to the pipeline's second "
     "stage",
     {KvCode::kInt8, KvCode::kE4M3, KvCode::kE5M2}, 3,
     gpu::kHeadDimTiles[gpu::kNumHeadDimTiles - 1],
     "the CUDA decode runs 8-bit caches in the same tiles (csrc/cuda/flash_decode.cu)"},
};
inline constexpr int kNumBackends = int(sizeof(kBackendCaps) / sizeof(kBackendCaps[0]));

inline constexpr FeatureRow kFeatures[] = {
    {Feature::kForward, "forward", "forward (out, lse)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kBackward, "backward", "backward (dq, dk, dv)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kVarlen, "varlen", "variable-length batches (cu_seqlens)",
     Support::kYes, "", Support::kYes,
     "offsets in device memory are not read on the host: max_seqlen_q/k required"},
    {Feature::kCausalWindow, "causal_window", "causal and sliding windows, both alignments",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kBias, "bias", "additive float bias, broadcast",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kDbias, "dbias", "bias gradient (dbias)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kMask, "mask", "boolean mask, broadcast",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kAlibi, "alibi", "ALiBi slopes",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kSoftcap, "softcap", "logit softcapping",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kDropout, "dropout", "dropout (Philox, same mask on every backend)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kGqa, "gqa", "grouped-query / multi-query attention",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kBlockMask, "block_mask", "block-sparse masks (fmha.BlockMask)",
     Support::kYes, "not with varlen or KV caches",
     Support::kYes, "not with varlen or KV caches"},
    {Feature::kKvCache, "kv_cache", "KV caches, contiguous (forward only)",
     Support::kYes, "", Support::kYes, "lengths checked on the device"},
    {Feature::kPagedKvCache, "paged_kv_cache", "KV caches, paged (block table)",
     Support::kYes, "", Support::kYes, "block table checked on the device"},
    {Feature::kKvCache8Bit, "kv_cache_8bit", "8-bit KV caches (int8, float8_e4m3fn, float8_e5m2)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kFp8Forward, "fp8_forward",
     "float8_e4m3fn q/k/v with descale_q/k/v (forward only)",
     Support::kYes, "dequantised to float32; no KV caches, dropout or sinks",
     Support::kYes, "sm_90 only; no bias, masks, ALiBi, softcap, KV caches, dropout, sinks"},
    {Feature::kSinks, "sinks", "attention sinks (and their gradient)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kLseGrad, "lse_grad", "gradient through lse (dlse)",
     Support::kYes, "", Support::kYes, ""},
    {Feature::kDeterministicBackward, "deterministic_backward", "deterministic backward",
     Support::kYes, "always", Support::kYes, "deterministic=True: a separate dQ kernel"},
    {Feature::kNumSplits, "num_splits", "split-KV forward (num_splits)",
     Support::kIgnored, "accepted, no effect", Support::kYes, "0 = by occupancy"},
    {Feature::kLseOptional, "lse_optional", "forward without lse (lse=None)",
     Support::kYes, "", Support::kNo, "the kernels always write lse"},
};
static_assert(sizeof(kFeatures) / sizeof(kFeatures[0]) == kNumFeatures,
              "one row per Feature");

constexpr bool features_in_order() {
  for (int i = 0; i < kNumFeatures; ++i)
    if (int(kFeatures[i].feature) != i) return false;
  return true;
}
static_assert(features_in_order(), "kFeatures lists the features in Feature's order");

constexpr const BackendCaps& caps(Backend b) { return kBackendCaps[b == Backend::kCpu ? 0 : 1]; }

constexpr Support support(Backend b, Feature f) {
  return b == Backend::kCpu ? kFeatures[int(f)].cpu : kFeatures[int(f)].cuda;
}

constexpr bool takes_dtype(Backend b, DType t) {
  const BackendCaps& c = caps(b);
  for (int i = 0; i < c.num_dtypes; ++i)
    if (c.dtypes[i] == t) return true;
  return false;
}

// Whether a backend takes q, k, v of dtype t: its dtypes, and float8_e4m3fn where it runs
// the float8 forward (Feature::kFp8Forward, forward only: check_params refuses the backward).
constexpr bool takes_input_dtype(Backend b, DType t) {
  return t == DType::kFloat8E4M3 ? support(b, Feature::kFp8Forward) == Support::kYes
                                 : takes_dtype(b, t);
}

constexpr bool takes_kv_code(Backend b, KvCode code) {
  const BackendCaps& c = caps(b);
  for (int i = 0; i < c.num_kv_codes; ++i)
    if (c.kv_codes[i] == code) return true;
  return false;
}

inline const char* kv_code_name(KvCode code) {
  switch (code) {
    case KvCode::kNone: return "none";
    case KvCode::kInt8: return "int8";
    case KvCode::kE4M3: return "float8_e4m3fn";
    case KvCode::kE5M2: return "float8_e5m2";
  }
  return "?";
}

static_assert(caps(Backend::kCpu).backend == Backend::kCpu &&
                  caps(Backend::kCuda).backend == Backend::kCuda,
              "kBackendCaps lists cpu, then cuda");

}  // namespace fmha
