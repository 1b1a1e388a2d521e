// The FlashAttention-2 backward kernels (Dao, "FlashAttention-2", 2023, Algorithm 2), written
// only with the wrappers of cuda/primitives.cuh so that they run on sm_80+ GPUs and, in CI,
// under the SIMT emulator.
//
// Given the forward's O and lse, per (batch, head) with D = rowsum(dO o O):
//   P  = exp(S - lse)            recomputed from Q, K: never stored
//   dV = Pd^T dO                 Pd = P o Z, Z the dropout mask scaled by 1/(1-p)
//   dP = dO V^T
//   dS = P o (dP o Z - D)        (times 1 - tanh^2 with softcap; dbias = dS before that)
//   dK = scale dS^T Q,  dQ = scale dS K
//
// Kernels, in launch order (flash_bwd.cu):
//  1. flash_bwd_dot_do_o   D and lse in the log2 domain for every query row (float32
//                          scratch).
//  2. flash_bwd_kernel     one CTA per (key block Kj of kBlockN = 16 keys per warp, kv head, batch):
//                          Kj, Vj stay in shared memory, dKj and dVj in registers, while the
//                          CTA sweeps every query block Qi of every query head of the kv
//                          head's group (GQA: dK/dV summed on chip, never per-head copies).
//                          dQ: dS goes through shared memory and is added to a float32
//                          accumulator with atomics (the default).
//  3. deterministic mode: flash_bwd_dq_kernel, one CTA per (query block, query head, batch),
//                          sweeps the key blocks and sums dQ in registers in a fixed order
//                          (recomputing S and dP: two more GEMMs, no atomics), else
//                          flash_bwd_convert_dq scales the float32 accumulator into dq.
//  4. with dbias: flash_bwd_dbias_kernel, one CTA per tile of dbias, recomputes S, P, dP
//                          and dS for every (batch, head[, query row]) the bias broadcasts
//                          onto the tile and sums them in registers in a fixed order: no
//                          scratch but D, no atomics, so memory stays O(size of the bias)
//                          (a bias constant along the keys gets zeros instead:
//                          fmha/params.h, dbias_is_zero).
//
// The main kernel works on transposed scores, S^T = Kj Qi^T (as the CPU backward does), in one
// of two shapes (FlashBwdConfig::kTiled):
//  - 16 keys a warp (4 or 8 warps): its rows of dK and dV are mma accumulators of its own, and
//    the accumulator of S^T (keys x queries) is, re-packed in registers, the A operand of
//    dV += Pd^T dO and dK += dS^T Q -- no shared-memory round trip except dS for dQ; but each
//    warp reads all of Qi and dOi, each fragment feeding one mma pair.
//  - tiled (plain d = 64 and 128, FlashAttention-2's work split): the 8 warps tile each
//    product differently (S^T, dP^T: 4 key x 2 query groups; dV, dK: 4 key groups x 2 column
//    halves; dQ: query groups x column quarters or halves), Pd^T and dS^T going through shared
//    memory, so that each fragment loaded feeds 2-4 mma. d = 64 takes 128 queries a step, S^T
//    to dS^T in two sub-passes of 64.
//
// The strong zero of the NaN rule (cuda/strong_zero.cuh): a step or key block that may hold
// zero-weight pairs and whose streamed operand -- Qi or dOi (and the resident Kj, for the main
// kernel's dQ), Kj in the dQ kernel -- holds NaN or Inf poisons the accumulators the
// reference makes non-finite and zeroes those entries before the products. The dbias kernel
// needs nothing: dS is 0 wherever P is.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/flash_bwd.h"
#include "cuda/primitives.cuh"
#include "cuda/score.cuh"
#include "cuda/strong_zero.cuh"
#include "cuda/tile_io.cuh"

namespace fmha {
namespace gpu {

// Registers: a thread of the main kernel holds its warp's 16 x kOutDim slices of dK and dV
// (kOutDim/2 floats each: 64 + 64 at d = 128) plus S^T and dP^T for one query block
// (kBlockM/2 floats each); K and V fragments are re-read from shared memory per k-step
// rather than held (that would be another kHeadDim/2 registers each).
// d = 256 would need 256 registers for dK, dV alone: there, kSplits = 2 CTAs share a key
// block, each computing S^T and dP^T over the whole head dim (the 2 GEMMs of 5 that every
// column needs) but dK, dV, dQ for its own 128 columns.
template <int kHeadDim_, bool kExtras_>
struct FlashBwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kOutDim = kHeadDim_ > 128 ? 128 : kHeadDim_;  // dK/dV/dQ columns per CTA
  static constexpr int kSplits = kHeadDim / kOutDim;
  // Warps of 16 keys each. Every warp reads all of Qi and dOi per step (the B operands of
  // S^T, dP^T, dV, dK: each fragment feeds one mma pair) and its Kj, Vj rows (A). 8 warps
  // (the plain kernels at d = 64 and 128) share one copy of Qi and dOi between 128 keys, and
  // sum dQi over 128 keys before its atomics: per step, the copies, the barriers, the lse and
  // D loads and half the atomics are spread over twice the mma (tools/sass_report.py, slowest
  // warp, sm_80 / sm_90: 3.40 / 3.50 non-mma instructions per mma at d = 64, 2.94 / 3.02 at
  // d = 128, against 3.59 / 3.67 and 3.47 / 3.53 with 4 warps; shared bytes per mma stay
  // ~375-381, set by the one mma pair per B fragment).
  static constexpr int kWarps = !kExtras_ && (kHeadDim_ == 64 || kHeadDim_ == 128) ? 8 : 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kWarps;  // keys per CTA
  // The tiled pass (FlashAttention-2's work split; the plain d = 128 kernels): the 8 warps
  // tile S^T and dP^T 4 (keys) x 2 (queries), 32 x 32 a warp, so each Kj, Vj fragment feeds
  // two mma pairs and each Qi, dOi fragment two; P^T and dS^T go through shared memory, from
  // which the warps, 4 (keys) x 2 (head-dim halves), take dV and dK, and 2 (queries) x 4
  // (head-dim quarters) dQ: every fragment loaded feeds 2-4 mma. Else each warp owns 16 keys
  // of every product and reads all of Qi and dOi (each B fragment feeds one mma pair).
  // Plain d = 64 takes 128 queries a step in two sub-passes of 64 (kSubPasses): the step's
  // 320 mma a warp carry its fixed work (copies, barriers, dQ's atomics) as at d = 128,
  // while S^T and dP^T of one sub-pass at a time (32 registers each) leave P in float32.
  static constexpr bool kTiled = !kExtras_ && (kHeadDim_ == 64 || kHeadDim_ == 128);
  static constexpr int kWarpKeys = kTiled ? 32 : 16;          // a warp's keys of S^T, dK, dV
  static constexpr int kKeyWarps = kBlockN / kWarpKeys;       // warps along the keys
  static constexpr int kSideWarps = kWarps / kKeyWarps;       // along the queries (dims)
  static constexpr int kMTiles = kWarpKeys / 16;              // m-tiles of a warp's S^T, dK
  // Tiled: P packed to 16 bits before dP^T is formed, so that dP^T's accumulators take S^T's
  // registers (d = 128: S^T, dP^T, dK and dV at once spilled 4-56 bytes, ptxas 13.0); at
  // d = 64, where they fit, P stays float32 (unpacking it cost 32 instructions a pass).
  static constexpr bool kPackP = kTiled && kHeadDim_ >= 128;
  // Where P is packed, dP^T - D is one product, its accumulators starting at -D: the stage
  // holds -D twice per query pair, (-D_2i, -D_2i+1, -D_2i, -D_2i+1) -- a thread's C operand of
  // an n-tile as one 16-byte load (the FADD of dP - D saved per score: 32 a pass).
  static constexpr int kDWords = kPackP ? 2 : 1;  // floats of the D stage per query
  // Queries per step. 16-key warps: S^T and dP^T cost kBlockM/2 registers each on top of dK,
  // dV. At d >= 96, 64 queries spilled (ptxas 13.0, sm_80: 56-76 bytes at d = 128) and 32 did
  // too with the score pipeline of kExtras (8-56 bytes, varying with which feature was cut).
  // With 8 warps, 128 queries spilled d = 64 (36-48 bytes, sm_80 and sm_90) and 64 queries
  // d = 128 (16-124 bytes, whatever of kPointersInSmem, the dQ lanes' re-read and kDqRows was
  // cut). Tiled: 64 (a warp's 32 x 32 of S^T is 32 registers).
  static constexpr int kBlockM = kTiled && kHeadDim_ == 64 ? 128
                                 : kHeadDim_ < 96 || kTiled ? 64
                                 : (kExtras_ || kSplits > 1) ? 16
                                                             : 32;
  static constexpr int kSubPasses = kTiled ? kBlockM / 64 : 1;  // of S^T, dP^T, P, dS a step
  // Qi double-buffered; but in the tiled pass Qi has one stage and loads with dOi during dQ,
  // when no warp reads either (at d = 64, two stages of Qi beside P^T and dS^T of 128 queries:
  // ~167 KiB, over an sm_80 SM's 163 KiB). The two copies then split over the warp halves
  // (kCopyThreads): the first copies Qi, the second dOi, by one code path whose source,
  // strides and destination are selected by the half (the tiles have one shape), so that each
  // warp issues one copy's pointer, edge and step work a step, not two.
  static constexpr bool kQWithDo = kTiled;
  static constexpr int kStages = kQWithDo ? 1 : 2;
  static constexpr int kCopyThreads = kQWithDo ? kThreads / 2 : kThreads;  // of each copy
  // dOi, lse and D: double-buffered too, but in the tiled pass loaded once dV has read dOi,
  // during dQ (one stage: two did not fit an sm_80 SM's shared memory beside P^T).
  static constexpr int kDoStages = kTiled ? 1 : kStages;
  // Rows padded by 8 elements (16 bytes): 16-byte aligned row starts for ldmatrix and
  // cp.async, and the 8 rows one ldmatrix reads fall in distinct banks.
  static constexpr int kPad = 8;
  static constexpr int kStride = kHeadDim + kPad;
  using Layout = tile::Padded<kStride>;
  static constexpr int kDsStride = kBlockM + kPad;
  static constexpr int kTileQ = kBlockM * kStride, kTileKV = kBlockN * kStride;
  static constexpr int kTileDs = kBlockN * kDsStride;  // dS^T (and P^T when tiled)
  // The plain kernels keep each thread's pointers into the next step's Qi and dOi in shared
  // memory (2 per thread), moved on by a block per step: computed afresh per step, with the
  // step's head and block, they cost ~120 instructions a pass (d = 128, ptxas 13.0). Behind
  // them, what every thread reads the same (7 int64 in 8: the moves of a step, the copy's row
  // steps, the blocks per head). Where the threads copy whole blocks (not 96-wide rows).
  static constexpr bool kPointersInSmem =
      !kExtras_ && tile::FullBlock<uint16_t, kBlockM, kHeadDim, Layout, kCopyThreads>::kUsable;
  // (kQWithDo: the pointers and moves stay in registers, flash_bwd_kernel.)
  static constexpr int kPointerBytes =
      kPointersInSmem && !kQWithDo ? 2 * int(sizeof(void*)) * kThreads + 8 * int(sizeof(int64_t))
                                   : 0;
  // Kj, Vj; kStages x Qi; kDoStages x dOi; dS^T (and P^T); the pointers; kDoStages x (lse,
  // D: kDWords floats a query) of the query block; kDoStages ints (the step whose lse holds a
  // NaN).
  static constexpr size_t kSmemBytes =
      size_t(2 * kTileKV + (kStages + kDoStages) * kTileQ + (kTiled ? 2 : 1) * kTileDs) * 2 +
      kPointerBytes + size_t((1 + kDWords) * kDoStages * kBlockM) * sizeof(float) +
      kDoStages * sizeof(int);

  static_assert(kSmemBytes <= 163 * 1024, "fits an sm_80 CTA's shared memory");

  static constexpr int kNTilesS = kBlockM / 8;    // n-tiles of S^T (queries)
  // Tiled d = 64: a thread's lse and D of two n-tiles read as one 16-byte access each
  // (lse_slot); elsewhere a pair per n-tile (at d = 256 the four more registers live at once
  // spilled 4-8 bytes; at d = 128 the pairs' pass counts 22 instructions fewer on sm_90 fp16,
  // ptxas 13.0).
  static constexpr bool kLseQuads = kTiled && kHeadDim_ == 64;
  static constexpr int kWarpNTiles = kNTilesS / (kSideWarps * kSubPasses);  // ... a warp's S^T
  static constexpr int kKStepsD = kHeadDim / 16;  // k-steps over the head dim
  static constexpr int kNTilesD = kOutDim / 8;    // n-tiles of dK, dV, dQ (this CTA's columns)
  static constexpr int kWarpNTilesD = kNTilesD / kSideWarps;  // ... of a warp's dK, dV
  static constexpr int kKStepsM = kBlockM / 16;   // k-steps over queries (dV, dK)
  static constexpr int kKStepsN = kBlockN / 16;   // k-steps over keys (dQ)
  // dQ's work units: 16 queries x kDqChunk n-tiles of the head dim. A warp takes one row
  // group of 16 queries and a run of its units. One unit per warp where its accumulator (4
  // kDqChunk registers) fits beside dK and dV (kOutDim registers) within 128: then each dS^T
  // fragment a warp loads feeds kDqChunk mma and no warp loops (d <= 96 plain, d <= 64 with
  // extras; at d = 128 and 256 the wide units spilled 8-56 bytes, ptxas 13.0). Else 2 n-tiles
  // per unit (d = 96 with extras: 6 units, 1-2 per warp).
  // With 8 warps at d = 128 a warp takes kDqRows = 2 row groups instead (all 32 queries) and
  // 2 n-tiles: each Kj fragment it loads feeds 2 mma pairs, where one row group a warp reads
  // twice the Kj fragments or holds the row group's dS^T fragments (kDqHoistDs).
  // (Tiled: row groups of 32 queries x warps of 4 n-tiles each, 2 x 4 at d = 128, 4 x 2 at
  // d = 64.)
  static constexpr int kDqRows = kWarps == 8 && (kHeadDim_ == 128 || kTiled) ? 2 : 1;
  static constexpr int kDqUnitsWide = kNTilesD * (kBlockM / (16 * kDqRows)) / kWarps;
  static constexpr int kDqChunk =
      kDqRows > 1 ||
              ((kNTilesD * (kBlockM / 16)) % kWarps == 0 && kDqUnitsWide >= 2 &&
               kDqUnitsWide % 2 == 0 && kNTilesD % kDqUnitsWide == 0 &&
               kOutDim + 4 * kDqUnitsWide <= 128)
          ? kDqUnitsWide
          : 2;
  static constexpr int kDqUnits = (kBlockM / (16 * kDqRows)) * (kNTilesD / kDqChunk);
  // Whether a warp keeps its row group's dS^T fragments (kKStepsN x 4 registers) through its
  // dQ units: where it takes more than one (d = 128, d = 256 plain, d = 96 and 128 with
  // extras), but not at d = 256 with extras, where that spilled 4 bytes (ptxas 13.0, sm_80).
  static constexpr bool kDqHoistDs = kDqUnits > kWarps && !(kExtras_ && kSplits > 1);
  static_assert(!kDqHoistDs || kDqRows == 1, "hoisted dS^T fragments: one row group");

