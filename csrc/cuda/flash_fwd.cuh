// The FlashAttention-2 forward kernel (Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", 2023, Algorithm 1), written only with the wrappers of
// cuda/primitives.cuh so that it runs on sm_80+ GPUs and, in CI, under the SIMT emulator.
//
// Work decomposition: one CTA per (query block Qi of kBlockM rows, query head, batch
// [, key split]); 4 warps, each owning 32 rows of Qi (two m16 tiles, kBlockM = 128; 16 rows
// where registers are short: d = 256 and the extras), so the softmax statistics of a row
// never leave its warp (no shared-memory reduction). Key/value blocks Kj, Vj of kBlockN keys
// stream through shared memory with cp.async: with 16 rows two stages deep, the copy of block
// j+1 in flight while the tensor cores work on block j; with 32 rows single-buffered, as in
// FlashAttention-2, the copy of Vj under S = Qi Kj^T and that of Kj+1 under the softmax and
// P Vj.
//
// Per key block, per warp (names from the paper):
//   S  = Qi Kj^T                 mma.sync m16n8k16, f32 accumulate; Qi as A fragments, held
//                                 in registers for the whole kernel (ldmatrix once) or, where
//                                 registers are short (kQInRegs = false), re-read from shared
//                                 memory per k-step
//   mask S (tails, causal/window)
//   m' = max(m, rowmax(S)); P = exp2(S*scale*log2e - m'); l = l*exp2(m - m') + rowsum(P)
//                                 (lazily: m' = m unless rowmax(S) passes m by more than
//                                 kLazyRescale = 8 in log2 units; then exp2(m - m') = 1,
//                                 and a warp multiplies only the 8-row slots of O where one
//                                 of its rows moved, never on the first key block)
//   O  = O*exp2(m - m') + P Vj    P re-packed in registers as f16/bf16 A fragments (the
//                                 accumulator layout of S is the A layout of P: no
//                                 shared-memory round trip); Vj via ldmatrix.trans
// and once at the end O /= l, lse = (m + log2 l) * ln2. When pairs of zero weight can occur
// (a window, causal included, a mask, a bias or dropout), a key block whose Vj holds NaN or
// Inf is made safe for P Vj first (cuda/strong_zero.cuh): rare, and voted on at the barrier
// the block waits at anyway.
//
// Head dims: one FlashFwdConfig per head-dim tile (32, 64, 96, 128, 256, cuda/head_dims.h);
// a smaller head_dim runs in the next built tile with the extra columns zero-filled in
// shared memory (they add 0 to q.k and are not stored). head_dim_v may differ from head_dim:
// the tile holds the larger, K is loaded head_dim wide, V and O head_dim_v wide.
//
// Variable-length batches (cu_seqlens_q/k): sequence b owns rows [cu[b], cu[b+1]) of the
// packed tensors; the grid is sized by the longest sequence and a CTA whose query block
// starts past its sequence's end exits at once. Everything else (window diagonal, ALiBi,
// bias/mask and dropout coordinates) uses positions within the sequence, as the CPU does.
//
// Split-KV (FlashDecoding): with num_splits > 1 the key blocks a CTA would visit are cut
// into num_splits contiguous ranges, one CTA each; every CTA writes its normalised partial
// O (float32) and lse, and flash_fwd_combine_kernel merges them by lse. A split that sees no
// key writes O = 0, lse = -inf and drops out of the merge with weight 0.
//
// The score pipeline (cuda/score.cuh, semantics in fmha/score.h) -- softcap, additive bias
// (any float dtype, broadcast by zero strides), ALiBi, boolean mask, dropout (the same mask
// as the CPU for any tiling or split) -- is compiled in only when kExtras: plain attention
// keeps its registers and its single multiply per score.
//
// The steady state (FlashAttention-2's): key blocks wholly inside the sequence are copied
// without bounds tests (tile::load's whole-block path), plain attention tests keys only on
// the window's edge blocks and the sequence's last partial block, and its scale rides in the
// exp2's FFMA.
//
// Not yet here: output staged through shared memory for coalesced stores. Performance
// reasoning: docs/cuda_kernels.md.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/flash_fwd.h"
#include "cuda/head_dims.h"
#include "cuda/primitives.cuh"
#include "cuda/score.cuh"
#include "cuda/strong_zero.cuh"
#include "cuda/tile_io.cuh"

namespace fmha {
namespace gpu {

// The shape of one forward kernel. Register budget per thread (255 max, no spills) is what
// decides the tiles: a warp owns 16 kMTiles rows (kMTiles m16 tiles), so per thread
//   O accumulator  kMTiles x kHeadDim / 8 n-tiles x 4 floats = kMTiles kHeadDim / 2 registers
//   S accumulator  kMTiles x kBlockN / 8 n-tiles x 4 floats  = kMTiles kBlockN / 2
//   Q fragments    kMTiles x kHeadDim / 16 k-steps x 4       = kMTiles kHeadDim / 4 (kQInRegs)
// plus ~50-90 for addresses, softmax statistics, the K/V fragments in flight and indices.
// kColSplit = 2: two warps share each 16 rows, one half of O's columns each (8 warps): both
// compute the rows' S and softmax, each accumulates P V for its own half.
// kMTiles = 2 (FlashAttention-2's 32 rows per warp, a 128-row Qi): each K and V fragment a
// warp loads feeds twice the mma, and the pass's fixed costs (barriers, copies, loop) are
// spread over twice the work. Kj and Vj are then single-buffered, so that Qi's 128 rows and
// them fit two CTAs per sm_80 SM: the copy of Vj runs under S = Qi Kj^T and that of Kj+1
// under the softmax and P Vj, as in FlashAttention-2 (kStages = 1).
template <int kHeadDim_, int kBlockN_, bool kQInRegs_, int kCtasPerSm_, int kColSplit_ = 1,
          bool kSwizzled_ = false, int kMTiles_ = 1>
struct FlashFwdConfigBase {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMTiles = kMTiles_;  // m16 tiles of query rows per warp
  static constexpr int kRowWarps = 4;       // warps along the rows: 16 kMTiles rows each
  static constexpr int kRowsPerWarp = 16 * kMTiles;
  static constexpr int kBlockM = kRowsPerWarp * kRowWarps, kBlockN = kBlockN_;
  static constexpr int kColSplit = kColSplit_;
  static constexpr int kWarps = kRowWarps * kColSplit, kThreads = 32 * kWarps;
  static constexpr int kOutDim = kHeadDim / kColSplit;  // O columns per warp
  // Kj, Vj buffers: 2 = the next block's copy in flight under the whole of this block's work;
  // 1 = Vj's copy under S, Kj+1's under the softmax and P Vj.
  static constexpr int kStages = kMTiles == 1 ? 2 : 1;
  static constexpr bool kQInRegs = kQInRegs_;
  // CTAs one SM holds at once (registers x 128 threads and shared memory, sm_80): the
  // split-KV heuristic's unit of "the GPU is full".
  static constexpr int kCtasPerSm = kCtasPerSm_;
  // Launch bounds' CTAs per SM: 0 leaves ptxas to choose its register target, which suits
  // every config but one (below).
  static constexpr int kMinBlocks = 0;
  // Whole key blocks copied without bounds tests (tile::load's FullBlock path).
  static constexpr bool kWholeBlocks = true;
  // The tiles' rows in shared memory (cuda/tile_io.cuh). Qi's are padded by 8 elements (16
  // bytes), where the kernel also keeps a few ints; Kj's and Vj's too, or packed and
  // XOR-swizzled where their padding would cost a CTA per SM.
  using QLayout = tile::Padded<kHeadDim + 8>;
  using KVLayout = std::conditional_t<kSwizzled_, tile::Swizzled<kHeadDim>, QLayout>;
  static constexpr int kPad = QLayout::kStride - kHeadDim;  // Qi's
  static constexpr int kTileQ = kBlockM * QLayout::kStride;
  static constexpr int kTileKV = kBlockN * KVLayout::kStride;
  // The whole-block copy reads from two per-thread pointers into K and V, moved by whole
  // blocks. The 16-row kernels keep them in registers through the loop; the 32-row ones have
  // none to spare, so there they wait in shared memory after the tiles, with K's and V's
  // bases for the checked copy (32 bytes per thread), and are read back per copy: one LDS.64
  // where ptxas, left to itself, recomputed them from the parameters or spilled them.
  static constexpr bool kPointersInSmem =
      kMTiles == 2 && tile::FullBlock<uint16_t, kBlockN, kHeadDim, KVLayout, kThreads>::kUsable;
  static constexpr int kPointerBytes = kPointersInSmem ? 4 * int(sizeof(void*)) * kThreads : 0;
  // Qi once, then kStages x (Kj, Vj)[, the pointers].
  static constexpr size_t kSmemBytes = size_t(kTileQ + 2 * kStages * kTileKV) * 2 + kPointerBytes;
  static_assert(kStages == 2 || kStages == 1, "double- or single-buffered Kj, Vj");

