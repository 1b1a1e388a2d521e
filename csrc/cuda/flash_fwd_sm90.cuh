// The Hopper (sm_90a) forward kernel, in FlashAttention-3's design (Shah et al.,
// "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision", 2024),
// written only with cuda/hopper.cuh and cuda/primitives.cuh so that it runs on an H100/H200
// and, in CI, under the SIMT emulator. The walk-through: docs/cuda_kernels.md, "The sm_90
// forward".
//
// One CTA per (query block Qi of kBlockM = 128 rows, query head, batch [, key split]), three
// warpgroups of 128 threads with different roles (warp specialisation):
//   warpgroup 0, the producer: gives registers away (setmaxnreg.dec), and one elected lane
//     of its first warp issues every TMA load: Qi once, then Kj and Vj of each key block into
//     a ring of kStages stages. Each stage has a "full" mbarrier per tile (the TMA's bytes
//     complete it) and an "empty" one (the consumers' 256 threads arrive when done reading);
//   warpgroups 1 and 2, the consumers: take the registers (setmaxnreg.inc), each owns 64 rows
//     of Qi and, per key block j (names from the paper):
//       S  = Qi Kj^T          wgmma m64n{kBlockN}k16, A (Qi) and B (Kj) from shared memory
//                             through descriptors over the TMA's 128-byte swizzle; f32
//       release Kj's stage    (empty mbarrier), mask S (window edges, the sequence's tail)
//       m' = max(m, rowmax S), P = exp2(S scale log2e - m'), l = l exp2(m - m') + rowsum P
//       O  = O exp2(m - m')   (lazily, as the sm_80 kernel: cuda/flash_fwd.cuh kLazyRescale)
//       O += P Vj             wgmma m64n{d}k16 with A = P from registers (the accumulator
//                             layout of S is the A-fragment layout: converted to f16/bf16
//                             in place) and B = Vj, N-major, from shared memory
//       release Vj's stage
//     and at the end O /= l, lse = (m + log2 l) ln2; O by TMA stores from a staging tile (d
//     <= 128, dense, no splits) or from registers. Where registers allow (d <= 128 without a
//     window or varlen, d = 64 with), S(j+1) is issued ahead of P Vj and its softmax runs
//     while the tensor cores do P Vj (FlashAttention-3's intra-warpgroup overlap), and the
//     two consumers take turns to issue their wgmma (ping-pong, through two mbarriers).
// The score semantics come from fmha/score.h (through cuda/score.cuh) as in every kernel.
//
// The strong zero (cuda/strong_zero.cuh, the NaN rule): a pair of zero weight meets V as
// 0 * V in the wgmma, NaN where V is NaN or Inf. The blocks that can hold such a pair (the
// window's edge blocks, and a varlen sequence's last block, whose tail rows are the next
// sequence's) are scanned by every consumer warp (reads only: the tile belongs to the TMA and
// to both consumer warpgroups) and, in the rare block that holds a non-finite V, P Vj runs as
// a plain per-thread product that skips the excluded pairs -- no shared-memory write, so no
// consumer ever waits on another.
//
// Split-KV uses FwdLaunch and the combine kernel of cuda/flash_fwd.cuh, as the sm_80 kernel.
//
// e4m3 inputs (FlashAttention-3's FP8 forward) run in the same kernel: see the note at
// flash_fwd_sm90_kernel and fp8_v_transpose_kernel.
//
// What the emulator cannot check (timing and overlap, cuda/emu/README.md) this kernel does not
// rely on for correctness: every hand-off is an mbarrier phase over TMA data, no generic store
// is ordered by an mbarrier (the ping-pong's mbarriers order issue only; O's staging is each
// warp's own, ordered by __syncwarp), and every wgmma/TMA operand lives in dynamic shared
// memory.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/flash_fwd.cuh"  // FwdLaunch, kLazyRescale, flash_fwd_combine_kernel
#include "cuda/hopper.cuh"
#include "cuda/primitives.cuh"
#include "cuda/score.cuh"

namespace fmha {
namespace gpu {

// The split-KV combine is the sm_80 forward's kernel. Its instantiations for this kernel's
// tiles live in flash_fwd_sm90.cu, which is built for every arch, and never in the generated
// launchers, which may be built for sm_90a alone (CMakeLists.txt): the combine launched on
// another GPU must find its machine code there.
#define FMHA_SM90_COMBINE(T, D) \
  extern template int run_flash_fwd_combine<T, D>(const FwdParams&, const FwdLaunch&, Stream);
FMHA_SM90_COMBINE(half_t, 64) FMHA_SM90_COMBINE(half_t, 128) FMHA_SM90_COMBINE(half_t, 256)
FMHA_SM90_COMBINE(bf16_t, 64) FMHA_SM90_COMBINE(bf16_t, 128) FMHA_SM90_COMBINE(bf16_t, 256)
#undef FMHA_SM90_COMBINE

// The shape of one sm_90 forward kernel. Tiles per head dim as FlashAttention-3 picks them
// for 16-bit inputs: the consumer's registers hold O (64 x d / 128 threads = d / 2 floats) and
// S (kBlockN / 2), and shared memory (227 KiB per CTA on H100/H200) holds Qi and kStages
// stages of Kj and Vj. kElem: bytes per input element, 2 (f16/bf16) or 1 (e4m3, where Vj's
// stage holds Vj^T: 8-bit wgmma operands are K-major).
template <int kHeadDim_, int kBlockN_, int kStages_, int kElem_ = 2>
struct FlashFwdSm90ConfigBase {
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kElem = kElem_;
  static constexpr bool kFp8 = kElem == 1;
  static constexpr int kConsumers = 2;                   // consumer warpgroups
  static constexpr int kRowsPerWg = 64;                  // wgmma's M
  static constexpr int kBlockM = kConsumers * kRowsPerWg;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Tiles move by TMA as boxes of kRowBytes-byte rows, the span of the swizzle the wgmma
  // descriptors read (128 bytes; 64 for e4m3 at d = 64); a tile of R rows is kBoxes such
  // boxes of R x kRowBytes, one after the other. A swizzle atom is 8 such rows.
  static constexpr int kRowBytes = kHeadDim * kElem < 128 ? kHeadDim * kElem : 128;
  static constexpr SmemSwizzle kSwizzle = kRowBytes == 128 ? SmemSwizzle::k128B : SmemSwizzle::k64B;
  static constexpr int kAtomBytes = 8 * kRowBytes;
  static constexpr int kBoxCols = kRowBytes / kElem;
  static constexpr int kBoxes = kHeadDim / kBoxCols;
  static constexpr int kQBytes = kBlockM * kHeadDim * kElem;
  static constexpr int kKVBytes = kBlockN * kHeadDim * kElem;
  static constexpr int kBoxBytesKV = kBlockN * kRowBytes;
  // k per wgmma (m64nNk16 for 16-bit types, k32 for 8-bit): 32 bytes of a row either way.
  static constexpr int kKStep = 32 / kElem;
  // Qi full; Kj, Vj full and empty per stage; the consumers' two turns (ping-pong)
  static constexpr int kBarriers = 1 + 4 * kStages + 2;
  // O's staging for the TMA stores (16-bit O in 64-column boxes of 128 bytes, as a 16-bit Qi:
  // each consumer warp's 16 rows), up to d = 128: its own bytes, because no barrier the
  // emulator models orders a warp's writes after another warp's wgmma reads of Qi (the
  // warpgroup meets only at wgmma.wait_group). d = 256 has no room (224 KiB) and stores O
  // from registers.
  static constexpr int kOBoxes = kHeadDim / 64;
  static constexpr int kOStageBytes = kHeadDim <= 128 ? kBlockM * kHeadDim * 2 : 0;
  static constexpr size_t kSmemBytes =
      size_t(kQBytes) + 2 * kStages * size_t(kKVBytes) + kOStageBytes + 8 * kBarriers;
  // setmaxnreg: the producer keeps 24 registers, each consumer takes 240 (128 x (24 + 2 x
  // 240) = 64512 of the SM's 65536).
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // Whether the kernel with the strong zero's watch (kEdges) is built: at d = 256 its rare
  // product does not fit the consumer's registers, and such calls run in the sm_80 kernel.
  // (e4m3 calls never need it: the pre-pass gives the wgmma finite Vj^T, see below.)
  static constexpr bool kEdges = kHeadDim <= 128 && !kFp8;
  // Whether the plain kernel overlaps the softmax with the next QK^T: at d = 256 the next
  // block's S (40 registers) beside O (128) and P (20) in flight spills 88 bytes.
  static constexpr bool kOverlap = kHeadDim <= 128;
  // ... and the kernel with the strong zero's watch: at d = 128 its rare product beside the
  // overlap's state (and O's copy, kept through the discarded P Vj) spills 912 bytes; at
  // d = 64 both fit.
  static constexpr bool kOverlapEdges = kHeadDim <= 64;
  // P's A fragments: 4 registers per wgmma k-step, 2 (16-bit) or 4 (e4m3) values each.
  static constexpr int kPRegs = kBlockN / kKStep * 4;

