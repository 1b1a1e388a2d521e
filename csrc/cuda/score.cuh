// The score pipeline of the CUDA kernels -- the forward and both backward kernels -- for one
// element of S: from its q.k accumulator to the log2-domain logit the softmax takes, with
// the semantics of csrc/fmha/score.h (whose functions it calls) and the bias read in any
// float dtype. Written with the wrappers of cuda/primitives.cuh, so it runs on the GPU and
// under the emulator.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/primitives.cuh"
#include "fmha/params.h"
#include "fmha/score.h"

namespace fmha {
inline namespace FMHA_ISA_TAG {
namespace score {

// One element of a broadcast bias, as float, whatever its dtype.
FMHA_DEVICE float bias_at(const Broadcast4& bias, int64_t index) {
  switch (bias.dtype) {
    case DType::kFloat64: return float(static_cast<const double*>(bias.ptr)[index]);
    case DType::kFloat32: return static_cast<const float*>(bias.ptr)[index];
    case DType::kBFloat16: return gpu::to_float(static_cast<const gpu::bf16_t*>(bias.ptr)[index]);
    case DType::kFloat16: return gpu::to_float(static_cast<const gpu::half_t*>(bias.ptr)[index]);
  }
  return 0.0f;
}

// The logit of (query i, key j) in the log2 domain from acc = q_i . k_j: scale, softcap,
// bias, ALiBi (slope = alibi_slope(p, b, h), 0 without ALiBi), times log2 e. `visible`
// (the window test) is narrowed by the boolean mask and a -inf bias; bias and mask are read only where it
// holds, so rows and keys past the sequence never touch memory. dcap receives d softcap /
// ds (1 without softcap) for the backward's chain rule.
// kBlockSparse = false: a kernel that never sees a block-sparse mask (the decode kernel:
// KV-cache calls refuse it) leaves its test out.
template <bool kBlockSparse = true>
FMHA_DEVICE float logit_log2(const FwdParams& p, const Seq& s, float acc, int b, int h, int i,
                             int j, float slope, bool& visible, float& dcap) {
  float x = acc * float(p.scale);
  dcap = 1.0f;
  if (p.softcap > 0.0) {
    float t;
    x = softcap(x, float(p.softcap), t);
    dcap = softcap_grad(t);
  }
  if (visible && p.bias.ptr) {
    const float bias = bias_at(p.bias, offset_of(p.bias, b, h, i, j));
    if (bias == -INFINITY) visible = false;  // a -inf bias masks the pair, whatever q.k is
    x += bias;
  }
  x += alibi(slope, s, i, j);
  if (visible && p.mask.ptr) visible = mask_allows(p.mask, b, h, i, j);
  if (kBlockSparse && visible && p.block_mask.index)
    visible = block_mask_allows(p.block_mask, b, h, i, j);
  return x * kLog2e;
}

// Pair (query i, key j) is not excluded (docs/semantics.md, "Non-finite inputs"): inside the
// window and the sequence, allowed by the mask, its bias not -inf -- what logit_log2 folds into
// `visible` as it goes. The strong zero's rare blocks (cuda/strong_zero.cuh) ask it again for
// single pairs; plain kernels (no kExtras) have only the window.
template <bool kExtras>
FMHA_DEVICE bool included(const FwdParams& p, const Seq& s, int b, int h, int i, int j) {
  if (!visible(p, s, i, j)) return false;
  if (kExtras && p.mask.ptr && !mask_allows(p.mask, b, h, i, j)) return false;
  if (kExtras && p.block_mask.index && !block_mask_allows(p.block_mask, b, h, i, j)) return false;
  return !(kExtras && p.bias.ptr && bias_at(p.bias, offset_of(p.bias, b, h, i, j)) == -INFINITY);
}

// Every row of [i0, i1] sees every key of [j0, j1] by position (rows past sq and keys past sk
// aside: their tile rows are zero-filled): no pair of the block is excluded by the window.
FMHA_DEVICE bool block_inside_window(const Seq& s, int left, int right, int i0, int i1, int j0,
                                     int j1) {
  i1 = i1 < s.sq - 1 ? i1 : s.sq - 1;
  j1 = j1 < s.sk - 1 ? j1 : s.sk - 1;
  return key_lo(s, left, i1) <= j0 && key_hi(s, right, i0) >= j1;
}

// The strong zero (cuda/strong_zero.cuh): key blocks from the returned one on may hold a
// pair of zero weight for some row of [row_first, ...]: every block (0) when `zeros` (a mask,
// bias or dropout can make one) or a left window is set; with a causal or right window, the
// blocks past the last key row_first sees (the diagonal ones); none (n_end) otherwise.
template <int kBlockN>
FMHA_DEVICE int first_edge_block(const Seq& s, int left, int right, int row_first, int n_end,
                                 bool zeros) {
  if (zeros || left >= 0) return 0;
  if (right < 0) return n_end;
  const int hi = key_hi(s, right, row_first);  // the fewest keys any row of the block sees
  return hi >= s.sk - 1 ? n_end : (hi + 1 > 0 ? (hi + 1) / kBlockN : 0);
}

// Whether a mask, a bias or dropout can give a pair zero weight anywhere (the strong zero
// then watches every block).
FMHA_DEVICE bool zeros_anywhere(const FwdParams& p) {
  return p.mask.ptr != nullptr || p.block_mask.index != nullptr || p.bias.ptr != nullptr ||
         p.dropout_p > 0.0;
}

// Whether the block-sparse mask (params.h) leaves rows [i0, i0 + rows) x keys [j0, j0 + keys)
// of (b, h) -- clipped to the sequence -- with nothing to attend: kernels skip such tiles,
// neither loading nor computing them.
FMHA_DEVICE bool tile_skipped(const FwdParams& p, const Seq& s, int b, int h, int i0, int rows,
                              int j0, int keys) {
  if (p.block_mask.index == nullptr) return false;
  const int i1 = i0 + rows < s.sq ? i0 + rows - 1 : s.sq - 1;
  const int j1 = j0 + keys < s.sk ? j0 + keys - 1 : s.sk - 1;
  return block_tile_kind(p.block_mask, b, h, i0, i1, j0, j1) == kTileEmpty;
}

// The key blocks [n_begin, n_end) of kBlockN keys that some row of [row_first, row_last]
// may see (window sides left, right as in the params): blocks wholly outside every row's
// window are never loaded.
template <int kBlockN>
FMHA_DEVICE void key_blocks(const Seq& s, int left, int right, int row_first, int row_last,
                            int& n_begin, int& n_end) {
  n_begin = key_lo(s, left, row_first) / kBlockN;
  const int hi = key_hi(s, right, row_last);
  n_end = hi < 0 ? 0 : hi / kBlockN + 1;
}

}  // namespace score
}  // namespace FMHA_ISA_TAG
}  // namespace fmha
