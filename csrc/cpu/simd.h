// The one SIMD mapping of the CPU kernels: a float vector type `VecF` and its operations for
// the instruction set this translation unit is compiled for (AVX-512, AVX2+FMA, or one plain
// float for the portable path). Everything above this file is written once against it.
//
// Also here: the register-blocking shape of the GEMM micro-kernel for this ISA (gemm.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/vexp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define FMHA_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FMHA_SIMD_AVX2 1
#endif

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// x as rounded: a compiler barrier that keeps a product from being contracted with the next
// addition into one fused multiply-add (GCC does so by default wherever FMA exists), for the
// places whose result must match the same two steps computed apart (the softmax's folded
// scale: the forward's scores must equal the backward's, which scales in a pass of its own).
template <typename T>
inline T unfused(T x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
  asm("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(x));
#else
  volatile T y = x;
  x = y;
#endif
  return x;
}

#if defined(FMHA_SIMD_AVX512)
// 32 zmm registers: 6 rows x 4 vectors of accumulators (24) + 4 B vectors + 1 broadcast.
constexpr int kW = 16, kGemmRows = 6, kGemmVecs = 4;
struct VecF {
  __m512 v;
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF zero() { return {_mm512_setzero_ps()}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  friend VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend VecF min(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend float hsum(VecF a) { return _mm512_reduce_add_ps(a.v); }
  // The four sums of a, b, c, d's lanes at once: a transposing reduction, about a third of
  // the instructions of four hsum.
  friend void hsum4(VecF a, VecF b, VecF c, VecF d, float* out) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a.v, b.v), _mm512_unpackhi_ps(a.v, b.v));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c.v, d.v), _mm512_unpackhi_ps(c.v, d.v));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
  }
  friend float hmax(VecF a) { return _mm512_reduce_max_ps(a.v); }
  // x * 2^n for integral-valued n in [-127, 127]: one vscalefps, the same correctly rounded
  // product as the other levels' x * pow2i(n) (2^n built in the exponent bits).
  static VecF mul_pow2(VecF x, VecF n) { return {_mm512_scalef_ps(x.v, n.v)}; }
  // This value as rounded, kept out of any fused multiply-add the compiler would form with
  // the next operation (see unfused() above).
  VecF unfused() const {
    __m512 x = v;
    asm("" : "+v"(x));
    return {x};
  }
  // lanes where a < b take `x`, others keep this
  VecF select_lt(VecF a, VecF b, VecF x) const {
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), v, x.v)};
  }
  // lanes where a == b take `x`, others keep this
  VecF select_eq(VecF a, VecF b, VecF x) const {
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ), v, x.v)};
  }
};

