// 8-bit KV caches on the CPU (fmha/kvquant.h; docs/semantics.md, "8-bit KV caches").
//
// Every code's value decode(code) is exact in every float type, so the kernels read codes
// as one more element type (Code<C>), widened to floats in registers by the same products
// that read float or bfloat16 rows; no dequantised copy of the cache exists. The scales are
// applied per key instead of per element: a key's score is multiplied by scale * k_scale, its
// probability by v_scale before P V (`key_scales`). A tile's codes are widened into a float
// tile first only where that is cheaper or needed: more than 4 query rows per kv head (each
// code would otherwise be widened once per 4 rows), V on levels without AVX-512 (the GEMM
// reads float rows), the strong zero (a NaN/Inf value next to an excluded pair), and the
// GEMM-shaped tiles of long query chunks, which stage the codes' exact values in T.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/bf16_pairs.h"
#include "cpu/simd.h"
#include "cpu/tile.h"
#include "fmha/kvquant.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

template <KvCode C>
struct Code {
  static constexpr KvCode kCode = C;
  uint8_t bits;
};

// One element as float: the products' scalar tails.
inline float load_one(const float* x) { return *x; }
template <KvCode C>
inline float load_one(const Code<C>* x) { return kvq::decode(C, x->bits); }
// One element as bfloat16 bits (exact): the pair packing's scalar tails.
template <KvCode C>
inline uint16_t to_bf16_bits(Code<C> x) { return bf16_round(kvq::decode(C, x.bits)); }

#if defined(__AVX2__) && defined(__F16C__)
// Eight float8 codes (the low 8 bytes of `bytes`) as IEEE half bits: e5m2 is a half's top
// byte; e4m3's seven magnitude bits shifted into a half are its value / 2^8 (the caller
// multiplies by 256), and its NaN code becomes a half NaN -- exactly decode()'s values.
template <KvCode C>
inline __m128i fp8_as_half(__m128i bytes) {
  const __m128i h = _mm_cvtepu8_epi16(bytes);
  if constexpr (C == KvCode::kE5M2) {
    return _mm_slli_epi16(h, 8);
  } else {
    const __m128i nan_code = _mm_set1_epi16(0x7F);
    const __m128i mag = _mm_and_si128(h, nan_code);
    const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_andnot_si128(nan_code, h), 8),
                                      _mm_slli_epi16(mag, 7));
    return _mm_blendv_epi8(bits, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(mag, nan_code));
  }
}
#endif

