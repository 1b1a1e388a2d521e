// Packing for the bfloat16 dot-product GEMM (gemm.h, AVX512-BF16): operands become 32-bit
// words holding two consecutive elements along the reduction dimension.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/gemm.h"
#include "fmha/numeric.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

inline uint32_t pair_word(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// Rows r < n of a bf16 (rows, dim) slice, transposed into pair words: dst[kp * ld + r] holds
// (src[r][2kp], src[r][2kp+1]); rows [n, ld) and an odd dim's missing partner are zero.
inline void pack_pairs_t(const bf16_t* src, int64_t stride, int n, int dim, uint32_t* dst,
                         int ld) {
  const int kp_n = (dim + 1) / 2;
  for (int kp = 0; kp < kp_n; ++kp)
    for (int r = n; r < ld; ++r) dst[int64_t(kp) * ld + r] = 0;
  for (int r = 0; r < n; ++r) {
    const bf16_t* row = src + r * stride;
    for (int kp = 0; kp < kp_n; ++kp) {
      const uint16_t hi = 2 * kp + 1 < dim ? row[2 * kp + 1].bits : uint16_t(0);
      dst[int64_t(kp) * ld + r] = pair_word(row[2 * kp].bits, hi);
    }
  }
}

inline uint16_t to_bf16_bits(bf16_t x) { return x.bits; }
inline uint16_t to_bf16_bits(float x) { return float_to_bf16(x); }

// Two rows at a time of a (rows, dim) slice into pair words along the rows: dst[kp * ld + t]
// holds (src[2kp][t], src[2kp+1][t]) for t < dim, zero for t in [dim, ld) and for the
// missing partner of an odd n. (The B operand of O += P V, dV += Pᵀ dO, ...)
template <typename S>
inline void pack_row_pairs(const S* src, int64_t stride, int n, int dim, uint32_t* dst, int ld) {
  for (int kp = 0; kp < (n + 1) / 2; ++kp) {
    const S* r0 = src + int64_t(2 * kp) * stride;
    const S* r1 = 2 * kp + 1 < n ? r0 + stride : nullptr;
    uint32_t* out = dst + int64_t(kp) * ld;
    for (int t = 0; t < dim; ++t)
      out[t] = pair_word(to_bf16_bits(r0[t]), r1 ? to_bf16_bits(r1[t]) : uint16_t(0));
    for (int t = dim; t < ld; ++t) out[t] = 0;
  }
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
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (; 2 * kp + 1 < n; ++kp) {
      const float* c0 = P + int64_t(2 * kp) * cs;
      int i = 0;
      for (; i + 16 <= m; i += 16) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c0 + cs + i),
                                                           _mm512_loadu_ps(c0 + i));
        _mm512_storeu_si512(dst + int64_t(kp) * ld + i,
                            _mm512_permutexvar_epi16(interleave, both));
      }
      for (; i < m; ++i)
        dst[int64_t(kp) * ld + i] = pair_word(float_to_bf16(c0[i]), float_to_bf16(c0[i + cs]));
    }
  }
#endif
  for (; kp < (n + 1) / 2; ++kp) {
    const float* c0 = P + int64_t(2 * kp) * cs;
    const bool odd = 2 * kp + 1 >= n;
    for (int i = 0; i < m; ++i)
      dst[int64_t(kp) * ld + i] =
          pair_word(float_to_bf16(c0[i * rs]), odd ? uint16_t(0) : float_to_bf16(c0[i * rs + cs]));
  }
}

// True when a bf16 tensor's rows can be read in place as pair words: even row stride and
// head_dim, 4-byte aligned.
inline bool pairs_in_place(const void* base, int64_t row_stride, int dim) {
  return row_stride % 2 == 0 && dim % 2 == 0 && reinterpret_cast<uintptr_t>(base) % 4 == 0;
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
