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

// True when every row of q, k, v, dout starts 16-byte aligned: tiles move with cp.async.
bool rows_aligned(const BwdParams& p) {
  return aligned(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride) &&
         aligned(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride) &&
         aligned(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride) &&
         aligned(p.dout, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

}  // namespace

template <typename T, int kHeadDim, bool kExtras>
void run_flash_bwd(const BwdParams& p, Stream stream) {
  const bool vec = rows_aligned(p);
  const int64_t rows = int64_t(p.batch) * p.seqlen_q;  // per query head
  BwdWork w;
  Scratch d_buf(size_t(p.heads_q) * rows * sizeof(float), stream);
  w.d = d_buf.as<float>();
  Scratch dq_buf(p.deterministic ? 0 : size_t(p.heads_q) * rows * p.head_dim * sizeof(float),
                 stream, /*zero=*/true);
  w.dq_accum = dq_buf.as<float>();
  // dbias: dS of every visible (b, h, i, j), zero elsewhere, then reduced to dbias's shape.
  const bool with_dbias = kExtras && p.dbias != nullptr;
  Scratch ds_buf(with_dbias ? size_t(p.batch) * p.heads_q * p.seqlen_q * p.seqlen_k * sizeof(float) : 0,
                 stream, /*zero=*/true);
  if (with_dbias) {
    w.ds = ds_buf.as<float>();
    w.ds_row_stride = p.seqlen_k;
    w.ds_head_stride = int64_t(p.seqlen_q) * p.seqlen_k;
    w.ds_batch_stride = int64_t(p.heads_q) * w.ds_head_stride;
  }

  const dim3 row_grid(ceil_div(p.seqlen_q, 64), p.heads_q, p.batch);
  FMHA_LAUNCH(flash_bwd_dot_do_o<T>, row_grid, dim3(128), 0, stream, p, w);

  auto launch_main = [&](auto atomic_dq) {
    constexpr bool kAtomic = decltype(atomic_dq)::value;
    using Cfg = FlashBwdConfig<kHeadDim, kExtras>;
    auto kernel = &flash_bwd_kernel<T, Cfg, kExtras, kAtomic>;
    if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
    const dim3 grid(ceil_div(p.seqlen_k, Cfg::kBlockN) * Cfg::kSplits, p.heads_kv, p.batch);
    FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, w, vec);
  };
  if (p.deterministic) {
    launch_main(std::false_type{});
    using Cfg = FlashBwdDqConfig<kHeadDim>;
    auto kernel = &flash_bwd_dq_kernel<T, Cfg, kExtras>;
    if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
    const dim3 grid(ceil_div(p.seqlen_q, Cfg::kBlockM) * Cfg::kSplits, p.heads_q, p.batch);
    FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, w, vec);
  } else {
    launch_main(std::true_type{});
    FMHA_LAUNCH(flash_bwd_convert_dq<T>, row_grid, dim3(128), 0, stream, p, w);
  }
  if (with_dbias) {
    const int64_t total = int64_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows * p.dbias_cols;
    const int blocks = int(std::min<int64_t>(ceil_div(total, 128), 65535));
    FMHA_LAUNCH(flash_bwd_reduce_dbias, dim3(blocks), dim3(128), 0, stream, p, w);
  }
}

namespace {

template <typename T, bool kExtras>
void run_head_dim(const BwdParams& p, Stream stream) {
  switch (head_dim_tile(p.head_dim)) {
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
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16)
    unsupported(std::string("dtype ") + dtype_name(p.dtype) + ", expected float16 or bfloat16");
  if (p.head_dim < 1 || p.head_dim > 256)
    unsupported("head_dim " + std::to_string(p.head_dim) + ", expected 1..256");
  if (p.head_dim_v != p.head_dim)
    unsupported("head_dim_v " + std::to_string(p.head_dim_v) + " != head_dim " +
                std::to_string(p.head_dim));
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0)
    unsupported("heads_q " + std::to_string(p.heads_q) + " is not a multiple of heads_kv " +
                std::to_string(p.heads_kv));
  if (!(p.dropout_p >= 0.0 && p.dropout_p < 1.0))
    unsupported("dropout_p " + std::to_string(p.dropout_p) + ", expected [0, 1)");
  if (!(p.softcap >= 0.0)) unsupported("softcap " + std::to_string(p.softcap) + ", expected >= 0");
  if (p.dbias && !p.bias.ptr) unsupported("dbias without bias");
  if (p.batch <= 0 || p.heads_q <= 0) return;
  const Stream stream = static_cast<Stream>(stream_ptr);
  const bool extras = p.softcap > 0.0 || p.bias.ptr || p.mask.ptr || p.alibi_slopes ||
                      p.dropout_p > 0.0;
  if (p.dtype == DType::kFloat16)
    return extras ? run_head_dim<half_t, true>(p, stream) : run_head_dim<half_t, false>(p, stream);
  return extras ? run_head_dim<bf16_t, true>(p, stream) : run_head_dim<bf16_t, false>(p, stream);
}

// Until the instantiation files are generated: every (dtype, tile, extras) here.
#define FMHA_BWD_INSTANTIATE(T, D)                                  \
  template void run_flash_bwd<T, D, false>(const BwdParams&, Stream); \
  template void run_flash_bwd<T, D, true>(const BwdParams&, Stream);
FMHA_BWD_INSTANTIATE(half_t, 32)
FMHA_BWD_INSTANTIATE(half_t, 64)
FMHA_BWD_INSTANTIATE(half_t, 96)
FMHA_BWD_INSTANTIATE(half_t, 128)
FMHA_BWD_INSTANTIATE(half_t, 256)
FMHA_BWD_INSTANTIATE(bf16_t, 32)
FMHA_BWD_INSTANTIATE(bf16_t, 64)
FMHA_BWD_INSTANTIATE(bf16_t, 96)
FMHA_BWD_INSTANTIATE(bf16_t, 128)
FMHA_BWD_INSTANTIATE(bf16_t, 256)

}  // namespace gpu
}  // namespace fmha