  static_assert(kHeadDim % kBoxCols == 0, "whole boxes");
  static_assert(kBlockN % kKStep == 0 && kBlockN <= 256, "P Vj: whole k-steps; S: wgmma N <= 256");
  static_assert(!kFp8 || kBlockN == 128, "e4m3: Vj^T rows are one 128-byte swizzled box");
  static_assert(kBoxBytesKV % 1024 == 0, "boxes start on a 1024-byte boundary");
  static_assert(kSmemBytes <= 227 * 1024, "fits an sm_90 CTA's shared memory");
  static_assert(kHeadDim / 2 + kBlockN / 2 + kPRegs <= 208, "O, S and P within 240 registers");
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "the register file");
};

template <int kHeadDim, bool kFp8 = false>
struct FlashFwdSm90Config;
// d = 64: 128 x 128 tiles, 2 stages: 80 KiB. (FlashAttention-3 runs 192-row blocks here with
// three consumers; two keep one kernel shape for every head dim.)
template <> struct FlashFwdSm90Config<64> : FlashFwdSm90ConfigBase<64, 128, 2> {};
// d = 128: 128 x 128, 2 stages: 160 KiB; O 64 + S 64 + P 32 registers per consumer thread.
template <> struct FlashFwdSm90Config<128> : FlashFwdSm90ConfigBase<128, 128, 2> {};
// d = 256: 128 x 80, 2 stages: 224 KiB; O 128 + S 40 + P 20 registers (FlashAttention-3's
// tile for this head dim).
template <> struct FlashFwdSm90Config<256> : FlashFwdSm90ConfigBase<256, 80, 2> {};
// e4m3: 128 x 128 at every head dim (P's k32 steps and Vj^T's 128-byte rows); d = 256: O 128
// + S 64 + P 16 registers, 160 KiB.
template <int kHeadDim>
struct FlashFwdSm90Config<kHeadDim, true> : FlashFwdSm90ConfigBase<kHeadDim, 128, 2, 1> {};

// The tensor maps of one launch (kernel parameters: TMA reads them from the constant bank).
// Dimensions (columns, rows, heads, batch): dense tensors per (b, h), varlen ones over the
// packed rows with batch 1.
struct Sm90Maps {
  TensorMap q, k, v;
  // O in boxes of 64 columns x 16 rows (one consumer warp's), written by TMA stores from
  // shared memory; o_tma = 0 where O's rows cannot be (unaligned) or must not be (varlen: a
  // box clipped at the tensor's end would write the next sequence's rows) stored that way.
  TensorMap o;
  int o_tma = 0;
  // e4m3 calls: the pre-pass's V^T (fp8_v_transpose_kernel) in place of v, and its flags
  // (per (batch, kv head, key block): the block's V held a NaN code, which V^T holds as 0).
  TensorMap vt;
  const int* v_nan = nullptr;
  int v_blocks = 0;  // key blocks per (batch, kv head)
};

// e4m3: P is 2^kFp8POffset exp2(S - m) (fmha.reference's FP8_P_OFFSET, the same model).
constexpr int kFp8POffset = 8;

namespace sm90_detail {

// A 32-bit shared-memory load at base + offset: through the 32-bit shared window on the GPU
// (a generic pointer per column costs two registers each, hoisted), plainly in the emulator.
FMHA_DEVICE uint32_t lds_u32(const uint8_t* base, uint32_t base_shared, int offset) {
#if defined(FMHA_GPU_DEVICE_PATH)
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(base_shared + uint32_t(offset)));
  (void)base;
  return v;
#else
  (void)base_shared;
  return *reinterpret_cast<const uint32_t*>(base + offset);
#endif
}

// One row's reference-max step of the online softmax with the sm_80 kernel's lazy rescale
// (cuda/flash_fwd.cuh, kLazyRescale), raw_max being this thread's max of the block's raw
// scores: the quad's max, scaled by `fold` into the log2 domain, moves m only when it passes
// it by more than kLazyRescale. Returns the max the exponents subtract -- NaN where the max is
// +inf (0 * inf in the FFMA), which makes the row NaN as in the sm_80 kernel -- and sets
// alpha = exp2(old m - it), O's and l's factor.
// (lazy = 0: the exact running max, which the e4m3 kernel needs: its P, 2^8 exp2(s - m), must
// stay within e4m3's range.)
FMHA_DEVICE float lazy_max_step(float& m, float raw_max, float fold, float& alpha,
                                float lazy = kLazyRescale) {
  raw_max = fmaxf(raw_max, shfl_xor(raw_max, 1));
  raw_max = fmaxf(raw_max, shfl_xor(raw_max, 2));
  const float block_logit = raw_max * fold;
  const float row_max = block_logit > m + lazy ? block_logit : m;
  const float m_use = fmaf(0.0f, row_max, row_max);
  alpha = exp2_approx(m - m_use);
  m = row_max;
  return m_use;
}

template <typename T>
FMHA_DEVICE bool nonfinite_bits(uint16_t bits) {
  // f16: 5 exponent bits at 10..14; bf16: 8 at 7..14. All ones: Inf or NaN.
  constexpr uint16_t kExp = std::is_same<T, half_t>::value ? 0x7C00 : 0x7F80;
  return (bits & kExp) == kExp;
}

}  // namespace sm90_detail

