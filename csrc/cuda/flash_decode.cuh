// Decode over KV caches on CUDA: FlashDecoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding
// for long-context inference", 2023) over contiguous or paged caches (Kwon et al.,
// "Efficient Memory Management for Large Language Model Serving with PagedAttention", 2023),
// written only with the wrappers of cuda/primitives.cuh so that it runs on sm_80+ GPUs and,
// in CI, under the SIMT emulator. Semantics: docs/semantics.md, "KV caches".
//
// One call is three kernels on the caller's stream, and never a host synchronisation:
//   1. kvcache_check_kernel: the lengths and block-table entries (device memory) against
//      the capacity and the pool; one CTA writes the call's refusal code.
//   2. kvcache_append_kernel: k_new / v_new into rows cache_seqlens[b] ... of each cache,
//      unless the call was refused.
//   3. flash_decode_kernel, then (with splits) flash_fwd_combine_kernel (cuda/flash_fwd.cuh).
//
// Decode has few query rows and many keys, so the work is cut along the keys. One CTA per
// (row block, key split, kv head, batch):
//   - Rows. The kv head's whole GQA group, seqlen_q x heads_q / heads_kv query rows ordered
//     (query, head), is one set of rows: each key row is read once for all the query heads
//     that share it. kRows rows per CTA (4 or 8); longer groups take more row blocks.
//   - Keys. Split s owns keys [s * split_keys, (s + 1) * split_keys) of its sequence, at
//     positions fixed by the call's shape (never by the capacity or the pool layout: paged
//     and contiguous caches give bitwise-equal results); the 4 warps take its 32-key chunks
//     in turn, each with its own softmax state, merged through shared memory at the end.
//   - Per chunk, per warp (Algorithm 1 of FlashAttention-2 with one key per lane):
//       S   = q K^T     lane t reads key row t (16-byte loads, through the block table) and
//                       dots it with the CTA's q rows, held in shared memory as float32
//       m'  = max(m, rowmax S)    (warp shuffles), P = exp2(S - m'), l = l exp2(m - m') + P
//       O   = O exp2(m - m') + P V   P goes through shared memory; lane t owns head dims
//                       [t * kCols, (t + 1) * kCols) of O and reads them of each V row
//                       (coalesced), so no reduction over the head dim is needed
//     A chunk that holds a pair of zero weight for some row (the window's edge) skips the
//     product for those pairs instead of multiplying, so a NaN in a V row nobody sees stays
//     out (docs/semantics.md, "Non-finite inputs").
//   - Splits write float32 partial O (normalised) and lse; the combine merges them by lse.
//     Without splits the CTA writes out and lse itself.
//
// 8-bit caches (fmha/kvquant.h; docs/semantics.md, "8-bit KV caches") are the same kernels
// with the cache element type C = Code8<format> instead of T: each lane widens the codes it
// loads in registers (8 codes per 8-byte load of a K row), the key's k_scale multiplies its
// S entries and its v_scale its P entries (after l took them), and the append quantises.
// With unit scales an 8-bit cache gives bitwise the result of a 16-bit cache holding the
// codes' values, as on the CPU.
//
// Prediction, unconfirmed (no GPU has run this kernel; docs/cuda_kernels.md): the loads are
// independent across lanes and chunks and the CUDA-core FMAs per key row are 2 x rows x
// head_dim, so for GQA groups up to 8 the kernel should stream the cache at a large fraction
// of HBM bandwidth; a group of 16 or more rows would want the tensor cores.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/flash_decode.h"
#include "cuda/flash_fwd.cuh"  // FwdLaunch and flash_fwd_combine_kernel
#include "cuda/primitives.cuh"
#include "cuda/score.cuh"
#include "fmha/kvquant.h"

