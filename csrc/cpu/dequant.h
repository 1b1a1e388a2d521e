// 8-bit KV caches on the CPU (fmha/kvquant.h): cache rows dequantised into a tile's staging
// buffer as the kernels read them -- decode(code) * scale in float, then the inputs' dtype --
// so the products, softmax and accumulation downstream are those of a float cache, and no
// dequantised copy of the cache ever exists.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu/tile.h"
#include "fmha/kvquant.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// x[t] = decode(src[t]) for t < n, as float. AVX2 + F16C (and so AVX-512): eight codes per
// step, by integer widening for int8 and through IEEE half bits for float8 -- e5m2 is a
// half's top byte; e4m3's seven magnitude bits shifted into a half are its value / 2^8, and
// its NaN code becomes a half NaN -- exactly decode()'s values. Elsewhere the scalar decode.
inline void decode_codes(KvCode c, const uint8_t* src, int n, float* x) {
  int t = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i nan_code = _mm_set1_epi16(0x7F), half_nan = _mm_set1_epi16(0x7E00);
  for (; t + 8 <= n; t += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + t));
    __m256 v;
    if (c == KvCode::kInt8) {
      v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else {
      const __m128i h = _mm_cvtepu8_epi16(bytes);
      if (c == KvCode::kE5M2) {
        v = _mm256_cvtph_ps(_mm_slli_epi16(h, 8));
      } else {
        const __m128i mag = _mm_and_si128(h, nan_code);
        const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_andnot_si128(nan_code, h), 8),
                                          _mm_slli_epi16(mag, 7));
        const __m128i is_nan = _mm_cmpeq_epi16(mag, nan_code);
        v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_blendv_epi8(bits, half_nan, is_nan)),
                          _mm256_set1_ps(256.0f));
      }
    }
    _mm256_storeu_ps(x + t, v);
  }
#endif
  for (; t < n; ++t) x[t] = kvq::decode(c, src[t]);
}

// Rows [j0, j0 + n) of kv head hk of the key (value = false) or value cache of sequence b,
// dequantised into stage (n rows of dim elements of T).
template <typename T>
inline void dequant_rows(const FwdParams& p, const Seq& s, int b, int hk, bool value, int j0,
                         int n, int dim, T* stage) {
  const uint8_t* base = static_cast<const uint8_t*>(value ? p.v : p.k) +
                        hk * (value ? p.v_head_stride : p.k_head_stride);
  const int64_t batch_stride = value ? p.v_batch_stride : p.k_batch_stride;
  const int64_t row_stride = value ? p.v_row_stride : p.k_row_stride;
  const float* scales = value ? p.v_scale : p.k_scale;
  float x[1024];  // head_dim <= 1024 (the CPU kernels' limit)
  for (int r = 0; r < n; ++r) {
    const int j = j0 + r;
    decode_codes(p.kv_code, base + key_row_offset(p, s, b, batch_stride, row_stride, j), dim, x);
    const float scale = scales[kvq::scale_offset(p, b, j, hk)];
    for (int t = 0; t < dim; ++t) x[t] *= scale;
    store_row(x, dim, stage + int64_t(r) * dim);
  }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