// Sixteen rows of sixteen floats transposed in registers: afterwards r[t] holds element t
// of every row. Three stages of in-lane shuffles, then two of 128-bit lane shuffles.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}
#elif defined(FMHA_SIMD_AVX2)
// 16 ymm registers: 4 rows x 2 vectors (8) + 2 B vectors + 1 broadcast, room to spare.
constexpr int kW = 8, kGemmRows = 4, kGemmVecs = 2;
struct VecF {
  __m256 v;
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF zero() { return {_mm256_setzero_ps()}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  friend VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend VecF min(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
  friend float hsum(VecF a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  friend void hsum4(VecF a, VecF b, VecF c, VecF d, float* out) {
    out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
  }
  friend float hmax(VecF a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static VecF pow2i(VecF n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v),
                                                         _mm256_set1_epi32(127)), 23);
    return {_mm256_castsi256_ps(e)};
  }
  static VecF mul_pow2(VecF x, VecF n) { return x * pow2i(n); }
  VecF unfused() const {
    __m256 x = v;
    asm("" : "+x"(x));
    return {x};
  }
  VecF select_lt(VecF a, VecF b, VecF x) const {
    return {_mm256_blendv_ps(v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ))};
  }
  VecF select_eq(VecF a, VecF b, VecF x) const {
    return {_mm256_blendv_ps(v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ))};
  }
};
#else
// Portable: one float per "vector"; the compiler is free to do what it can.
constexpr int kW = 1, kGemmRows = 4, kGemmVecs = 4;
struct VecF {
  float v;
  static VecF load(const float* p) { return {*p}; }
  static VecF set1(float x) { return {x}; }
  static VecF zero() { return {0.f}; }
  void store(float* p) const { *p = v; }
  friend VecF operator+(VecF a, VecF b) { return {a.v + b.v}; }
  friend VecF operator-(VecF a, VecF b) { return {a.v - b.v}; }
  friend VecF operator*(VecF a, VecF b) { return {a.v * b.v}; }
  friend VecF fma(VecF a, VecF b, VecF c) { return {madd(a.v, b.v, c.v)}; }
  // With a NaN operand max/min return b, as the x86 instructions do (vexp relies on it).
  friend VecF max(VecF a, VecF b) { return {a.v > b.v ? a.v : b.v}; }
  friend VecF min(VecF a, VecF b) { return {a.v < b.v ? a.v : b.v}; }
  friend float hsum(VecF a) { return a.v; }
  friend void hsum4(VecF a, VecF b, VecF c, VecF d, float* out) {
    out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
  }
  friend float hmax(VecF a) { return a.v; }
  static VecF pow2i(VecF n) {
    const int32_t e = ((n.v == n.v ? int32_t(n.v) : 0) + 127) << 23;  // NaN: no UB cast
    float f;
    std::memcpy(&f, &e, 4);
    return {f};
  }
  static VecF mul_pow2(VecF x, VecF n) { return x * pow2i(n); }
  VecF unfused() const { return {fmha::cpu::FMHA_CPU_ISA_NS::unfused(v)}; }
  VecF select_lt(VecF a, VecF b, VecF x) const { return {a.v < b.v ? x.v : v}; }
  VecF select_eq(VecF a, VecF b, VecF x) const { return {a.v == b.v ? x.v : v}; }
};
#endif

// exp on a vector: the same reduction and polynomial as exp_approx (vexp.h), lane by lane
// bit-identical to it, so every ISA level computes the same softmax.
// A NaN argument gives NaN: max/min return their second operand when either is NaN (as
// the x86 instructions do), so the clamp passes x through instead of replacing it.
inline VecF vexp(VecF x) {
  const VecF lo = VecF::set1(-87.0f);
  const VecF xc = min(VecF::set1(88.0f), max(lo, x));
  const VecF magic = VecF::set1(12582912.f);
  const VecF n = fma(xc, VecF::set1(1.44269504088896341f), magic) - magic;
  VecF r = fma(n, VecF::set1(-0.693145751953125f), xc);
  r = fma(n, VecF::set1(-1.42860682030941723212e-6f), r);
  VecF p = VecF::set1(8.290272206e-3f);
  p = fma(p, r, VecF::set1(4.189816117e-2f));
  p = fma(p, r, VecF::set1(1.666763872e-1f));
  p = fma(p, r, VecF::set1(4.999914765e-1f));
  p = fma(p, r, VecF::set1(9.999997020e-1f));
  p = fma(p, r, VecF::set1(1.f));
  return VecF::mul_pow2(p, n).select_lt(x, lo, VecF::zero());
}

// exp_lean (vexp.h) on a vector, lane by lane bit-identical to it (x > 0 clamped to 0; NaN
// passes both clamps as their second operand).
inline VecF vexp_lean(VecF x) {
  const VecF lo = VecF::set1(-87.0f);
  const VecF xc = min(VecF::zero(), max(lo, x));
  const VecF magic = VecF::set1(12582912.f);
  const VecF n = fma(xc, VecF::set1(1.44269504088896341f), magic) - magic;
  const VecF r = fma(n, VecF::set1(-0.693147182464599609375f), xc);
  VecF p = VecF::set1(4.151384532e-2f);
  p = fma(p, r, VecF::set1(1.678747386e-1f));
  p = fma(p, r, VecF::set1(5.000301600e-1f));
  p = fma(p, r, VecF::set1(9.999668598e-1f));
  p = fma(p, r, VecF::set1(1.f));
  return VecF::mul_pow2(p, n).select_lt(x, lo, VecF::zero());
}

inline int round_up_w(int n) { return (n + kW - 1) / kW * kW; }

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