namespace fmha {
namespace gpu {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kDecodeChunk = 32;        // keys per warp step: one per lane
constexpr int kDecodeSplitKeys = 256;   // keys per split unless num_splits says otherwise

// FwdLaunch's split fields (num_splits over the capacity, split_keys, the partials) plus:
struct DecodeLaunch : FwdLaunch {
  int rows = 0;         // query rows per kv head: seqlen_q * (heads_q / heads_kv)
  int row_blocks = 1;   // blockIdx.x = split * row_blocks + row block
  const int* refused = nullptr;  // the call's refusal code (kvcache_check_kernel)
};

// One byte of an 8-bit cache in `format`: the kernels' element type for such caches.
template <KvCode F>
struct Code8 {
  static constexpr KvCode kFormat = F;
  uint8_t bits;
};
template <typename C>
constexpr bool is_code8 = false;
template <KvCode kFormat>
constexpr bool is_code8<Code8<kFormat>> = true;

// CTAs per SM that the register budget of the append and decode kernels assumes: none for
// 16-bit caches (ptxas's own choice); three for 8-bit ones, i.e. up to 168 registers. Left
// to itself ptxas gives some 8-bit kernels 32-96 registers and spills: it aims at an
// occupancy that widening the codes does not fit in.
template <typename C>
constexpr int decode_min_ctas() {
  return is_code8<C> ? 3 : 0;
}

// The value of a code, exact in float (fmha/kvquant.h's decode, without its branches):
//   int8  the integer;  e5m2  the top byte of a half;
//   e4m3  its sign and 7 magnitude bits placed in a half's sign, exponent and mantissa
//         (bias 15, not 7), times 2^8: subnormal codes become half subnormals, whose
//         conversion to float is exact and forms no float subnormal (so flushing those to
//         zero, in a build or a thread, changes nothing); 0x7F is NaN.
template <KvCode kFormat>
FMHA_DEVICE float to_float(Code8<kFormat> x) {
  const uint32_t c = x.bits;
  if constexpr (kFormat == KvCode::kInt8) {
    return float(int(int8_t(c)));
  } else if constexpr (kFormat == KvCode::kE5M2) {
    return to_float(from_bits<half_t>(uint16_t(c << 8)));
  } else {
    const uint32_t mag = c & 0x7Fu;
    const float v = to_float(from_bits<half_t>(uint16_t(((c & 0x80u) << 8) | (mag << 7))));
    return mag == 0x7Fu ? NAN : v * 256.0f;
  }
}

namespace decode_detail {

// Eight 16-bit elements, one 16-byte load.
struct __align__(16) Pack8 {
  uint32_t w[4];
};
// Four floats of shared memory, one 16-byte load (a broadcast when every lane reads them).
struct __align__(16) Float4 {
  float x[4];
};

// x[0..7] = row[c .. c + 8) as float, zero past n (the head dim); 16-byte loads when vec.
template <typename T>
FMHA_DEVICE void load8(const T* row, int c, int n, bool vec, float (&x)[8]) {
  if (vec && c + 8 <= n) {
    const Pack8 v = *reinterpret_cast<const Pack8*>(row + c);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[2 * e] = to_float(from_bits<T>(uint16_t(v.w[e] & 0xFFFFu)));
      x[2 * e + 1] = to_float(from_bits<T>(uint16_t(v.w[e] >> 16)));
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = c + e < n ? to_float(row[c + e]) : 0.0f;
  }
}

// Eight 8-bit codes, one 8-byte load.
struct __align__(8) Codes8 {
  uint32_t w[2];
};

// Four 16-bit elements, one 8-byte load.
struct __align__(8) Pack4 {
  uint32_t w[2];
};

// kCols elements of a V row as loaded, widened to float when used: the elements themselves,
// two 16-bit ones a word (four 8-bit codes, below) -- half (a quarter) of the registers
// floats would take for the rows the P V loop keeps in flight. One 4-, 8- or 16-byte load
// for 2, 4 or 8 columns when vec (c0 is then a multiple of kCols: the lane's columns).
template <typename C, int kCols>
struct RawCols {
  static constexpr int kWords = (kCols + 1) / 2;
  uint32_t w[kWords];  // element c in half c % 2 of word c / 2; 0 (the value 0) past the row
  FMHA_DEVICE void load(const C* row, int c0, int n, bool vec) {
    constexpr bool kVector = kCols == 2 || kCols == 4 || kCols == 8;
    if (kVector && vec && c0 + kCols <= n) {
      if constexpr (kCols == 2) w[0] = *reinterpret_cast<const uint32_t*>(row + c0);
      if constexpr (kCols == 4) {
        const Pack4 v = *reinterpret_cast<const Pack4*>(row + c0);
        w[0] = v.w[0];
        w[1] = v.w[1];
      }
      if constexpr (kCols == 8) {
        const Pack8 v = *reinterpret_cast<const Pack8*>(row + c0);
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = v.w[i];
      }
    } else {
      zero();
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        if (c0 + c < n) w[c / 2] |= uint32_t(bits_of(row[c0 + c])) << (16 * (c % 2));
    }
  }
  FMHA_DEVICE void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  FMHA_DEVICE void widen(float (&y)[kCols]) const {
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      y[c] = to_float(from_bits<C>(uint16_t(w[c / 2] >> (16 * (c % 2)))));
  }
};
template <KvCode kFormat, int kCols>
struct RawCols<Code8<kFormat>, kCols> {
  static_assert(kCols == 2 || kCols == 4 || kCols % 8 == 0,
                "RawCols: the vector loads below cover 2, 4 or a multiple of 8 codes");
  static constexpr int kWords = (kCols + 3) / 4;
  uint32_t w[kWords];  // code c in byte c % 4 of word c / 4; 0 (the value 0) past the row
  FMHA_DEVICE void load(const Code8<kFormat>* row, int c0, int n, bool vec) {
    const uint8_t* b = &row[c0].bits;
    if (vec && c0 + kCols <= n && kCols >= 2) {
      if constexpr (kCols == 2) w[0] = *reinterpret_cast<const uint16_t*>(b);
      if constexpr (kCols == 4) w[0] = *reinterpret_cast<const uint32_t*>(b);
      if constexpr (kCols % 8 == 0) {
#pragma unroll
        for (int i = 0; i < kCols / 8; ++i) {
          const Codes8 v = *reinterpret_cast<const Codes8*>(b + 8 * i);
          w[2 * i] = v.w[0];
          w[2 * i + 1] = v.w[1];
        }
      }
    } else {
      zero();
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        if (c0 + c < n) w[c / 4] |= uint32_t(b[c]) << (8 * (c % 4));
    }
  }
  FMHA_DEVICE void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  FMHA_DEVICE void widen(float (&y)[kCols]) const {
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      y[c] = to_float(Code8<kFormat>{uint8_t(w[c / 4] >> (8 * (c % 4)))});
  }
  // Elements [c0, c0 + 8) only (c0 a multiple of 8).
  FMHA_DEVICE void widen8(int c0, float (&y)[8]) const {
#pragma unroll
    for (int c = 0; c < 8; ++c)
      y[c] = to_float(Code8<kFormat>{uint8_t(w[(c0 + c) / 4] >> (8 * (c % 4)))});
  }
};

FMHA_DEVICE float warp_max(float x) {
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) x = fmaxf(x, shfl_xor(x, w));
  return x;
}
FMHA_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) x += shfl_xor(x, w);
  return x;
}

}  // namespace decode_detail