  static constexpr int kNTilesS = kBlockN / 8;     // n-tiles of S (keys)
  static constexpr int kKStepsQK = kHeadDim / 16;  // k-steps of Qi Kj^T (head dim)
  static constexpr int kNTilesO = kOutDim / 8;     // n-tiles of O (this warp's columns)
  static constexpr int kKStepsPV = kBlockN / 16;   // k-steps of P Vj (keys)
  // Philox draws of dropout unrolled together: all of them (ILP) unless registers are short.
  static constexpr int kDropoutUnroll = kHeadDim >= 256 ? 1 : 2 * kNTilesS;
  // Accumulator + fragment registers per thread (the part that grows with the tile).
  static constexpr int kTileRegs =
      kMTiles * (kOutDim / 2 + kBlockN / 2 + (kQInRegs ? kHeadDim / 4 : 4));

  static_assert(kMTiles == 1 || kMTiles == 2, "16 or 32 rows per warp");
  static_assert(kMTiles == 1 || kColSplit == 1, "32 rows: one warp per row block");
  static_assert(kHeadDim % kColSplit == 0 && kOutDim % 16 == 0, "whole column halves");
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "whole mma k-steps");
  static_assert(kNTilesS % 2 == 0 && kNTilesO % 2 == 0, "B fragments load two n-tiles per x4");
  static_assert((kBlockM * kHeadDim / 8) % kThreads == 0 && (kBlockN * kHeadDim / 8) % kThreads == 0,
                "whole 16-byte chunks per thread");
  static_assert(kTileQ % 64 == 0, "Kj, Vj start on 128-byte boundaries (Layout::at)");
  // (32 rows per warp: FlashAttention-2's 128 x 64 tile at d = 128 takes 200, as here.)
  static_assert(kTileRegs <= (kMTiles == 1 ? 176 : 200),
                "leave >= ~55-80 registers for addresses and softmax state");
  // 163 KiB: the most dynamic shared memory one CTA may opt into on sm_80 (A100); and
  // kCtasPerSm CTAs in its 164 KiB, 1 KiB of which each CTA leaves to the system.
  static_assert(kSmemBytes <= 163 * 1024, "fits an sm_80 SM");
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 164 * 1024,
                "kCtasPerSm CTAs fit an sm_80 SM");
};

// Configs per head-dim tile and kExtras (the score pipeline's per-element work -- bias/mask
// addresses, ALiBi, Philox -- needs ~30-60 more registers than the plain path).
template <int kHeadDim, bool kExtras>
struct FlashFwdConfig;