  static_assert(kBlockN == 16 * kWarps, "16 keys a warp");
  static_assert(kKeyWarps * kSideWarps == kWarps && kWarpNTiles % 2 == 0 &&
                    kWarpNTilesD % 2 == 0,
                "whole warp tiles");
  static_assert(kHeadDim % 16 == 0 && kBlockM % 16 == 0, "whole mma k-steps");
  static_assert(kNTilesS % 2 == 0 && kNTilesD % 2 == 0, "B fragments load two n-tiles per x4");
  static_assert(kNTilesD % kDqChunk == 0 && kDqChunk % 2 == 0, "whole dQ chunks");
  static_assert(kHeadDim % kOutDim == 0, "whole column splits");
};

// The deterministic dQ kernel: the forward's shape (4 warps x 16 query rows, key blocks
// streamed), with dQ accumulated in registers.
template <int kHeadDim_>
struct FlashBwdDqConfig {
  static constexpr int kHeadDim = kHeadDim_;
  // d = 256: two CTAs per query block, 128 dQ columns each (as FlashBwdConfig: S and dP
  // over the whole head dim in both), else 128 accumulator registers spilled.
  static constexpr int kOutDim = kHeadDim_ > 128 ? 128 : kHeadDim_;
  static constexpr int kSplits = kHeadDim / kOutDim;
  // 32 keys from d = 96: with 64, the d = 96 extras kernel sat at 255 registers, and the
  // strong zero's vote alone spilled it (ptxas 13.0, sm_80: 8 bytes).
  static constexpr int kBlockM = 64, kBlockN = kHeadDim_ >= 96 ? 32 : 64;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kPad = 8, kStride = kHeadDim + kPad;
  // Rows copied in order (tile::FullBlock::kPairRows off): at d = 32 the paired order spills
  // this kernel 4 bytes (ptxas 13.0, sm_80), so its cp.async stores take 2 wavefronts a phase.
  using Layout = tile::Padded<kStride, /*kPairRows=*/false>;
  static constexpr int kTileQ = kBlockM * kStride, kTileKV = kBlockN * kStride;
  // Qi, dOi once; Kj, Vj (single stage: this path trades speed for reproducibility).
  static constexpr size_t kSmemBytes = size_t(2 * kTileQ + 2 * kTileKV) * 2;
  static constexpr int kNTilesS = kBlockN / 8, kKStepsD = kHeadDim / 16;
  static constexpr int kNTilesD = kOutDim / 8, kKStepsN = kBlockN / 16;
  static_assert(kBlockM == 16 * kWarps && kNTilesS % 2 == 0 && kNTilesD % 2 == 0, "layout");
  static_assert((kBlockN * kHeadDim / 8) % kThreads == 0, "whole chunks");
};

// The dbias kernel: the dQ kernel's orientation and tile (4 warps x 16 query rows, S = Qi
// Kj^T), one kBlockM x kBlockN tile of dbias per CTA. A thread keeps S, dP and the tile's
// dbias sums in registers (kBlockN/2 floats each) next to the score pipeline's state: with
// 64 keys that spilled at d = 128 (ptxas 13.0, sm_80: 12 bytes) and took 252 registers at
// d = 96, hence 32 keys from d = 96 (twice the CTAs for a one-row bias, too).
template <int kHeadDim_>
struct FlashBwdDbiasConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64, kBlockN = kHeadDim_ >= 96 ? 32 : 64;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kPad = 8, kStride = kHeadDim + kPad;
  using Layout = tile::Padded<kStride>;
  static constexpr int kTileQ = kBlockM * kStride, kTileKV = kBlockN * kStride;
  static constexpr size_t kSmemBytes = size_t(2 * kTileQ + 2 * kTileKV) * 2;
  static constexpr int kNTilesS = kBlockN / 8, kKStepsD = kHeadDim / 16;
  static_assert(kBlockM == 16 * kWarps && kNTilesS % 2 == 0, "layout");
  // The one-row reduction's kWarps x kBlockN floats fit where Qi was.
  static_assert(kWarps * kBlockN * sizeof(float) <= kTileQ * 2, "reduction buffer");
};

// Scratch of one backward launch (flash_bwd.cu owns it). Rows of a query head are
// indexed b * seqlen_q + i (seqlen_q the maximum when varlen).
struct BwdWork {
  float* d = nullptr;         // (heads_q, batch * seqlen_q): rowsum(dO o O)
  // (heads_q, batch * seqlen_q): lse in the log2 domain, +inf for rows with no visible key
  // (lse = -inf) and rows past a varlen sequence, so that exp2(x - lse) is exactly 0 there,
  // never NaN. Read by the main kernel as D is: from lse's own strides, its row address cost
  // the warps that load it ~40 instructions a pass more than D's (d = 64, sm_90).
  float* lse2 = nullptr;
  float* dq_accum = nullptr;  // (heads_q, batch * seqlen_q, head_dim), unscaled; atomics mode
};

namespace bwd_detail {

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

// kUnsigned: the same value from unsigned products of the (non-negative) 32-bit operands,
// exact in 64 bits without their sign extensions: the tiled pass's lse, D and dQ rows, 4-8
// instructions a pass fewer (the extras kernels spilled with it, 4-40 bytes, ptxas 13.0).
template <bool kUnsigned = false>
FMHA_DEVICE int64_t work_row(const FwdParams& p, int h, int b, int i) {
  if constexpr (kUnsigned) {
    const uint64_t hb = uint64_t(uint32_t(h)) * uint32_t(p.batch) + uint32_t(b);
    return int64_t(hb * uint32_t(p.seqlen_q) + uint32_t(i));
  }
  return (int64_t(h) * p.batch + b) * p.seqlen_q + i;
}

// The query blocks [m_begin, m_end) that can see some key of [n0, n0 + kBlockN).
template <int kBlockM, int kBlockN>
FMHA_DEVICE void query_range(const FwdParams& p, const score::Seq& s, int n0, int& m_begin,
                             int& m_end) {
  const int lo = score::query_lo(p, s, n0), hi = score::query_hi(p, s, n0 + kBlockN - 1);
  if (lo > hi) {
    m_begin = m_end = 0;
    return;
  }
  m_begin = lo / kBlockM;
  m_end = hi / kBlockM + 1;
}

// The tiled pass's copy of one Qi or dOi block by a warp half (Cfg::kCopyThreads) where two
// threads share each row (d = 128: 64 rows of 16 chunks, 8 chunks a thread): thread c takes
// chunks 2k + half(c) of row row_of(c), so that its global and shared addresses are one
// pointer each plus 32 k bytes, immediates (FullBlock's chunks, rows apart, cost ~27 64-bit
// multiplies and adds a pass, ptxas 13.0). The two lanes of a row read its bytes [32 k,
// 32 k + 32) at once: whole sectors. The 8 lanes of a phase of cp.async stores take 8 rows,
// one 16-byte bank group each where a padded row is an odd number of 16-byte groups long.
// strong_zero::has_nonfinite reads back the same chunks (nonfinite); the element-wise copy of
// unaligned tensors (!vec) stays tile::load's.
template <typename T, typename Cfg>
struct RowPairCopy {
  using Layout = typename Cfg::Layout;
  static constexpr int kChunksPerRow = Cfg::kHeadDim / 8;
  static constexpr int kPerThread = kChunksPerRow / 2;
  static constexpr bool kUsable = Cfg::kQWithDo && Cfg::kCopyThreads == 128 &&
                                  Cfg::kBlockM == 64 && kChunksPerRow % 2 == 0 &&
                                  Layout::kPadded && (Layout::kStride / 8) % 2 == 1;
  // Thread c (bits 0-2: a row of 8, bit 3: the half-row, bits 4-6: the group of 8 rows; the
  // bits above, the warp half's, ignored): c / 32 * 16 + c % 32 / 16 * 8 + c % 8 as bits,
  // every row of 64 twice.
  FMHA_DEVICE static int row_of(int c) { return (c & 7) | ((c >> 1) & 0x38); }
  FMHA_DEVICE static int half(int c) { return (c >> 3) & 1; }
  // Thread c's first chunk from the block's first element (row stride ld), and in the tile.
  FMHA_DEVICE static int64_t thread_offset(int64_t ld, int c) {
    return int64_t(row_of(c)) * ld + half(c) * 8;
  }
  FMHA_DEVICE static int smem_offset(int c) { return Layout::offset(row_of(c), half(c) * 8); }
  // A block whose rows are whole (the tile's width) and 16-byte aligned: dst, src thread c's
  // first chunk in the tile and in the matrix; a row past the matrix (!row_in) is zero-filled,
  // read from `any` (a valid address) instead: one test a thread, no branch.
  FMHA_DEVICE static void load(T* dst, const T* src, bool row_in, const T* any) {
    const T* from = row_in ? src : any;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) cp_async_16(dst + 16 * k, from + 16 * k, row_in ? 16 : 0);
  }
  // An edge block (vec, columns short of the tile's): rows [0, rows) and columns [0, cols) of
  // g (its first row, stride ld) copied, the rest of the tile zero.
  FMHA_DEVICE static void load_checked(T* tile, const T* g, int64_t ld, int rows, int cols,
                                       int c) {
    const int r = row_of(c);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int col = (2 * k + half(c)) * 8;
      const int valid = r < rows && col < cols ? min(cols - col, 8) : 0;
      cp_async_16(tile + Layout::offset(r, col), valid > 0 ? g + r * ld + col : g, valid * 2);
    }
  }
  // Whether thread c's chunks of the tile hold a NaN or Inf, once its copies retired.
  FMHA_DEVICE static bool nonfinite(const T* tile, int c) {
    const T* first = tile + smem_offset(c);
    uint32_t carry = 0;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k)
      carry |= strong_zero::chunk_nonfinite_carry<T>(first + 16 * k);
    return (carry & 0x80008000u) != 0;
  }
};

// x / d and x % d for a divisor fixed through a loop: a multiply-high, an add and a shift
// instead of the ~20 instructions of a runtime integer division (Granlund & Montgomery's
// round-up method; exact for 0 <= x < 2^31 and 1 <= d < 2^31).
struct FastDivmod {
  uint32_t d, mul, shift;
  FMHA_DEVICE explicit FastDivmod(int divisor) : d(uint32_t(divisor < 1 ? 1 : divisor)), shift(0) {
    while ((uint32_t(1) << shift) < d) ++shift;  // ceil(log2 d)
    mul = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }
  FMHA_DEVICE int div(int x) const {
    const uint32_t hi = uint32_t((uint64_t(uint32_t(x)) * mul) >> 32);
    return int((hi + uint32_t(x)) >> shift);
  }
};

// Whether the tile of query rows [m0, m0 + kBlockM) x keys [n0, n0 + kBlockN) of a plain call
// (no extras) lies wholly inside both sequences and, by in_window, inside every row's window:
// then no pair of it is excluded and the kernels skip the per-pair test (FlashAttention-2's
// split of interior and edge blocks).
template <bool kExtras, typename Cfg>
FMHA_DEVICE bool inner_step(const score::Seq& s, bool in_window, int m0, int n0) {
  return !kExtras && in_window && m0 + Cfg::kBlockM <= s.sq && n0 + Cfg::kBlockN <= s.sk;
}


// S and dP of one block, in either kernel's orientation: acc_s = As Bs^T, acc_dp = Adp Bdp^T.
// The A tiles give the warp's 16 rows, the B tiles kNTilesS * 8 rows, all stored row-major
// over the head dim -- B's rows are its mma columns, so both load with plain ldmatrix. The
// main kernel passes (Kj, Vj) and (Qi, dOi) for S^T, dP^T; the dQ and dbias kernels the
// reverse for S, dP.
// A warp's tile is kMTiles x 16 rows from A row a_row0 by kNTiles x 8 from B row b_row0;
// acc[mt * kNTiles + j] is m-tile mt, n-tile j. With two m-tiles every B fragment feeds two
// mma pairs. kProducts: 1 S, 2 dP, 3 both. dp0 (where given): dP's accumulators start at
// dp0[j] in every m-tile (else at 0), its first k-step's mma taking them as C.
template <typename T, typename Cfg, int kMTiles = 1, int kNTiles = Cfg::kNTilesS,
          int kProducts = 3>
