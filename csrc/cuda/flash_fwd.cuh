// The FlashAttention-2 forward kernel (Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", 2023, Algorithm 1), written only with the wrappers of
// cuda/primitives.cuh so that it runs on sm_80+ GPUs and, in CI, under the SIMT emulator.
//
// Work decomposition: one CTA per (query block Qi of kBlockM = 64 rows, query head, batch);
// 4 warps, each owning 16 rows of Qi, so the softmax statistics of a row never leave its
// warp (no shared-memory reduction). Key/value blocks Kj, Vj of kBlockN = 64 keys stream
// through shared memory with cp.async, two stages deep: the copy of block j+1 is in flight
// while the tensor cores work on block j.
//
// Per key block, per warp (names from the paper):
//   S  = Qi Kj^T                 mma.sync m16n8k16, f32 accumulate; Qi lives in registers
//                                 as A fragments for the whole kernel (ldmatrix once)
//   mask S (tails, causal/window)
//   m' = max(m, rowmax(S)); P = exp2(S*scale*log2e - m'); l = l*exp2(m - m') + rowsum(P)
//   O  = O*exp2(m - m') + P Vj    P re-packed in registers as f16/bf16 A fragments (the
//                                 accumulator layout of S is the A layout of P: no
//                                 shared-memory round trip); Vj via ldmatrix.trans
// and once at the end O /= l, lse = (m + log2 l) * ln2.
//
// Head dims: the tile is kHeadDim wide (64 or 128); a smaller head_dim runs in the next
// tile width with the extra columns zero-filled in shared memory (they add 0 to q.k and
// are not stored). head_dim_v must equal head_dim.
//
// The score pipeline of design.md -- softcap, additive bias (any float dtype, broadcast by
// zero strides), ALiBi, boolean mask, dropout (Philox4x32-10, fmha/philox.h: the same mask as
// the CPU for any tiling) -- is compiled in only when kExtras: plain attention keeps its
// registers and its single multiply per score.
//
// Not yet here: varlen (the launcher rejects it; see flash_fwd.cu), split-KV, output staged
// through shared memory for coalesced stores, skipping the mask arithmetic for blocks inside every window.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/flash_fwd.h"
#include "cuda/primitives.cuh"
#include "fmha/philox.h"

namespace fmha {
namespace gpu {

template <int kHeadDim_>
struct FlashFwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64, kBlockN = 64;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kStages = 2;
  // Rows padded by 8 elements (16 bytes): row starts stay 16-byte aligned (ldmatrix,
  // cp.async) and the 8 rows one ldmatrix reads fall in distinct banks (144- and 272-byte
  // strides step through all 32 banks).
  static constexpr int kPad = 8;
  static constexpr int kStride = kHeadDim + kPad;
  static constexpr int kTileQ = kBlockM * kStride, kTileKV = kBlockN * kStride;
  // Qi once, then kStages x (Kj, Vj): 46 KiB at d = 64, 87 KiB at d = 128.
  static constexpr size_t kSmemBytes = size_t(kTileQ + 2 * kStages * kTileKV) * 2;

  static constexpr int kNTilesS = kBlockN / 8;    // n-tiles of S (keys)
  static constexpr int kKStepsQK = kHeadDim / 16;  // k-steps of Qi Kj^T (head dim)
  static constexpr int kNTilesO = kHeadDim / 8;   // n-tiles of O (head dim)
  static constexpr int kKStepsPV = kBlockN / 16;   // k-steps of P Vj (keys)

  static_assert(kBlockM == 16 * kWarps, "each warp owns 16 query rows");
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "whole mma k-steps");
  static_assert(kNTilesS % 2 == 0 && kNTilesO % 2 == 0, "B fragments load two n-tiles per x4");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0, "whole 16-byte chunks per thread");
  static_assert((kStride * 2) % 16 == 0, "16-byte aligned shared rows");
};