// Each line: kHeadDim, kBlockN, kQInRegs, CTAs per SM (sm_80)[, kColSplit, K/V swizzled,
// m16 tiles per warp]. The plain kernels give each warp 32 query rows wherever ptxas fits
// them (all but d = 256; d = 128 at 32-key blocks): instructions per HMMA of both shapes
// are in docs/cuda_kernels.md (tools/sass_report.py and tools/ptxas_check.py count them); every choice below is the widest tile that ptxas fits without spilling on
// both sm_80 and sm_90 (ptxas uses what it is given, so the counts sit near 255 either way:
// what matters is that nothing spills).
//
// d = 32: 32 rows per warp, 2 x (16 (O) + 32 (S) + 8 (Q)) registers of tiles, 24 KiB of
// shared memory (4 of them the copy's pointers); ptxas takes 188-196 registers, two CTAs per SM. Bound by softmax and
// memory, not mma; kBlockN = 64 keeps the exp work per barrier of the others. Extras: 16
// rows per warp.
template <> struct FlashFwdConfig<32, false> : FlashFwdConfigBase<32, 64, true, 2, 1, false, 2> {};
template <> struct FlashFwdConfig<32, true> : FlashFwdConfigBase<32, 64, true, 2> {};
// d = 64: 32 rows per warp at kBlockN = 64 (O 64 + S 64 registers, 40 KiB with the copy's
// pointers, two CTAs per SM by registers): the pass of 16 rows x 128 keys it replaced had the same 128 HMMA but 68
// ldmatrix instead of 40. Q is re-read from shared memory (2 ldmatrix.x4 per k-step and
// warp): in registers (+32) it spilled 44 bytes on sm_80. flash-attn's 128 x 128 tile (S 128
// registers) spills under nvcc 13.0. Extras: 16 rows, kBlockN = 32 halves S and the
// per-score extras state.
template <> struct FlashFwdConfig<64, false> : FlashFwdConfigBase<64, 64, false, 2, 1, false, 2> {};
template <> struct FlashFwdConfig<64, true> : FlashFwdConfigBase<64, 32, true, 3> {
  // With the whole-block copy as well, ptxas's 168-register target (3 CTAs) spilled 36 bytes
  // on sm_80: the checked copy only, keeping 3 CTAs per SM.
  static constexpr bool kWholeBlocks = false;
};
// d = 96: 32 rows per warp, Q from shared memory and kBlockN = 32 (2 x (48 + 16 + 4)
// registers of tiles, 39 KiB): kBlockN = 64 spilled 72 bytes on sm_90; kBlockN = 48 has no
// whole 16-byte chunks per thread. Two CTAs per SM. Extras: 16 rows, Q in registers.
template <> struct FlashFwdConfig<96, false> : FlashFwdConfigBase<96, 32, false, 2, 1, false, 2> {};
template <> struct FlashFwdConfig<96, true> : FlashFwdConfigBase<96, 32, true, 2> {};
// d = 128. Plain: 32 rows per warp at kBlockN = 32 (O 128 + S 32 registers), Q from shared
// memory as FlashAttention-2 does, K and V swizzled, 54 KiB with the copy's pointers; ptxas
// takes 251-254 registers, two CTAs per SM. FlashAttention-2's 128 x 64 tile (S 64) spilled
// 152-184 bytes here (docs/cuda_kernels.md, "The forward"). With 32 keys a pass would carry
// O's rescale (128 multiplies per thread) for half the products; the lazy rescale
// (kLazyRescale) skips it once the rows' maxima settle. Extras: 16 rows, Q in registers but
// kBlockN = 32 (S 16 registers), 51 KiB.
template <> struct FlashFwdConfig<128, false> : FlashFwdConfigBase<128, 32, false, 2, 1, true, 2> {};
template <> struct FlashFwdConfig<128, true> : FlashFwdConfigBase<128, 32, true, 2> {};
// d = 256: the O accumulator alone is 128 registers. Q from shared memory and kBlockN = 16
// (S 8 registers); kBlockN = 32 spilled 8-48 bytes. So the rescale of O (128 multiplies
// per thread) comes every 16 keys: see docs/cuda_kernels.md for the cost. 68 KiB of shared memory.
// Extras: even kBlockN = 16 spilled 8 bytes on sm_90 (the Philox draws of dropout on top of
// O); there two warps share each 16 rows (kColSplit = 2, 8 warps, 64 O registers each),
// recomputing S for their rows, and kBlockN = 32.
template <> struct FlashFwdConfig<256, false> : FlashFwdConfigBase<256, 16, false, 1> {};
template <> struct FlashFwdConfig<256, true> : FlashFwdConfigBase<256, 32, false, 1, 2> {};
// The online softmax's lazy rescale (as FlashAttention-4 does it): a row keeps its reference
// max m until a block's max passes it by more than this (log2 units). Until then P <= 2^8
// (float16 and bfloat16 hold it with room to spare; P V and l accumulate in float32), alpha
// = 1 and O needs no multiply: O / l and lse = m + log2 l are the same sums at another
// scale. A warp multiplies its O only when one of its rows moved (a vote), and then only the
// 8-row slots that moved, so once the maxima settle the common pass carries no rescale at all.
constexpr float kLazyRescale = 8.0f;

// What one launch of flash_fwd_kernel needs beyond the params: resolved once on the host.
struct FwdLaunch {
  bool vec = false;     // rows 16-byte aligned: tiles move by cp.async
  int num_splits = 1;   // key ranges per (query block, head, batch); 1 = write out/lse directly
  int m_blocks = 1;     // query blocks per (head, batch): blockIdx.x = split * m_blocks + m_block
  // num_splits > 1: partial results, row r = (split, b, h, i) at [r * head_dim] / [r], with
  // i < seqlen_q (the maximum when varlen): float32, O normalised by its own l.
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  // KV-cache calls (cuda/flash_decode.cuh): keys per split, at fixed positions, so that
  // sequence b has partials for only the splits its rows reach: splits_for(its rows).
  int split_keys = 0;
  FMHA_DEVICE int splits_for(int keys) const {
    if (split_keys == 0) return num_splits;
    return keys > split_keys ? (keys + split_keys - 1) / split_keys : 1;
  }
  // Split-KV: the split-th of num_splits equal contiguous shares of the key blocks
  // [n_begin, n_end) a query block sees (a share may be empty: it then reports no key, lse
  // -inf). Shared by the sm_80 and sm_90 forward kernels.
  FMHA_DEVICE void take_split(int split, int& n_begin, int& n_end) const {
    if (num_splits <= 1) return;
    const int per = (max(n_end - n_begin, 0) + num_splits - 1) / num_splits;
    n_begin += split * per;
    n_end = min(n_end, n_begin + per);
  }
  // Host: the scratch the partials take (0 without splits), and pointing them into it.
  int64_t partial_rows(const FwdParams& p) const {
    return num_splits > 1 ? int64_t(num_splits) * p.batch * p.heads_q * p.seqlen_q : 0;
  }
  size_t partial_bytes(const FwdParams& p) const {
    return size_t(partial_rows(p)) * (p.head_dim_v + 1) * sizeof(float);
  }
  void place_partials(const FwdParams& p, float* scratch) {
    if (partial_rows(p) == 0) return;
    o_partial = scratch;
    lse_partial = scratch + partial_rows(p) * p.head_dim_v;
  }
};

namespace flash_detail {

// tile::load (cuda/tile_io.cuh) with this config's tile width and threads.
template <typename T, typename Cfg, typename Layout, int kRows>
FMHA_DEVICE void load_tile(T* smem, const T* g, int64_t ld, int rows, int cols, int row0,
                           bool vec, int tid) {
  tile::load<T, kRows, Cfg::kHeadDim, Layout, Cfg::kThreads, Cfg::kWholeBlocks>(
      smem, g, ld, rows, cols, row0, vec, tid);
}

}  // namespace flash_detail