FMHA_DEVICE void s_and_dp(float (&acc_s)[kMTiles * kNTiles][4],
                          float (&acc_dp)[kMTiles * kNTiles][4], const T* a_s, const T* a_dp,
                          const T* b_s, const T* b_dp, int a_row0, int b_row0, int lane,
                          const float (*dp0)[4] = nullptr) {
#pragma unroll
  for (int j = 0; j < kMTiles * kNTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (kProducts & 1) acc_s[j][e] = 0.0f;
      if (kProducts & 2) acc_dp[j][e] = 0.0f;
    }
  // The lane's row and column offsets. (With two m-tiles, the tiled pass, as bit fields: ptxas
  // re-derives them from the thread index there and, from the signed lane, adds the signed
  // remainder's fix-ups, ~13 instructions a pass on sm_90, ptxas 13.0.)
  constexpr bool kBits = kMTiles > 1;
  const int l16 = kBits ? lane & 15 : lane % 16, l8 = kBits ? lane & 7 : lane % 8;
  const int hi16 = kBits ? (lane >> 4) & 1 : lane / 16;
  const int hi8 = kBits ? (lane >> 3) & 1 : (lane / 8) % 2;
#pragma unroll
  for (int kk = 0; kk < Cfg::kKStepsD; ++kk) {
    uint32_t fa_s[kMTiles][4], fa_dp[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int a_off = (a_row0 + mt * 16 + l16) * Cfg::kStride + kk * 16 + hi16 * 8;
      if (kProducts & 1) ldmatrix<4>(fa_s[mt], a_s + a_off);
      if (kProducts & 2) ldmatrix<4>(fa_dp[mt], a_dp + a_off);
    }
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      const int row = b_row0 + j * 8 + l8 + hi16 * 8;
      const int dim = kk * 16 + hi8 * 8;
      uint32_t b4[4];
      if (kProducts & 1) {
        ldmatrix<4>(b4, b_s + row * Cfg::kStride + dim);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
          mma_pair<T>(acc_s[mt * kNTiles + j], acc_s[mt * kNTiles + j + 1], fa_s[mt], b4);
      }
      if (kProducts & 2) {
        ldmatrix<4>(b4, b_dp + row * Cfg::kStride + dim);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          float(&d0)[4] = acc_dp[mt * kNTiles + j];
          float(&d1)[4] = acc_dp[mt * kNTiles + j + 1];
          if (kk == 0 && dp0 != nullptr) {
            const uint32_t b0[2] = {b4[0], b4[1]}, b1[2] = {b4[2], b4[3]};
            mma_m16n8k16<T>(d0, fa_dp[mt], b0, dp0[j]);
            mma_m16n8k16<T>(d1, fa_dp[mt], b1, dp0[j + 1]);
          } else {
            mma_pair<T>(d0, d1, fa_dp[mt], b4);
          }
        }
      }
    }
  }
}

}  // namespace bwd_detail

// ---------------------------------------------------------------------------- 1. D

// D[i] = sum_c dO[i][c] O[i][c], in float32: one warp per row at a time, lanes across the
// head dim, a butterfly sum. Also lse2[i] (BwdWork).
template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_dot_do_o(BwdParams p, BwdWork w) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int h = blockIdx.y, b = blockIdx.z;
  const score::Seq s = score::seq_of(p, b);
  const T* O = static_cast<const T*>(p.o) +
               score::q_base(p, s, b, p.o_batch_stride, p.o_row_stride) + h * p.o_head_stride;
  const T* dO = static_cast<const T*>(p.dout) +
                score::q_base(p, s, b, p.do_batch_stride, p.do_row_stride) + h * p.do_head_stride;
  for (int r = warp; r < 64; r += 4) {
    const int i = blockIdx.x * 64 + r;
    if (i >= p.seqlen_q) break;
    float sum = 0.0f;
    if (i < s.sq)
      for (int c = lane; c < p.head_dim_v; c += 32)
        sum += to_float(O[i * p.o_row_stride + c]) * to_float(dO[i * p.do_row_stride + c]);
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) sum += shfl_xor(sum, m);
    if (lane == 0) {
      // D - dlse: the gradient through lse folds into the per-row term (fmha/params.h).
      const int64_t lse_at = h * p.lse_head_stride +
                             score::q_base(p, s, b, p.lse_batch_stride, p.lse_row_stride) +
                             int64_t(i) * p.lse_row_stride;
      if (p.dlse && i < s.sq) sum -= static_cast<const float*>(p.dlse)[lse_at];
      w.d[bwd_detail::work_row(p, h, b, i)] = sum;
      const float l = i < s.sq ? static_cast<const float*>(p.lse)[lse_at] : -INFINITY;
      w.lse2[bwd_detail::work_row(p, h, b, i)] = l == -INFINITY ? INFINITY : l * score::kLog2e;
      // dbias of a bias constant along the keys is 0 (run_flash_bwd fills it), except that a
      // row whose lse is NaN, or that sees keys and has a non-finite D, sums to NaN.
      if (p.dbias && p.dbias_cols == 1 && i < s.sq) {  // dbias_is_zero(p), host-only
        const float L = static_cast<const float*>(p.lse)[lse_at];
        if (L != L || (L != -INFINITY && !(fabsf(sum) < INFINITY)))
          static_cast<float*>(p.dbias)[(int64_t(p.dbias_batch == 1 ? 0 : b) * p.dbias_heads +
                                        (p.dbias_heads == 1 ? 0 : h)) * p.dbias_rows +
                                       (p.dbias_rows == 1 ? 0 : i)] = NAN;
      }
    }
  }
}

// ---------------------------------------------------------------------------- 2. dK, dV (dQ)