#if defined(FMHA_SIMD_AVX512)
// kW = 16 codes widened to floats.
// float8 as halves as in fp8_as_half, sixteen lanes at once: the sign bit and the magnitude
// bits merged by one bitwise select, the NaN code by a mask.
template <KvCode C>
inline __m512 decode16(__m128i bytes) {
  if constexpr (C == KvCode::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else {
    const __m256i h = _mm256_cvtepu8_epi16(bytes);
    if constexpr (C == KvCode::kE5M2) {
      return _mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
    } else {
      const __m256i nan_code = _mm256_set1_epi16(0x7F), mag = _mm256_and_si256(h, nan_code);
      // bit 15 of (h << 8), the sign; the rest from (mag << 7), the magnitude at bits 13..7
      const __m256i bits = _mm256_ternarylogic_epi32(_mm256_slli_epi16(h, 8), _mm256_slli_epi16(mag, 7),
                                                     _mm256_set1_epi16(int16_t(0x8000)), 0xE4);
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, nan_code);
      const __m256i half = _mm256_mask_blend_epi16(nan, bits, _mm256_set1_epi16(0x7E00));
      return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    }
  }
}
template <KvCode C>
inline VecF load_vec(const Code<C>* x) {
  return {decode16<C>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)))};
}
// pv_block's V loads (forward.h): lanes past `mask` zero.
template <KvCode C>
inline __m512 load16(const Code<C>* x, __mmask16 mask) {
  return decode16<C>(_mm_maskz_loadu_epi8(mask, x));
}
#if defined(__AVX512BF16__)
// 32 codes as bfloat16 pairs for the pair dot products (forward.h, dot_block_bf16), lanes
// past `mask` zero. The floats are exact in bfloat16, so the rounding conversion is exact.
template <KvCode C>
inline __m512bh load_pairs(const Code<C>* x, __mmask32 mask) {
  const __m256i bytes = _mm256_maskz_loadu_epi8(mask, x);
  const __m512 lo = decode16<C>(_mm256_castsi256_si128(bytes));
  const __m512 hi = decode16<C>(_mm256_extracti128_si256(bytes, 1));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Sixteen columns of two rows of codes as pair words (bf16_pairs.h, pack_pairs_of_rows): both
// rows widened to floats, rounded to bfloat16 together (exactly), their halves interleaved.
template <KvCode C>
inline int vector_pair_words(const Code<C>* r0, const Code<C>* r1, int dim, uint32_t* out) {
  int t = 0;
  for (; t + 16 <= dim; t += 16) {
    const __m512 lo = decode16<C>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + t)));
    const __m512 hi = decode16<C>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + t)));
    _mm512_storeu_si512(out + t, halves_interleaved((__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
  }
  return t;
}
#endif
#elif defined(FMHA_SIMD_AVX2)
template <KvCode C>
inline VecF load_vec(const Code<C>* x) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x));
  if constexpr (C == KvCode::kInt8) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))};
  } else {
    const __m256 h = _mm256_cvtph_ps(fp8_as_half<C>(bytes));
    return {C == KvCode::kE4M3 ? _mm256_mul_ps(h, _mm256_set1_ps(256.0f)) : h};
  }
}
#else
template <KvCode C>
inline VecF load_vec(const Code<C>* x) { return {load_one(x)}; }
#endif
inline VecF load_vec(const float* x) { return VecF::load(x); }

// Calls f(Code<C>{}) for the call's encoding: the products are instantiated per encoding.
template <typename F>
inline void with_code(KvCode c, F&& f) {
  switch (c) {
    case KvCode::kInt8: f(Code<KvCode::kInt8>{}); break;
    case KvCode::kE4M3: f(Code<KvCode::kE4M3>{}); break;
    case KvCode::kE5M2: f(Code<KvCode::kE5M2>{}); break;
    default: break;
  }
}

// Where row j of kv head hk of the key (value = false) or value cache of sequence b starts.
inline const uint8_t* code_row(const FwdParams& p, const Seq& s, int b, int hk, bool value,
                               int j) {
  return static_cast<const uint8_t*>(value ? p.v : p.k) +
         hk * (value ? p.v_head_stride : p.k_head_stride) +
         key_row_offset(p, s, b, value ? p.v_batch_stride : p.k_batch_stride,
                        value ? p.v_row_stride : p.k_row_stride, j);
}

// Pointers to n rows of kv head hk of an 8-bit cache, from their element offsets.
template <typename C>
inline void code_rows(const void* cache, int64_t head_stride, int hk, const int64_t* offsets,
                      int n, const C** rows) {
  const C* head = static_cast<const C*>(cache) + hk * head_stride;
  for (int r = 0; r < n; ++r) rows[r] = head + offsets[r];
}

// The per-key factors of keys [j0, j0 + n) of kv head hk: for K, scale * k_scale (what the
// key's dot product is multiplied by); for V, v_scale (what its probability is multiplied
// by before P V).
template <typename A>
inline void key_scales(const FwdParams& p, int b, int hk, bool value, int j0, int n, A* out) {
  const float* scales = value ? p.v_scale : p.k_scale;
  const A factor = value ? A(1) : A(p.scale);  // as scale_rows applies it to a float cache's S
  for (int r = 0; r < n; ++r) out[r] = factor * A(scales[kvq::scale_offset(p, b, j0 + r, hk)]);
}

// The probe behind _C.cpu_decode_kv_codes, and decode_rows: n codes widened by the
// products' vector loads.
template <KvCode C>
inline void decode_codes(const uint8_t* src, int64_t n, float* dst) {
  const Code<C>* x = reinterpret_cast<const Code<C>*>(src);
  int64_t t = 0;
  for (; t + kW <= n; t += kW) load_vec(x + t).store(dst + t);
  for (; t < n; ++t) dst[t] = load_one(x + t);
}