// 1. The call's lengths and block table against the capacity and the pool, and static
// scales of 8-bit caches (finite, > 0): one CTA, which
// writes the call's KvCacheRefusal bits to *refused and ORs them into *flag (sticky).
// A length is checked before the blocks it implies are (a refused length reads no table),
// and the blocks before `writer` is indexed by them. writer (paged appends only: num_blocks
// zeros) records, per block, the table entry whose append writes into it; every entry that
// reads or writes a block must then be that entry (the host's rule, fmha/kvcache.h).
__global__ void __launch_bounds__(kDecodeThreads)
    kvcache_check_kernel(FwdParams p, int* refused, int* flag, int64_t* writer) {
  int code = 0;
  for (int b = threadIdx.x; b < p.batch; b += kDecodeThreads) {
    const int64_t len = p.cache_seqlens[b];
    if (len < 0) code |= kRefusedLength;
    else if (len + p.seqlen_new > p.seqlen_k) code |= kRefusedCapacity;
  }
  if (p.kv_code != KvCode::kNone && p.scale_row_stride == 0)  // static scales, per kv head
    for (int h = threadIdx.x; h < p.heads_kv; h += kDecodeThreads) {
      const float ks = p.k_scale[h * p.scale_head_stride], vs = p.v_scale[h * p.scale_head_stride];
      // NaN fails both comparisons
      if (!(ks > 0.0f && ks <= 3.402823466e38f && vs > 0.0f && vs <= 3.402823466e38f))
        code |= kRefusedScale;
    }
  // Table entry (b, i) of every sequence whose length passed, among the entries its rows
  // use: f(b, i, len, block). Sequences in turn, entries across the threads (no 64-bit
  // division, which ptxas turns into a call).
  const int max_blocks = p.block_table ? p.seqlen_k / p.block_size : 0;
  auto for_each_entry = [&](auto&& f) {
    for (int b = 0; b < p.batch; ++b) {
      const int64_t len = p.cache_seqlens[b];
      if (len < 0 || len + p.seqlen_new > p.seqlen_k) continue;  // refused above
      for (int i = threadIdx.x; i < max_blocks; i += kDecodeThreads) {
        if (int64_t(i) * p.block_size >= len + p.seqlen_new) break;  // never read
        f(b, i, len, p.block_table[b * p.block_table_stride + i]);
      }
    }
  };
  for_each_entry([&](int, int, int64_t, int block) {
    if (block < 0 || block >= p.num_blocks) code |= kRefusedBlock;
  });
  if (writer && !__syncthreads_or(code)) {  // every length and block in range
    // The entry (b, i) appending to a block stores b * max_blocks + i + 1 there (two such
    // entries both store; the loser sees it below); then every entry reading or writing a
    // block must be the one stored.
    for_each_entry([&](int b, int i, int64_t len, int block) {
      if (int64_t(i + 1) * p.block_size > len) writer[block] = int64_t(b) * max_blocks + i + 1;
    });
    __syncthreads();
    for_each_entry([&](int b, int i, int64_t, int block) {
      const int64_t w = writer[block];
      if (w != 0 && w != int64_t(b) * max_blocks + i + 1) code |= kRefusedShared;
    });
  }
  int all = 0;
#pragma unroll
  for (int bit = 1; bit <= kRefusedScale; bit *= 2)
    if (__syncthreads_or(code & bit)) all |= bit;
  if (threadIdx.x == 0) {
    *refused = all;
    if (all) *flag |= all;
  }
}