// kEdges: the call may give a pair zero weight (a window, causal included, or varlen: a box
// reads the next sequence's rows): the blocks that can hold one are watched for the strong
// zero. Without (the keys past a dense sequence's end are the TMA's zero fill, masked), the
// loop has no scan and no rare product. Where registers allow (Cfg::kOverlap, kOverlapEdges)
// it overlaps each block's softmax with the next QK^T, the consumers in ping-pong.
//
// T: q, k, v's type (half_t, bf16_t, or e4m3_t with Cfg::kFp8), TO: out's. e4m3 inputs
// (FlashAttention-3's FP8 forward): the wgmma are k32 with both operands K-major, so Vj's
// stage holds Vj^T, read by TMA from the copy fp8_v_transpose_kernel made; S is scaled by
// scale * descale_q * descale_k (folded into exp2 as for 16-bit inputs), P = 2^8 exp2(S - m)
// against the exact running max m is rounded to e4m3 for P Vj (2^8: P's largest values use
// e4m3's range up to 256 instead of [0, 1], where small ones would lose bits as subnormals;
// fmha.reference.attention_fp8_forward(quantize_p=True) is this model), l sums P unrounded,
// and O is scaled by descale_v at the end.
template <typename T, typename TO, typename Cfg, bool kEdges>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ Sm90Maps maps, FwdParams p, FwdLaunch launch) {
  constexpr bool kFp8 = Cfg::kFp8;
  static_assert(kFp8 == std::is_same<T, e4m3_t>::value, "Cfg::kFp8 iff e4m3 inputs");
  static_assert(kFp8 || std::is_same<T, TO>::value, "16-bit inputs write out in their type");
  static_assert(!(kFp8 && kEdges), "e4m3 calls need no strong-zero watch (V^T is finite)");
  constexpr bool kOverlap = kEdges ? Cfg::kOverlapEdges : Cfg::kOverlap;
  // TMA's 128-byte swizzle, the wgmma descriptors (base offset 0) and the swizzle arithmetic
  // below address 1024-byte atoms from the tiles' starts: a misaligned window would give
  // silently wrong operands, so the kernel stops instead.
  FMHA_DYNAMIC_SHARED_ALIGNED(uint8_t, smem, 1024);
  if (smem_u32(smem) % 1024u != 0) __trap();
  uint8_t* sQ = smem;                                // [2 consumers][kBoxes][64 rows][kRowBytes]
  uint8_t* sK = sQ + Cfg::kQBytes;                   // [kStages][kBoxes][kBlockN][kRowBytes]
  uint8_t* sV = sK + Cfg::kStages * Cfg::kKVBytes;   // the same; e4m3: [kStages][d][128 keys]
  uint8_t* sO = sV + Cfg::kStages * Cfg::kKVBytes;   // O staging: [2][kOBoxes][64][128 B] (or none)
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sO + Cfg::kOStageBytes);
  uint64_t* k_full = q_full + 1;
  uint64_t* v_full = k_full + Cfg::kStages;
  uint64_t* k_empty = v_full + Cfg::kStages;
  uint64_t* v_empty = k_empty + Cfg::kStages;
  uint64_t* turn = v_empty + Cfg::kStages;  // [consumer]: its turn to issue wgmma

  const int tid = threadIdx.x, wg = tid / 128;
  const int m_block = blockIdx.x % launch.m_blocks, split = blockIdx.x / launch.m_blocks;
  const int h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / (p.heads_q / p.heads_kv);  // GQA: the K/V head's tiles, never copied
  const score::Seq seq = score::seq_of(p, b);
  const int m0 = m_block * Cfg::kBlockM;
  // Varlen: the grid is sized by the longest sequence; this block lies past its own.
  // (Uniform over the CTA, before any barrier.)
  if (m0 >= seq.sq) return;
  const int left = p.window_left, right = p.window_right;
  int n_begin, n_end;
  score::key_blocks<Cfg::kBlockN>(seq, left, right, m0, m0 + Cfg::kBlockM - 1, n_begin, n_end);
  launch.take_split(split, n_begin, n_end);

  if (tid == 0) {
    // Arrival counts: one (the producer's arrive.expect_tx) for the full barriers, every
    // consumer thread for the empty ones.
    mbarrier_init(q_full, 1);
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], 128 * Cfg::kConsumers);
      mbarrier_init(&v_empty[s], 128 * Cfg::kConsumers);
    }
    for (int c = 0; c < Cfg::kConsumers; ++c) mbarrier_init(&turn[c], 128);
    fence_barrier_init();  // the inits, seen by TMA's complete_tx (the async proxy) too
  }
  // The barriers exist before anyone arrives on or waits for them (the only CTA-wide barrier).
  __syncthreads();

  // Packed (varlen) tensors: rows from the sequence's first; dense ones: per (b, h).
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int q_row0 = varlen ? seq.q_first : 0, k_row0 = varlen ? seq.k_first : 0;
  const int q_bz = varlen ? 0 : b, k_bz = varlen ? 0 : b;

  if (wg == 0) {
    // ---- producer
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid >= 32 || n_begin >= n_end) return;  // one warp issues; the rest have no work
    const bool leader = elect_one();
    if (leader) {
      mbarrier_arrive_expect_tx(q_full, Cfg::kQBytes);
      for (int c = 0; c < Cfg::kConsumers; ++c)
        for (int x = 0; x < Cfg::kBoxes; ++x) {
          const int32_t at[4] = {x * Cfg::kBoxCols, q_row0 + m0 + c * Cfg::kRowsPerWg, h, q_bz};
          tma_load<4>(sQ + (c * Cfg::kBoxes + x) * Cfg::kRowsPerWg * Cfg::kRowBytes, &maps.q, at,
                      q_full);
        }
    }
    // One tile (Kj or Vj) into stage s once its last readers released it. e4m3's Vj^T is
    // one box of d rows x 128 keys of the pre-pass's copy (per batch entry, from key 0).
    auto refill = [&](uint8_t* tiles, const TensorMap* map, uint64_t* full, uint64_t* empty,
                      int n, int s, uint32_t parity, bool transposed) {
      mbarrier_wait(&empty[s], parity);
      // Every lane has seen the stage free before the leader refills it (the others wait
      // without arriving: nothing else holds them back; hopper.cuh, mbarrier_wait).
      __syncwarp();
      if (leader) {
        mbarrier_arrive_expect_tx(&full[s], Cfg::kKVBytes);
        if (transposed) {
          const int32_t at[4] = {n * Cfg::kBlockN, 0, h_kv, b};
          tma_load<4>(tiles + s * Cfg::kKVBytes, map, at, &full[s]);
        } else {
          for (int x = 0; x < Cfg::kBoxes; ++x) {
            const int32_t at[4] = {x * Cfg::kBoxCols, k_row0 + n * Cfg::kBlockN, h_kv, k_bz};
            tma_load<4>(tiles + s * Cfg::kKVBytes + x * Cfg::kBoxBytesKV, map, at, &full[s]);
          }
        }
      }
    };
    for (int n = n_begin, i = 0; n < n_end; ++n, ++i) {
      const int s = i % Cfg::kStages;
      const uint32_t parity = uint32_t((i / Cfg::kStages) & 1) ^ 1u;  // the first round: free
      refill(sK, &maps.k, k_full, k_empty, n, s, parity, false);
      refill(sV, kFp8 ? &maps.vt : &maps.v, v_full, v_empty, n, s, parity, kFp8);
    }
    return;
  }

  // ---- consumers
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int c = wg - 1;                      // this consumer's 64 rows of Qi
  const int ctid = tid - 128 * wg;           // thread within the warpgroup
  const int warp = ctid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;      // accumulator fragment coordinates
  // The rows of this thread: g and g + 8 of its warp's 16 (the wgmma accumulator layout is
  // mma.sync's, warp w holding rows 16w..16w+15).
  const int row_lo = m0 + c * Cfg::kRowsPerWg + 16 * warp + g;
  constexpr int kS = Cfg::kBlockN / 2, kO = Cfg::kHeadDim / 2;  // accumulator floats per thread

  float m[2] = {-FLT_MAX, -FLT_MAX}, l[2] = {0.0f, 0.0f};  // as flash_fwd.cuh: log2 domain
  float acc_o[kO];