template <typename T, typename Cfg, bool kExtras>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    flash_fwd_kernel(FwdParams p, FwdLaunch launch) {
  FMHA_DYNAMIC_SHARED(T, smem);
  using QLayout = typename Cfg::QLayout;
  using KVLayout = typename Cfg::KVLayout;
  T* sQ = smem;                              // [kBlockM] rows, QLayout
  T* sK = sQ + Cfg::kTileQ;                  // [kStages][kBlockN] rows, KVLayout
  T* sV = sK + Cfg::kStages * Cfg::kTileKV;  // [kStages][kBlockN] rows, KVLayout

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const int m_block = blockIdx.x % launch.m_blocks, split = blockIdx.x / launch.m_blocks;
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.heads_q / p.heads_kv);  // GQA: K and V are shared, never copied
  const score::Seq seq = score::seq_of(p, b);
  const int sq = seq.sq, sk = seq.sk, d = p.head_dim, dv = p.head_dim_v;
  const int m0 = m_block * Cfg::kBlockM;
  // Varlen: the grid is sized by the longest sequence; this block lies past its own.
  // (Uniform over the CTA, before any barrier.)
  if (m0 >= sq) return;

  const int left = p.window_left, right = p.window_right;
  int n_begin, n_end;
  score::key_blocks<Cfg::kBlockN>(seq, left, right, m0, m0 + Cfg::kBlockM - 1, n_begin, n_end);
  launch.take_split(split, n_begin, n_end);

  // The rows of this thread in the accumulator layout: g and g + 8 of each of the warp's
  // m16 tiles, row_lo + 16 mt + 8 r, which statistics index x = 2 mt + r holds; its O
  // columns start at c_base (kColSplit: warps w and w + 4 share rows, split columns).
  // (Constants without the column split: no registers or arithmetic for it.)
  constexpr int kM = Cfg::kMTiles;
  const int row_warp = Cfg::kColSplit > 1 ? warp % Cfg::kRowWarps : warp;
  const int c_base = Cfg::kColSplit > 1 ? (warp / Cfg::kRowWarps) * Cfg::kOutDim : 0;
  const int row_lo = m0 + row_warp * Cfg::kRowsPerWarp + g;
  auto row_of = [&](int x) { return row_lo + 16 * (x / 2) + 8 * (x % 2); };

  // Running statistics in the log2 domain: m = max of S*scale*log2(e), l = sum of exp2.
  // l is this thread's partial sum (its 16 columns per block); the quad sums it at the end.
  // m starts at the lowest finite float, not -inf: a row that has seen no visible key keeps
  // it, and its P = exp2(-inf - m) and alpha = exp2(m - m) are exactly 0 and 1 with no test
  // (with -inf, exp2(-inf - -inf) would be NaN). Its lse comes from l = 0: -inf.
  float m[2 * kM], l[2 * kM];