namespace flash_detail {

// Copies rows [row0, row0 + kRows) x columns [0, kHeadDim) of a (rows x cols) matrix with
// row stride ld into shared memory (row stride kStride), zero outside the matrix: the zero
// rows of a tail block keep NaN/garbage out of P Vj (0 * NaN is NaN), the zero columns pad
// head_dim up to the tile width.
template <typename T, typename Cfg, int kRows>
FMHA_DEVICE void load_tile(T* smem, const T* g, int64_t ld, int rows, int cols, int row0,
                           bool vec, int tid) {
  constexpr int kChunksPerRow = Cfg::kHeadDim / 8;  // 16-byte chunks of 8 elements
  constexpr int kChunks = kRows * kChunksPerRow;
  if (vec) {
#pragma unroll
    for (int i = 0; i < kChunks / Cfg::kThreads; ++i) {
      const int chunk = tid + i * Cfg::kThreads;
      const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
      const int gr = row0 + r;
      const int valid = (gr < rows && c < cols) ? min(cols - c, 8) : 0;
      // A chunk with nothing to read still needs a valid source address: the matrix base.
      const T* src = valid > 0 ? g + gr * ld + c : g;
      cp_async_16(smem + r * Cfg::kStride + c, src, valid * 2);
    }
  } else {
    const T zero = from_bits<T>(0);
#pragma unroll 4
    for (int i = tid; i < kRows * Cfg::kHeadDim; i += Cfg::kThreads) {
      const int r = i / Cfg::kHeadDim, c = i % Cfg::kHeadDim;
      const int gr = row0 + r;
      smem[r * Cfg::kStride + c] = (gr < rows && c < cols) ? g[gr * ld + c] : zero;
    }
  }
}

// One element of a broadcast bias, as float, whatever its dtype.
FMHA_DEVICE float bias_at(const Broadcast4& bias, int64_t index) {
  switch (bias.dtype) {
    case DType::kFloat64: return float(static_cast<const double*>(bias.ptr)[index]);
    case DType::kFloat32: return static_cast<const float*>(bias.ptr)[index];
    case DType::kBFloat16: return to_float(static_cast<const bf16_t*>(bias.ptr)[index]);
    case DType::kFloat16: return to_float(static_cast<const half_t*>(bias.ptr)[index]);
  }
  return 0.0f;
}

}  // namespace flash_detail