#pragma unroll
  for (int e = 0; e < kO; ++e) acc_o[e] = 0.0f;

  if (n_begin < n_end) {
    // As the sm_80 plain kernel: raw S, the scale folded into exp2 (needs scale * log2e > 0:
    // the launcher claims no other call). e4m3: times the (batch, kv head)'s descale_q *
    // descale_k, whose sign the host cannot see: where it is negative, a row's largest scaled
    // score is its smallest raw one, and an excluded pair's raw score is +inf (`flip`); where
    // it is 0 (every score 0), the smallest positive float stands in, so that an excluded
    // pair is -inf and not 0 x -inf.
    float fold = float(p.scale) * score::kLog2e;
    if constexpr (kFp8) {
      fold *= descale_at(p.q_descale, p.q_descale_batch_stride, p.q_descale_head_stride, b, h_kv) *
              descale_at(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride, b, h_kv);
      if (fold == 0.0f) fold = FLT_MIN;
    }
    const bool flip = kFp8 && fold < 0.0f;
    const float excluded = flip ? INFINITY : -INFINITY;  // a raw score that folds to -inf
    // Blocks [inner_lo, inner_hi) need no mask; from n_edge on a block may hold a pair of
    // zero weight (the strong zero). Varlen: the last block's tail rows are the next
    // sequence's (the TMA box reads on), so it is an edge block too.
    const int inner_lo = (score::key_lo(seq, left, min(m0 + Cfg::kBlockM, seq.sq) - 1) +
                          Cfg::kBlockN - 1) / Cfg::kBlockN;
    const int inner_hi = (score::key_hi(seq, right, m0) + 1) / Cfg::kBlockN;
    const int n_edge = min(score::first_edge_block<Cfg::kBlockN>(seq, left, right, m0, n_end, false),
                           varlen ? seq.sk / Cfg::kBlockN : n_end);
    const uint8_t* sQc = sQ + c * Cfg::kBoxes * Cfg::kRowsPerWg * Cfg::kRowBytes;
    mbarrier_wait(q_full, 0);

    // FlashAttention-3's intra-warpgroup overlap: block j's P Vj is issued behind the next
    // block's S = Qi Kj+1^T, and the softmax of S(j+1) runs while the tensor cores do P Vj;
    // O's rescale for block j+1 and P's packing wait for P Vj (its A registers and O are in
    // flight until then).
    float acc_s[kS];
    uint32_t p_frag[Cfg::kBlockN / Cfg::kKStep][4];
    // ---- S = Qi Kj^T: K-major A and B, one k-step (k16; e4m3: k32) per 32 bytes of a box's
    // kRowBytes-byte rows (boxes kRows x kRowBytes apart), 8-row atoms kAtomBytes apart.
    // Issued and committed as one group, not waited for.
    auto issue_s = [&](int i) {
      const int s = i % Cfg::kStages;
      const uint8_t* tK = sK + s * Cfg::kKVBytes;
      mbarrier_wait(&k_full[s], uint32_t((i / Cfg::kStages) & 1));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::kHeadDim / Cfg::kKStep; ++kk) {
        const int box = kk * 32 / Cfg::kRowBytes, in_box = kk * 32 % Cfg::kRowBytes;
        const uint64_t a = make_smem_desc(sQc + box * Cfg::kRowsPerWg * Cfg::kRowBytes + in_box,
                                          16, Cfg::kAtomBytes, Cfg::kSwizzle);
        const uint64_t bd = make_smem_desc(tK + box * Cfg::kBoxBytesKV + in_box, 16,
                                           Cfg::kAtomBytes, Cfg::kSwizzle);
        wgmma_ss<Cfg::kBlockN, T>(acc_s, a, bd, kk > 0);
      }
      wgmma_commit_group();
    };
    // ---- mask and online softmax of block n's S (in acc_s: P, unpacked), alpha for O.
    float alpha[2];
    bool rescale = false;
    auto softmax = [&](int n) {
      const int n0 = n * Cfg::kBlockN;
      rescale = false;
      // ---- mask: keys past the sequence and outside the row's window get -inf (edge blocks
      // only; rows past seqlen_q are never stored).
      if (n < inner_lo || n >= inner_hi) {
#pragma unroll
        for (int e = 0; e < kS; ++e) {
          const int i_row = row_lo + 8 * ((e % 4) / 2), key = n0 + 8 * (e / 4) + 2 * t + e % 2;
          if (!score::key_visible(seq, left, right, i_row, key)) acc_s[e] = excluded;
        }
      }

      // ---- online softmax (the sm_80 kernel's, lazy rescale included): a row's scores
      // are spread over the 4 lanes of a quad.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m_use;
        if constexpr (kFp8) {
          // The thread's largest scaled score (the smallest raw one where fold < 0), the
          // exact max (lazy 0), and 2^8 for P's range.
          float best = flip ? INFINITY : -INFINITY;
          if (flip) {
#pragma unroll
            for (int j = 0; j < kS / 4; ++j)
              best = fminf(best, fminf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
          } else {
#pragma unroll
            for (int j = 0; j < kS / 4; ++j)
              best = fmaxf(best, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
          }
          m_use = sm90_detail::lazy_max_step(m[r], best * fold, 1.0f, alpha[r], 0.0f) -
                  float(kFp8POffset);
        } else {
          float raw_max = -INFINITY;
#pragma unroll
          for (int j = 0; j < kS / 4; ++j)
            raw_max = fmaxf(raw_max, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
          m_use = sm90_detail::lazy_max_step(m[r], raw_max, fold, alpha[r]);
        }
        rescale |= alpha[r] != 1.0f;
        float row_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kS / 4; ++j)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            acc_s[4 * j + e] = exp2_approx(fmaf(acc_s[4 * j + e], fold, -m_use));
            row_sum += acc_s[4 * j + e];
          }
        l[r] = l[r] * alpha[r] + row_sum;
      }
    };
    // ---- O = O alpha (a warp's rows moved: a vote), P packed as wgmma A fragments: n-tiles
    // 2kk, 2kk+1 of S are k-step kk's A (mma.sync's layout, which wgmma's register A keeps per
    // warp). e4m3, k32: register x of k-step kk holds 4 keys of row g (x even) or g + 8 (x
    // odd), A's k = 4t..4t+3 (x < 2) or 16 + 4t.. (x >= 2); the thread has keys 2t, 2t+1 of
    // each n-tile, so A's k = 16h + 4t + q holds key 16h + 8 (q / 2) + 2t + q % 2 of the
    // 32-key chunk, the order in which the pre-pass stored Vj^T's columns (v_t_key).
    auto rescale_and_pack = [&] {
      if (warp_ballot(rescale) != 0u) {
#pragma unroll
        for (int e = 0; e < kO; ++e) acc_o[e] *= alpha[(e % 4) / 2];
      }
#pragma unroll
      for (int kk = 0; kk < Cfg::kBlockN / Cfg::kKStep; ++kk)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          if constexpr (kFp8) {
            const float* q4 = acc_s + 16 * kk + 8 * (x / 2) + 2 * (x % 2);  // n-tiles 4kk + 2(x/2)
            p_frag[kk][x] = uint32_t(pack_fp8x2<e4m3_t>(q4[0], q4[1])) |
                            uint32_t(pack_fp8x2<e4m3_t>(q4[4], q4[5])) << 16;
          } else {
            p_frag[kk][x] = pack2<T>(acc_s[8 * kk + 2 * x], acc_s[8 * kk + 2 * x + 1]);
          }
        }
    };

    // Ping-pong (FlashAttention-3): the consumers take turns to issue their wgmma, so that one
    // warpgroup's GEMMs run while the other does its softmax. A turn is a phase of the
    // consumer's `turn` barrier, completed by the other consumer's 128 arrivals once it has
    // issued; consumer 1 hands consumer 0 its first. (Scheduling only: no data passes.)
    uint32_t turns = 0;
    auto take_turn = [&] {
      if constexpr (kOverlap) mbarrier_wait(&turn[c], turns++ & 1u);
    };
    auto give_turn = [&] {
      if constexpr (kOverlap) mbarrier_arrive(&turn[1 - c]);
    };
    if (kOverlap && c == 1) mbarrier_arrive(&turn[0]);
    take_turn();
    issue_s(0);
    give_turn();
    wgmma_wait_group<0>();
    mbarrier_arrive(&k_empty[0]);  // this thread is done with K's stage
    softmax(n_begin);
    rescale_and_pack();
    // One key block; `more` (a block follows) is a compile-time constant, the last block
    // peeled, and every block commits one group and waits to depth 1, so that ptxas can prove
    // S(j+1) retired before its softmax reads it. (A runtime `more` or a data-dependent wait
    // depth makes ptxas serialise every wgmma: warning C7514, no overlap.)
    // e4m3: V^T holds V's NaN codes as 0, so that the wgmma never meets an excluded pair's 0
    // x NaN (the strong zero); a block whose V held one (the pre-pass's flag) gets O's NaN
    // back here, once P Vj retired, in each row and column an included pair meets it.
    // (e4m3 has no infinities.) Rare: reads V's codes from global memory.
    auto v_nan_fix = [&](int n) {
      if (maps.v_nan[(int64_t(b) * p.heads_kv + h_kv) * maps.v_blocks + n] == 0) return;
      const uint8_t* v8 = static_cast<const uint8_t*>(p.v) + h_kv * p.v_head_stride +
                          score::k_base(p, seq, b, p.v_batch_stride, p.v_row_stride);
#pragma unroll 1
      for (int kr = 0; kr < Cfg::kBlockN; ++kr) {
        const int key = n * Cfg::kBlockN + kr;
        const bool in_lo = score::included<false>(p, seq, b, h, row_lo, key);
        const bool in_hi = score::included<false>(p, seq, b, h, row_lo + 8, key);
        if (!in_lo && !in_hi) continue;
        const uint8_t* v_row = v8 + int64_t(key) * p.v_row_stride;
#pragma unroll
        for (int jn = 0; jn < kO / 4; ++jn)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * jn + 2 * t + e;
            if (col < p.head_dim_v && (v_row[col] & 0x7F) == 0x7F) {
              if (in_lo) acc_o[4 * jn + e] = NAN;
              if (in_hi) acc_o[4 * jn + 2 + e] = NAN;
            }
          }
      }
    };
    auto step = [&](int n, int i, auto more_c) {
      constexpr bool more = decltype(more_c)::value;
      const int s = i % Cfg::kStages;
      const uint32_t parity = uint32_t((i / Cfg::kStages) & 1);
      const uint8_t* tV = sV + s * Cfg::kKVBytes;
      [[maybe_unused]] const int n0 = n * Cfg::kBlockN;  // (the rare block)

      mbarrier_wait(&v_full[s], parity);
      // The strong zero: an edge block whose Vj holds NaN or Inf (each warp scans the whole
      // tile, so the four warps of the warpgroup agree without talking).
      bool v_nonfinite = false;
      if (kEdges && n >= n_edge) {
        bool any = false;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(tV);
        for (int x = lane; x < Cfg::kKVBytes / 4; x += 32)
          any |= sm90_detail::nonfinite_bits<T>(uint16_t(words[x])) ||
                 sm90_detail::nonfinite_bits<T>(uint16_t(words[x] >> 16));
        v_nonfinite = warp_ballot(any) != 0u;
      }
      float o_before[kEdges && kOverlap ? kO : 1];  // the rare block's O, kept through P Vj
      if constexpr (kEdges && kOverlap) {
        if (v_nonfinite) {
#pragma unroll
          for (int e = 0; e < kO; ++e) o_before[e] = acc_o[e];
        }
      }
      // The overlap: the next block's S is issued now, ahead of P Vj, so that its softmax
      // runs under P Vj.
      take_turn();
      if (kOverlap && more) issue_s(i + 1);
      if (kOverlap || !v_nonfinite) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::kBlockN / Cfg::kKStep; ++kk) {
          if constexpr (kFp8) {
            // ---- O += P Vj with Vj^T K-major (keys contiguous: d rows of 128 bytes, one box),
            // k32 steps 32 bytes apart, 8-row atoms 1024 bytes (SBO).
            const uint64_t bd = make_smem_desc(tV + kk * 32, 16, 1024, SmemSwizzle::k128B);
            wgmma_rs<Cfg::kHeadDim, T, T, 0>(acc_o, p_frag[kk], bd, true);
          } else {
            // ---- O += P Vj: Vj N-major (head dims contiguous), k16 steps 16 rows (2 KiB)
            // apart, 64-column boxes kBlockN x 128 bytes apart (LBO), 8-row atoms 1024 bytes
            // (SBO).
            const uint64_t bd = make_smem_desc(tV + kk * 16 * 128, Cfg::kBoxBytesKV, 1024,
                                               SmemSwizzle::k128B);
            wgmma_rs<Cfg::kHeadDim, T, T, 1>(acc_o, p_frag[kk], bd, true);
          }
        }
      }
      wgmma_commit_group();  // empty in the rare block in turn: one group per block either way
      give_turn();
      if constexpr (kOverlap) {
        if (more) {
          // S(j+1) retired (the group after it is P Vj's)
          wgmma_wait_group<1>();
          mbarrier_arrive(&k_empty[(i + 1) % Cfg::kStages]);
          softmax(n + 1);
        }
      }
      wgmma_wait_group<0>();  // P Vj retired (in turn: P Vj, then S(j+1) and its softmax)
      // The rare block's product, here when no wgmma is in flight. With the overlap its P Vj
      // wgmma ran too (its result discarded: O restored first), so that every path leaves the
      // same wgmma in flight on O: a path that skips them makes ptxas put a warpgroup.arrive
      // on it and serialise every wgmma (C7520); in turn, skipping them is clean.
      if constexpr (kEdges) if (v_nonfinite) {
        if constexpr (kOverlap) {
#pragma unroll
          for (int e = 0; e < kO; ++e) acc_o[e] = o_before[e];
        }
        // The rare block: a plain product over the block's keys, P (as packed for the wgmma)
        // from the quad's lanes by shuffles, skipping excluded pairs; an included pair that
        // meets NaN or Inf makes O NaN (NaN stands for +-Inf, as in strong_zero.cuh). Unrolled
        // over the k-steps (p_frag by constant indices: indexed by a loop counter it would
        // live in local memory), rolled over the 16 keys of each.
#pragma unroll
        for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
#pragma unroll 1
          for (int q = 0; q < 16; ++q) {
            // A layout: registers 0/1 hold rows g/g+8 at keys 2t, 2t+1; 2/3 the 8 keys after.
            const int half = q / 8, src = (q % 8) / 2, e = q % 2;
            const uint32_t mine_lo = half ? p_frag[kk][2] : p_frag[kk][0];
            const uint32_t mine_hi = half ? p_frag[kk][3] : p_frag[kk][1];
            const uint32_t w_lo = shfl_idx(mine_lo, (lane & ~3) | src);
            const uint32_t w_hi = shfl_idx(mine_hi, (lane & ~3) | src);
            const float p_lo = to_float(from_bits<T>(uint16_t(w_lo >> (16 * e))));
            const float p_hi = to_float(from_bits<T>(uint16_t(w_hi >> (16 * e))));
            const int kr = 16 * kk + q, key = n0 + kr;
            const bool in_lo = score::included<false>(p, seq, b, h, row_lo, key);
            const bool in_hi = score::included<false>(p, seq, b, h, row_lo + 8, key);
            // Vj's row kr as TMA swizzled it (64-column boxes of kBlockN x 128 bytes, the 16-byte
            // chunk XORed with the row mod 8 -- PTX ISA "Tensor-map" swizzle modes), each
            // column one XOR with the row's phase: the 64 full offsets hoisted out
            // of the loop would take 64 registers).
            const uint8_t* v_row = tV + kr * 128 + 4 * t;
            const uint32_t v_row_s = smem_u32(v_row);
            const int phase = (kr % 8) * 16;
            // One 32-bit word per n-tile: columns 2t, 2t+1 of its 8, for both rows.
#pragma unroll
            for (int jn = 0; jn < kO / 4; ++jn) {
              const uint32_t w = sm90_detail::lds_u32(
                  v_row, v_row_s, (jn / 8) * Cfg::kBoxBytesKV + (((jn % 8) * 16) ^ phase));
#pragma unroll
              for (int e2 = 0; e2 < 2; ++e2) {
                const uint16_t bits = uint16_t(w >> (16 * e2));
                const float v = to_float(from_bits<T>(bits));
                const bool bad = sm90_detail::nonfinite_bits<T>(bits);
                if (in_lo) acc_o[4 * jn + e2] = bad ? NAN : fmaf(p_lo, v, acc_o[4 * jn + e2]);
                if (in_hi) acc_o[4 * jn + 2 + e2] = bad ? NAN : fmaf(p_hi, v, acc_o[4 * jn + 2 + e2]);
              }
            }
          }
        }
      }
      mbarrier_arrive(&v_empty[s]);  // this thread is done with Vj's stage
      if constexpr (!kOverlap) {
        if (more) {
          issue_s(i + 1);
          wgmma_wait_group<0>();
          mbarrier_arrive(&k_empty[(i + 1) % Cfg::kStages]);
          softmax(n + 1);
        }
      }
      if constexpr (kFp8) v_nan_fix(n);
      if (more) rescale_and_pack();
    };
    int n = n_begin, i = 0;
    for (; n + 1 < n_end; ++n, ++i) step(n, i, std::true_type{});
    step(n, i, std::false_type{});  // n_begin < n_end here: the last block exists
  }

  // ---- epilogue: l over the quad, O /= l, lse; as flash_fwd.cuh (l = 0: out 0 or NaN,
  // lse -inf; a NaN l: NaN).
  const bool partial = launch.num_splits > 1;
  const int dv = p.head_dim_v;
  TO* O = static_cast<TO*>(p.o) + h * p.o_head_stride +
         score::q_base(p, seq, b, p.o_batch_stride, p.o_row_stride);
  float* lse = static_cast<float*>(p.lse) + h * p.lse_head_stride +
               score::q_base(p, seq, b, p.lse_batch_stride, p.lse_row_stride);
  const int64_t partial_row0 = ((int64_t(split) * p.batch + b) * p.heads_q + h) * p.seqlen_q;
  // O through shared memory and TMA stores: each warp stages its 16 rows in its own part of
  // sO, laid out as the O map's 128-byte swizzle reads it; rows past seqlen_q and columns past
  // head_dim_v are clipped by the map. Whole-line writes in place of 4-byte stores spread over
  // 8 rows.
  const bool o_by_tma = Cfg::kOStageBytes > 0 && maps.o_tma && !partial;
  uint8_t* const o_stage = sO + (c * Cfg::kOBoxes * Cfg::kRowsPerWg + 16 * warp) * 128;
  // e4m3: O and l carry V's descale and P's 2^8 (kFp8POffset) still.
  const float o_factor =
      kFp8 ? descale_at(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride, b, h_kv)
           : 1.0f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += shfl_xor(l[r], 1);
    l[r] += shfl_xor(l[r], 2);
    const float inv_l = l[r] != 0.0f ? o_factor / l[r] : 0.0f;
    const float row_lse =
        l[r] != 0.0f ? (m[r] + log2f(l[r]) - (kFp8 ? kFp8POffset : 0)) * score::kLn2 : -INFINITY;
    const int i_row = row_lo + 8 * r;
    if (o_by_tma) {
      const int row = g + 8 * r;  // within the warp's 16
#pragma unroll
      for (int j = 0; j < kO / 4; ++j)
        *reinterpret_cast<uint32_t*>(o_stage + (j / 8) * Cfg::kRowsPerWg * 128 + row * 128 +
                                     (((j % 8) ^ (row % 8)) * 16) + 4 * t) =
            pack2<TO>(acc_o[4 * j + 2 * r] * inv_l, acc_o[4 * j + 2 * r + 1] * inv_l);
    }
    if (i_row >= seq.sq) continue;
    if (!o_by_tma) {
#pragma unroll
      for (int j = 0; j < kO / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * t + e;
          if (col >= dv) continue;
          const float o = acc_o[4 * j + 2 * r + e] * inv_l;
          if (partial)
            launch.o_partial[(partial_row0 + i_row) * dv + col] = o;
          else
            O[i_row * p.o_row_stride + col] = from_float<TO>(o);
        }
    }
    if (t == 0) {
      if (partial) launch.lse_partial[partial_row0 + i_row] = row_lse;
      else lse[i_row * p.lse_row_stride] = row_lse;
    }
  }
  if (o_by_tma) {
    // The staged bytes, written through the generic proxy, become visible to the TMA's reads
    // (each writer's fence, then the warp's barrier); the store has read them before exit.
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
      for (int x = 0; x < Cfg::kOBoxes; ++x) {
        const int32_t at[4] = {x * 64, m0 + c * Cfg::kRowsPerWg + 16 * warp, h, b};
        tma_store<4>(&maps.o, at, o_stage + x * Cfg::kRowsPerWg * 128);
      }
      bulk_commit_group();
      bulk_wait_group_read<0>();
    }
  }
}