// 2. k_new / v_new row t of sequence b, kv head blockIdx.y, into cache row
// cache_seqlens[b] + t: grid (seqlen_new, heads_kv, batch). 8-bit caches (C = Code8):
// quantised as the CPU does (fmha/kvquant.h): with dynamic scales the row's scale is
// max |x| over its finite entries / qmax, written next to the row first.
namespace decode_detail {
template <typename T, KvCode kFormat>
FMHA_DEVICE void append_codes_row(const T* src, uint8_t* dst, float* scale, bool dynamic,
                                  int dim, float* red) {
  float top = 0.0f;
  for (int c = threadIdx.x; c < dim; c += kDecodeThreads) {
    const float x = fabsf(to_float(src[c]));
    if (x <= 3.402823466e38f) top = fmaxf(top, x);  // finite (NaN fails the test)
  }
  top = warp_max(top);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = top;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, red[w]);
  const float s = dynamic ? kvq::dynamic_scale(kFormat, top) : *scale;
  __syncthreads();  // red is reused by the next row
  if (dynamic && threadIdx.x == 0) *scale = s;
  for (int c = threadIdx.x; c < dim; c += kDecodeThreads)
    dst[c] = kvq::encode(kFormat, to_float(src[c]) / s);
}
}  // namespace decode_detail