template <typename T, typename Cfg, bool kExtras>
__global__ void __launch_bounds__(Cfg::kThreads) flash_fwd_kernel(FwdParams p, bool vec) {
  FMHA_DYNAMIC_SHARED(T, smem);
  T* sQ = smem;                       // [kBlockM][kStride]
  T* sK = sQ + Cfg::kTileQ;           // [kStages][kBlockN][kStride]
  T* sV = sK + Cfg::kStages * Cfg::kTileKV;  // [kStages][kBlockN][kStride]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.heads_q / p.heads_kv);  // GQA: K and V are shared, never copied
  const int sq = p.seqlen_q, sk = p.seqlen_k, d = p.head_dim;
  const int m0 = m_block * Cfg::kBlockM;

  const T* Q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const T* K = static_cast<const T*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const T* V = static_cast<const T*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  T* O = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
  float* lse = static_cast<float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride;

  // Visible keys of row i: [i + off - left, i + off + right] (negative window: unbounded).
  const int off = p.bottom_right ? sk - sq : 0;
  const int left = p.window_left, right = p.window_right;
  // Key blocks that intersect some row's window: blocks wholly outside are never loaded.
  int n_begin = 0, n_end = (sk + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (left >= 0) n_begin = max(0, m0 + off - left) / Cfg::kBlockN;
  if (right >= 0) {
    const int last_key = m0 + Cfg::kBlockM - 1 + off + right;  // of the block's last row
    n_end = last_key < 0 ? 0 : min(n_end, last_key / Cfg::kBlockN + 1);
  }

  // The two rows of this thread in the accumulator layout: g and g + 8 of the warp's 16.
  const int row_lo = m0 + warp * 16 + g;
  const int rows[2] = {row_lo, row_lo + 8};

  // Running statistics in the log2 domain: m = max of S*scale*log2(e), l = sum of exp2.
  // l is this thread's partial sum (its 16 columns per block); the quad sums it at the end.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc_o[Cfg::kNTilesO][4];
#pragma unroll
  for (int j = 0; j < Cfg::kNTilesO; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.0f;

  if (n_begin < n_end) {
    constexpr float kLog2e = 1.4426950408889634f;
    const float scale_log2 = float(p.scale) * kLog2e;  // exp(x) = exp2(x log2 e)
    // kExtras only: the rest of the score pipeline and dropout. Everything else they need
    // is read from the params (kernel parameters live in the constant bank: free to
    // re-read, and caching them here cost registers -- 16-byte spills at d = 128 on sm_80).
    const float slope =
        kExtras && p.alibi_slopes
            ? float(p.alibi_slopes[b * p.alibi_batch_stride + h * p.alibi_head_stride])
            : 0.0f;

    auto load_kv = [&](int n_block, int stage) {
      flash_detail::load_tile<T, Cfg, Cfg::kBlockN>(sK + stage * Cfg::kTileKV, K,
                                                    p.k_row_stride, sk, d,
                                                    n_block * Cfg::kBlockN, vec, tid);
      flash_detail::load_tile<T, Cfg, Cfg::kBlockN>(sV + stage * Cfg::kTileKV, V,
                                                    p.v_row_stride, sk, d,
                                                    n_block * Cfg::kBlockN, vec, tid);
    };

    flash_detail::load_tile<T, Cfg, Cfg::kBlockM>(sQ, Q, p.q_row_stride, sq, d, m0, vec, tid);
    cp_async_commit();
    load_kv(n_begin, 0);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's part of Qi landed (Kj may still be in flight)
    // Every thread's part of Qi is in shared memory before any warp reads its rows.
    __syncthreads();

    // Qi as A fragments, kept in registers: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15)
    // addressed by lanes 0-7, 8-15, 16-23, 24-31 are registers a0..a3 of the mma A layout.
    uint32_t q_frag[Cfg::kKStepsQK][4];
#pragma unroll
    for (int kk = 0; kk < Cfg::kKStepsQK; ++kk)
      ldmatrix<4>(q_frag[kk], sQ + (warp * 16 + lane % 16) * Cfg::kStride + kk * 16 + (lane / 16) * 8);

    for (int n_block = n_begin; n_block < n_end; ++n_block) {
      const int stage = (n_block - n_begin) % Cfg::kStages;
      // Prefetch block n+1 into the other stage; its last readers (block n-1) finished at
      // the trailing __syncthreads of the previous iteration.
      if (n_block + 1 < n_end) load_kv(n_block + 1, (stage + 1) % Cfg::kStages);
      cp_async_commit();
      cp_async_wait<1>();  // all but the newest group (block n+1) retired: block n landed
      // ... for every thread: Kj and Vj are complete in shared memory.
      __syncthreads();
      const T* tK = sK + stage * Cfg::kTileKV;
      const T* tV = sV + stage * Cfg::kTileKV;
      const int n0 = n_block * Cfg::kBlockN;

      // ---- S = Qi Kj^T. B[k][n] = Kj[n][k]: Kj's rows (keys) as stored are the B columns,
      // so plain ldmatrix gives the B fragment; x4 = 2 n-tiles (8 keys each) x 2 k-halves.
      float acc_s[Cfg::kNTilesS][4];
#pragma unroll
      for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[j][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsQK; ++kk) {
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; j += 2) {
          uint32_t k4[4];
          const int key = j * 8 + (lane % 8) + (lane / 16) * 8;
          const int dim = kk * 16 + ((lane / 8) % 2) * 8;
          ldmatrix<4>(k4, tK + key * Cfg::kStride + dim);
          const uint32_t b0[2] = {k4[0], k4[1]}, b1[2] = {k4[2], k4[3]};
          mma_m16n8k16<T>(acc_s[j], q_frag[kk], b0, acc_s[j]);
          mma_m16n8k16<T>(acc_s[j + 1], q_frag[kk], b1, acc_s[j + 1]);
        }
      }

      // ---- scale into the log2 domain and mask: keys past seqlen_k (zero-filled, but they
      // must get probability 0, not exp(0)) and keys outside the row's window.
#pragma unroll
      for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = rows[e / 2], key = n0 + j * 8 + 2 * t + (e % 2);
          bool visible = key < sk && (left < 0 || key >= i + off - left) &&
                         (right < 0 || key <= i + off + right);
          float x = acc_s[j][e];
          if constexpr (kExtras) {
            // Rows past seqlen_q have no bias / mask entries in memory: never read them.
            visible = visible && i < sq;
            x *= float(p.scale);
            if (p.softcap > 0.0)  // Gemma 2 / Grok logit cap
              x = float(p.softcap) * tanhf(x / float(p.softcap));
            if (visible && p.bias.ptr)
              x += flash_detail::bias_at(p.bias, b * p.bias.batch_stride + h * p.bias.head_stride +
                                                     i * p.bias.row_stride + key * p.bias.col_stride);
            x -= slope * fabsf(float(i + off - key));  // ALiBi: distance to the diagonal
            if (visible && p.mask.ptr)
              visible = static_cast<const uint8_t*>(p.mask.ptr)[
                  b * p.mask.batch_stride + h * p.mask.head_stride + i * p.mask.row_stride +
                  key * p.mask.col_stride] != 0;
            x *= kLog2e;
          } else {
            x *= scale_log2;
          }
          acc_s[j][e] = visible ? x : -INFINITY;
        }

      // ---- online softmax. A row's 64 scores are spread over the 4 lanes of a quad
      // (16 each): reduce within the thread, then across the quad with two xor-shuffles.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float row_max = m[r];
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; ++j)
          row_max = fmaxf(row_max, fmaxf(acc_s[j][2 * r], acc_s[j][2 * r + 1]));
        row_max = fmaxf(row_max, shfl_xor(row_max, 1));
        row_max = fmaxf(row_max, shfl_xor(row_max, 2));
        // A row with no visible key so far keeps m = -inf; subtracting 0 instead keeps
        // exp2(-inf - -inf) = NaN out: its P is exactly 0.
        const float m_use = row_max == -INFINITY ? 0.0f : row_max;
        const float alpha = exp2_approx(m[r] - m_use);  // exp2(-inf) = 0 on the first block
        m[r] = row_max;
        float row_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            acc_s[j][e] = exp2_approx(acc_s[j][e] - m_use);
            row_sum += acc_s[j][e];
          }
        l[r] = l[r] * alpha + row_sum;
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesO; ++j) {
          acc_o[j][2 * r] *= alpha;
          acc_o[j][2 * r + 1] *= alpha;
        }
      }

      // ---- dropout, after l (the normaliser counts dropped entries too). A thread's keys
      // 2t, 2t+1 of an n-tile share one Philox draw of four (keys 4c..4c+3): words 0, 1 for
      // even t, 2, 3 for odd t (selects, not a runtime index into the draw).
      if (kExtras && p.dropout_p > 0.0) {
        // Keys and threshold as DropoutKey and dropout_threshold (fmha/philox.h) make them.
        const uint32_t threshold = uint32_t(fmin(p.dropout_p * 4294967296.0, 4294967295.0));
        const float keep_scale = float(1.0 / (1.0 - p.dropout_p));
        const uint32_t bh = uint32_t(b) * uint32_t(p.heads_q) + uint32_t(h);
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int j = 0; j < Cfg::kNTilesS; ++j) {
            const int key = n0 + j * 8 + 2 * t;
            const Philox4 rnd = philox4x32_10(
                uint32_t(key >> 2), uint32_t(rows[r]), bh, uint32_t(p.offset), uint32_t(p.seed),
                uint32_t(p.seed >> 32) + uint32_t(p.offset >> 32));
            const uint32_t w0 = (t & 1) ? rnd.x[2] : rnd.x[0];
            const uint32_t w1 = (t & 1) ? rnd.x[3] : rnd.x[1];
            acc_s[j][2 * r] = w0 >= threshold ? acc_s[j][2 * r] * keep_scale : 0.0f;
            acc_s[j][2 * r + 1] = w1 >= threshold ? acc_s[j][2 * r + 1] * keep_scale : 0.0f;
          }
      }

      // ---- O += P Vj. The S accumulator of n-tiles 2k, 2k+1 is exactly the A fragment of
      // P for k-step k (rows g / g+8, keys 2t.. / 2t+8..): convert in registers.
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsPV; ++kk) {
        const uint32_t p_frag[4] = {
            pack2<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]),
            pack2<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]),
            pack2<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]),
            pack2<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3])};
        // Vj is row-major keys x dims = the K x N B operand: ldmatrix.trans, two n-tiles
        // (dims) x two k-halves (keys) per x4, as in cuda/gemm_tc.cuh.
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesO; j += 2) {
          uint32_t v4[4];
          const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          const int dim = j * 8 + (lane / 16) * 8;
          ldmatrix<4, true>(v4, tV + key * Cfg::kStride + dim);
          const uint32_t b0[2] = {v4[0], v4[1]}, b1[2] = {v4[2], v4[3]};
          mma_m16n8k16<T>(acc_o[j], p_frag, b0, acc_o[j]);
          mma_m16n8k16<T>(acc_o[j + 1], p_frag, b1, acc_o[j + 1]);
        }
      }
      // Every warp is done reading this stage before the next iteration's prefetch (of
      // block n+2) overwrites it.
      __syncthreads();
    }
    cp_async_wait<0>();  // retire the trailing empty group
  }

  // ---- epilogue: l over the quad, O /= l, lse. A row with no visible key has l = 0:
  // out 0, lse -inf (never NaN).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += shfl_xor(l[r], 1);
    l[r] += shfl_xor(l[r], 2);
    const float inv_l = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int i = rows[r];
    if (i < sq) {
#pragma unroll
      for (int j = 0; j < Cfg::kNTilesO; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = j * 8 + 2 * t + e;
          if (col < d) O[i * p.o_row_stride + col] = from_float<T>(acc_o[j][2 * r + e] * inv_l);
        }
      if (t == 0)
        lse[i * p.lse_row_stride] =
            l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.6931471805599453f : -INFINITY;
    }
  }
}

}  // namespace gpu
}  // namespace fmha
