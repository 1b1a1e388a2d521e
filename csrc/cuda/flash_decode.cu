// Dispatch of the CUDA decode over KV caches (cuda/flash_decode.cuh): the split of the keys,
// the device-side refusal flag, and the three launches. Compiled by nvcc and, as host C++,
// for the emulator (fmha._cuda_emu).
//
// Every config must compile without a register spill or a stack frame on sm_80 and sm_90
// (`python tools/ptxas_check.py`).
#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "cuda/flash_decode.cuh"
#include "cuda/launch.h"
#include "fmha/validate.h"

namespace fmha {
namespace gpu {

namespace {

// The device's sticky refusal flag (one int per device, allocated on first use and kept).
int* refusal_flag() {
#if defined(__CUDACC__)
  constexpr int kMaxDevices = 64;
  static int* flags[kMaxDevices] = {};
  static std::mutex mutex;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices)
    throw std::runtime_error("fmha: no current CUDA device for the KV-cache refusal flag");
  std::lock_guard<std::mutex> lock(mutex);
  if (!flags[device]) {
    int* f = nullptr;
    cudaError_t err = cudaMalloc(&f, sizeof(int));
    if (err == cudaSuccess) err = cudaMemset(f, 0, sizeof(int));
    if (err != cudaSuccess)
      throw std::runtime_error(concat("fmha: KV-cache refusal flag: ", cudaGetErrorString(err)));
    flags[device] = f;
  }
  return flags[device];
#else
  static int flag = 0;
  return &flag;
#endif
}

// Keys per split: num_splits cuts the capacity into that many ranges (multiples of the
// 32-key chunk); by default kDecodeSplitKeys, doubled while the float32 partials of a
// call would pass 256 MiB (long chunked prefills). Positions depend on the call's shape
// only through these, never on where the rows live: paged and contiguous caches of the
// same rows split alike unless num_splits or the partials' cap tie it to the capacity.
int split_keys_for(const FwdParams& p) {
  const int64_t capacity = std::max(p.seqlen_k, 1);
  if (p.num_splits > 0) {
    const int64_t per = (capacity + p.num_splits - 1) / p.num_splits;
    return int(std::max<int64_t>(kDecodeChunk, (per + kDecodeChunk - 1) / kDecodeChunk * kDecodeChunk));
  }
  const int64_t row_bytes = int64_t(p.batch) * p.heads_q * p.seqlen_q * (p.head_dim_v + 1) * 4;
  int64_t keys = kDecodeSplitKeys;
  while (keys < capacity && (capacity + keys - 1) / keys * row_bytes > (int64_t(256) << 20))
    keys *= 2;
  return int(std::min<int64_t>(keys, INT32_MAX / 2));
}

template <typename T, typename C, int kHeadDim, int kRows>
void run_decode(const FwdParams& p, DecodeLaunch& launch, Stream stream) {
  auto kernel = &flash_decode_kernel<T, C, kHeadDim, kRows>;
  constexpr int kSmem = decode_smem_floats<kHeadDim, kRows>() * int(sizeof(float));
  static_assert(kSmem <= 48 * 1024, "flash_decode_kernel: shared memory over 48 KiB");
  launch.row_blocks = (launch.rows + kRows - 1) / kRows;
  const dim3 grid(launch.row_blocks * launch.num_splits, p.heads_kv, p.batch);
  FMHA_LAUNCH(kernel, grid, dim3(kDecodeThreads), kSmem, stream, p, launch);
}

// The head-dim tile of the decode kernels for caches of C: the call's tile for 16-bit
// caches; for 8-bit ones the next of 64, 128, 256 (three tiles instead of five keep the
// build small; a wider tile only pads the head dim).
template <typename C>
constexpr int decode_tile(int tile) {
  if constexpr (!is_code8<C>) return tile;
  return tile <= 64 ? 64 : tile <= 128 ? 128 : 256;
}

// One call on caches of element type C (T, or Code8 for 8-bit caches).
template <typename T, typename C>
int run(const FwdParams& p, int tile, Stream stream) {
  DecodeLaunch launch;
  launch.vec = flash_fwd_rows_aligned(p);
  launch.rows = p.seqlen_q * (p.heads_q / p.heads_kv);
  launch.split_keys = split_keys_for(p);
  launch.num_splits = std::max(1, (p.seqlen_k + launch.split_keys - 1) / launch.split_keys);

  Scratch refused(sizeof(int), stream);
  launch.refused = refused.as<int>();
  // Which table entry appends to each block (paged appends only), zeros to start from.
  const bool shared_check = p.block_table && p.seqlen_new > 0;
  Scratch writer(shared_check ? size_t(p.num_blocks) * sizeof(int64_t) : 0, stream,
                 /*zero=*/true);
  FMHA_LAUNCH(kvcache_check_kernel, dim3(1), dim3(kDecodeThreads), 0, stream, p,
              refused.as<int>(), refusal_flag(), shared_check ? writer.as<int64_t>() : nullptr);
  if (p.seqlen_new > 0) {
    auto append = &kvcache_append_kernel<T, C>;
    FMHA_LAUNCH(append, dim3(p.seqlen_new, p.heads_kv, p.batch), dim3(kDecodeThreads), 0,
                stream, p, launch.refused);
  }

  Scratch scratch(launch.partial_bytes(p), stream);
  launch.place_partials(p, scratch.as<float>());
  if (launch.rows == 0) return launch.num_splits;  // no query row: the append was all
  with_head_dim_tile(tile, [&](auto tile_c) {
    constexpr int kTile = decode_tile<C>(decltype(tile_c)::value);
    // Eight rows per CTA hold 8 x kTile / 32 O accumulators per lane: at kTile = 256 that
    // spills on sm_80, so the widest tile takes four.
    if constexpr (kTile > 128) run_decode<T, C, kTile, 4>(p, launch, stream);
    else if (launch.rows <= 4) run_decode<T, C, kTile, 4>(p, launch, stream);
    else run_decode<T, C, kTile, 8>(p, launch, stream);
    if (launch.num_splits > 1) {
      auto combine = &flash_fwd_combine_kernel<T, kTile>;
      const dim3 cgrid((p.seqlen_q + kCombineWarps - 1) / kCombineWarps, p.heads_q, p.batch);
      FMHA_LAUNCH(combine, cgrid, dim3(32 * kCombineWarps), 0, stream, p,
                  static_cast<const FwdLaunch&>(launch));
    }
  });
  return launch.num_splits;
}

// The cache element type of the call: T, or the 8-bit format of kv_code. A build may leave
// the 8-bit kernels out (FMHA_DECODE_8BIT=0: the sanitizer programs, which run none).
#if !defined(FMHA_DECODE_8BIT)
#define FMHA_DECODE_8BIT 1
#endif
template <typename T>
int run_caches(const FwdParams& p, int tile, Stream stream) {
  if (p.kv_code == KvCode::kNone) return run<T, T>(p, tile, stream);
#if FMHA_DECODE_8BIT
  switch (p.kv_code) {
    case KvCode::kInt8: return run<T, Code8<KvCode::kInt8>>(p, tile, stream);
    case KvCode::kE4M3: return run<T, Code8<KvCode::kE4M3>>(p, tile, stream);
    case KvCode::kE5M2: return run<T, Code8<KvCode::kE5M2>>(p, tile, stream);
    case KvCode::kNone: break;
  }
#endif
  throw Unsupported("k_cache: this build of the CUDA decode has no 8-bit cache kernels "
                    "(FMHA_DECODE_8BIT=0)");
}

}  // namespace

int launch_flash_decode(const FwdParams& p, void* stream_ptr) {
  check_params(p, Backend::kCuda);
  FMHA_CHECK_ARG(p.cache_seqlens, "launch_flash_decode: cache_seqlens is required");
  const int tile = launch_tile(p, "launch_flash_decode");
  if (p.batch == 0 || p.heads_kv == 0) return 0;  // no sequence or no head: nothing to write
  const Stream stream = static_cast<Stream>(stream_ptr);
  if (p.dtype == DType::kFloat16) return run_caches<half_t>(p, tile, stream);
  return run_caches<bf16_t>(p, tile, stream);
}

int kvcache_refusals(bool clear) {
  int* flag = refusal_flag();
#if defined(__CUDACC__)
  int value = 0;
  cudaError_t err = cudaMemcpy(&value, flag, sizeof(int), cudaMemcpyDeviceToHost);
  if (err == cudaSuccess && clear) err = cudaMemset(flag, 0, sizeof(int));
  if (err != cudaSuccess)
    throw std::runtime_error(concat("fmha: KV-cache refusal flag: ", cudaGetErrorString(err)));
  return value;
#else
  const int value = *flag;
  if (clear) *flag = 0;
  return value;
#endif
}

}  // namespace gpu
}  // namespace fmha
