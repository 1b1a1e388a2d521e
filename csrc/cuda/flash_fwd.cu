// Dispatch of the CUDA FlashAttention-2 forward (cuda/flash_fwd.cuh): runtime dtype, head_dim
// and "extras" become template arguments here, once. The launchers themselves are compiled
// in the generated files of csrc/cuda/instantiations/ (tools/generate_instantiations.py),
// one per {half, bf16} x head-dim tile {32, 64, 96, 128, 256} x extras {off, on}; this file
// only declares them (flash_fwd_instantiations.inc) and names just the tiles this build has
// (FMHA_CUDA_HDIM_MASK, cuda/head_dims.h). Compiled by nvcc and, as host C++, for the
// emulator (fmha._cuda_emu).
//
// "extras" (softcap, bias, ALiBi, mask, dropout) is a template flag so plain attention pays
// nothing for them in registers. Varlen and split-KV are runtime: they cost a few scalar
// registers once per CTA, not per score.
//
// Every config must compile without a register spill or a stack frame on sm_80 and sm_90:
// `python tools/ptxas_check.py` (run by tests/test_cuda_emu.py) fails otherwise. Measured
// register counts live in dated files under benchmarks/gpu/ (ptxas_registers_*.md); the
// reasoning behind each config is in cuda/flash_fwd.cuh and cuda/NOTES.md.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/flash_fwd.cuh"
#include "cuda/launch_checks.h"

namespace fmha {
namespace gpu {

#include "cuda/instantiations/flash_fwd_instantiations.inc"

namespace {

[[noreturn]] void unsupported(const std::string& what) {
  throw std::invalid_argument("launch_flash_fwd: " + what);
}

// SMs of the current device: the split-KV heuristic's measure of the GPU. The emulator
// reports an A100's 108 so that the heuristic does under test what it does there.
int sm_count() {
#if defined(__CUDACC__)
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 108;
  return count;
#else
  return 108;
#endif
}

// One runtime tile -> its compile-time launcher, only for the tiles this build compiled:
// an unbuilt tile's launcher is never named (its file was not compiled).
// Returns the number of key splits used; 0 when no tile matched.
template <typename T, bool kExtras, int... kTiles>
int run_tile(int tile, const FwdParams& p, Stream stream) {
  int ran = 0;
  auto one = [&](auto tile_c) {
    constexpr int kTile = decltype(tile_c)::value;
    if constexpr (head_dim_tile_built(kTile)) {
      if (!ran && tile == kTile) {
        ran = run_flash_fwd<T, kTile, kExtras>(p, stream);
      }
    }
  };
  (one(std::integral_constant<int, kTiles>{}), ...);
  return ran;
}

template <typename T, bool kExtras>
int run_head_dim(const FwdParams& p, Stream stream) {
  const int tile = head_dim_tile(std::max(p.head_dim, p.head_dim_v));
  const int splits = run_tile<T, kExtras, 32, 64, 96, 128, 256>(tile, p, stream);
  if (splits == 0)
    unsupported("head_dim " + std::to_string(p.head_dim) +
                ": no head-dim tile >= it was built (FMHA_CUDA_HEAD_DIMS)");
  return splits;
}

template <typename T>
int run_extras(const FwdParams& p, Stream stream) {
  const bool extras = p.softcap > 0.0 || p.bias.ptr || p.mask.ptr || p.alibi_slopes ||
                      p.dropout_p > 0.0;
  if (extras) return run_head_dim<T, true>(p, stream);
  return run_head_dim<T, false>(p, stream);
}

}  // namespace

bool flash_fwd_rows_aligned(const FwdParams& p) {
  auto ok = [](const void* ptr, int64_t row, int64_t head, int64_t batch) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row % 8 == 0 && head % 8 == 0 &&
           batch % 8 == 0;
  };
  return ok(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride) &&
         ok(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride) &&
         ok(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
}

// FlashDecoding's rule: split only when the (query block, head, batch) CTAs cannot fill the
// GPU, into the fewest splits whose last wave is nearly full. Each split must keep at least
// one key block, and at most kMaxSplits partials are merged per row.
int flash_fwd_num_splits(const FwdParams& p, int m_blocks, int n_blocks, int ctas_per_sm) {
  constexpr int kMaxSplits = 128;
  if (p.num_splits > 0) return std::min(p.num_splits, kMaxSplits);
  const int64_t ctas = int64_t(m_blocks) * p.heads_q * p.batch;
  const int64_t slots = int64_t(sm_count()) * ctas_per_sm;
  if (ctas * 10 >= slots * 8 || n_blocks < 2) return 1;  // >= 80% full without splitting
  const int most = std::min<int64_t>({kMaxSplits, n_blocks, (slots + ctas - 1) / ctas * 2});
  // Wave efficiency of n splits: work / (waves x slots). Take the smallest n within 85% of
  // the best, since every split adds partial traffic and a merge.
  auto efficiency = [&](int n) {
    const int64_t work = ctas * n, waves = (work + slots - 1) / slots;
    return double(work) / double(waves * slots);
  };
  double best = 0;
  for (int n = 1; n <= most; ++n) best = std::max(best, efficiency(n));
  for (int n = 1; n <= most; ++n)
    if (efficiency(n) >= 0.85 * best) return n;
  return 1;
}

int launch_flash_fwd(const FwdParams& p, void* stream_ptr) {
  check_launch_params(p, "launch_flash_fwd");
  if (head_dim_tile(std::max(p.head_dim, p.head_dim_v)) == 0)
    unsupported("head_dim " + std::to_string(std::max(p.head_dim, p.head_dim_v)) +
                ": no head-dim tile >= it was built (FMHA_CUDA_HEAD_DIMS)");
  if (p.batch <= 0 || p.heads_q <= 0 || p.seqlen_q <= 0) return 0;  // nothing to write
  // seqlen_k == 0: the kernel visits no key block and writes out 0, lse -inf.
  const Stream stream = static_cast<Stream>(stream_ptr);
  if (p.dtype == DType::kFloat16) return run_extras<half_t>(p, stream);
  return run_extras<bf16_t>(p, stream);
}

}  // namespace gpu
}  // namespace fmha
