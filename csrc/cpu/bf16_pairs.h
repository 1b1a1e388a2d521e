// Packing for the bfloat16 dot-product GEMM (gemm.h, AVX512-BF16): operands become 32-bit
// words holding two consecutive elements along the reduction dimension.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/gemm.h"
#include "fmha/numeric.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

inline uint32_t pair_word(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// float -> bfloat16 exactly as the AVX512-BF16 conversions do it (round to nearest even,
// denormal inputs read as zero), so a scalar tail and a vector body round alike (checked
// against vcvtneps2bf16 on 32M values, denormals included).
inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  if ((u & 0x7f800000u) == 0) return uint16_t((u >> 16) & 0x8000u);        // ±0, denormals
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Rows r < n of a bf16 (rows, dim) slice, transposed into pair words: dst[kp * ld + r] holds
// (src[r][2kp], src[r][2kp+1]); rows [n, ld) and an odd dim's missing partner are zero.
inline void pack_pairs_t(const bf16_t* src, int64_t stride, int n, int dim, uint32_t* dst,
                         int ld) {
  const int kp_n = (dim + 1) / 2;
  for (int kp = 0; kp < kp_n; ++kp)
    for (int r = n; r < ld; ++r) dst[int64_t(kp) * ld + r] = 0;
  int r0 = 0;
#if defined(FMHA_SIMD_AVX512)
  // 16 rows x 16 whole pairs at a time: each pair is one 32-bit word, so the pair transpose
  // is a 16 x 16 word transpose through registers.
  for (; r0 + 16 <= n; r0 += 16) {
    const bf16_t* s = src + r0 * stride;
    int kp = 0;
    for (; 2 * kp + 32 <= dim; kp += 16) {
      __m512 x[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_ps(s + i * stride + 2 * kp);
      transpose16(x);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + int64_t(kp + i) * ld + r0, x[i]);
    }
    for (; kp < kp_n; ++kp)
      for (int i = 0; i < 16; ++i) {
        const bf16_t* row = s + i * stride;
        const uint16_t hi = 2 * kp + 1 < dim ? row[2 * kp + 1].bits : uint16_t(0);
        dst[int64_t(kp) * ld + r0 + i] = pair_word(row[2 * kp].bits, hi);
      }
  }
#endif
  for (int r = r0; r < n; ++r) {
    const bf16_t* row = src + r * stride;
    for (int kp = 0; kp < kp_n; ++kp) {
      const uint16_t hi = 2 * kp + 1 < dim ? row[2 * kp + 1].bits : uint16_t(0);
      dst[int64_t(kp) * ld + r] = pair_word(row[2 * kp].bits, hi);
    }
  }
}

inline uint16_t to_bf16_bits(bf16_t x) { return x.bits; }
inline uint16_t to_bf16_bits(float x) { return bf16_round(x); }

#if defined(__AVX512BF16__)
// 32 bfloat16 as two halves of 16 (a, b) -> 16 pair words (a[i], b[i]).
inline __m512i halves_interleaved(__m512i both) {
  const __m512i order = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, both);
}
#endif

// The vector part of a pair of rows' words (pack_pairs_of_rows): out[t] = (r0[t], r1[t]) for
// t below the returned count. A type without one (float) leaves all to the scalar loop.
template <typename S>
inline int vector_pair_words(const S*, const S*, int, uint32_t*) { return 0; }
#if defined(__AVX512BF16__)
inline int vector_pair_words(const bf16_t* r0, const bf16_t* r1, int dim, uint32_t* out) {
  int t = 0;  // widen both rows' 16 elements to 32 bits and merge: one word per column
  for (; t + 16 <= dim; t += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r0 + t)));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r1 + t)));
    _mm512_storeu_si512(out + t, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  return t;
}
#endif

// Two rows at a time into pair words along the rows: dst[kp * ld + t] holds (row(2kp)[t],
// row(2kp+1)[t]) for t < dim, zero for t in [dim, ld) and for the missing partner of an odd
// n. row(i) is where row i starts. (The B operand of O += P V, dV += Pᵀ dO, ...)
template <typename S, typename RowAt>
inline void pack_pairs_of_rows(RowAt row, int n, int dim, uint32_t* dst, int ld) {
  for (int kp = 0; kp < (n + 1) / 2; ++kp) {
    const S* r0 = row(2 * kp);
    const S* r1 = 2 * kp + 1 < n ? row(2 * kp + 1) : nullptr;
    uint32_t* out = dst + int64_t(kp) * ld;
    const int t0 = r1 ? vector_pair_words(r0, r1, dim, out) : 0;
    for (int t = t0; t < dim; ++t)
      out[t] = pair_word(to_bf16_bits(r0[t]), r1 ? to_bf16_bits(r1[t]) : uint16_t(0));
    for (int t = dim; t < ld; ++t) out[t] = 0;
  }
}