// The e4m3 kernel's P Vj reads Vj^T (8-bit wgmma operands are K-major): V^T of each (batch
// entry, kv head) as head_dim_v rows of `vt_row` bytes (the keys, padded to whole key blocks
// with 0), made by this pre-pass. Within each 32-key chunk, column c holds key v_t_key(c),
// the order of the keys in P's A fragments (see rescale_and_pack), so that P needs no
// shuffle. A NaN code is stored as 0, and v_nan[(b, kv head, key block)] says the
// block's V held one (the kernel's v_nan_fix puts the NaN back where an included pair meets
// it). One CTA of 128 threads per (key block, kv head, batch entry). (FlashAttention-3
// transposes Vj in shared memory in its producer warps instead; that needs generic stores
// ordered by mbarriers, which the emulator's race checker does not model.)
// The key at column `col` of a 32-key chunk: A's k = 16 h + 4 t + 2 q + e holds the S
// accumulator's key 16 h + 8 q + 2 t + e (thread t's columns 2t, 2t+1 of n-tiles 2h, 2h+1).
FMHA_HD int v_t_key(int col) {
  // col = 16 h + 4 t + 2 q + e  ->  16 h + 8 q + 2 t + e
  return (col & ~15) + 8 * ((col / 2) % 2) + 2 * ((col / 4) % 4) + col % 2;
}