template <typename T, typename Cfg, bool kExtras, bool kAtomicDq>
__global__ void __launch_bounds__(Cfg::kThreads, 1) flash_bwd_kernel(BwdParams p, BwdWork w,
                                                                  bool vec) {
  FMHA_DYNAMIC_SHARED(T, smem);
  T* sK = smem;                                // [kBlockN][kStride]
  T* sV = sK + Cfg::kTileKV;                   // [kBlockN][kStride]
  constexpr bool kTiled = Cfg::kTiled;
  T* sQ = sV + Cfg::kTileKV;                    // [kStages][kBlockM][kStride]
  T* sdO = sQ + Cfg::kStages * Cfg::kTileQ;     // [kDoStages][kBlockM][kStride]
  T* sdS = sdO + Cfg::kDoStages * Cfg::kTileQ;  // [kBlockN][kDsStride]: dS^T
  T* sP = sdS + Cfg::kTileDs;                   // [kBlockN][kDsStride]: P^T (tiled)
  char* sPointers = reinterpret_cast<char*>(sdS + (kTiled ? 2 : 1) * Cfg::kTileDs);
  float* sLse = reinterpret_cast<float*>(sPointers + Cfg::kPointerBytes);  // [kDoStages][kBlockM]
  float* sD = sLse + Cfg::kDoStages * Cfg::kBlockM;  // [kDoStages][kDWords * kBlockM]
  // [kDoStages]: the step whose lse (loaded into that stage) holds a NaN; older values are
  // other steps', so nothing needs clearing.
  int* sNanLse = reinterpret_cast<int*>(sD + Cfg::kDWords * Cfg::kDoStages * Cfg::kBlockM);

  // (t from the unsigned index: taken from the signed lane, with its sign fix-up, it spilled
  // 4 bytes of the d = 128 atomic-dQ kernel, ptxas 13.0.)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = int(threadIdx.x % 4);  // mma fragment coordinates
  const int n_block = blockIdx.x / Cfg::kSplits, h_kv = blockIdx.y, b = blockIdx.z;
  const int c_base = (blockIdx.x % Cfg::kSplits) * Cfg::kOutDim;  // this CTA's columns
  const int group = p.heads_q / p.heads_kv;
  const score::Seq s = score::seq_of(p, b);
  const int n0 = n_block * Cfg::kBlockN;
  if (n0 >= s.sk) return;  // varlen: past this sequence's keys (it writes nothing there)
  // Q, K, dQ, dK are head_dim wide, V, dO, dV head_dim_v: the tile holds the larger.
  const int d = p.head_dim, dv = p.head_dim_v;

  const T* K = static_cast<const T*>(p.k) +
               score::k_base(p, s, b, p.k_batch_stride, p.k_row_stride) + h_kv * p.k_head_stride;
  const T* V = static_cast<const T*>(p.v) +
               score::k_base(p, s, b, p.v_batch_stride, p.v_row_stride) + h_kv * p.v_head_stride;

  int m_begin, m_end;
  bwd_detail::query_range<Cfg::kBlockM, Cfg::kBlockN>(p, s, n0, m_begin, m_end);
  const int blocks_per_head = m_end - m_begin, steps = group * blocks_per_head;
  // Step x is query head head_of(x) of the group, query block m_begin + block_of(x, head):
  // by a multiply-high in the plain kernels; by a division in the extras kernels, where the
  // divisor's two more live registers spilled d = 256 (ptxas 13.0).
  const bwd_detail::FastDivmod per_head(kExtras ? 1 : blocks_per_head);
  auto head_of = [&](int x) { return kExtras ? x / blocks_per_head : per_head.div(x); };
  auto block_of = [&](int x, int head) {
    return x - head * (kExtras ? blocks_per_head : int(per_head.d));
  };

  // The two key rows of this thread in the accumulator layout of S^T, dK and dV: key_lo,
  // key_lo + 8, and 16 below them for a second m-tile (computed, not an array: a
  // runtime-indexed array would live in local memory). A tiled warp's queries of S^T start
  // at row q_warp of the step's block (of each sub-pass's 64), its columns of dK and dV at
  // c_base + dim0.
  const int key_row0 = (warp % Cfg::kKeyWarps) * Cfg::kWarpKeys;  // in the key block
  const int key_lo = n0 + key_row0 + g;
  const int q_warp = (warp / Cfg::kKeyWarps) * Cfg::kWarpNTiles * 8;
  const int dim0 = (warp / Cfg::kKeyWarps) * Cfg::kWarpNTilesD * 8;

  float acc_dk[Cfg::kMTiles][Cfg::kWarpNTilesD][4], acc_dv[Cfg::kMTiles][Cfg::kWarpNTilesD][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < Cfg::kWarpNTilesD; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[mt][j][e] = acc_dv[mt][j][e] = 0.0f;

  tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
      sK, K, p.k_row_stride, s.sk, d, n0, vec, tid);
  tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
      sV, V, p.v_row_stride, s.sk, dv, n0, vec, tid);
  cp_async_commit();

  // The plain kernels' Qi and dOi copies (Cfg::kPointersInSmem): each thread's pointers into
  // the next step's tiles wait in shared memory, in this thread's slots (written and read by
  // it alone; volatile, so that the compiler keeps them there). Those kernels take every step
  // in order, so each copy moves its pointers on to the head's next block, or to the next
  // head's first; a whole block (its rows inside the sequence) copies from them with no
  // address arithmetic but the row steps. What every thread adds is in `moves` (tid 0 writes
  // it before the first barrier below).
  constexpr bool kSlots = Cfg::kPointersInSmem;
  using FullQ =
      tile::FullBlock<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kCopyThreads>;
  // Where one copy takes Qi and dOi at once (kQWithDo), the pointers stay in registers
  // (copy_src) and the moves come from the params, a constant-bank operand: 13 shared
  // loads and stores a pass fewer (~3,000 bytes). There each warp half copies one tile
  // (Cfg::kCopyThreads): CopyHalf selects dOi's source, strides and destination over Qi's,
  // and the thread holds one pointer. (The half from the thread index read where it is used:
  // held from the kernel's start, it spilled the d = 128 kernel on sm_80, 10 spill loads and 4
  // stores a pass, ptxas 13.0.)
  constexpr bool kRegs = Cfg::kQWithDo;
  // Where two threads of a half share each row (d = 128): bwd_detail::RowPairCopy.
  using PairCopy = bwd_detail::RowPairCopy<T, Cfg>;
  constexpr bool kRowPairs = PairCopy::kUsable;
  struct CopyHalf {
    bool is_do;         // the half that copies dOi
    int tid;            // the thread's index in its half
    int64_t row_stride;  // of its tensor
  };
  auto copy_half = [&](unsigned t) {
    const bool is_do = t >= unsigned(Cfg::kCopyThreads);
    return CopyHalf{is_do, int(t % Cfg::kCopyThreads), is_do ? p.do_row_stride : p.q_row_stride};
  };
  const T* volatile* const slots =
      kSlots && !kRegs ? reinterpret_cast<const T* volatile*>(sPointers) + 2 * tid : nullptr;
  const T* copy_src = nullptr;  // kRegs: this thread's first chunk of the next step's tile
  // In elements, Qi's then dOi's: [0, 1] to the head's next block, [2, 3] to the next head's
  // first, [4, 5] the row step of a copy (FullBlock::kRowsPerPass rows); [6] blocks per head.
  volatile int64_t* const moves =
      kSlots && !kRegs
          ? reinterpret_cast<volatile int64_t*>(sPointers + 2 * sizeof(void*) * Cfg::kThreads)
          : nullptr;
  auto move = [&](int k) -> int64_t { return moves[k]; };
  // Row 0 of query head h in Q (dO).
  auto q_head = [&](int h) {
    return static_cast<const T*>(p.q) + score::q_base(p, s, b, p.q_batch_stride, p.q_row_stride) +
           h * p.q_head_stride;
  };
  auto do_head = [&](int h) {
    return static_cast<const T*>(p.dout) +
           score::q_base(p, s, b, p.do_batch_stride, p.do_row_stride) + h * p.do_head_stride;
  };
  static_assert(kSlots || !kRegs, "the tiled pass's copies start from copy_src");
  if constexpr (kSlots) {
    // Step 0: the group's first query head, block m_begin.
    const int64_t row0 = int64_t(m_begin) * Cfg::kBlockM;
    if constexpr (kRegs) {
      const CopyHalf c = copy_half(unsigned(tid));
      copy_src = (c.is_do ? do_head(h_kv * group) : q_head(h_kv * group)) + row0 * c.row_stride +
                 (kRowPairs ? PairCopy::thread_offset(c.row_stride, c.tid)
                            : FullQ::thread_offset(c.row_stride, c.tid));
    } else {
      slots[0] = q_head(h_kv * group) + row0 * p.q_row_stride +
                 FullQ::thread_offset(p.q_row_stride, tid);
      slots[1] = do_head(h_kv * group) + row0 * p.do_row_stride +
                 FullQ::thread_offset(p.do_row_stride, tid);
    }
    if (!kRegs && tid == 0) {
      const int64_t back = int64_t(blocks_per_head - 1) * Cfg::kBlockM;
      moves[0] = int64_t(Cfg::kBlockM) * p.q_row_stride;
      moves[1] = int64_t(Cfg::kBlockM) * p.do_row_stride;
      moves[2] = p.q_head_stride - back * p.q_row_stride;
      moves[3] = p.do_head_stride - back * p.do_row_stride;
      moves[4] = FullQ::kRowsPerPass * p.q_row_stride;
      moves[5] = FullQ::kRowsPerPass * p.do_row_stride;
      moves[6] = blocks_per_head;
    }
  }

  // Step `step` of the sweep: query head h = h_kv * group + step / blocks_per_head, query
  // block m_begin + step % blocks_per_head. Loads Qi into stage q_stage and dOi into do_stage
  // with cp.async, lse and D with plain loads. (The tiled pass: once dV and dK have read the
  // step before's, during dQ.)
  auto load_step = [&](int step, int q_stage, int do_stage) {
    const int hq = head_of(step);
    const int h = h_kv * group + hq;
    const int blk = block_of(step, hq);
    const int m0 = (m_begin + blk) * Cfg::kBlockM;
    T* const q_dst = sQ + q_stage * Cfg::kTileQ;
    T* const do_dst = sdO + do_stage * Cfg::kTileQ;
    if constexpr (kRegs) {
      const CopyHalf c = copy_half(thread_index_reread());
      T* const dst = c.is_do ? do_dst : q_dst;
      const T* const src = copy_src;
      if (kRowPairs && vec && d == Cfg::kHeadDim && dv == Cfg::kHeadDim) {
        // (Rows past the sequence, of the last block, zero-filled by the one copy path.)
        PairCopy::load(dst + PairCopy::smem_offset(c.tid), src,
                       m0 + PairCopy::row_of(c.tid) < s.sq, static_cast<const T*>(p.q));
      } else if (!kRowPairs && vec && d == Cfg::kHeadDim && dv == Cfg::kHeadDim &&
                 m0 + Cfg::kBlockM <= s.sq) {
        FullQ::load_stepping(dst + FullQ::smem_offset(c.tid), src,
                             FullQ::kRowsPerPass * c.row_stride);
      } else if (kRowPairs && vec) {  // head_dim or head_dim_v short of the tile: both tiles
        PairCopy::load_checked(dst, (c.is_do ? do_head(h) : q_head(h)) + int64_t(m0) * c.row_stride,
                               c.row_stride, s.sq - m0, c.is_do ? dv : d, c.tid);
      } else {
        tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kCopyThreads,
                   false>(dst, c.is_do ? do_head(h) : q_head(h), c.row_stride, s.sq,
                          c.is_do ? dv : d, m0, vec, c.tid);
      }
      // On to the next step: the head's next block, or the next head's first.
      const int64_t back = int64_t(blocks_per_head - 1) * Cfg::kBlockM;
      copy_src = src + (blk + 1 < blocks_per_head
                            ? Cfg::kBlockM * c.row_stride
                            : (c.is_do ? p.do_head_stride : p.q_head_stride) -
                                  back * c.row_stride);
    } else if constexpr (kSlots) {
      const T* q_src = slots[0];
      const T* do_src = slots[1];
      if (vec && d == Cfg::kHeadDim && dv == Cfg::kHeadDim && m0 + Cfg::kBlockM <= s.sq) {
        const int chunk = FullQ::smem_offset(tid);
        FullQ::load_stepping(q_dst + chunk, q_src, move(4));
        FullQ::load_stepping(do_dst + chunk, do_src, move(5));
      } else {  // (also both when only one of head_dim, head_dim_v fills the tile: a test
                // each cost 10-16 instructions a pass, and spilled d = 128 on sm_90)
        tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads, false>(
            q_dst, q_head(h), p.q_row_stride, s.sq, d, m0, vec, tid);
        tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads, false>(
            do_dst, do_head(h), p.do_row_stride, s.sq, dv, m0, vec, tid);
      }
      // On to the next step: the head's next block, or the next head's first. (After the
      // last step they point past the tensors; nothing reads them there.)
      const bool next_block = blk + 1 < int(move(6));
      slots[0] = q_src + (next_block ? move(0) : move(2));
      slots[1] = do_src + (next_block ? move(1) : move(3));
    } else {
      tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
          q_dst, q_head(h), p.q_row_stride, s.sq, d, m0, vec, tid);
      tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
          do_dst, do_head(h), p.do_row_stride, s.sq, dv, m0, vec, tid);
    }
    const int stage = do_stage;  // lse and D go with dOi
    // Where row r's lse and D sit in their stage (Cfg::kLseQuads): within each warp's
    // kWarpNTiles * 8 queries of S^T, query 8 j + 2t + e at 2 kWarpNTiles t + 2 j + e, so that
    // a thread's values of n-tiles j, j + 1 (j even) are adjacent (for_each_score).
    auto lse_slot = [](int r) {
      constexpr int kRun = Cfg::kWarpNTiles * 8;
      return Cfg::kLseQuads ? r / kRun * kRun + 2 * Cfg::kWarpNTiles * (r % 8 / 2) +
                                  2 * (r % kRun / 8) + r % 2
                            : r;
    };
    // lse in the log2 domain (BwdWork::lse2); +inf for rows past the block's sequence.
    auto load_lse = [&](int r) {
      const int i = m0 + r;
      float lse_l2 = INFINITY;
      if (i < s.sq) {
        lse_l2 = w.lse2[bwd_detail::work_row<kTiled>(p, h, b, i)];
        // NaN, or -inf from a finite lse below -2.4e38: the fast path's exp2(S - lse) would
        // not give the rule's 0 for S = -inf there.
        if (!(lse_l2 > -INFINITY)) sNanLse[stage] = step;  // (stage: dOi's)
      }
      sLse[stage * Cfg::kBlockM + lse_slot(r)] = lse_l2;
    };
    auto load_d = [&](int r) {
      const int i = m0 + r;
      const float d_i = i < s.sq ? w.d[bwd_detail::work_row<kTiled>(p, h, b, i)] : 0.0f;
      if constexpr (Cfg::kDWords == 2) {  // -D twice per query pair (Cfg::kDWords)
        float* at = sD + stage * 2 * Cfg::kBlockM + r + (r & ~1);  // 2 (r & ~1) + r % 2
        at[0] = at[2] = -d_i;
      } else {
        sD[stage * Cfg::kBlockM + lse_slot(r)] = d_i;
      }
    };
    // With 8 warps, lse and D by different warps: each warp's pass issues one of the two
    // address computations at most (the slowest warp's pass, d = 128: 57 instructions above
    // the others' with both in one warp).
    if constexpr (Cfg::kWarps == 8) {
      static_assert(2 * Cfg::kBlockM <= Cfg::kThreads, "a thread per row of each");
      if (tid < Cfg::kBlockM)
        load_lse(tid);
      else if (tid < 2 * Cfg::kBlockM)
        load_d(tid - Cfg::kBlockM);
    } else if (tid < Cfg::kBlockM) {
      load_lse(tid);
      load_d(tid);
    }
  };

  // The block-sparse mask (params.h): steps whose tile (query block, this key block) it
  // leaves empty are neither loaded nor computed. next_step(x): the first step from x on
  // that is not (x itself without the mask) -- or the empty step just before it, so that
  // steps taken alternate in parity and step % kStages stays the stage: a counter of steps
  // taken, kept through the loop, cost the kernels at ptxas's register cap a spill. (An
  // empty step taken adds exact zeros.)
  // (Batch, heads and keys are re-read from blockIdx and the params, for the same reason.)
  static_assert(Cfg::kStages == 2 || !kExtras, "steps taken alternate between two stages");
  auto next_step = [&](int x, int after) {
    if (kExtras && p.block_mask.index) {
      const int bz = int(blockIdx.z), q_head0 = int(blockIdx.y) * (p.heads_q / p.heads_kv);
      const score::Seq sb = score::seq_of(p, bz);
      while (x < steps &&
             score::tile_skipped(p, sb, bz, q_head0 + x / blocks_per_head,
                                 (m_begin + x % blocks_per_head) * Cfg::kBlockM, Cfg::kBlockM,
                                 int(blockIdx.x / Cfg::kSplits) * Cfg::kBlockN, Cfg::kBlockN))
        ++x;
      if (after >= 0 && x < steps && (x - after) % 2 == 0) --x;
    }
    return x;
  };
  if (tid < Cfg::kDoStages) sNanLse[tid] = -1;
  __syncthreads();  // before any load_step marks a stage (or reads the moves)
  const int first = next_step(0, -1);
  if (first < steps) load_step(first, first % Cfg::kStages, first % Cfg::kDoStages);
  cp_async_commit();

  const float scale_log2 = float(p.scale) * score::kLog2e;
  const uint32_t threshold = kExtras ? dropout_threshold(p.dropout_p) : 0u;
  const float keep_scale = kExtras ? float(1.0 / (1.0 - p.dropout_p)) : 1.0f;
  // The strong zero: every step may hold a zero-weight pair when a mask, a bias or dropout
  // can make one; otherwise only window edges do.
  const bool zeros_anywhere = kExtras && score::zeros_anywhere(p);
  // This thread's chunks of Kj (dQ's B operand), checked once, as soon as they landed.
  bool k_nonfinite = false;
  if (kAtomicDq) {
    cp_async_wait<1>();  // all but the newest group (the first step): Kj, Vj
    k_nonfinite = strong_zero::has_nonfinite<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout,
                                             Cfg::kThreads>(sK, vec, tid);
  }

  for (int step = first; step < steps;) {
    const int stage = step % Cfg::kStages;
    // Prefetch the next step into the other stage; its last readers (the previous step)
    // finished at the trailing __syncthreads of the previous iteration. (The next step is
    // found again at the end: held through the body, it cost registers.)
    // (Tiled, kQWithDo: nothing; Qi, dOi, lse and D load at the end of dV and dK.)
    if constexpr (Cfg::kQWithDo) {
      cp_async_wait<0>();  // Kj, Vj and this step's Qi, dOi landed
    } else {
      if (const int next = next_step(step + 1, step); next < steps)
        load_step(next, (stage + 1) % Cfg::kStages, (stage + 1) % Cfg::kDoStages);
      cp_async_commit();
      cp_async_wait<1>();  // all but the newest group: Kj, Vj and this step's Qi, dOi landed
    }

    const int hq = head_of(step);
    const int h = h_kv * group + hq;
    const int m0 = (m_begin + block_of(step, hq)) * Cfg::kBlockM;
    const int do_stage = stage % Cfg::kDoStages;
    T* tQ = sQ + stage * Cfg::kTileQ;
    T* tdO = sdO + do_stage * Cfg::kTileQ;
    // (Without a window every block is inside it: its test cost ~15 instructions a pass.)
    const bool in_window =
        (p.window_left < 0 && p.window_right < 0) ||
        score::block_inside_window(s, p.window_left, p.window_right, m0, m0 + Cfg::kBlockM - 1,
                                   n0, n0 + Cfg::kBlockN - 1);
    const bool may_zero = zeros_anywhere || !in_window;
    // ... for every thread, and lse / D too; and whether an operand of the step's products
    // holds a NaN or Inf that a zero-weight pair must not pass on (rare).
    // (kRegs: the thread's share of the one tile it copied.)
    const bool nonfinite = __syncthreads_or(
        may_zero &&
        (k_nonfinite ||
         (kRegs ? kRowPairs && vec
                      ? PairCopy::nonfinite(tid >= Cfg::kCopyThreads ? tdO : tQ,
                                            tid % Cfg::kCopyThreads)
                      : strong_zero::has_nonfinite<T, Cfg::kBlockM, Cfg::kHeadDim,
                                                   typename Cfg::Layout, Cfg::kCopyThreads>(
                            tid >= Cfg::kCopyThreads ? tdO : tQ, vec, tid % Cfg::kCopyThreads)
                : strong_zero::has_nonfinite<T, Cfg::kBlockM, Cfg::kHeadDim,
                                             typename Cfg::Layout, Cfg::kThreads>(tQ, vec, tid) ||
                      strong_zero::has_nonfinite<T, Cfg::kBlockM, Cfg::kHeadDim,
                                                 typename Cfg::Layout, Cfg::kThreads>(tdO, vec,
                                                                                      tid))));
    const float* tLse = sLse + do_stage * Cfg::kBlockM;
    const float* tD = sD + do_stage * Cfg::kDWords * Cfg::kBlockM;

    // Which score rules the step takes (the same in every sub-pass): the pair tests unless it is
    // an inner step (bwd_detail::inner_step), the test of S = -inf where its lse holds a NaN.
    const bool inner = bwd_detail::inner_step<kExtras, Cfg>(s, in_window, m0, n0);
    const bool nan_lse = sNanLse[do_stage] == step;
    // (Untiled: the accumulators of S^T and dP^T are dV's and dK's A operands, after the loop.)
    constexpr int kNT = Cfg::kWarpNTiles;
    float acc_s[Cfg::kMTiles * kNT][4], acc_dp[Cfg::kMTiles * kNT][4];
    // Sub-pass sp: queries [q_off, q_off + 8 kWarpNTiles) of the step's block for this warp.
    // (Called once per sub-pass: as a loop of one trip it spilled the d = 256 kernel with
    // extras, 4 bytes on sm_80, ptxas 13.0.)
    auto sub_pass = [&](int sp) {
      const int q_off = q_warp + sp * (Cfg::kBlockM / Cfg::kSubPasses);
      // ---- S^T = Kj Qi^T and dP^T = Vj dOi^T (keys x queries). A: the warp's 16 rows of Kj
      // (Vj), k-major as stored; B[k][n] = Qi[n][k]: Qi's rows as stored are the B columns,
      // plain ldmatrix, two n-tiles (8 queries each) x two k-halves per x4.
      // (Tiled: the warp's 32 keys x 32 queries, element [mt * kWarpNTiles + j]; S^T alone
      // here, dP^T once P is packed, below: both at once, with dK and dV, spilled.)
      bwd_detail::s_and_dp<T, Cfg, Cfg::kMTiles, kNT, Cfg::kPackP ? 1 : 3>(
          acc_s, acc_dp, sK, sV, tQ, tdO, key_row0, q_off, lane);

      // ---- P, then dS = P o (dP o Z - D) into acc_dp and Pd = P o Z into acc_s. Element
      // (j, e) is key keys[e / 2], query m0 + j * 8 + 2t + e % 2.
      // (Each element has its own dropout draw: the two keys of a thread are 8 apart, in
      // different draws of four.)
      const float slope = kExtras ? float(score::alibi_slope(p, b, h)) : 0.0f;
      // f(j, e, lse, D) for each of the thread's scores (element e of n-tile j, key key_lo + 8
      // (e / 2), query m0 + 8 j + 2t + e % 2): the thread's two queries of an n-tile are
      // adjacent, so their lse and D are read as one pair each (tiled: those of two n-tiles
      // as one 16-byte access, Cfg::kLseQuads).
      // (Element (mt * kNT + j, e) of a tiled warp: key key_lo + 16 mt + 8 (e / 2), query m0 +
      // q_off + 8 j + 2t + e % 2; lse and D are read once for both m-tiles.)
      auto for_each_score = [&](auto&& f) {
        auto for_tile = [&](int j, FloatPair lse2, FloatPair d2) {
#pragma unroll
          for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              f(mt * kNT + j, e, key_lo + 16 * mt + 8 * (e / 2),
                m0 + q_off + j * 8 + 2 * t + e % 2, e % 2 ? lse2.y : lse2.x,
                e % 2 ? d2.y : d2.x);
        };
        if constexpr (Cfg::kLseQuads) {
#pragma unroll
          for (int j = 0; j < kNT; j += 2) {
            const int at = q_off + 2 * kNT * t + 2 * j;  // lse_slot(q_off + 8 j + 2t)
            const FloatPairs lse4 = *reinterpret_cast<const FloatPairs*>(tLse + at);
            const FloatPairs d4 = *reinterpret_cast<const FloatPairs*>(tD + at);
            for_tile(j, lse4.lo, d4.lo);
            for_tile(j + 1, lse4.hi, d4.hi);
          }
        } else {
          // (Where the D stage holds -D quads, Cfg::kDWords == 2, dP - D comes from the
          // product and f's D is NaN: read by no one, as it must not be.)
#pragma unroll
          for (int j = 0; j < kNT; ++j)
            for_tile(j, *reinterpret_cast<const FloatPair*>(tLse + q_off + j * 8 + 2 * t),
                     Cfg::kDWords == 1
                         ? *reinterpret_cast<const FloatPair*>(tD + q_off + j * 8 + 2 * t)
                         : FloatPair{NAN, NAN});
        }
      };
      // kInner: a plain step whose rows and keys all lie inside the sequences and the window
      // (bwd_detail::inner_step): no pair to test.
      auto scores = [&](auto inner) {
        constexpr bool kInner = decltype(inner)::value;
        for_each_score([&](int j, int e, int key, int i, float lse_i, float d_i) {
          bool visible = kInner || score::visible(p, s, i, key);
          float x;
          [[maybe_unused]] float dcap = 1.0f;  // read only by the extras
          if constexpr (kExtras)
            x = score::logit_log2(p, s, acc_s[j][e], b, h, i, key, slope, visible, dcap);
          else
            x = acc_s[j][e] * scale_log2;
          // P = 0 where S = -inf, also in a NaN row; dS = 0 where P = 0 (docs/semantics.md).
          // Plain: the exponent as one FFMA, as scores_fast takes it.
          const float arg = kExtras ? x - lse_i : fmaf(acc_s[j][e], scale_log2, -lse_i);
          const float prob = visible && x != -INFINITY ? exp2_approx(arg) : 0.0f;
          float dp = acc_dp[j][e], pd = prob;
          if (kExtras && p.dropout_p > 0.0) {
            const bool keep = visible && score::dropout_keep(p, threshold, b, h, i, key);
            dp = keep ? dp * keep_scale : 0.0f;
            pd = keep ? prob * keep_scale : 0.0f;
          }
          float ds = prob == 0.0f ? 0.0f : prob * (dp - d_i);
          if constexpr (kExtras) ds = prob == 0.0f ? 0.0f : ds * dcap;
          acc_s[j][e] = pd;
          acc_dp[j][e] = ds;
        });
      };
      // A plain step with no pair to test and no NaN lse, as FlashAttention-2 computes it: P =
      // exp2(S scale - lse) in one FFMA, dS = P (dP - D) but 0 where P is -- the rule above
      // without its test of S = -inf, which exp2(-inf - lse) already makes 0 when lse is not NaN
      // (lse is finite or +inf: a row with no visible key).
      // The test of P = 0 is left to the rare thread that needs it: P (dP - D) differs from
      // the rule's 0 where P = 0 only when dP - D is not finite, and is NaN there (else it is
      // +-0: the same value); one unordered compare finds a NaN in two scores (96 instructions
      // a pass fewer than a test and select per score at d = 64).
      auto scores_fast = [&] {
        bool nan_ds = false;
        for_each_score([&](int j, int e, int, int, float lse_i, float d_i) {
          const float prob = exp2_approx(fmaf(acc_s[j][e], scale_log2, -lse_i));
          acc_s[j][e] = prob;
          acc_dp[j][e] = prob * (acc_dp[j][e] - d_i);
          if (e % 2) nan_ds |= acc_dp[j][e - 1] != acc_dp[j][e - 1] || acc_dp[j][e] != acc_dp[j][e];
        });
        if (nan_ds) {
#pragma unroll
          for (int jj = 0; jj < Cfg::kMTiles * kNT; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[jj][e] = acc_s[jj][e] == 0.0f ? 0.0f : acc_dp[jj][e];
        }
      };
      // Element (j, e) of P^T (dS^T): half e % 2 of word e / 2 of packed row pair j; rows
      // key_row0 + 16 mt + g (+ 8) of the tile, columns q_off + 8 j + 2t (+ 1).
      auto store_t = [&](T* tile, int jj, uint32_t lo, uint32_t hi) {
        const int mt = jj / kNT, j = jj % kNT;
        T* at = tile + (key_row0 + mt * 16 + g) * Cfg::kDsStride + q_off + j * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(at) = lo;
        *reinterpret_cast<uint32_t*>(at + 8 * Cfg::kDsStride) = hi;
      };
      if constexpr (Cfg::kPackP) {
        // P (the plain rules of `scores`), packed to 16-bit pairs -- the A operand of dV as it
        // goes to shared memory, and the P of dS = P o (dP - D) below -- so that dP^T's
        // accumulators replace S^T's. (dS from the rounded P, as a low-precision softmax
        // backward takes it.) kTest: the pair tests of a step that needs them.
        auto probs = [&](auto test_visible, auto test_inf) {
          constexpr bool kVisible = decltype(test_visible)::value;
          constexpr bool kInf = decltype(test_inf)::value;
          for_each_score([&](int j, int e, int key, int i, float lse_i, float) {
            const bool visible = !kVisible || score::visible(p, s, i, key);
            const bool finite = !kInf || acc_s[j][e] * scale_log2 != -INFINITY;
            const float prob = exp2_approx(fmaf(acc_s[j][e], scale_log2, -lse_i));
            acc_s[j][e] = visible && finite ? prob : 0.0f;
          });
        };
        if (!inner)
          probs(std::true_type{}, std::true_type{});
        else if (nan_lse)
          probs(std::false_type{}, std::true_type{});
        else
          probs(std::false_type{}, std::false_type{});
        uint32_t p_pack[Cfg::kMTiles * kNT][2];
#pragma unroll
        for (int jj = 0; jj < Cfg::kMTiles * kNT; ++jj) {
          p_pack[jj][0] = pack2<T>(acc_s[jj][0], acc_s[jj][1]);
          p_pack[jj][1] = pack2<T>(acc_s[jj][2], acc_s[jj][3]);
          store_t(sP, jj, p_pack[jj][0], p_pack[jj][1]);
        }
        // dP^T - D as one product: its accumulators start at -D (Cfg::kDWords).
        float minus_d[kNT][4];
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          const FloatPairs d4 =
              *reinterpret_cast<const FloatPairs*>(tD + 2 * (q_off + j * 8 + 2 * t));
          minus_d[j][0] = d4.lo.x;
          minus_d[j][1] = d4.lo.y;
          minus_d[j][2] = d4.hi.x;
          minus_d[j][3] = d4.hi.y;
        }
        bwd_detail::s_and_dp<T, Cfg, Cfg::kMTiles, kNT, 2>(acc_s, acc_dp, sK, sV, tQ, tdO,
                                                           key_row0, q_off, lane, minus_d);
        // dS = P (dP - D), 0 where P is (also against a non-finite dP or D), as scores_fast
        // takes it: without the per-score test, NaN only where P = 0 meets a non-finite
        // dP - D; one unordered compare per two scores finds it, and only then (rare) are the
        // P = 0 entries of the packed dS set to 0. (An exact 0 from P = 0 may be -0 here: the
        // same value in every sum it enters.)
        bool nan_ds = false;
#pragma unroll
        for (int j = 0; j < Cfg::kMTiles * kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const FloatPair prob2 = unpack2<T>(p_pack[j][e / 2]);
            acc_dp[j][e] = (e % 2 ? prob2.y : prob2.x) * acc_dp[j][e];  // P (dP - D)
            if (e % 2)
              nan_ds |= acc_dp[j][e - 1] != acc_dp[j][e - 1] || acc_dp[j][e] != acc_dp[j][e];
          }
        uint32_t ds_pack[Cfg::kMTiles * kNT][2];
#pragma unroll
        for (int jj = 0; jj < Cfg::kMTiles * kNT; ++jj) {
          ds_pack[jj][0] = pack2<T>(acc_dp[jj][0], acc_dp[jj][1]);
          ds_pack[jj][1] = pack2<T>(acc_dp[jj][2], acc_dp[jj][3]);
        }
        if (nan_ds) {
#pragma unroll
          for (int jj = 0; jj < Cfg::kMTiles * kNT; ++jj)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
              const uint32_t pw = p_pack[jj][k];
              ds_pack[jj][k] &= ((pw & 0x7FFFu) == 0 ? 0xFFFF0000u : 0xFFFFFFFFu) &
                                ((pw & 0x7FFF0000u) == 0 ? 0x0000FFFFu : 0xFFFFFFFFu);
            }
        }
#pragma unroll
        for (int jj = 0; jj < Cfg::kMTiles * kNT; ++jj)
          store_t(sdS, jj, ds_pack[jj][0], ds_pack[jj][1]);
      } else {
        if (!inner)
          scores(std::false_type{});
        else if (kExtras || nan_lse)
          scores(std::true_type{});
        else
          scores_fast();
        if constexpr (kTiled) {  // Pd^T and dS^T to shared memory
#pragma unroll
          for (int jj = 0; jj < Cfg::kMTiles * kNT; ++jj) {
            store_t(sP, jj, pack2<T>(acc_s[jj][0], acc_s[jj][1]),
                    pack2<T>(acc_s[jj][2], acc_s[jj][3]));
            store_t(sdS, jj, pack2<T>(acc_dp[jj][0], acc_dp[jj][1]),
                    pack2<T>(acc_dp[jj][2], acc_dp[jj][3]));
          }
        }
      }
    };
    static_assert(Cfg::kSubPasses <= 2, "one or two sub-passes");
    sub_pass(0);
    if constexpr (Cfg::kSubPasses > 1) sub_pass(1);

    // ---- the strong zero, in a step whose operands hold NaN or Inf: dV (dK) becomes NaN where
    // a pair that takes part meets one in dOi (Qi); dropped pairs take part in dK and dQ, not
    // in dV. Then those entries become 0, once every warp has formed S^T and dP^T from them.
    // (Poisoning before S^T, where fewer registers are live, spilled the d = 256 kernel with
    // extras and atomic dQ on sm_90: ptxas 13.0, 4 bytes.)
    if (nonfinite) {
      auto takes_part = [&](int r, int k, bool dropout) {
        const int i = m0 + k, key = key_lo + 8 * r;
        return score::included<kExtras>(p, s, b, h, i, key) &&
               !(dropout && !score::dropout_keep(p, threshold, b, h, i, key));
      };
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        strong_zero::poison<T, Cfg::kWarpNTilesD, Cfg::kBlockM, typename Cfg::Layout>(
            acc_dv[mt], tdO, c_base + dim0, t, [&](int r, int k) {
              return takes_part(r + 2 * mt, k, kExtras && p.dropout_p > 0.0);
            });
        strong_zero::poison<T, Cfg::kWarpNTilesD, Cfg::kBlockM, typename Cfg::Layout>(
            acc_dk[mt], tQ, c_base + dim0, t,
            [&](int r, int k) { return takes_part(r + 2 * mt, k, false); });
      }
      __syncthreads();  // every warp has read the raw Qi, dOi
      strong_zero::sanitise<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout,
                            Cfg::kThreads>(tQ, tid);
      strong_zero::sanitise<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout,
                            Cfg::kThreads>(tdO, tid);
      __syncthreads();
    }

    // ---- dV += Pd^T dOi, dK += dS^T Qi.
    if constexpr (kTiled) {
      // The warp's kWarpKeys keys x kWarpNTilesD n-tiles from column dim0: A = P^T (dS^T)
      // from shared memory, plain ldmatrix (keys are its rows); B[k][n] = dOi[k][n] (Qi):
      // row-major queries x dims, ldmatrix.trans. Each B fragment feeds kMTiles mma pairs.
      __syncthreads();  // P^T, dS^T of every warp (and the strong zero's Qi, dOi) in place
      // The lanes' rows and columns from the thread index read anew: derived from the
      // kernel's first read, ptxas held them through the pass and spilled (ptxas 13.0).
      const unsigned kv_tid = thread_index_reread();
      const int kv_lane = int(kv_tid % 32), kv_warp = int(kv_tid / 32);
      const int kv_row0 = (kv_warp % Cfg::kKeyWarps) * Cfg::kWarpKeys;
      const int kv_dim0 = (kv_warp / Cfg::kKeyWarps) * Cfg::kWarpNTilesD * 8;
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsM; ++kk) {
        uint32_t p_frag[Cfg::kMTiles][4], ds_frag[Cfg::kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
          const int at = (kv_row0 + mt * 16 + kv_lane % 16) * Cfg::kDsStride + kk * 16 +
                         (kv_lane / 16) * 8;
          ldmatrix<4>(p_frag[mt], sP + at);
          ldmatrix<4>(ds_frag[mt], sdS + at);
        }
#pragma unroll
        for (int j = 0; j < Cfg::kWarpNTilesD; j += 2) {
          const int q = kk * 16 + (kv_lane % 8) + ((kv_lane / 8) % 2) * 8;
          const int dim = c_base + kv_dim0 + j * 8 + (kv_lane / 16) * 8;
          uint32_t b4[4];
          ldmatrix<4, true>(b4, tdO + q * Cfg::kStride + dim);
#pragma unroll
          for (int mt = 0; mt < Cfg::kMTiles; ++mt)
            mma_pair<T>(acc_dv[mt][j], acc_dv[mt][j + 1], p_frag[mt], b4);
          ldmatrix<4, true>(b4, tQ + q * Cfg::kStride + dim);
#pragma unroll
          for (int mt = 0; mt < Cfg::kMTiles; ++mt)
            mma_pair<T>(acc_dk[mt][j], acc_dk[mt][j + 1], ds_frag[mt], b4);
        }
      }
      // Every warp is done with Qi and dOi: the next step's Qi, dOi, lse and D load during dQ
      // (each warp half copies one tile, each warp reads both after the next step's first
      // barrier).
      __syncthreads();
      if (const int next = next_step(step + 1, step); next < steps)
        load_step(next, (stage + 1) % Cfg::kStages, (stage + 1) % Cfg::kDoStages);
      cp_async_commit();
    } else {
      // The accumulators of n-tiles 2k, 2k+1 are the A fragment of k-step k (keys g / g+8,
      // queries 2t.. / 2t+8..): converted in registers. B[k][n] = dOi[k][n] (Qi): row-major
      // queries x dims, ldmatrix.trans.
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsM; ++kk) {
        uint32_t p_frag[4], ds_frag[4];
        a_frag_from_acc<T>(p_frag, acc_s[2 * kk], acc_s[2 * kk + 1]);
        a_frag_from_acc<T>(ds_frag, acc_dp[2 * kk], acc_dp[2 * kk + 1]);
        if constexpr (kAtomicDq) {
          // dS^T for the dQ product below, in the same packed form.
          T* row_lo = sdS + (warp * 16 + g) * Cfg::kDsStride + kk * 16 + 2 * t;
          T* row_hi = row_lo + 8 * Cfg::kDsStride;
          *reinterpret_cast<uint32_t*>(row_lo) = ds_frag[0];
          *reinterpret_cast<uint32_t*>(row_hi) = ds_frag[1];
          *reinterpret_cast<uint32_t*>(row_lo + 8) = ds_frag[2];
          *reinterpret_cast<uint32_t*>(row_hi + 8) = ds_frag[3];
        }
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesD; j += 2) {
          const int q = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          const int dim = c_base + j * 8 + (lane / 16) * 8;
          uint32_t b4[4];
          ldmatrix<4, true>(b4, tdO + q * Cfg::kStride + dim);
          mma_pair<T>(acc_dv[0][j], acc_dv[0][j + 1], p_frag, b4);
          ldmatrix<4, true>(b4, tQ + q * Cfg::kStride + dim);
          mma_pair<T>(acc_dk[0][j], acc_dk[0][j + 1], ds_frag, b4);
        }
      }
    }

    if constexpr (kAtomicDq) {
      if constexpr (!kTiled) __syncthreads();  // dS^T of every warp is in shared memory
      // ---- dQi += dS Kj.
      // Each warp owns one 16-query row group of dQi and a run of its column chunks (kDqChunk
      // n-tiles of the head dim each; one chunk per warp where the accumulator fits). Where a
      // warp takes several (Cfg::kDqHoistDs), the row group's dS fragments, its two row
      // addresses and the edge test are taken once for all of them; else in the chunk. (What is
      // held where is what kept every build free of spills, ptxas 13.0.)
      float* dq_rows = w.dq_accum + bwd_detail::work_row<kTiled>(p, h, b, 0) * d;
      constexpr int kChunks = Cfg::kNTilesD / Cfg::kDqChunk;
      constexpr int kRowGroups = Cfg::kBlockM / (16 * Cfg::kDqRows);  // of a warp's rows
      static_assert(Cfg::kWarps % kRowGroups == 0, "whole warps per row group");
      constexpr int kWarpsPerGroup = Cfg::kWarps / kRowGroups;
      static_assert(kChunks >= kWarpsPerGroup, "a chunk for every warp");
      // The warp's chunks [c_begin, c_end): all kPerWarp of them where they divide evenly.
      constexpr bool kEven = kChunks % kWarpsPerGroup == 0;
      constexpr int kPerWarp = (kChunks + kWarpsPerGroup - 1) / kWarpsPerGroup;
      // (A constant q0 where there is one row group: it kept d = 256 with extras free of spills
      // and spilled d = 128 with extras.)
      constexpr bool kOneGroup = kRowGroups == 1 && !Cfg::kDqHoistDs;
      const int q0 = kOneGroup ? 0 : (warp / kWarpsPerGroup) * 16 * Cfg::kDqRows;
      const int w_in = kOneGroup ? warp : warp % kWarpsPerGroup;
      const int c_begin = kEven ? w_in * kPerWarp : w_in * kChunks / kWarpsPerGroup;
      const int c_end = kEven ? c_begin + kPerWarp : (w_in + 1) * kChunks / kWarpsPerGroup;
      // The thread's two rows: one address each, its columns at constant offsets from them.
      // Every add is issued: in a step whose block reaches past the sequence or whose tile is
      // wider than the head dim, a row or column outside adds 0 to a valid element of the
      // sequence's last row (x + 0 is x, but for a -0 -- a flushed negative subnormal -- that
      // becomes +0: the same value). A guarded add (atomicAdd, or a predicated red) compiled
      // to a branch and a reconvergence barrier per add. (Unused, and so not computed, where
      // the chunk takes them itself.)
      const int i_lo = m0 + q0 + g;
      const bool lo_in = i_lo < s.sq, hi_in = i_lo + 8 < s.sq;
      const bool inside = m0 + Cfg::kBlockM <= s.sq && c_base + Cfg::kOutDim <= d;
      float* const dq_lo = dq_rows + int64_t(lo_in ? i_lo : s.sq - 1) * d;
      float* const dq_hi = dq_rows + int64_t(hi_in ? i_lo + 8 : s.sq - 1) * d;
      // A[q][key] = dS^T[key][q] for the row group: ldmatrix.trans from dS^T (lanes address
      // its key rows).
      const T* ds_rows =
          sdS + ((lane % 8) + (lane / 16) * 8) * Cfg::kDsStride + q0 +
          ((lane / 8) % 2) * 8;
      uint32_t a_ds[Cfg::kDqHoistDs ? Cfg::kKStepsN : 1][4];
      if constexpr (Cfg::kDqHoistDs) {
#pragma unroll
        for (int kk = 0; kk < Cfg::kKStepsN; ++kk)
          ldmatrix<4, true>(a_ds[kk], ds_rows + kk * 16 * Cfg::kDsStride);
      }
      // Two copies of the chunks: a step with a non-finite operand (nonfinite) poisons dQ where
      // a pair that takes part meets a NaN or Inf of Kj and multiplies by Kj's fragments with
      // those entries 0 (Kj stays raw in shared memory: later steps' S^T reads it).
      auto dq_units = [&](auto strong_zero_tag) {
        constexpr bool kStrongZero = decltype(strong_zero_tag)::value;
        auto dq_chunk = [&](int c) {
          const int col0 = c_base + c * Cfg::kDqChunk * 8;  // the chunk's first column
          constexpr int kRows = Cfg::kDqRows;
          float acc_q[kRows][Cfg::kDqChunk][4];
#pragma unroll
          for (int rg = 0; rg < kRows; ++rg)
#pragma unroll
            for (int j = 0; j < Cfg::kDqChunk; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc_q[rg][j][e] = 0.0f;
          if constexpr (kStrongZero) {
#pragma unroll
            for (int rg = 0; rg < kRows; ++rg)
              strong_zero::poison<T, Cfg::kDqChunk, Cfg::kBlockN, typename Cfg::Layout>(
                  acc_q[rg], sK, col0, t, [&](int r, int k) {
                    return score::included<kExtras>(p, s, b, h, m0 + q0 + 16 * rg + g + 8 * r,
                                                    n0 + k);
                  });
          }
          // B[key][dim] = Kj[key][dim]: row-major, ldmatrix.trans.
          const T* k_chunk = sK + ((lane % 8) + ((lane / 8) % 2) * 8) * Cfg::kStride +
                             col0 + (lane / 16) * 8;
#pragma unroll
          for (int kk = 0; kk < Cfg::kKStepsN; ++kk) {
            // One A fragment per row group, each B fragment shared by the kRows of them.
            uint32_t a_kk[kRows][4];
            if constexpr (!Cfg::kDqHoistDs) {
#pragma unroll
              for (int rg = 0; rg < kRows; ++rg)
                ldmatrix<4, true>(a_kk[rg], ds_rows + kk * 16 * Cfg::kDsStride + 16 * rg);
            }
#pragma unroll
            for (int j = 0; j < Cfg::kDqChunk; j += 2) {
              uint32_t b4[4];
              ldmatrix<4, true>(b4, k_chunk + kk * 16 * Cfg::kStride + j * 8);
              if constexpr (kStrongZero) {
#pragma unroll
                for (int r = 0; r < 4; ++r) b4[r] = strong_zero::finite_pair<T>(b4[r]);
              }
#pragma unroll
              for (int rg = 0; rg < kRows; ++rg) {
                const uint32_t(&a)[4] =
                    Cfg::kDqHoistDs ? a_ds[Cfg::kDqHoistDs ? kk : 0] : a_kk[rg];
                mma_pair<T>(acc_q[rg][j], acc_q[rg][j + 1], a, b4);
              }
            }
          }
          const int col = col0 + 2 * t;  // the thread's first column
          // The adds from row addresses lo, hi that include col.
          auto add_all = [&](auto inside_tag, const float(&acc)[Cfg::kDqChunk][4], float* lo,
                             float* hi, bool lo_ok, bool hi_ok) {
            constexpr bool kInside = decltype(inside_tag)::value;  // every row and column
#pragma unroll
            for (int j = 0; j < Cfg::kDqChunk; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int dc = j * 8 + (e % 2);  // the column, from col
                const bool col_in = kInside || col + dc < d;
                const bool in = kInside || ((e / 2 ? hi_ok : lo_ok) && col_in);
                float* const row = e / 2 ? hi : lo;
                atomic_add(col_in ? row + dc : row - col + (d - 1), in ? acc[j][e] : 0.0f);
              }
          };
          // Tiled, a block inside the sequence and a head dim filling the tile (d = kOutDim):
          // the thread's rows lie a constant number of floats apart, so that every add
          // takes a constant offset from one address (the generic adds cost ~60 address
          // instructions a pass, 4 rows each found and clamped). The row's offset from the
          // head's first in 32 bits, up to 2^24 rows (the 64-bit product spilled the fp16 sm_90 or
          // the bf16 kernel, ptxas 13.0); longer sequences take the generic adds. The head's
          // first row as one 32 x 32-bit product, (h, b) by the rows' span (the generic adds'
          // 64-bit row base cost 12 more instructions a pass on sm_90).
          constexpr bool kOneAddress = kTiled && Cfg::kSplits == 1;
          if (kOneAddress && m0 + Cfg::kBlockM <= s.sq && Cfg::kOutDim <= d &&
              p.seqlen_q <= (1 << 24)) {
            float* const at =
                w.dq_accum +
                uint64_t(uint32_t(h * p.batch + b)) * (uint32_t(p.seqlen_q) * Cfg::kOutDim) +
                (uint32_t(m0 + q0 + g) * Cfg::kOutDim + uint32_t(col));
#pragma unroll
            for (int rg = 0; rg < kRows; ++rg)
#pragma unroll
              for (int j = 0; j < Cfg::kDqChunk; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                  atomic_add(at + (16 * rg + 8 * (e / 2)) * Cfg::kOutDim + j * 8 + e % 2,
                             acc_q[rg][j][e]);
          } else if constexpr (Cfg::kDqHoistDs) {
            if (inside)
              add_all(std::true_type{}, acc_q[0], dq_lo + col, dq_hi + col, lo_in, hi_in);
            else
              add_all(std::false_type{}, acc_q[0], dq_lo + col, dq_hi + col, lo_in, hi_in);
          } else {
#pragma unroll
            for (int rg = 0; rg < kRows; ++rg) {
              const int i0 = m0 + q0 + 16 * rg + g;
              const bool lo_ok = i0 < s.sq, hi_ok = i0 + 8 < s.sq;
              float* const lo = dq_rows + int64_t(lo_ok ? i0 : s.sq - 1) * d + col;
              float* const hi = dq_rows + int64_t(hi_ok ? i0 + 8 : s.sq - 1) * d + col;
              if (m0 + Cfg::kBlockM <= s.sq && c_base + Cfg::kOutDim <= d)
                add_all(std::true_type{}, acc_q[rg], lo, hi, lo_ok, hi_ok);
              else
                add_all(std::false_type{}, acc_q[rg], lo, hi, lo_ok, hi_ok);
            }
          }
        };
        if constexpr (kPerWarp == 1) {
          dq_chunk(c_begin);
        } else {
#pragma unroll 1
          for (int c = c_begin; c < c_end; ++c) dq_chunk(c);
        }
      };
      if (nonfinite)
        dq_units(std::true_type{});
      else
        dq_units(std::false_type{});
    }
    // Every warp is done with this stage (and dS^T) before the next prefetch overwrites it.
    // (Tiled: the barrier after dV and dK saw to the stage; dS^T is next written after the
    // next step's first barrier.)
    if constexpr (!kTiled) __syncthreads();
    step = next_step(step + 1, step);
  }
  cp_async_wait<0>();  // Kj, Vj when there was no step; the trailing empty group otherwise

  // ---- dK = scale dS^T Q, dV: this thread's rows key_lo, key_lo + 8.
  // (Tiled: the sequence found again -- its first key row, held through the sweep, spilled.)
  const score::Seq se = kTiled ? score::seq_of(p, int(blockIdx.z)) : s;
  T* dK = static_cast<T*>(p.dk) + score::k_base(p, se, b, p.dk_batch_stride, p.dk_row_stride) +
          h_kv * p.dk_head_stride;
  T* dV = static_cast<T*>(p.dv) + score::k_base(p, se, b, p.dv_batch_stride, p.dv_row_stride) +
          h_kv * p.dv_head_stride;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
    tile::store_acc<T>(dK, p.dk_row_stride, acc_dk[mt], key_lo + 16 * mt, s.sk, c_base + dim0, d,
                       t, float(p.scale));
    tile::store_acc<T>(dV, p.dv_row_stride, acc_dv[mt], key_lo + 16 * mt, s.sk, c_base + dim0,
                       dv, t, 1.0f);
  }
}

