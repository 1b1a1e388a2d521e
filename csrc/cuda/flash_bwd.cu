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

// ---- empty calls: the main kernels' tiles need a query row and a key row (and a grid
// with a zero extent does not launch), so a backward without any (query row, key row) pair
// writes its zero gradients here. (Outside the anonymous namespace: nvcc's host stub of a
// kernel there does not compile.)

// Zeros `rows` x `dim` 16-bit elements from `t` (row stride `row_stride`), 128 threads.
FMHA_DEVICE void zero_rows(uint16_t* t, int rows, int dim, int64_t row_stride) {
  for (int idx = threadIdx.x; idx < rows * dim; idx += 128)
    t[int64_t(idx / dim) * row_stride + idx % dim] = 0;
}

// dq = 0 (q_side) or dk = dv = 0 on 64 rows of one (head, batch) per CTA; varlen rows are
// found as the main kernels find them (score::seq_of), on the device.
__global__ void __launch_bounds__(128) flash_bwd_zero_grads(BwdParams p, bool q_side) {
  const int h = blockIdx.y, b = blockIdx.z, m0 = blockIdx.x * 64;
  const score::Seq s = score::seq_of(p, b);
  const int rows = min(64, (q_side ? s.sq : s.sk) - m0);
  if (rows <= 0) return;
  if (q_side) {
    zero_rows(static_cast<uint16_t*>(p.dq) +
                  score::q_base(p, s, b, p.dq_batch_stride, p.dq_row_stride) +
                  h * p.dq_head_stride + int64_t(m0) * p.dq_row_stride,
              rows, p.head_dim, p.dq_row_stride);
    return;
  }
  zero_rows(static_cast<uint16_t*>(p.dk) +
                score::k_base(p, s, b, p.dk_batch_stride, p.dk_row_stride) +
                h * p.dk_head_stride + int64_t(m0) * p.dk_row_stride,
            rows, p.head_dim, p.dk_row_stride);
  zero_rows(static_cast<uint16_t*>(p.dv) +
                score::k_base(p, s, b, p.dv_batch_stride, p.dv_row_stride) +
                h * p.dv_head_stride + int64_t(m0) * p.dv_row_stride,
            rows, p.head_dim_v, p.dv_row_stride);
}

namespace {

// No pair: dq = 0 where there are query rows, dk = dv = 0 where there are key rows, and
// dbias = 0 (it may have elements even so: a bias broadcast over an empty dimension).
void backward_without_pairs(const BwdParams& p, bool q_rows, bool k_rows, Stream stream) {
  if (q_rows)
    FMHA_LAUNCH(flash_bwd_zero_grads, dim3(bwd_detail::ceil_div(p.seqlen_q, 64), p.heads_q,
                                           p.batch),
                dim3(128), 0, stream, p, true);
  if (k_rows)
    FMHA_LAUNCH(flash_bwd_zero_grads, dim3(bwd_detail::ceil_div(p.seqlen_k, 64), p.heads_kv,
                                           p.batch),
                dim3(128), 0, stream, p, false);
  if (p.dbias)
    zero_fill(p.dbias, size_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows * p.dbias_cols *
                           sizeof(float), stream);
}

}  // namespace

void launch_flash_bwd(const BwdParams& p, void* stream_ptr) {
  check_params(p, Backend::kCuda);
  const int tile = launch_tile(p, "launch_flash_bwd");
  const Stream stream = static_cast<Stream>(stream_ptr);
  // Varlen: seqlen_q / seqlen_k are 0 exactly when no sequence has a query / key row.
  const bool q_rows = p.batch > 0 && p.heads_q > 0 && p.seqlen_q > 0;
  const bool k_rows = p.batch > 0 && p.heads_kv > 0 && p.seqlen_k > 0;
  if (!q_rows || !k_rows) return backward_without_pairs(p, q_rows, k_rows, stream);
  if (p.dtype == DType::kFloat16) return run<half_t>(p, tile, stream);
  return run<bf16_t>(p, tile, stream);
}

}  // namespace gpu
}  // namespace fmha
