// exp for the softmax, written so that the compiler vectorises it at every ISA level.
//
// float: exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2]
// (ln 2 split in two for an exact reduction), exp(r) by its degree-6 Taylor polynomial
// (truncation error r^7/7! < 1.2e-7 relative), then 2^n built in the exponent bits.
// Tested against float64 exp over [-87, 0] at every ISA level (tests/test_core.py::
// test_kernel_exp_accuracy: relative error below 4e-7, i.e. a few float32 ulp). Inputs below -87 (including -inf, the mask value) give exactly 0 rather
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
  float p = 1.f / 720.f;
  p = madd(p, r, 1.f / 120.f);
  p = madd(p, r, 1.f / 24.f);
  p = madd(p, r, 1.f / 6.f);
  p = madd(p, r, 0.5f);
  p = madd(p, r, 1.f);
  p = madd(p, r, 1.f);
  const int32_t bits = ((n == n ? int32_t(n) : 0) + 127) << 23;  // NaN x: p is NaN already
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.f : p * scale;
}

inline float exp_acc(float x) { return exp_approx(x); }
inline double exp_acc(double x) { return std::exp(x); }

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
