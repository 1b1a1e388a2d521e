// Dispatch of the CUDA FlashAttention-2 backward (cuda/flash_bwd.cuh): runtime dtype and
// head_dim become template arguments here, once; the launches of one backward, in order, on
// the caller's stream. Compiled by nvcc and, as host C++, for the emulator (fmha._cuda_emu).
//
// Head-dim tiles 32, 64, 96, 128, 256 (a head_dim runs in the smallest built tile that holds
// it, zero-padded); at 256 two CTAs share each key block, 128 output columns each (see
// FlashBwdConfig).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/flash_bwd.cuh"
#include "cuda/launch_checks.h"
#include "cuda/head_dims.h"

namespace fmha {
namespace gpu {

namespace {

[[noreturn]] void unsupported(const std::string& what) {
  throw std::invalid_argument("launch_flash_bwd: " + what);
}

bool aligned(const void* ptr, int64_t row, int64_t head, int64_t batch) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row % 8 == 0 && head % 8 == 0 &&
         batch % 8 == 0;
}

}  // namespace

bool flash_bwd_rows_aligned(const BwdParams& p) {
  return aligned(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride) &&
         aligned(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride) &&
         aligned(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride) &&
         aligned(p.dout, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
}

// The launchers are instantiated in csrc/cuda/instantiations/ (one file each); only declared here.
#include "cuda/instantiations/flash_bwd_instantiations.inc"

namespace {

template <typename T, bool kExtras>
void run_head_dim(const BwdParams& p, Stream stream) {
  switch (head_dim_tile(std::max(p.head_dim, p.head_dim_v))) {
    case 32: if constexpr (head_dim_tile_built(32)) return run_flash_bwd<T, 32, kExtras>(p, stream); break;
    case 64: if constexpr (head_dim_tile_built(64)) return run_flash_bwd<T, 64, kExtras>(p, stream); break;
    case 96: if constexpr (head_dim_tile_built(96)) return run_flash_bwd<T, 96, kExtras>(p, stream); break;
    case 128: if constexpr (head_dim_tile_built(128)) return run_flash_bwd<T, 128, kExtras>(p, stream); break;
    case 256: if constexpr (head_dim_tile_built(256)) return run_flash_bwd<T, 256, kExtras>(p, stream); break;
  }
  unsupported("head_dim " + std::to_string(p.head_dim) + " has no tile in this build");
}

}  // namespace

void launch_flash_bwd(const BwdParams& p, void* stream_ptr) {
  check_launch_params(p, "launch_flash_bwd");
  if (p.dbias && !p.bias.ptr) unsupported("dbias without bias");
  if (p.batch <= 0 || p.heads_q <= 0) return;
  const Stream stream = static_cast<Stream>(stream_ptr);
  const bool extras = p.softcap > 0.0 || p.bias.ptr || p.mask.ptr || p.alibi_slopes ||
                      p.dropout_p > 0.0;
  if (p.dtype == DType::kFloat16)
    return extras ? run_head_dim<half_t, true>(p, stream) : run_head_dim<half_t, false>(p, stream);
  return extras ? run_head_dim<bf16_t, true>(p, stream) : run_head_dim<bf16_t, false>(p, stream);
}

}  // namespace gpu
}  // namespace fmha
