// exp for the softmax, written so that the compiler vectorises it at every ISA level.
//
// float: exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2]
// (ln 2 split in two for an exact reduction), exp(r) by a degree-5 polynomial with p(0) = 1
// whose other coefficients are fitted for the least maximum relative error on that interval
// (9.2e-8; the degree-6 Taylor polynomial it replaced: 1.6e-7, one multiply-add more), then
// 2^n built in the exponent bits. Tested against float64 exp over [-87, 0] at every ISA level
// (tests/kernels/test_core.py::test_kernel_exp_accuracy: relative error below 4e-7, i.e. a few
// float32 ulp; 1.6e-7 measured with fused multiply-adds). Inputs below -87 (including -inf, the mask value) give exactly 0 rather
// than a denormal, so masked entries never slow the FPU down; NaN gives NaN.
// float64 inputs use std::exp: exactness matters more than speed there.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// a*b + c, fused where the ISA has FMA (std::fma without hardware support is a libm call).
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline float exp_approx(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // -inf -> -87; 2^n normal
  // Round to nearest by the 1.5*2^23 trick (branch-free, vectorises; |x/ln2| < 2^22).
  const float n = madd(xc, 1.44269504088896341f, 12582912.f) - 12582912.f;
  float r = madd(n, -0.693145751953125f, xc);  // ln2 high part: n * it is exact
  r = madd(n, -1.42860682030941723212e-6f, r);  // ln2 low part
  float p = 8.290272206e-3f;
  p = madd(p, r, 4.189816117e-2f);
  p = madd(p, r, 1.666763872e-1f);
  p = madd(p, r, 4.999914765e-1f);
  p = madd(p, r, 9.999997020e-1f);
  p = madd(p, r, 1.f);
  const int32_t bits = ((n == n ? int32_t(n) : 0) + 127) << 23;  // NaN x: p is NaN already
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.f : p * scale;
}

// The softmax's exp for 16-bit inputs, for x <= 0 (the softmax's arguments, S - max and
// m_old - m_new; a row with a NaN score, whose max skips the NaN, can pass x > 0: clamped to
// 0, a defined 1 in a row that is NaN anyway): one ln 2 constant in the reduction (|n| <= 126:
// r off by < 2.4e-7), the upper clamp at 0 rather than 88, and a degree-4 polynomial with exp(0) = 1 exact, its other coefficients fitted for
// the least maximum relative error on [-ln2/2, ln2/2]. Relative error over [-87, 0] below
// 4e-6 where a*b+c is fused, 7e-6 where not (the scalar build rounds n ln 2 before the
// subtraction): tests/kernels/test_core.py::test_kernel_lean_exp_accuracy. Against the 2^-9
// (bfloat16) or 2^-11 (float16) of the inputs' and the output's rounding, nothing; it takes
// two multiply-adds fewer than exp_approx in the step that bounds the 16-bit forward after
// its products (docs/cpu_kernels.md, "The forward").
// -inf and x < -87 give 0; NaN gives NaN.
inline float exp_lean(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 0.0f ? 0.0f : x);  // NaN passes
  const float n = madd(xc, 1.44269504088896341f, 12582912.f) - 12582912.f;
  const float r = madd(n, -0.693147182464599609375f, xc);
  float p = 4.151384532e-2f;
  p = madd(p, r, 1.678747386e-1f);
  p = madd(p, r, 5.000301600e-1f);
  p = madd(p, r, 9.999668598e-1f);
  p = madd(p, r, 1.f);
  const int32_t bits = ((n == n ? int32_t(n) : 0) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.f : p * scale;
}

inline float exp_acc(float x) { return exp_approx(x); }
inline double exp_acc(double x) { return std::exp(x); }

// The forward softmax's exp: exp_lean where the inputs are 16-bit (kLean), else exp_acc.
template <bool kLean>
inline float softmax_exp(float x) { return kLean ? exp_lean(x) : exp_approx(x); }
template <bool kLean>
inline double softmax_exp(double x) { return std::exp(x); }

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