// ---------------------------------------------------------------------------- 3. dQ

// Deterministic dQ: per (query block, query head, batch), dQi = scale sum_j dS_ij Kj over key
// blocks in order, in registers. S = Qi Kj^T and dP = dOi Vj^T as the forward forms S; the
// dS accumulator is the A operand of dS Kj (Kj via ldmatrix.trans), as P of P V in the forward.
// With kExtras, and plain from d = 96, the launch bounds say two CTAs per SM, which those
// configs reach: left to choose, ptxas squeezed some of them (extras d = 32; plain d = 96 and
// 128 on sm_80 once the strong zero was in) to 168 registers for a third CTA and spilled. Other plain
// configs are left unspecified (0): they reach three CTAs at d = 32, and at d = 64 on sm_90.
template <typename T, typename Cfg, bool kExtras>
__global__ void __launch_bounds__(Cfg::kThreads, kExtras || Cfg::kHeadDim >= 96 ? 2 : 0)
    flash_bwd_dq_kernel(BwdParams p, BwdWork w, bool vec) {
  FMHA_DYNAMIC_SHARED(T, smem);
  T* sQ = smem;
  T* sdO = sQ + Cfg::kTileQ;
  T* sK = sdO + Cfg::kTileQ;
  T* sV = sK + Cfg::kTileKV;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int m_block = blockIdx.x / Cfg::kSplits, h = blockIdx.y, b = blockIdx.z;
  const int c_base = (blockIdx.x % Cfg::kSplits) * Cfg::kOutDim;  // this CTA's dQ columns
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const score::Seq s = score::seq_of(p, b);
  const int m0 = m_block * Cfg::kBlockM;
  if (m0 >= s.sq) return;
  const int d = p.head_dim, dv = p.head_dim_v;

  const T* Q = static_cast<const T*>(p.q) +
               score::q_base(p, s, b, p.q_batch_stride, p.q_row_stride) + h * p.q_head_stride;
  const T* dO = static_cast<const T*>(p.dout) +
                score::q_base(p, s, b, p.do_batch_stride, p.do_row_stride) + h * p.do_head_stride;
  const T* K = static_cast<const T*>(p.k) +
               score::k_base(p, s, b, p.k_batch_stride, p.k_row_stride) + h_kv * p.k_head_stride;
  const T* V = static_cast<const T*>(p.v) +
               score::k_base(p, s, b, p.v_batch_stride, p.v_row_stride) + h_kv * p.v_head_stride;

  const int left = p.window_left, right = p.window_right;
  int n_begin, n_end;
  score::key_blocks<Cfg::kBlockN>(s, left, right, m0, m0 + Cfg::kBlockM - 1, n_begin, n_end);

  // This thread's query rows row_lo and row_lo + 8, with their lse (log2 domain, +inf for
  // rows without a visible key or past the sequence: P = 0 there) and D.
  const int row_lo = m0 + warp * 16 + g;
  float lse_lo = INFINITY, lse_hi = INFINITY, d_lo = 0.0f, d_hi = 0.0f;
  {
    const float* lse = static_cast<const float*>(p.lse) + h * p.lse_head_stride +
                       score::q_base(p, s, b, p.lse_batch_stride, p.lse_row_stride);
    auto lse_l2 = [&](int i) {
      const float l = lse[int64_t(i) * p.lse_row_stride];
      return l == -INFINITY ? INFINITY : l * score::kLog2e;
    };
    if (row_lo < s.sq) {
      lse_lo = lse_l2(row_lo);
      d_lo = w.d[bwd_detail::work_row(p, h, b, row_lo)];
    }
    if (row_lo + 8 < s.sq) {
      lse_hi = lse_l2(row_lo + 8);
      d_hi = w.d[bwd_detail::work_row(p, h, b, row_lo + 8)];
    }
  }

  float acc_dq[Cfg::kNTilesD][4];
#pragma unroll
  for (int j = 0; j < Cfg::kNTilesD; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[j][e] = 0.0f;

  tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
      sQ, Q, p.q_row_stride, s.sq, d, m0, vec, tid);
  tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
      sdO, dO, p.do_row_stride, s.sq, dv, m0, vec, tid);
  cp_async_commit();

  const float scale_log2 = float(p.scale) * score::kLog2e;
  const uint32_t threshold = kExtras ? dropout_threshold(p.dropout_p) : 0u;
  const float keep_scale = kExtras ? float(1.0 / (1.0 - p.dropout_p)) : 1.0f;
  const float slope = kExtras ? float(score::alibi_slope(p, b, h)) : 0.0f;
  // The strong zero: key blocks from n_edge on may hold a zero-weight pair (as in the
  // forward, kept in the padding of Qi's first row rather than in a register).
  {
    const int n_edge = score::first_edge_block<Cfg::kBlockN>(
        s, left, right, m0, n_end,
        kExtras && score::zeros_anywhere(p));
    if (tid == 0) *reinterpret_cast<int*>(sQ + Cfg::kHeadDim) = n_edge;  // read after a barrier
  }
  const int* const n_edge_slot = reinterpret_cast<const int*>(sQ + Cfg::kHeadDim);

  for (int n_block = n_begin; n_block < n_end; ++n_block) {
    const int n0 = n_block * Cfg::kBlockN;
    // Empty under the block-sparse mask: nothing to load or add (uniform over the CTA).
    if (kExtras && score::tile_skipped(p, s, b, h, m0, Cfg::kBlockM, n0, Cfg::kBlockN)) continue;
    tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
        sK, K, p.k_row_stride, s.sk, d, n0, vec, tid);
    tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
        sV, V, p.v_row_stride, s.sk, dv, n0, vec, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // S = Qi Kj^T, dP = dOi Vj^T (queries x keys).
    float acc_s[Cfg::kNTilesS][4], acc_dp[Cfg::kNTilesS][4];
    bwd_detail::s_and_dp<T, Cfg>(acc_s, acc_dp, sQ, sdO, sK, sV, warp * 16, 0, lane);

    // dS = P o (dP o Z - D), element (j, e): query row_lo + 8 (e / 2), key n0 + j * 8 + 2t +
    // e % 2. Each element takes its own dropout draw: sharing one per key pair, as the
    // forward does, made ptxas spill (24 bytes at d = 128 on sm_90).
    auto scores = [&](auto inner) {  // kInner: as in flash_bwd_kernel
      [[maybe_unused]] constexpr bool kInner = decltype(inner)::value;  // plain kernels only
#pragma unroll
      for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row_lo + 8 * (e / 2), key = n0 + j * 8 + 2 * t + (e % 2);
          bool visible;
          float x, dcap = 1.0f;
          if constexpr (kExtras) {
            visible = score::visible(p, s, i, key);
            x = score::logit_log2(p, s, acc_s[j][e], b, h, i, key, slope, visible, dcap);
          } else {
            visible = kInner || (i < s.sq && score::key_visible(s, left, right, i, key));
            x = acc_s[j][e] * scale_log2;
          }
          const float lse_i = e < 2 ? lse_lo : lse_hi;
          const float prob =  // plain: the exponent as one FFMA, as in flash_bwd_kernel
              visible && x != -INFINITY
                  ? exp2_approx(kExtras ? x - lse_i : fmaf(acc_s[j][e], scale_log2, -lse_i))
                  : 0.0f;
          float dp = acc_dp[j][e];
          if (kExtras && p.dropout_p > 0.0)
            dp = visible && score::dropout_keep(p, threshold, b, h, i, key) ? dp * keep_scale
                                                                            : 0.0f;
          acc_s[j][e] = prob == 0.0f ? 0.0f : prob * (dp - (e < 2 ? d_lo : d_hi)) * dcap;
        }
    };
    if (bwd_detail::inner_step<kExtras, Cfg>(
            s, score::block_inside_window(s, left, right, m0, m0 + Cfg::kBlockM - 1, n0,
                                          n0 + Cfg::kBlockN - 1),
            m0, n0))
      scores(std::true_type{});
    else
      scores(std::false_type{});

    // The strong zero, once S (which needs Kj raw) is formed: the block votes on whether Kj
    // holds NaN or Inf (a flag kept from the load through S and dS spilled at d = 96); if so,
    // dQ becomes NaN where a pair that takes part (dropped pairs do, in dQ) meets one, and
    // Kj's NaN and Inf become 0.
    if (n_block >= *n_edge_slot &&
        __syncthreads_or(strong_zero::has_nonfinite<T, Cfg::kBlockN, Cfg::kHeadDim,
                                                    typename Cfg::Layout, Cfg::kThreads>(sK, vec,
                                                                                         tid))) {
      strong_zero::poison<T, Cfg::kNTilesD, Cfg::kBlockN, typename Cfg::Layout>(
          acc_dq, sK, c_base, t, [&](int r, int k) {
            return score::included<kExtras>(p, s, b, h, row_lo + 8 * r, n0 + k);
          });
      __syncthreads();  // every warp has read the raw Kj
      strong_zero::sanitise<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout,
                            Cfg::kThreads>(sK, tid);
      __syncthreads();
    }

    // dQi += dS Kj.