// The block's keys x head_dim_v codes go through shared memory: read by rows of V (16-byte
// loads where vec16: V's base, strides and head_dim_v multiples of 16 bytes; else bytes),
// written by rows of V^T (a warp writes one 128-byte row, a lane 4 keys).
template <int kBlockN>
__global__ void __launch_bounds__(kBlockN)
    fp8_v_transpose_kernel(FwdParams p, uint8_t* vt, int* v_nan, int64_t vt_row, int v_blocks,
                           bool vec16) {
  static_assert(kBlockN == 128, "a warp writes a 128-key row of V^T, 4 keys a lane");
  constexpr int kPitch = 256 + 16;  // bytes per key in the tile: d <= 256, 16-byte aligned rows
  __shared__ __align__(16) uint8_t tile[kBlockN * kPitch];
  const int n = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const score::Seq seq = score::seq_of(p, b);
  const int dv = p.head_dim_v, keys = min(kBlockN, seq.sk - n * kBlockN);
  const uint8_t* in = static_cast<const uint8_t*>(p.v) + hk * p.v_head_stride +
                      score::k_base(p, seq, b, p.v_batch_stride, p.v_row_stride) +
                      int64_t(n) * kBlockN * p.v_row_stride;
  if (vec16) {
    const int chunks = dv / 16;
    for (int c = tid; c < kBlockN * chunks; c += kBlockN) {
      const int key = c / chunks, x = c % chunks;
      struct alignas(16) Chunk { uint32_t w[4]; };  // one 16-byte load / store
      Chunk w = {{0, 0, 0, 0}};
      if (key < keys)
        w = *reinterpret_cast<const Chunk*>(in + int64_t(key) * p.v_row_stride + 16 * x);
      *reinterpret_cast<Chunk*>(tile + key * kPitch + 16 * x) = w;
    }
  } else {
    for (int e = tid; e < kBlockN * dv; e += kBlockN) {
      const int key = e / dv, col = e % dv;
      tile[key * kPitch + col] = key < keys ? in[int64_t(key) * p.v_row_stride + col] : uint8_t(0);
    }
  }
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  int key_of[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) key_of[j] = (lane / 8) * 32 + v_t_key((4 * lane + j) % 32);
  uint8_t* out =
      vt + (int64_t(b) * p.heads_kv + hk) * dv * vt_row + int64_t(n) * kBlockN + 4 * lane;
  bool nan = false;
  for (int col = warp; col < dv; col += kBlockN / 32) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint8_t x = tile[key_of[j] * kPitch + col];
      const bool bad = (x & 0x7F) == 0x7F;  // e4m3fn: S.1111.111 is NaN (no infinities)
      nan |= bad;
      word |= uint32_t(bad ? 0 : x) << (8 * j);
    }
    *reinterpret_cast<uint32_t*>(out + int64_t(col) * vt_row) = word;
  }
  const int any = __syncthreads_or(nan);
  if (tid == 0) v_nan[(int64_t(b) * p.heads_kv + hk) * v_blocks + n] = any;
}