#pragma unroll
  for (int x = 0; x < 2 * kM; ++x) {
    m[x] = -FLT_MAX;
    l[x] = 0.0f;
  }
  float acc_o[kM][Cfg::kNTilesO][4];
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int j = 0; j < Cfg::kNTilesO; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][j][e] = 0.0f;

  if (n_begin < n_end) {
    const T* Q = static_cast<const T*>(p.q) + h * p.q_head_stride +
                 score::q_base(p, seq, b, p.q_batch_stride, p.q_row_stride);
    const T* K = static_cast<const T*>(p.k) + h_kv * p.k_head_stride +
                 score::k_base(p, seq, b, p.k_batch_stride, p.k_row_stride);
    const T* V = static_cast<const T*>(p.v) + h_kv * p.v_head_stride +
                 score::k_base(p, seq, b, p.v_batch_stride, p.v_row_stride);
    // Plain attention keeps S raw and folds the scale into the exponent: the row max is taken
    // on raw scores (scaling by a positive number keeps the order, and rounds the max to
    // exactly the max of the scaled scores), then P = exp2(S * scale_log2 - m), one FFMA per
    // score. So the plain kernel needs scale_log2 > 0; the launcher sends other scales to
    // the extras kernel, whose logits already carry the scale (there `fold` is 1: exact).
    const float scale_log2 = float(p.scale) * score::kLog2e;
    const float fold = kExtras ? 1.0f : scale_log2;
    // kExtras only: the rest of the score pipeline and dropout. Everything else they need
    // is read from the params (kernel parameters live in the constant bank: free to
    // re-read, and caching them here cost registers -- 16-byte spills at d = 128 on sm_80).
    const float slope = kExtras ? float(score::alibi_slope(p, b, h)) : 0.0f;
    // The strong zero (cuda/strong_zero.cuh): the key blocks from n_edge on may hold a
    // zero-weight pair and vote on Vj. Every block when a mask, a bias or dropout can make
    // one, or a left window is set; with a causal or right window only the blocks past row
    // m0's last visible key (the diagonal ones); none for plain attention. n_edge waits in
    // shared memory, in the padding of Qi's first row, and is read per block: kept in a
    // register through the loop (or the window's two edges, or per-block window arithmetic)
    // it cost kernels at ptxas's register cap a spill.
    const int n_edge = score::first_edge_block<Cfg::kBlockN>(
        seq, left, right, m0, n_end,
        kExtras && score::zeros_anywhere(p));
    static_assert(Cfg::kPad * 2 >= 3 * sizeof(int),
                  "n_edge, a count and the first block fit a row's padding");
    int* const n_edge_slot = reinterpret_cast<int*>(sQ + Cfg::kHeadDim);  // read after a barrier
    if (tid == 0) *n_edge_slot = n_edge;

    // The block-sparse mask (params.h): the loop takes only the key blocks it leaves
    // non-empty for this CTA's rows, listed here once -- offsets from n_begin, in the padding
    // of Qi's rows 1.. -- and counted in row 0's. (Asked inside the loop, the mask cost the
    // kernels at ptxas's register cap a spill.) More than the padding holds: every block.
    constexpr int kListPerRow = Cfg::kPad * int(sizeof(T)) / int(sizeof(uint16_t));
    constexpr int kListMax = (Cfg::kBlockM - 1) * kListPerRow;
    auto list_entry = [&](int k) {
      return reinterpret_cast<uint16_t*>(sQ + (1 + k / kListPerRow) * QLayout::kStride +
                                         Cfg::kHeadDim) + k % kListPerRow;
    };
    int n_count = n_end - n_begin;  // blocks the loop takes
    bool listed = false;            // they are list_entry's, not n_begin, n_begin + 1, ...
    if (kExtras && p.block_mask.index) {
      if (tid == 0) {
        // Offsets past 16 bits cannot be listed either: every block then.
        int count = n_end - n_begin > 0xFFFF + 1 ? kListMax + 1 : 0;
        for (int n = n_begin; n < n_end && count <= kListMax; ++n)
          if (!score::tile_skipped(p, seq, b, h, m0, Cfg::kBlockM, n * Cfg::kBlockN,
                                   Cfg::kBlockN)) {
            if (count < kListMax) *list_entry(count) = uint16_t(n - n_begin);
            ++count;
          }
        n_edge_slot[1] = count <= kListMax ? count : -1;
      }
      __syncthreads();
      if (n_edge_slot[1] >= 0) {
        listed = true;
        n_count = n_edge_slot[1];
      }
    }
    // The loop's k runs over [k_begin, k_end) and takes block block_at(k): without extras
    // k is the block itself (the loop as it was before the mask, register for register).
    const int k_begin = kExtras ? 0 : n_begin, k_end = kExtras ? n_count : n_end;
    // The loop's first k, beside n_edge: read only on a pass whose rescale vote fired (kept in
    // a register through the loop, it cost the d = 128 kernel 12 instructions a pass).
    int* const k_begin_slot = n_edge_slot + 2;  // read after a barrier
    if (tid == 0) *k_begin_slot = k_begin;
    auto block_at = [&](int k) {
      if constexpr (kExtras) return n_begin + (listed ? int(*list_entry(k)) : k);
      return k;
    };

    // Key blocks below n_full are copied whole (tile::FullBlock) from this thread's first
    // chunk of K's and V's block, moved by whole blocks; the others -- the sequence's partial
    // last block, and every block when rows are not 16-byte aligned or either head dim is
    // below the tile's (one count for both: a call with head_dim != head_dim_v copies K and V
    // checked, a rare shape) -- by the checked copy. Left to itself, ptxas recomputed the
    // whole copy's addresses from the parameters per block (~10-19 instructions per tile
    // copy), so:
    //  - the 16-row kernels keep the two pointers in registers through the loop (pinned by
    //    an empty asm);
    //  - the 32-row kernels have no registers for them (pinned: 8 bytes of spill at d = 64
    //    on sm_80). Their pointers wait in shared memory after the tiles -- this thread's
    //    slots, written and read by it alone (no barrier), volatile so that the compiler
    //    cannot forward a stored value into a register: the next block's chunk of K and of V
    //    (each copy moves its slot on by a block: the plain loop takes blocks in order), then
    //    K's and V's bases for the checked copy. What the copy adds to them is pinned instead:
    //    this thread's chunk in the tile, and with 4 or more chunks per thread the step
    //    between their rows (with 2, d = 32, the pinned steps cost more moves than they save).
    using FullKV = tile::FullBlock<T, Cfg::kBlockN, Cfg::kHeadDim, KVLayout, Cfg::kThreads>;
    const int n_full = Cfg::kWholeBlocks && FullKV::kUsable && launch.vec &&
                               d == Cfg::kHeadDim && dv == Cfg::kHeadDim
                           ? sk / Cfg::kBlockN
                           : 0;
    const T* k_thread = K + FullKV::thread_offset(p.k_row_stride, tid);
    const T* v_thread = V + FullKV::thread_offset(p.v_row_stride, tid);
    static_assert(!(kExtras && Cfg::kPointersInSmem), "the plain loop's blocks are consecutive");
    const T* volatile* const slots =
        Cfg::kPointersInSmem
            ? reinterpret_cast<const T* volatile*>(sV + Cfg::kStages * Cfg::kTileKV) + 4 * tid
            : nullptr;
    if constexpr (Cfg::kPointersInSmem) {
      slots[0] = k_thread + int64_t(n_begin) * (Cfg::kBlockN * p.k_row_stride);
      slots[1] = v_thread + int64_t(n_begin) * (Cfg::kBlockN * p.v_row_stride);
      slots[2] = K;
      slots[3] = V;
    }
    int kv_chunk = FullKV::smem_offset(tid);
    int64_t k_step = FullKV::kRowsPerPass * p.k_row_stride;
    int64_t v_step = FullKV::kRowsPerPass * p.v_row_stride;
#if defined(FMHA_GPU_DEVICE_PATH)
    if constexpr (Cfg::kMTiles == 1 && Cfg::kWholeBlocks && FullKV::kUsable)
      asm("" : "+l"(k_thread), "+l"(v_thread));
    if constexpr (Cfg::kPointersInSmem) asm("" : "+r"(kv_chunk));
    if constexpr (Cfg::kPointersInSmem && Cfg::kBlockN / FullKV::kRowsPerPass >= 4)
      asm("" : "+l"(k_step), "+l"(v_step));
#endif
    auto load_kv_tile = [&](T* dst, const T* g, const T* g_thread, int64_t ld, int cols,
                            int n_block, int slot) {
      if (n_block < n_full) {
        if constexpr (Cfg::kPointersInSmem) {
          const T* src = slots[slot];
          const int64_t step = slot == 0 ? k_step : v_step;
          FullKV::load_stepping(dst + kv_chunk, src, step);
          slots[slot] = src + (Cfg::kBlockN / FullKV::kRowsPerPass) * step;
        } else {
          FullKV::load_at(dst, g_thread + int64_t(n_block) * (Cfg::kBlockN * ld), ld, tid);
        }
      } else {
        tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, KVLayout, Cfg::kThreads, false>(
            dst, Cfg::kPointersInSmem ? static_cast<const T*>(slots[2 + slot]) : g, ld, sk, cols,
            n_block * Cfg::kBlockN, launch.vec, tid);
      }
    };
    auto load_k = [&](int n_block, int stage) {
      load_kv_tile(sK + stage * Cfg::kTileKV, K, k_thread, p.k_row_stride, d, n_block, 0);
    };
    auto load_v = [&](int n_block, int stage) {
      load_kv_tile(sV + stage * Cfg::kTileKV, V, v_thread, p.v_row_stride, dv, n_block, 1);
    };
    // Plain attention: the blocks [inner_lo, inner_hi) lie inside the sequence and inside
    // every row's window (rows past seqlen_q aside: never stored), so their scores need no
    // mask; only the window's edge blocks and the sequence's last partial block test keys.
    const int inner_lo = (score::key_lo(seq, left, min(m0 + Cfg::kBlockM, sq) - 1) +
                          Cfg::kBlockN - 1) / Cfg::kBlockN;
    const int inner_hi = (score::key_hi(seq, right, m0) + 1) / Cfg::kBlockN;

    flash_detail::load_tile<T, Cfg, QLayout, Cfg::kBlockM>(sQ, Q, p.q_row_stride, sq, d, m0,
                                                           launch.vec, tid);
    cp_async_commit();
    if (k_begin < k_end) {
      load_k(block_at(k_begin), 0);
      if constexpr (Cfg::kStages == 2) load_v(block_at(k_begin), 0);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's part of Qi landed (Kj may still be in flight)
    // Every thread's part of Qi is in shared memory before any warp reads its rows.
    __syncthreads();

    // Qi as A fragments: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) addressed by lanes
    // 0-7, 8-15, 16-23, 24-31 are registers a0..a3 of the mma A layout. sQ is never
    // overwritten, so where registers are short the fragments are re-read per k-step.
    // (Offsets from smem: Layout::at, cuda/tile_io.cuh.)
    const int q_lane = QLayout::offset(row_warp * Cfg::kRowsPerWarp + lane % 16, (lane / 16) * 8);
    uint32_t q_frag[kM][Cfg::kQInRegs ? Cfg::kKStepsQK : 1][4];
    if constexpr (Cfg::kQInRegs) {
#pragma unroll
      for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int kk = 0; kk < Cfg::kKStepsQK; ++kk)
          ldmatrix<4>(q_frag[mt][kk], smem + QLayout::at(q_lane, 16 * mt, kk * 16));
    }
    // The lanes' rows and columns of the K (x4: keys 0-7 | 8-15 x dims 0-7 | 8-15) and V
    // (.trans: keys 0-7 | 8-15 x dims 0-7 | 8-15, in the B fragments' order) ldmatrix sweeps.
    const int k_lane = KVLayout::offset(lane % 8 + (lane / 16) * 8, ((lane / 8) % 2) * 8);
    const int v_lane = KVLayout::offset(lane % 8 + ((lane / 8) % 2) * 8, (lane / 16) * 8);

    // A rare block (Vj holds NaN or Inf where a pair of zero weight may meet it, voted on at
    // the barrier that sees Vj complete): O becomes NaN where a pair that takes part (neither
    // excluded nor dropped) meets one, then Vj's NaN and Inf become 0 for P Vj.
    auto strong_zero_v = [&](T* tV, int n0) {
#pragma unroll
      for (int mt = 0; mt < kM; ++mt)
        strong_zero::poison<T, Cfg::kNTilesO, Cfg::kBlockN, KVLayout>(
            acc_o[mt], tV, c_base, t, [&](int r, int k) {
              const int i = row_of(2 * mt + r), key = n0 + k;
              return score::included<kExtras>(p, seq, b, h, i, key) &&
                     !(kExtras && p.dropout_p > 0.0 &&
                       !score::dropout_keep(p, dropout_threshold(p.dropout_p), b, h, i, key));
            });
      __syncthreads();  // every warp has read the raw Vj
      strong_zero::sanitise<T, Cfg::kBlockN, Cfg::kHeadDim, KVLayout, Cfg::kThreads>(tV, tid);
      __syncthreads();
    };

    for (int k = k_begin; k < k_end; ++k) {
      const int stage = (k - k_begin) % Cfg::kStages;
      const int n_block = block_at(k);
      T* tV = sV + stage * Cfg::kTileKV;
      const int k_base = Cfg::kTileQ + stage * Cfg::kTileKV + k_lane;
      const int v_base = Cfg::kTileQ + (Cfg::kStages + stage) * Cfg::kTileKV + v_lane;
      const int n0 = n_block * Cfg::kBlockN;
      // Whether this block's Vj may hold a zero-weight pair's NaN or Inf (the vote's question;
      // rare).
      auto v_vote = [&] {
        return n_block >= *n_edge_slot &&
               strong_zero::has_nonfinite<T, Cfg::kBlockN, Cfg::kHeadDim, KVLayout, Cfg::kThreads>(
                   tV, launch.vec, tid);
      };
      bool v_nonfinite = false;
      if constexpr (Cfg::kStages == 2) {
        // Prefetch the next block into the other stage; its last readers (the previous block)
        // finished at the trailing __syncthreads of the previous iteration.
        if (k + 1 < k_end) {
          load_k(block_at(k + 1), (stage + 1) % Cfg::kStages);
          load_v(block_at(k + 1), (stage + 1) % Cfg::kStages);
        }
        cp_async_commit();
        cp_async_wait<1>();  // all but the newest group (the next block) retired: this one landed
        // ... for every thread: Kj and Vj are complete in shared memory, and the vote. Here,
        // before S exists, the registers are the loop's fewest (NaN survives the rescale).
        v_nonfinite = __syncthreads_or(v_vote());
        if (v_nonfinite) strong_zero_v(tV, n0);
      } else {
        cp_async_wait<0>();  // Kj landed
        // ... for every thread; and every warp is done with P Vj-1: Vj may replace it.
        __syncthreads();
        load_v(n_block, 0);
        cp_async_commit();
      }

      // ---- S = Qi Kj^T. B[k][n] = Kj[n][k]: Kj's rows (keys) as stored are the B columns,
      // so plain ldmatrix gives the B fragment; x4 = 2 n-tiles (8 keys each) x 2 k-halves,
      // used by each of the warp's m-tiles.
      float acc_s[kM][Cfg::kNTilesS][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mt][j][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsQK; ++kk) {
        if constexpr (!Cfg::kQInRegs) {
#pragma unroll
          for (int mt = 0; mt < kM; ++mt)
            ldmatrix<4>(q_frag[mt][0], smem + QLayout::at(q_lane, 16 * mt, kk * 16));
        }
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; j += 2) {
          uint32_t k4[4];
          ldmatrix<4>(k4, smem + KVLayout::at(k_base, j * 8, kk * 16));
#pragma unroll
          for (int mt = 0; mt < kM; ++mt)
            mma_pair<T>(acc_s[mt][j], acc_s[mt][j + 1], q_frag[mt][Cfg::kQInRegs ? kk : 0], k4);
        }
      }
      // ---- mask: keys past seqlen_k (zero-filled, but they must get probability 0, not
      // exp(0)) and keys outside the row's window get -inf. The extras turn S into log2-domain
      // logits here; plain attention keeps it raw and tests keys only on edge blocks. Rows
      // past seqlen_q are never stored, so only the extras (which read bias / mask memory)
      // exclude them.
      if constexpr (kExtras) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt)