#pragma unroll
    for (int kk = 0; kk < Cfg::kKStepsN; ++kk) {
      uint32_t ds_frag[4];
      a_frag_from_acc<T>(ds_frag, acc_s[2 * kk], acc_s[2 * kk + 1]);
#pragma unroll
      for (int j = 0; j < Cfg::kNTilesD; j += 2) {
        const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int dim = c_base + j * 8 + (lane / 16) * 8;
        uint32_t b4[4];
        ldmatrix<4, true>(b4, sK + key * Cfg::kStride + dim);
        mma_pair<T>(acc_dq[j], acc_dq[j + 1], ds_frag, b4);
      }
    }
    __syncthreads();  // every warp is done with Kj, Vj before the next block overwrites them
  }
  cp_async_wait<0>();

  T* dQ = static_cast<T*>(p.dq) + score::q_base(p, s, b, p.dq_batch_stride, p.dq_row_stride) +
          h * p.dq_head_stride;
  tile::store_acc<T>(dQ, p.dq_row_stride, acc_dq, row_lo, s.sq, c_base, d, t, float(p.scale));
}

// dq = scale * dq_accum, in the input dtype: 64 rows of one (head, batch) per CTA.
template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_convert_dq(BwdParams p, BwdWork w) {
  const int h = blockIdx.y, b = blockIdx.z, d = p.head_dim;
  const score::Seq s = score::seq_of(p, b);
  const int m0 = blockIdx.x * 64;
  if (m0 >= s.sq) return;
  const int rows = min(64, s.sq - m0);
  T* dQ = static_cast<T*>(p.dq) + score::q_base(p, s, b, p.dq_batch_stride, p.dq_row_stride) +
          h * p.dq_head_stride;
  const float* acc = w.dq_accum + bwd_detail::work_row(p, h, b, m0) * d;
  const float scale = float(p.scale);
  for (int idx = threadIdx.x; idx < rows * d; idx += 128) {
    const int r = idx / d, c = idx % d;
    dQ[int64_t(m0 + r) * p.dq_row_stride + c] = from_float<T>(acc[idx] * scale);
  }
}

