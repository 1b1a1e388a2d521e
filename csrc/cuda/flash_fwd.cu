// Dispatch of the CUDA FlashAttention-2 forward (cuda/flash_fwd.cuh): runtime dtype, head_dim
// and "extras" become template arguments here, once. The launchers themselves are compiled
// in the generated files of csrc/cuda/instantiations/ (tools/generate_instantiations.py),
// one per {half, bf16} x head-dim tile (cuda/head_dims.h) x extras {off, on}; this file
// only declares them (flash_fwd_instantiations.inc) and names just the tiles this build has
// (FMHA_CUDA_HDIM_MASK, cuda/head_dims.h). Compiled by nvcc and, as host C++, for the
// emulator (fmha._cuda_emu).
//
// "extras" (softcap, bias, ALiBi, mask, dropout) is a template flag so plain attention pays
// nothing for them in registers. Varlen and split-KV are runtime: they cost a few scalar
// registers once per CTA, not per score.
//
// Every config must compile without a register spill or a stack frame on sm_80 and sm_90:
// `python tools/ptxas_check.py` (run by tests/native/test_cuda_emu.py) fails otherwise. The
// reasoning behind each config is in cuda/flash_fwd.cuh and docs/cuda_kernels.md.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cuda/flash_fwd.cuh"
#include "cuda/launch.h"
#include "fmha/validate.h"

namespace fmha {
namespace gpu {

#include "cuda/instantiations/flash_fwd_instantiations.inc"

namespace {

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

// The launcher of one dtype for the call's (built) head-dim tile and extras; returns the
// number of key splits used.
template <typename T>
int run(const FwdParams& p, int tile, Stream stream) {
  int splits = 0;
  with_head_dim_tile(tile, [&](auto tile_c) {
    constexpr int kTile = decltype(tile_c)::value;
    // The plain kernel folds the scale into exp2 and so needs scale * log2(e) > 0 as a float
    // (flash_fwd.cuh): a scale that is 0 or below, or rounds to 0, runs in the extras kernel.
    const bool fold = float(p.scale) * score::kLog2e > 0.0f;
    splits = needs_extras(p) || !fold ? run_flash_fwd<T, kTile, true>(p, stream)
                                      : run_flash_fwd<T, kTile, false>(p, stream);
  });
  return splits;
}

}  // namespace

bool flash_fwd_rows_aligned(const FwdParams& p) { return rows_aligned(p); }

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

namespace {

thread_local const char* last_kernel = "";

// FMHA_CUDA_KERNEL: unset or "auto" (the Hopper kernel where the device and the build have
// it; under the emulator only for float8 inputs, which no other kernel runs), "sm80" (always
// the sm_80 kernel), "sm90" (the Hopper kernel for every call it claims: how the emulator runs
// it). Anything else is an error.
bool use_sm90(const FwdParams& p) {
  const char* env = std::getenv("FMHA_CUDA_KERNEL");
  const std::string choice = env ? env : "";
  FMHA_CHECK_ARG(choice.empty() || choice == "auto" || choice == "sm80" || choice == "sm90",
                 "FMHA_CUDA_KERNEL: expected auto, sm80 or sm90, got \"", choice, "\"");
  if (choice == "sm80") return false;
#if defined(__CUDACC__)
  // The sm_90a code runs on compute capability 9.0 only (arch-specific features).
  bool hopper = false;
#if defined(FMHA_CUDA_SM90A)
  int device = 0, major = 0, minor = 0;
  hopper = cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
           major == 9 && minor == 0;
#endif
  FMHA_CHECK_ARG(hopper || choice != "sm90", "FMHA_CUDA_KERNEL=sm90: this device or build has "
                 "no sm_90a kernel (it needs compute capability 9.0 and FMHA_CUDA_ARCHS with 90)");
  return hopper && flash_fwd_sm90_claims(p);
#else
  return (choice == "sm90" || p.dtype == DType::kFloat8E4M3) && flash_fwd_sm90_claims(p);
#endif
}

// Why a float8 call cannot run: only the sm_90 kernel has a float8 path.
[[noreturn]] void refuse_float8(const FwdParams& p) {
  const char* env = std::getenv("FMHA_CUDA_KERNEL");
  if (env && std::string(env) == "sm80")
    throw Unsupported("q: float8_e4m3fn inputs run only in the sm_90 kernel, and "
                      "FMHA_CUDA_KERNEL=sm80 forces the sm_80 one");
  const std::string why = flash_fwd_sm90_refusal(p);
  if (!why.empty())
    throw Unsupported(concat(why, " with float8_e4m3fn inputs on CUDA (the sm_90 kernel's "
                             "float8 path takes plain, causal and windowed scores, GQA, varlen)"));
  throw Unsupported("q: float8_e4m3fn inputs need the sm_90 kernel: compute capability 9.0 "
                    "(H100/H200) and a build with 90 in FMHA_CUDA_ARCHS");
}

}  // namespace

const char* flash_fwd_take_last_kernel() {
  const char* k = last_kernel;
  last_kernel = "";
  return k;
}

int launch_flash_fwd(const FwdParams& p, void* stream_ptr) {
  check_params(p, Backend::kCuda);
  const int tile = launch_tile(p, "launch_flash_fwd");
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return 0;  // nothing to write
  if (use_sm90(p)) {
    last_kernel = "sm90";
    return launch_flash_fwd_sm90(p, stream_ptr);
  }
  if (p.dtype == DType::kFloat8E4M3) refuse_float8(p);
  last_kernel = "sm80";
  // seqlen_k == 0: the kernel visits no key block and writes out 0, lse -inf.
  const Stream stream = static_cast<Stream>(stream_ptr);
  if (p.dtype == DType::kFloat16) return run<half_t>(p, tile, stream);
  return run<bf16_t>(p, tile, stream);
}

}  // namespace gpu
}  // namespace fmha