#pragma unroll
          for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = row_of(2 * mt + e / 2), key = n0 + j * 8 + 2 * t + (e % 2);
              float dcap;
              bool visible = score::visible(p, seq, i, key);
              const float x = score::logit_log2(p, seq, acc_s[mt][j][e], b, h, i, key, slope,
                                                visible, dcap);
              acc_s[mt][j][e] = visible ? x : -INFINITY;
            }
      } else if (n_block < inner_lo || n_block >= inner_hi) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt)
#pragma unroll
          for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = row_of(2 * mt + e / 2), key = n0 + j * 8 + 2 * t + (e % 2);
              if (!score::key_visible(seq, left, right, i, key)) acc_s[mt][j][e] = -INFINITY;
            }
      }

      if constexpr (Cfg::kStages == 1) {
        cp_async_wait<0>();  // Vj landed
        // ... for every thread, and the vote; every warp is done with Kj: Kj+1 may replace it.
        v_nonfinite = __syncthreads_or(v_vote());
        if (k + 1 < k_end) load_k(block_at(k + 1), 0);
        cp_async_commit();
      }

      // ---- online softmax. A row's kBlockN scores are spread over the 4 lanes of a quad:
      // reduce within the thread, then across the quad with two xor-shuffles; the max of the
      // block's (raw) scores times `fold` is the max of their logits.
      float alpha[2 * kM];
      bool rescale = false;