// ---------------------------------------------------------------------------- 4. dbias

// dbias of a bias constant along the keys when lse has a gradient (fmha/params.h,
// dbias_is_zero): the zeros and NaNs already there plus dlse_i of every row that sees a key,
// summed over the bias's broadcast dimensions in a fixed order (b, h, i). One thread per
// dbias element; no atomics, so the sum is the same every run. (A template, like every
// kernel of this header, so that each instantiation file may hold a copy.)
template <typename T>
__global__ void __launch_bounds__(128) flash_bwd_dbias_dlse(BwdParams p) {
  const int64_t e = int64_t(blockIdx.x) * 128 + threadIdx.x;
  if (e >= int64_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows) return;
  const int bb = int(e / (int64_t(p.dbias_heads) * p.dbias_rows));
  const int hh = int(e / p.dbias_rows % p.dbias_heads), ii = int(e % p.dbias_rows);
  const float* lse = static_cast<const float*>(p.lse);
  const float* dlse = static_cast<const float*>(p.dlse);
  float acc = static_cast<float*>(p.dbias)[e];
  const int b_end = p.dbias_batch == 1 ? p.batch : bb + 1;
  const int h_end = p.dbias_heads == 1 ? p.heads_q : hh + 1;
  for (int b = p.dbias_batch == 1 ? 0 : bb; b < b_end; ++b) {
    const score::Seq s = score::seq_of(p, b);
    const int i_end = p.dbias_rows == 1 ? s.sq : min(ii + 1, s.sq);
    for (int h = p.dbias_heads == 1 ? 0 : hh; h < h_end; ++h)
      for (int i = p.dbias_rows == 1 ? 0 : ii; i < i_end; ++i) {
        const int64_t at = h * p.lse_head_stride +
                           score::q_base(p, s, b, p.lse_batch_stride, p.lse_row_stride) +
                           int64_t(i) * p.lse_row_stride;
        if (lse[at] != -INFINITY) acc += dlse[at];  // a NaN lse already made acc NaN
      }
  }
  static_cast<float*>(p.dbias)[e] = acc;
}