// Rows [j0, j0 + n) of kv head hk, their codes' values (unscaled, exact) into dst: n rows
// of `ld` elements of U (float, double, or a 16-bit type), columns [dim, ld) zero.
template <typename U>
inline void decode_rows(const FwdParams& p, const Seq& s, int b, int hk, bool value, int j0,
                        int n, int dim, U* dst, int64_t ld) {
  for (int r = 0; r < n; ++r) {
    const uint8_t* src = code_row(p, s, b, hk, value, j0 + r);
    U* x = dst + r * ld;
    if constexpr (std::is_same_v<U, float>)
      with_code(p.kv_code, [&](auto c) { decode_codes<decltype(c)::kCode>(src, dim, x); });
#if defined(__AVX512BF16__)
    else if constexpr (std::is_same_v<U, bf16_t>)  // the pair products' rows: 32 at a time
      with_code(p.kv_code, [&](auto c) {
        const auto* codes = reinterpret_cast<const decltype(c)*>(src);
        for (int t = 0; t < dim; t += 32) {
          const __mmask32 in = dim - t >= 32 ? __mmask32(~0u) : __mmask32((1u << (dim - t)) - 1);
          _mm512_mask_storeu_epi16(x + t, in, (__m512i)load_pairs(codes + t, in));
        }
      });
#endif
    else
      for (int t = 0; t < dim; ++t) x[t] = Store<U>::from(kvq::decode(p.kv_code, src[t]));
    for (int t = dim; t < ld; ++t) x[t] = Store<U>::from(0.0f);
  }
}

// The values decode(code) * v_scale of V rows [j0, j0 + n) (factors from key_scales), in A:
// the strong zero's rows.
template <typename A>
inline void dequant_rows(const FwdParams& p, const Seq& s, int b, int hk, int j0, int n,
                         int dim, const A* vscale, A* dst, int64_t ld) {
  decode_rows(p, s, b, hk, true, j0, n, dim, dst, ld);
  for (int r = 0; r < n; ++r)
    for (int t = 0; t < dim; ++t) dst[r * ld + t] *= vscale[r];
}

// Whether V rows [j0, j0 + n) hold a value that is not finite: a NaN or Inf code, or a
// scale that makes one (a code times a v_scale that is Inf, NaN, or large enough to
// overflow). Int8 codes are all finite.
template <typename A>
inline bool values_nonfinite(const FwdParams& p, const Seq& s, int b, int hk, int j0, int n,
                             const A* vscale) {
  const A top = A(kvq::qmax(p.kv_code));
  for (int r = 0; r < n; ++r)
    if (!(std::abs(vscale[r]) * top <= std::numeric_limits<A>::max())) return true;
  if (p.kv_code == KvCode::kInt8) return false;
  // e4m3: NaN is S.1111.111; e5m2: Inf and NaN have the exponent bits 11111.
  const uint8_t mask = p.kv_code == KvCode::kE4M3 ? 0x7F : 0x7C;
  for (int r = 0; r < n; ++r) {
    const uint8_t* x = code_row(p, s, b, hk, true, j0 + r);
    for (int t = 0; t < p.head_dim_v; ++t)
      if ((x[t] & mask) == mask) return true;
  }
  return false;
}

// X[c][t] *= f[c] for c < n, t < dim: a factor per key (row), for Sᵀ and Pᵀ.
template <typename A>
inline void scale_each_row(A* X, int n, int dim, int64_t ld, const A* f) {
  for (int c = 0; c < n; ++c) scale_rows(X + c * ld, 1, dim, int(ld), f[c]);
}

// S[m][c] *= f[c] for m < M, c < n: a factor per key (column).
template <typename A>
inline void scale_columns(A* S, int M, int n, int64_t ld, const A* f) {
  for (int m = 0; m < M; ++m) {
    A* row = S + m * ld;
#pragma omp simd
    for (int c = 0; c < n; ++c) row[c] *= f[c];
  }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