// pack_pairs_of_rows of a (rows, dim) slice with a row stride.
template <typename S>
inline void pack_row_pairs(const S* src, int64_t stride, int n, int dim, uint32_t* dst, int ld) {
  pack_pairs_of_rows<S>([&](int i) { return src + int64_t(i) * stride; }, n, dim, dst, ld);
}

// A float tile P (element (i, c) at P[i * rs + c * cs]) rounded to bfloat16 pair words along c:
// dst[kp * ld + i] = (P(i, 2kp), P(i, 2kp+1)) for i < m, kp < ceil(n/2).
inline void pack_float_pairs(const float* P, int64_t rs, int64_t cs, int m, int n, uint32_t* dst,
                             int ld) {
  int kp = 0;
#if defined(__AVX512BF16__)
  if (rs == 1) {
    // Columns c and c+1 are vectors along i: convert both at once (round to nearest even),
    // then interleave their 16-bit halves into pair words.
    for (; 2 * kp + 1 < n; ++kp) {
      const float* c0 = P + int64_t(2 * kp) * cs;
      int i = 0;
      for (; i + 16 <= m; i += 16) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c0 + cs + i),
                                                           _mm512_loadu_ps(c0 + i));
        _mm512_storeu_si512(dst + int64_t(kp) * ld + i, halves_interleaved(both));
      }
      for (; i < m; ++i)
        dst[int64_t(kp) * ld + i] = pair_word(bf16_round(c0[i]), bf16_round(c0[i + cs]));
    }
  }
#endif
  for (; kp < (n + 1) / 2; ++kp) {
    const float* c0 = P + int64_t(2 * kp) * cs;
    const bool odd = 2 * kp + 1 >= n;
    for (int i = 0; i < m; ++i)
      dst[int64_t(kp) * ld + i] =
          pair_word(bf16_round(c0[i * rs]), odd ? uint16_t(0) : bf16_round(c0[i * rs + cs]));
  }
}

// Rows i < m of a row-major float tile (leading dimension ld_src) rounded to bfloat16 along
// the row: dst[i * ld + kp] = (x[i][2kp], x[i][2kp+1]) for kp < ceil(n/2) (odd n: partner 0).
inline void pack_rows_bf16(const float* x, int64_t ld_src, int m, int n, uint32_t* dst,
                           int64_t ld) {
  for (int i = 0; i < m; ++i) {
    const float* row = x + i * ld_src;
    uint32_t* out = dst + i * ld;
    int c = 0;
#if defined(__AVX512BF16__)
    for (; c + 32 <= n; c += 32)  // 32 floats -> 32 bf16 in order = 16 pair words
      _mm512_storeu_si512(out + c / 2, (__m512i)_mm512_cvtne2ps_pbh(
                                           _mm512_loadu_ps(row + c + 16), _mm512_loadu_ps(row + c)));
#endif
    for (; c < n; c += 2)
      out[c / 2] = pair_word(bf16_round(row[c]), c + 1 < n ? bf16_round(row[c + 1]) : uint16_t(0));
  }
}

// Rows [0, n) of a bf16 (rows, dim) slice as pair words along dim, for a GEMM A operand:
// read in place when the layout allows (even dim and row stride, 4-byte aligned), else
// copied into `buf` (zero-padded to an even dim). Either way the same words: the arithmetic
// never depends on the memory layout. Returns the words; *ld receives their row stride.
inline const uint32_t* pair_rows(const bf16_t* src, int64_t stride, int n, int dim,
                                 void* buf, int64_t* ld) {
  if (dim % 2 == 0 && stride % 2 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0) {
    *ld = stride / 2;
    return reinterpret_cast<const uint32_t*>(src);
  }
  const int w = (dim + 1) / 2;
  uint16_t* out = static_cast<uint16_t*>(buf);
  for (int r = 0; r < n; ++r) {
    for (int t = 0; t < dim; ++t) out[int64_t(r) * 2 * w + t] = src[r * stride + t].bits;
    if (dim % 2) out[int64_t(r) * 2 * w + dim] = 0;
  }
  *ld = w;
  return reinterpret_cast<const uint32_t*>(buf);
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