// dbias = dS (before the softcap factor) summed over the bias's broadcast dimensions, with
// memory O(size of dbias): nothing is stored between kernels but D. One CTA per (tile of
// kBlockM rows x kBlockN keys of dbias, dbias head hh, dbias batch bb); dbias_cols is
// seqlen_k here (a bias constant along the keys never comes here: dbias_is_zero). The CTA
// sweeps, in a fixed order, every (b, h) the bias broadcasts onto (bb, hh) -- all batches
// when dbias_batch is 1, all query heads when dbias_heads is 1 -- and per (b, h) its own
// query block, or every query block that sees its keys when the bias has a single row
// (dbias_rows = 1). For each it recomputes S = Qi Kj^T and dP = dOi Vj^T with the score
// pipeline of the other kernels, forms dS = P o (dP o Z - D) and adds it to a register
// accumulator; a single-row bias then sums the tile's rows: within the thread, across the
// 8 lanes of a column (butterfly), across the warps in warp order. Every sum has a fixed
// order, so the result is bitwise the same every run.
// Cost: two GEMMs per (b, h, query block, key block) visited, i.e. another 2/5 of the main
// kernel's GEMMs when dbias is asked for.
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 2)
    flash_bwd_dbias_kernel(BwdParams p, BwdWork w, bool vec) {
  FMHA_DYNAMIC_SHARED(T, smem);
  T* sQ = smem;
  T* sdO = sQ + Cfg::kTileQ;
  T* sK = sdO + Cfg::kTileQ;
  T* sV = sK + Cfg::kTileKV;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int rows = p.dbias_rows, cols = p.dbias_cols;
  const bool one_row = rows == 1;  // every query row lands on dbias row 0
  const int col_tiles = (cols + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int m_tile = blockIdx.x / col_tiles, n0 = (blockIdx.x % col_tiles) * Cfg::kBlockN;
  const int hh = blockIdx.y, bb = blockIdx.z;
  const int b_lo = p.dbias_batch == 1 ? 0 : bb, b_hi = p.dbias_batch == 1 ? p.batch : bb + 1;
  const int h_lo = p.dbias_heads == 1 ? 0 : hh, h_hi = p.dbias_heads == 1 ? p.heads_q : hh + 1;
  const int group = p.heads_q / p.heads_kv;
  const int d = p.head_dim, dv = p.head_dim_v;
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const float keep_scale = float(1.0 / (1.0 - p.dropout_p));

  // dbias of this thread's elements (j, e): row m_tile * kBlockM + warp * 16 + g + 8 (e / 2)
  // (or the single row), key n0 + j * 8 + 2t + e % 2.
  float acc_db[Cfg::kNTilesS][4];
#pragma unroll
  for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_db[j][e] = 0.0f;

  for (int b = b_lo; b < b_hi; ++b) {
    const score::Seq s = score::seq_of(p, b);
    if (n0 >= s.sk) continue;  // varlen: no key of this sequence lands on the tile
    int m_begin, m_end;  // the query blocks that see a key of [n0, n0 + kBlockN)
    bwd_detail::query_range<Cfg::kBlockM, Cfg::kBlockN>(p, s, n0, m_begin, m_end);
    if (!one_row) {  // ... and land on this tile's rows
      m_begin = max(m_begin, m_tile);
      m_end = min(m_end, m_tile + 1);
    }
    if (m_begin >= m_end) continue;
    for (int h = h_lo; h < h_hi; ++h) {
      const int h_kv = h / group;
      const T* Q = static_cast<const T*>(p.q) +
                   score::q_base(p, s, b, p.q_batch_stride, p.q_row_stride) + h * p.q_head_stride;
      const T* dO = static_cast<const T*>(p.dout) +
                    score::q_base(p, s, b, p.do_batch_stride, p.do_row_stride) +
                    h * p.do_head_stride;
      const T* K = static_cast<const T*>(p.k) +
                   score::k_base(p, s, b, p.k_batch_stride, p.k_row_stride) + h_kv * p.k_head_stride;
      const T* V = static_cast<const T*>(p.v) +
                   score::k_base(p, s, b, p.v_batch_stride, p.v_row_stride) + h_kv * p.v_head_stride;
      const float* lse = static_cast<const float*>(p.lse) + h * p.lse_head_stride +
                         score::q_base(p, s, b, p.lse_batch_stride, p.lse_row_stride);
      const float slope = float(score::alibi_slope(p, b, h));
      // Every warp finished with the previous (b, h)'s tiles at the loop's trailing barrier.
      tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
          sK, K, p.k_row_stride, s.sk, d, n0, vec, tid);
      tile::load<T, Cfg::kBlockN, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
          sV, V, p.v_row_stride, s.sk, dv, n0, vec, tid);

      for (int m_block = m_begin; m_block < m_end; ++m_block) {
        const int m0 = m_block * Cfg::kBlockM;
        tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
            sQ, Q, p.q_row_stride, s.sq, d, m0, vec, tid);
        tile::load<T, Cfg::kBlockM, Cfg::kHeadDim, typename Cfg::Layout, Cfg::kThreads>(
            sdO, dO, p.do_row_stride, s.sq, dv, m0, vec, tid);
        cp_async_commit();

        // This thread's rows row_lo, row_lo + 8: lse in the log2 domain (+inf for rows with
        // no visible key or past the sequence, so that P = 0 there) and D.
        const int row_lo = m0 + warp * 16 + g;
        float lse_lo = INFINITY, lse_hi = INFINITY, d_lo = 0.0f, d_hi = 0.0f;
        auto lse_l2 = [&](int i) {
          const float l = lse[int64_t(i) * p.lse_row_stride];
          return l == -INFINITY ? INFINITY : l * score::kLog2e;
        };
        if (row_lo < s.sq) {
          lse_lo = lse_l2(row_lo);
          d_lo = w.d[bwd_detail::work_row(p, h, b, row_lo)];
        }
        if (row_lo + 8 < s.sq) {
          lse_hi = lse_l2(row_lo + 8);
          d_hi = w.d[bwd_detail::work_row(p, h, b, row_lo + 8)];
        }
        cp_async_wait<0>();
        __syncthreads();

        float acc_s[Cfg::kNTilesS][4], acc_dp[Cfg::kNTilesS][4];
        bwd_detail::s_and_dp<T, Cfg>(acc_s, acc_dp, sQ, sdO, sK, sV, warp * 16, 0, lane);

        // dS = P o (dP o Z - D), as the dQ kernel forms it but before the softcap factor.
        // P = 0 (hidden, dropped-out or -inf pairs, rows without keys) gives dS = 0 even
        // against a non-finite dP; a NaN lse or D of a row that sees keys gives NaN.
#pragma unroll
        for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = row_lo + 8 * (e / 2), key = n0 + j * 8 + 2 * t + (e % 2);
            bool visible = score::visible(p, s, i, key);
            float dcap;
            const float x = score::logit_log2(p, s, acc_s[j][e], b, h, i, key, slope, visible,
                                              dcap);
            const float prob =
                visible && x != -INFINITY ? exp2_approx(x - (e < 2 ? lse_lo : lse_hi)) : 0.0f;
            float dp = acc_dp[j][e];
            if (p.dropout_p > 0.0)
              dp = visible && score::dropout_keep(p, threshold, b, h, i, key) ? dp * keep_scale
                                                                              : 0.0f;
            if (prob != 0.0f) acc_db[j][e] += prob * (dp - (e < 2 ? d_lo : d_hi));
          }
        __syncthreads();  // every warp is done with Qi, dOi (and Kj, Vj) before the next load
      }
    }
  }

  float* out = static_cast<float*>(p.dbias) + (int64_t(bb) * p.dbias_heads + hh) * rows * cols;
  if (!one_row) {
#pragma unroll
    for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m_tile * Cfg::kBlockM + warp * 16 + g + 8 * (e / 2);
        const int key = n0 + j * 8 + 2 * t + (e % 2);
        if (i < rows && key < cols) out[int64_t(i) * cols + key] = acc_db[j][e];
      }
    return;
  }
  // One row: sum the CTA's 64 rows of each key. The sweep's last barrier freed shared memory.
  float* red = reinterpret_cast<float*>(smem);  // [kWarps][kBlockN]
#pragma unroll
  for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float v = acc_db[j][c] + acc_db[j][c + 2];
#pragma unroll
      for (int m = 4; m <= 16; m *= 2) v += shfl_xor(v, m);  // the 8 lanes of equal t
      if (g == 0) red[warp * Cfg::kBlockN + j * 8 + 2 * t + c] = v;
    }
  __syncthreads();
  if (tid < Cfg::kBlockN && n0 + tid < cols) {
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < Cfg::kWarps; ++r) sum += red[r * Cfg::kBlockN + tid];
    out[n0 + tid] = sum;
  }
}

// ---------------------------------------------------------------------------- launcher

// True when every row of q, k, v, dout starts 16-byte aligned: tiles move with cp.async
// (flash_bwd.cu).
bool flash_bwd_rows_aligned(const BwdParams& p);

// The launches of one backward, in order, on `stream`, for one (dtype, head-dim tile,
// extras): instantiated once per combination in csrc/cuda/instantiations/ (generated by
// tools/generate_instantiations.py), dispatched by flash_bwd.cu.
template <typename T, int kHeadDim, bool kExtras>
void run_flash_bwd(const BwdParams& p, Stream stream) {
  const bool vec = flash_bwd_rows_aligned(p);
  const int64_t rows = int64_t(p.batch) * p.seqlen_q;  // per query head
  BwdWork w;
  Scratch d_buf(2 * size_t(p.heads_q) * rows * sizeof(float), stream);  // D, then lse2
  w.d = d_buf.as<float>();
  w.lse2 = w.d + size_t(p.heads_q) * rows;
  Scratch dq_buf(p.deterministic ? 0 : size_t(p.heads_q) * rows * p.head_dim * sizeof(float),
                 stream, /*zero=*/true);
  w.dq_accum = dq_buf.as<float>();
  // dbias: zeros for a bias constant along the keys (fmha/params.h), else its own kernel below.
  if (dbias_is_zero(p))
    zero_fill(p.dbias, size_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows * sizeof(float), stream);

  const dim3 row_grid(bwd_detail::ceil_div(p.seqlen_q, 64), p.heads_q, p.batch);
  FMHA_LAUNCH(flash_bwd_dot_do_o<T>, row_grid, dim3(128), 0, stream, p, w);
  if (dbias_is_zero(p) && p.dlse) {
    const int64_t n = int64_t(p.dbias_batch) * p.dbias_heads * p.dbias_rows;
    FMHA_LAUNCH(flash_bwd_dbias_dlse<T>, dim3(unsigned((n + 127) / 128)), dim3(128), 0, stream,
                p);
  }

  auto launch_main = [&](auto atomic_dq) {
    constexpr bool kAtomic = decltype(atomic_dq)::value;
    using Cfg = FlashBwdConfig<kHeadDim, kExtras>;
    auto kernel = &flash_bwd_kernel<T, Cfg, kExtras, kAtomic>;
    if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
    const dim3 grid(bwd_detail::ceil_div(p.seqlen_k, Cfg::kBlockN) * Cfg::kSplits, p.heads_kv, p.batch);
    FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, w, vec);
  };
  if (p.deterministic) {
    launch_main(std::false_type{});
    using Cfg = FlashBwdDqConfig<kHeadDim>;
    auto kernel = &flash_bwd_dq_kernel<T, Cfg, kExtras>;
    if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
    const dim3 grid(bwd_detail::ceil_div(p.seqlen_q, Cfg::kBlockM) * Cfg::kSplits, p.heads_q, p.batch);
    FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, p, w, vec);
  } else {
    launch_main(std::true_type{});
    FMHA_LAUNCH(flash_bwd_convert_dq<T>, row_grid, dim3(128), 0, stream, p, w);
  }
  if constexpr (kExtras) {  // a bias is one of the extras
    if (p.dbias && !dbias_is_zero(p)) {
      using Cfg = FlashBwdDbiasConfig<kHeadDim>;
      auto kernel = &flash_bwd_dbias_kernel<T, Cfg>;
      if (Cfg::kSmemBytes > 48 * 1024) set_max_dynamic_smem(kernel, Cfg::kSmemBytes);
      const int tiles = bwd_detail::ceil_div(p.dbias_rows, Cfg::kBlockM) *
                        bwd_detail::ceil_div(p.dbias_cols, Cfg::kBlockN);
      FMHA_LAUNCH(kernel, dim3(tiles, p.dbias_heads, p.dbias_batch), dim3(Cfg::kThreads),
                  Cfg::kSmemBytes, stream, p, w, vec);
    }
  }
}

}  // namespace gpu
}  // namespace fmha