// Host side (cuda/flash_fwd_sm90.cu): whether the sm_90 kernel takes a call (the sm_80 one
// takes the rest), and the tensor maps of a launch.
bool flash_fwd_sm90_claims(const FwdParams& p);
// The call may give a pair zero weight: a window (causal included) or varlen.
inline bool flash_fwd_sm90_edges(const FwdParams& p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.cu_seqlens_q != nullptr;
}
int flash_fwd_sm90_tile(const FwdParams& p);
// Q and K in boxes of box_cols columns (kRowBytes: the swizzle's span) x 64 / block_n rows;
// V (16-bit) likewise, or (e4m3) V^T at vt with rows of vt_row bytes; O by TMA where it can.
Sm90Maps flash_fwd_sm90_maps(const FwdParams& p, int block_n, int box_cols,
                             const uint8_t* vt = nullptr, int64_t vt_row = 0, int tile = 0);

// The launcher every generated instantiation (csrc/cuda/instantiations/flash_fwd_sm90_*)
// instantiates once. Returns the number of key splits it used.
template <typename T, int kHeadDim>
int run_flash_fwd_sm90(const FwdParams& p, Stream stream) {
  constexpr bool kFp8 = std::is_same<T, e4m3_t>::value;
  using Cfg = FlashFwdSm90Config<kHeadDim, kFp8>;
  FwdLaunch launch;
  launch.vec = true;
  launch.m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  launch.num_splits = flash_fwd_num_splits(p, launch.m_blocks, n_blocks, 1);
  Scratch scratch(launch.partial_bytes(p), stream);
  launch.place_partials(p, scratch.as<float>());
  // e4m3: V^T and its NaN flags, made first on the same stream.
  const int64_t vt_row = int64_t(n_blocks) * Cfg::kBlockN;
  const int64_t vt_bytes = kFp8 ? int64_t(p.batch) * p.heads_kv * p.head_dim_v * vt_row : 0;
  const int64_t nan_flags = kFp8 ? int64_t(p.batch) * p.heads_kv * n_blocks : 0;
  Scratch v_t(size_t(vt_bytes + nan_flags * int64_t(sizeof(int))), stream);
  uint8_t* const vt = v_t.as<uint8_t>();
  int* const v_nan = reinterpret_cast<int*>(vt + vt_bytes);  // vt_bytes: a multiple of 128
  Sm90Maps maps = flash_fwd_sm90_maps(p, Cfg::kBlockN, Cfg::kBoxCols, vt, vt_row, kHeadDim);
  if constexpr (kFp8) {
    if (n_blocks > 0) {
      maps.v_nan = v_nan;
      maps.v_blocks = n_blocks;
      const bool vec16 = reinterpret_cast<uintptr_t>(p.v) % 16 == 0 &&
                         p.v_row_stride % 16 == 0 && p.v_head_stride % 16 == 0 &&
                         p.v_batch_stride % 16 == 0 && p.head_dim_v % 16 == 0;
      FMHA_LAUNCH(fp8_v_transpose_kernel<Cfg::kBlockN>, dim3(n_blocks, p.heads_kv, p.batch),
                  dim3(Cfg::kBlockN), 0, stream, p, vt, v_nan, vt_row, n_blocks, vec16);
    }
  }
  const dim3 grid(launch.m_blocks * launch.num_splits, p.heads_q, p.batch);
  auto go = [&](auto kernel) {
    set_max_dynamic_smem_sm90(kernel, Cfg::kSmemBytes);
    FMHA_LAUNCH(kernel, grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, maps, p, launch);
  };
  if constexpr (kFp8) {
    // out as bfloat16 (the default, as flash-attn 3) or float16 (check_params allows no other)
    if (p.o_dtype == DType::kFloat16) {
      go(&flash_fwd_sm90_kernel<T, half_t, Cfg, false>);
      return run_flash_fwd_combine<half_t, kHeadDim>(p, launch, stream);
    }
    go(&flash_fwd_sm90_kernel<T, bf16_t, Cfg, false>);
    return run_flash_fwd_combine<bf16_t, kHeadDim>(p, launch, stream);
  } else {
    if constexpr (Cfg::kEdges) {
      if (flash_fwd_sm90_edges(p)) {
        go(&flash_fwd_sm90_kernel<T, T, Cfg, true>);
      } else {
        go(&flash_fwd_sm90_kernel<T, T, Cfg, false>);
      }
    } else {
      go(&flash_fwd_sm90_kernel<T, T, Cfg, false>);
    }
    return run_flash_fwd_combine<T, kHeadDim>(p, launch, stream);
  }
}

}  // namespace gpu
}  // namespace fmha