template <typename T, typename C>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_ctas<C>())
    kvcache_append_kernel(FwdParams p, const int* refused) {
  if (*refused) return;  // the whole call is refused: nothing is written
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int j = p.cache_seqlens[b] + t;
  C* k = static_cast<C*>(const_cast<void*>(p.k)) + h * p.k_head_stride +
         score::cache_row_offset(p, b, p.k_batch_stride, p.k_row_stride, j);
  C* v = static_cast<C*>(const_cast<void*>(p.v)) + h * p.v_head_stride +
         score::cache_row_offset(p, b, p.v_batch_stride, p.v_row_stride, j);
  const T* kn = static_cast<const T*>(p.k_new) + b * p.k_new_batch_stride +
                int64_t(t) * p.k_new_row_stride + h * p.k_new_head_stride;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.v_new_batch_stride +
                int64_t(t) * p.v_new_row_stride + h * p.v_new_head_stride;
  if constexpr (is_code8<C>) {
    constexpr KvCode kFormat = C::kFormat;
    __shared__ float red[kDecodeWarps];
    const int64_t so = kvq::scale_offset(p, b, j, h);
    const bool dynamic = p.scale_row_stride != 0;
    decode_detail::append_codes_row<T, kFormat>(kn, &k->bits, p.k_scale + so, dynamic,
                                                p.head_dim, red);
    decode_detail::append_codes_row<T, kFormat>(vn, &v->bits, p.v_scale + so, dynamic,
                                                p.head_dim_v, red);
  } else {
    for (int c = threadIdx.x; c < p.head_dim; c += kDecodeThreads) k[c] = kn[c];
    for (int c = threadIdx.x; c < p.head_dim_v; c += kDecodeThreads) v[c] = vn[c];
  }
}

// Shared memory of flash_decode_kernel, in floats.
template <int kHeadDim, int kRows>
constexpr int decode_smem_floats() {
  return kRows * kHeadDim                       // q rows
         + kDecodeWarps * kRows * kDecodeChunk  // each warp's P of its chunk
         + kDecodeWarps * kRows * (kHeadDim + 2)  // each warp's O, m, l for the merge
         + 3 * kRows;                              // each row's query, head and ALiBi slope
}

