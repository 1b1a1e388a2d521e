// Host-side pieces shared by the CUDA launchers (flash_fwd.cu, flash_bwd.cu): which kernel
// variant a call needs and whether its tensors allow 16-byte vector accesses. Plain C++:
// compiled by nvcc and, for the emulator, by the host compiler.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/head_dims.h"
#include "fmha/error.h"
#include "fmha/params.h"

namespace fmha {
namespace gpu {

// The kernels' kExtras template flag: the optional score stages (softcap, bias, mask, ALiBi,
// dropout) are compiled in only when a call uses one, so plain attention pays nothing for
// them in registers.
inline bool needs_extras(const FwdParams& p) {
  return p.softcap > 0.0 || p.bias.ptr || p.mask.ptr || p.block_mask.index || p.alibi_slopes ||
         p.dropout_p > 0.0;
}

// One tensor's rows can be moved in 16-byte vectors: a 16-byte aligned base and row, head
// and batch strides that are multiples of 8 (16-bit) elements.
inline bool rows_aligned(const void* ptr, int64_t row, int64_t head, int64_t batch) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row % 8 == 0 && head % 8 == 0 &&
         batch % 8 == 0;
}

// The inputs the forward reads by rows: q, k, v.
inline bool rows_aligned(const FwdParams& p) {
  return rows_aligned(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride) &&
         rows_aligned(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride) &&
         rows_aligned(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
}

// The backward reads dout by rows as well.
inline bool rows_aligned(const BwdParams& p) {
  return rows_aligned(static_cast<const FwdParams&>(p)) &&
         rows_aligned(p.dout, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
}

// The built head-dim tile a call runs in (the smallest that holds head_dim and head_dim_v);
// InvalidArgument when this build compiled none that large (FMHA_CUDA_HEAD_DIMS).
inline int launch_tile(const FwdParams& p, const char* who) {
  const int d = std::max(p.head_dim, p.head_dim_v);
  const int tile = head_dim_tile(d);
  FMHA_CHECK_ARG(tile != 0, who, ": head_dim ", d,
                 ": no head-dim tile >= it was built (FMHA_CUDA_HEAD_DIMS)");
  return tile;
}

}  // namespace gpu
}  // namespace fmha