#pragma unroll
      for (int x = 0; x < 2 * kM; ++x) {
        const int mt = x / 2, r = x % 2;
        float block_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; ++j)
          block_max = fmaxf(block_max, fmaxf(acc_s[mt][j][2 * r], acc_s[mt][j][2 * r + 1]));
        block_max = fmaxf(block_max, shfl_xor(block_max, 1));
        block_max = fmaxf(block_max, shfl_xor(block_max, 2));
        // The reference max moves only when the block's max passes it by more than
        // kLazyRescale; otherwise alpha = 1 (exp2(0) is exact).
        const float block_logit = block_max * fold;
        const float row_max = block_logit > m[x] + kLazyRescale ? block_logit : m[x];
        // An infinite max (an Inf score, or a raw max whose scaled value overflows) makes the
        // row NaN, as exp2(inf - inf) did before the scale was folded: fmaf would have given
        // every key -inf, P = 0. (A row's first finite score: m - m_use is about -FLT_MAX,
        // alpha = exp2 of it = 0, and O and l are still 0, or NaN.) One FFMA: 0 * row_max is 0
        // for a finite max and NaN for +inf (row_max is never -inf or NaN: it is m, or a block
        // max that passed m).
        const float m_use = fmaf(0.0f, row_max, row_max);
        alpha[x] = exp2_approx(m[x] - m_use);
        rescale |= alpha[x] != 1.0f;
        m[x] = row_max;
        float row_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            acc_s[mt][j][e] = exp2_approx(fmaf(acc_s[mt][j][e], fold, -m_use));
            row_sum += acc_s[mt][j][e];
          }
        l[x] = l[x] * alpha[x] + row_sum;
      }
      // O's rescale: one vote for the common pass where no row moved, then one per 8-row slot
      // x (rows g + 8 r + 16 mt of the warp): a warp multiplies only the slots where one of its
      // lanes' rows moved (alpha = 1 in the others: skipping them is exact). Never on the
      // loop's first block, where every row's max moves from -FLT_MAX but O is still 0 (or NaN
      // from the strong zero, which stays NaN either way).
      if (warp_any(rescale) && k != *k_begin_slot) {
#pragma unroll
        for (int x = 0; x < 2 * kM; ++x)
          if (warp_any(alpha[x] != 1.0f)) {
#pragma unroll
            for (int j = 0; j < Cfg::kNTilesO; ++j) {
              acc_o[x / 2][j][2 * (x % 2)] *= alpha[x];
              acc_o[x / 2][j][2 * (x % 2) + 1] *= alpha[x];
            }
          }
      }

      // ---- dropout, after l (the normaliser counts dropped entries too). A thread's keys
      // 2t, 2t+1 of an n-tile share one Philox draw (score::dropout_keep_pair). Dropped
      // entries become 0; the kept ones' 1 / (1 - p) is applied to O once, in the epilogue:
      // P (up to 2^kLazyRescale) times it could pass float16's range before P V.
      if (kExtras && p.dropout_p > 0.0) {
        static_assert(!kExtras || kM == 1, "the extras run 16 rows per warp");
        const uint32_t threshold = dropout_threshold(p.dropout_p);
        // First the keep bits of all 2 x kNTilesS draws (bit 2x + e: draw x = r * kNTilesS +
        // j, key 2t + e), then the multiplies: the draws loop indexes no register array, so
        // where registers are short (kDropoutUnroll = 1) it runs one Philox at a time.
        static_assert(!kExtras || 2 * Cfg::kNTilesS * 2 <= 32, "keep bits fit one word");
        uint32_t keep = 0;
#pragma unroll Cfg::kDropoutUnroll
        for (int x = 0; x < 2 * Cfg::kNTilesS; ++x) {
          const int r = x / Cfg::kNTilesS, j = x % Cfg::kNTilesS;
          const int key = n0 + j * 8 + 2 * t;
          keep |= score::dropout_keep_pair(p, threshold, b, h, row_lo + 8 * r, key) << (2 * x);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!((keep >> (2 * (r * Cfg::kNTilesS + j) + e)) & 1u)) acc_s[0][j][2 * r + e] = 0.0f;
      }

      // ---- O += P Vj. The S accumulator of n-tiles 2k, 2k+1 is exactly the A fragment of
      // P for k-step k (rows g / g+8, keys 2t.. / 2t+8..): converted in registers, per k-step
      // (two stages) or all of P before the product (one stage: the rare block's strong zero
      // then runs with P packed, the fewest registers it can have once Vj has landed).
      constexpr bool kPackFirst = Cfg::kStages == 1;
      uint32_t p_frag[kM][kPackFirst ? Cfg::kKStepsPV : 1][4];
      if constexpr (kPackFirst) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt)
#pragma unroll
          for (int kk = 0; kk < Cfg::kKStepsPV; ++kk)
            a_frag_from_acc<T>(p_frag[mt][kk], acc_s[mt][2 * kk], acc_s[mt][2 * kk + 1]);
        if (v_nonfinite) strong_zero_v(tV, n0);
      }
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsPV; ++kk) {
        if constexpr (!kPackFirst) {
#pragma unroll
          for (int mt = 0; mt < kM; ++mt)
            a_frag_from_acc<T>(p_frag[mt][0], acc_s[mt][2 * kk], acc_s[mt][2 * kk + 1]);
        }
        // Vj is row-major keys x dims = the K x N B operand: ldmatrix.trans, two n-tiles
        // (dims) x two k-halves (keys) per x4, as in cuda/testing/gemm_tc.cuh.
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesO; j += 2) {
          uint32_t v4[4];
          ldmatrix<4, true>(v4, smem + KVLayout::at(v_base, kk * 16, c_base + j * 8));
#pragma unroll
          for (int mt = 0; mt < kM; ++mt)
            mma_pair<T>(acc_o[mt][j], acc_o[mt][j + 1], p_frag[mt][kPackFirst ? kk : 0], v4);
        }
      }
      // Two stages: every warp is done reading this stage before the next iteration's
      // prefetch (of the block after next) overwrites it. (One stage: the next iteration's
      // first barrier does this.)
      if constexpr (Cfg::kStages == 2) __syncthreads();
    }
    cp_async_wait<0>();  // retire the trailing empty group
  }

  // ---- epilogue: l over the quad, O /= l, lse. A row whose keys all have weight 0 (none
  // visible, or every score -inf) has l = 0: out 0 -- NaN where the strong zero or a visible
  // key's NaN V made O NaN (O * 0) -- and lse -inf; a NaN or Inf score made l NaN: out and
  // lse NaN.
  const bool partial = launch.num_splits > 1;
  // Bases recomputed here rather than kept live through the key loop (registers); in the
  // 32-row kernels from the sequence's offsets read again (8 bytes of spill at d = 64 on
  // sm_80 otherwise: the offset of its first query row held through the loop).
  const score::Seq seq_o = Cfg::kPointersInSmem ? score::seq_of(p, b) : seq;
  T* O = static_cast<T*>(p.o) + h * p.o_head_stride +
         score::q_base(p, seq_o, b, p.o_batch_stride, p.o_row_stride);
  float* lse = static_cast<float*>(p.lse) + h * p.lse_head_stride +
               score::q_base(p, seq_o, b, p.lse_batch_stride, p.lse_row_stride);
  // Split-KV partials: (split, b, h, i) rows of head_dim_v floats, i < seqlen_q (the maximum).
  const int64_t partial_row0 = ((int64_t(split) * p.batch + b) * p.heads_q + h) * p.seqlen_q;
