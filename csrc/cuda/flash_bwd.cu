// Dispatch of the CUDA FlashAttention-2 backward (cuda/flash_bwd.cuh): runtime dtype and
// head_dim become template arguments here, once; the launches of one backward, in order, on
// the caller's stream. Compiled by nvcc and, as host C++, for the emulator (fmha._cuda_emu).
//
// A head_dim runs in the smallest built tile (cuda/head_dims.h) that holds it, zero-padded;
// at 256 two CTAs share each key block, 128 output columns each (see
// FlashBwdConfig).
#include "cuda/flash_bwd.cuh"
#include "cuda/launch.h"
#include "fmha/validate.h"

namespace fmha {
namespace gpu {

bool flash_bwd_rows_aligned(const BwdParams& p) { return rows_aligned(p); }

// The launchers are instantiated in csrc/cuda/instantiations/ (one file each); only declared here.
#include "cuda/instantiations/flash_bwd_instantiations.inc"

namespace {

// The launches of one dtype for the call's (built) head-dim tile and extras.
template <typename T>
void run(const BwdParams& p, int tile, Stream stream) {
  with_head_dim_tile(tile, [&](auto tile_c) {
    constexpr int kTile = decltype(tile_c)::value;
    if (needs_extras(p)) run_flash_bwd<T, kTile, true>(p, stream);
    else run_flash_bwd<T, kTile, false>(p, stream);
  });
}

}  // namespace

void launch_flash_bwd(const BwdParams& p, void* stream_ptr) {
  check_params(p, Backend::kCuda);
  const int tile = launch_tile(p, "launch_flash_bwd");
  if (p.batch == 0 || p.heads_q == 0) return;  // no gradient to write
  const Stream stream = static_cast<Stream>(stream_ptr);
  if (p.dtype == DType::kFloat16) return run<half_t>(p, tile, stream);
  return run<bf16_t>(p, tile, stream);
}

}  // namespace gpu
}  // namespace fmha