// 3. Attention of kRows query rows of kv head blockIdx.y's group over one key split; the
// caches hold C (T, or Code8 for 8-bit caches).
template <typename T, typename C, int kHeadDim, int kRows>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_ctas<C>())
    flash_decode_kernel(FwdParams p, DecodeLaunch launch) {
  using namespace decode_detail;
  constexpr int kCols = kHeadDim / 32;       // O columns per lane
  constexpr int kUnroll = kCols >= 8 ? 4 : 8;  // V rows loaded ahead in P V
  // The steady P V loop below, but for e4m3 caches: their widening leaves it too few
  // registers at 3 CTAs per SM (ptxas spills on sm_90), and they take the general loop.
  constexpr bool kSteadyLoop = !std::is_same_v<C, Code8<KvCode::kE4M3>>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_block = blockIdx.x % launch.row_blocks, split = blockIdx.x / launch.row_blocks;
  const int hkv = blockIdx.y, b = blockIdx.z;
  const int group = p.heads_q / p.heads_kv;
  const int row0 = row_block * kRows;
  const int rows = min(kRows, launch.rows - row0);

  score::Seq seq;
  seq.sq = p.seqlen_q;
  seq.sk = score::cache_rows(p, b);
  seq.off = seq.sk - seq.sq;  // bottom-right: the last query is the last row
  if (split >= launch.splits_for(seq.sk)) return;  // past the sequence: unread
  const bool refused = *launch.refused != 0;

  FMHA_DYNAMIC_SHARED(float, smem);
  float* q_s = smem;                                      // [kRows][kHeadDim]
  float* p_s = q_s + kRows * kHeadDim;                    // [warp][kRows][kDecodeChunk]
  float* o_s = p_s + kDecodeWarps * kRows * kDecodeChunk;  // [warp][kRows][kHeadDim]
  float* ml_s = o_s + kDecodeWarps * kRows * kHeadDim;     // [warp][kRows][2]: m, l
  // Row r of the CTA is query ri[r] = (row0 + r) / group of head rh[r] = hkv * group +
  // (row0 + r) % group (rows past the CTA's repeat row0). Kept in shared memory, read by
  // broadcast: in registers they would cost 3 x kRows of them through the key loop.
  float* slope = ml_s + kDecodeWarps * kRows * 2;
  int* ri = reinterpret_cast<int*>(slope + kRows);
  int* rh = ri + kRows;
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x, row = row0 + (r < rows ? r : 0);
    ri[r] = row / group;
    rh[r] = hkv * group + row % group;
    slope[r] = float(score::alibi_slope(p, b, rh[r]));
  }
  for (int e = threadIdx.x; e < kRows * kHeadDim; e += kDecodeThreads) {
    const int r = e / kHeadDim, c = e % kHeadDim;
    const int row = row0 + r;
    float x = 0.0f;
    if (r < rows && c < p.head_dim)
      x = to_float(static_cast<const T*>(p.q)[b * p.q_batch_stride +
                                               int64_t(row / group) * p.q_row_stride +
                                               (hkv * group + row % group) * p.q_head_stride + c]);
    q_s[e] = x;
  }
  __syncthreads();

  // Keys of this split that some row of the CTA sees (rows grow with r, and so do windows).
  const int left = p.window_left, right = p.window_right;
  int j_begin = split * launch.split_keys;
  int j_end = min(j_begin + launch.split_keys, seq.sk);
  j_begin = max(j_begin, score::key_lo(seq, left, row0 / group));
  j_end = min(j_end, score::key_hi(seq, right, (row0 + rows - 1) / group) + 1);
  if (refused) j_end = j_begin;  // read nothing; the rows are written as NaN

  const C* K = static_cast<const C*>(p.k) + hkv * p.k_head_stride;
  const C* V = static_cast<const C*>(p.v) + hkv * p.v_head_stride;
  float m[kRows], l[kRows], acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  }
  float* my_p = p_s + warp * kRows * kDecodeChunk;
  // V rows the P V loop can read whole, with vector loads (the steady state's condition).
  const bool whole_rows = launch.vec && p.head_dim_v == kHeadDim;

  for (int c0 = j_begin + warp * kDecodeChunk; c0 < j_end; c0 += kDecodeWarps * kDecodeChunk) {
    // S for key j = c0 + lane: this lane's key row against every q row.
    const int j = c0 + lane;
    const bool key_in = j < j_end;
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.0f;
    // The V row of this lane's key, passed to the others in the P V loop below: in a paged
    // cache, the block and the row in it (the table is read once per key).
    int v_block = b, v_row = j;
    if (key_in) {
      if (p.block_table) {
        v_block = p.block_table[b * p.block_table_stride + j / p.block_size];
        v_row = j % p.block_size;
      }
      const C* krow = K + v_block * p.k_batch_stride + int64_t(v_row) * p.k_row_stride;
      auto dot8 = [&](int c, const float (&x)[8]) {  // s += q[:, c..c+8) . x
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int h = 0; h < 8; h += 4) {
            const Float4 qv = *reinterpret_cast<const Float4*>(q_s + r * kHeadDim + c + h);
#pragma unroll
            for (int e = 0; e < 4; ++e) s[r] = fmaf(qv.x[e], x[h + e], s[r]);
          }
      };
      if constexpr (is_code8<C>) {
        // 32 codes at a time (8 registers), two groups in flight: unrolled over the whole
        // row, ptxas hoists every load and widens them all at once, and spills.
        constexpr int kGroup = kHeadDim < 32 ? kHeadDim : 32;
#pragma unroll 2
        for (int c0 = 0; c0 < kHeadDim; c0 += kGroup) {
          RawCols<C, kGroup> raw;
          raw.load(krow, c0, p.head_dim, launch.vec);
#pragma unroll
          for (int c = 0; c < kGroup; c += 8) {
            float x[8];
            raw.widen8(c, x);
            dot8(c0 + c, x);
          }
        }
      } else {
#pragma unroll
        for (int c = 0; c < kHeadDim; c += 8) {
          float x[8];
          load8(krow, c, p.head_dim, launch.vec, x);
          dot8(c, x);
        }
      }
    }
    // 8-bit caches: the key's scales, from its row's slot (the same place for K and V).
    float v_scale = 1.0f;
    if constexpr (is_code8<C>) {
      if (key_in) {
        const int64_t so = kvq::scale_offset_at(p, v_block, v_row, hkv);
        const float k_scale = p.k_scale[so];
        v_scale = p.v_scale[so];
#pragma unroll
        for (int r = 0; r < kRows; ++r) s[r] *= k_scale;
      }
    }
    // Logits, online softmax. `clean`: every row sees this lane's key (or it is past the end).
    bool clean = true;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      bool vis = key_in && r < rows && score::key_visible(seq, left, right, ri[r], j);
      if (key_in && r < rows && !vis) clean = false;
      float dcap;
      float x = score::logit_log2<false>(p, seq, s[r], b, rh[r], ri[r], j, slope[r], vis, dcap);
      x = vis ? x : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(x));
      // Nothing seen yet (m_new = -inf): the state stays; exp2(-inf - -inf) is NaN. A masked
      // key has P = 0. A NaN score has P = NaN even when fmaxf dropped it from m_new (every
      // score of the warp NaN): l turns NaN, and the merge below makes the row NaN.
      const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new);
      const float pr = x == -INFINITY ? 0.0f : exp2f(x - m_new);
      m[r] = m_new;
      l[r] = l[r] * alpha + pr;  // this lane's share; summed over the warp at the end
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= alpha;
      my_p[r * kDecodeChunk + lane] = pr * v_scale;  // l took pr unscaled
    }
    const bool all_clean = warp_ballot(!clean) == 0;
    __syncwarp();
    // O += P V over the chunk's keys; lane owns columns [lane * kCols, (lane + 1) * kCols).
    // kUnroll V rows are loaded before any is used, so that many loads are in flight.
    const int n = min(kDecodeChunk, j_end - c0);
    if (kSteadyLoop && all_clean && n == kDecodeChunk && whole_rows) {
      // The steady state: a whole chunk whose pairs all count, from aligned rows of kHeadDim
      // columns. No per-key bounds, weight or width tests, and P read four keys at a time.
      // Each O element takes the keys in order, as below, so both loops give the same bits.
      auto whole_chunk = [&](auto v_row_of) {  // v_row_of(t): the chunk's key t's V row
        const int c_lane = lane * kCols;
        for (int t0 = 0; t0 < kDecodeChunk; t0 += kUnroll) {
          RawCols<C, kCols> raw[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)  // bounds that hold: the tests fold away
            raw[u].load(v_row_of(t0 + u), c_lane, c_lane + kCols, true);
#pragma unroll
          for (int u0 = 0; u0 < kUnroll; u0 += 4) {
            float pr[kRows][4];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              const Float4 f = *reinterpret_cast<const Float4*>(my_p + r * kDecodeChunk + t0 + u0);
#pragma unroll
              for (int e = 0; e < 4; ++e) pr[r][e] = f.x[e];
            }
#pragma unroll
            for (int u = u0; u < u0 + 4; ++u) {
              float x[kCols];
              raw[u].widen(x);
#pragma unroll
              for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int c = 0; c < kCols; ++c) acc[r][c] = fmaf(pr[r][u - u0], x[c], acc[r][c]);
            }
          }
        }
      };
      if (p.block_table) {
        whole_chunk([&](int t) {
          return V + shfl_idx(v_block, t) * p.v_batch_stride +
                 int64_t(shfl_idx(v_row, t)) * p.v_row_stride;
        });
      } else {
        const C* v_chunk = V + b * p.v_batch_stride + int64_t(c0) * p.v_row_stride;
        whole_chunk([&](int t) { return v_chunk + int64_t(t) * p.v_row_stride; });
      }
    } else {
      for (int t0 = 0; t0 < n; t0 += kUnroll) {
        RawCols<C, kCols> raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int t = t0 + u;
          const int blk = shfl_idx(v_block, t), row = shfl_idx(v_row, t);
          if (t < n)
            raw[u].load(V + blk * p.v_batch_stride + int64_t(row) * p.v_row_stride,
                        lane * kCols, p.head_dim_v, launch.vec);
          else
            raw[u].zero();
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (t0 + u >= n) break;
          float x[kCols];
          raw[u].widen(x);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float pr = my_p[r * kDecodeChunk + t0 + u];
#pragma unroll
            for (int c = 0; c < kCols; ++c)
              acc[r][c] = all_clean || pr != 0.0f ? fmaf(pr, x[c], acc[r][c]) : acc[r][c];
          }
        }
      }
    }
    __syncwarp();  // my_p is rewritten by the next chunk
  }

  // ---- merge the warps: O = sum_w exp2(m_w - M) O_w / sum_w exp2(m_w - M) l_w, M = max m_w.
  float* my_o = o_s + warp * kRows * kHeadDim;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float lr = warp_sum(l[r]);
    if (lane == 0) {
      ml_s[(warp * kRows + r) * 2] = lr != lr ? NAN : m[r];  // a NaN score: m may be -inf
      ml_s[(warp * kRows + r) * 2 + 1] = lr;
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) my_o[r * kHeadDim + lane * kCols + c] = acc[r][c];
  }
  __syncthreads();

  const bool partial = launch.num_splits > 1;
  const int dv = p.head_dim_v;
  for (int e = threadIdx.x; e < kRows * kHeadDim; e += kDecodeThreads) {
    const int r = e / kHeadDim, col = e % kHeadDim;
    if (r >= rows || col >= dv) continue;
    // The largest m, NaN if any warp's is (fmaxf would drop it).
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float mw = ml_s[(w * kRows + r) * 2];
      mx = mx != mx || mw != mw ? mx + mw : fmaxf(mx, mw);
    }
    // A warp whose keys of the row all have weight 0 (m -inf: it saw none, or their scores
    // are -inf) adds its O times 0: 0, or NaN where such a key, visible, met a NaN or Inf in V
    // (0 * NaN, as the reference and the CPU give).
    float sum_l = 0.0f, sum_o = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float mw = ml_s[(w * kRows + r) * 2];
      const float scale = mw == -INFINITY ? 0.0f : exp2f(mw - mx);
      sum_l += scale * ml_s[(w * kRows + r) * 2 + 1];
      sum_o += scale * o_s[(w * kRows + r) * kHeadDim + col];
    }
    // A row with no visible key: out 0 (or that NaN), lse -inf; a NaN score made sum_l NaN:
    // NaN. A refused call: NaN everywhere.
    float o = sum_l != 0.0f ? sum_o / sum_l : sum_o;
    float lse = sum_l != 0.0f ? (mx + log2f(sum_l)) * score::kLn2 : -INFINITY;
    if (refused) o = lse = NAN;
    const int row = row0 + r, i = row / group, h = hkv * group + row % group;
    if (partial) {
      const int64_t prow = ((int64_t(split) * p.batch + b) * p.heads_q + h) * p.seqlen_q + i;
      launch.o_partial[prow * dv + col] = o;
      if (col == 0) launch.lse_partial[prow] = lse;
    } else {
      static_cast<T*>(p.o)[b * p.o_batch_stride + int64_t(i) * p.o_row_stride +
                           h * p.o_head_stride + col] = from_float<T>(o);
      if (col == 0)
        static_cast<float*>(p.lse)[b * p.lse_batch_stride + h * p.lse_head_stride +
                                   int64_t(i) * p.lse_row_stride] = lse;
    }
  }
}

}  // namespace gpu
}  // namespace fmha