#pragma unroll
  for (int x = 0; x < 2 * kM; ++x) {
    const int mt = x / 2, r = x % 2;
    l[x] += shfl_xor(l[x], 1);
    l[x] += shfl_xor(l[x], 2);
    // (Dropout's 1 / (1 - p) on the kept entries, applied here.)
    const float inv_l = l[x] != 0.0f ? (kExtras && p.dropout_p > 0.0
                                            ? float(1.0 / (1.0 - p.dropout_p)) / l[x]
                                            : 1.0f / l[x])
                                     : 0.0f;  // a NaN l makes the row NaN
    const float row_lse = l[x] != 0.0f ? (m[x] + log2f(l[x])) * score::kLn2 : -INFINITY;
    const int i = row_of(x);
    if (i < sq) {
      if (partial) {
        float* Op = launch.o_partial + (partial_row0 + i) * dv;
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesO; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = c_base + j * 8 + 2 * t + e;
            if (col < dv) Op[col] = acc_o[mt][j][2 * r + e] * inv_l;
          }
        if (t == 0 && c_base == 0) launch.lse_partial[partial_row0 + i] = row_lse;
      } else {
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesO; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = c_base + j * 8 + 2 * t + e;
            if (col < dv)
              O[i * p.o_row_stride + col] = from_float<T>(acc_o[mt][j][2 * r + e] * inv_l);
          }
        if (t == 0 && c_base == 0) lse[i * p.lse_row_stride] = row_lse;
      }
    }
  }
}

// Split-KV merge: for each row, lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse)
// O_s (each O_s already normalised by its own l). One warp per row: the lanes share the
// splits for the two reductions, then the head dims for the weighted sum.
constexpr int kCombineWarps = 4;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps)
    flash_fwd_combine_kernel(FwdParams p, FwdLaunch launch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i = blockIdx.x * kCombineWarps + warp;
  const score::Seq seq = score::seq_of(p, b);
  if (i >= seq.sq) return;  // whole warps: no lane of a warp that shuffles has exited
  // A KV-cache call's sequence merges the splits its rows reach (score::cache_rows: the
  // flash kernels' seq_of does not read caches on the device).
  const int n = launch.splits_for(p.cache_seqlens ? score::cache_rows(p, b) : seq.sk);
  const int d = p.head_dim_v;  // O's columns
  const int64_t row = (int64_t(b) * p.heads_q + h) * p.seqlen_q + i;
  const int64_t split_stride = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const float* lse_s = launch.lse_partial + row;

  // The largest lse, NaN if any split's is (fmaxf would drop it): a NaN row stays NaN.
  auto max_nan = [](float a, float b) { return a != a || b != b ? a + b : fmaxf(a, b); };
  float mx = -INFINITY;
  for (int s = lane; s < n; s += 32) mx = max_nan(mx, lse_s[s * split_stride]);
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) mx = max_nan(mx, shfl_xor(mx, w));
  // Every split empty / every key masked: lse -inf (exp(-inf - -inf) would be NaN), out the
  // splits' O times 0: 0, or NaN where a split's strong zero made its O NaN -- a pair of
  // weight 0 that met a NaN or Inf in V -- as the kernel without splits gives O / l = NaN * 0.
  float sum = 0.0f;
  if (mx != -INFINITY)
    for (int s = lane; s < n; s += 32) sum += expf(lse_s[s * split_stride] - mx);
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) sum += shfl_xor(sum, w);
  const float total = mx == -INFINITY ? -INFINITY : mx + logf(sum);

  constexpr int kCols = (kHeadDim + 31) / 32;  // head dims per lane
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
  for (int s = 0; s < n; ++s) {
    // 0 for an empty split
    const float w = mx == -INFINITY ? 0.0f : expf(lse_s[s * split_stride] - total);
    const float* Os = launch.o_partial + (s * split_stride + row) * d;
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      if (lane + 32 * c < d) acc[c] += w * Os[lane + 32 * c];
  }
  T* O = static_cast<T*>(p.o) + h * p.o_head_stride +
         score::q_base(p, seq, b, p.o_batch_stride, p.o_row_stride) + int64_t(i) * p.o_row_stride;
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    if (lane + 32 * c < d) O[lane + 32 * c] = from_float<T>(acc[c]);
  if (lane == 0)
    static_cast<float*>(p.lse)[h * p.lse_head_stride + i * p.lse_row_stride +
                               score::q_base(p, seq, b, p.lse_batch_stride,
                                             p.lse_row_stride)] = total;
}

// Host side, defined in flash_fwd.cu (plain functions, shared by every instantiation).
// True when q, k, v rows may move by 16-byte cp.async.
bool flash_fwd_rows_aligned(const FwdParams& p);
// The number of key splits for a launch of (blocks_per_head x heads x batch) CTAs over
// n_blocks key blocks: p.num_splits when set, else the occupancy heuristic.
int flash_fwd_num_splits(const FwdParams& p, int m_blocks, int n_blocks, int ctas_per_sm);

// After a launch with key splits, the merge of its partials; returns the number of splits.
// (Shared with the sm_90 forward, cuda/flash_fwd_sm90.cuh.)
template <typename T, int kHeadDim>
int run_flash_fwd_combine(const FwdParams& p, const FwdLaunch& launch, Stream stream) {
  if (launch.num_splits > 1) {
    auto combine = &flash_fwd_combine_kernel<T, kHeadDim>;
    const dim3 cgrid((p.seqlen_q + kCombineWarps - 1) / kCombineWarps, p.heads_q, p.batch);
    FMHA_LAUNCH(combine, cgrid, dim3(32 * kCombineWarps), 0, stream, p, launch);
  }
  return launch.num_splits;
}

// The launcher every generated instantiation file (csrc/cuda/instantiations/) instantiates
// once: run_flash_fwd<T, head-dim tile, extras>. Returns the number of key splits it used.
template <typename T, int kHeadDim, bool kExtras>
int run_flash_fwd(const FwdParams& p, Stream stream) {
  using Cfg = FlashFwdConfig<kHeadDim, kExtras>;
  FwdLaunch launch;
  launch.vec = flash_fwd_rows_aligned(p);
  launch.m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  launch.num_splits = flash_fwd_num_splits(
      p, launch.m_blocks, (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, Cfg::kCtasPerSm);
  // Stream-ordered: freed after the combine kernel on the same stream has run.
  Scratch scratch(launch.partial_bytes(p), stream);
  launch.place_partials(p, scratch.as<float>());
  auto kernel = &flash_fwd_kernel<T, Cfg, kExtras>;
  if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
  const dim3 grid(launch.m_blocks * launch.num_splits, p.heads_q, p.batch);
  FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, launch);
  return run_flash_fwd_combine<T, kHeadDim>(p, launch, stream);
}

}  // namespace gpu
}  // namespace fmha
