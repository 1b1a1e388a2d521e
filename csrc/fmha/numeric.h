// Storage types and their conversions to the accumulation type.
//
// bfloat16 and float16 are stored as raw 16-bit patterns; conversions round to nearest even,
// as the hardware (and torch) do, so a CPU result and a GPU result can be compared exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

// Compiled into every CPU instruction-set translation unit with different flags: the inline
// namespace gives each its own copy, so the linker never swaps an AVX-512 instantiation into
// the portable kernels (an ODR trap of per-ISA builds).
#include "fmha/isa_tag.h"

namespace fmha {
inline namespace FMHA_ISA_TAG {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even on the dropped 16 bits
  return uint16_t(u >> 16);
}

#if defined(__F16C__)
inline float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t float_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = float(mant) * 5.9604644775390625e-8f;
    return bits_float(float_bits(v) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_f16(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds (to even) to infinity
  if (x < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 puts the value on a grid of 2^-24
    // (the half subnormal step) and lets the FPU round it to nearest even.
    const float a = bits_float(x) + 0.5f;
    return sign | uint16_t(float_bits(a) - 0x3f000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round to nearest even at bit 13.
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return sign | uint16_t(x >> 13);
}
#endif

// Accumulation type: float64 for float64 inputs, float32 otherwise (docs/semantics.md).
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_t = typename AccOf<T>::type;

template <typename A> inline A to_acc(double x) { return A(x); }
template <typename A> inline A to_acc(float x) { return A(x); }
template <typename A> inline A to_acc(bf16_t x) { return A(bf16_to_float(x.bits)); }
template <typename A> inline A to_acc(f16_t x) { return A(f16_to_float(x.bits)); }

template <typename T> struct Store;
template <> struct Store<double> { static double from(double a) { return a; } };
template <> struct Store<float> { static float from(float a) { return a; } };
template <> struct Store<bf16_t> { static bf16_t from(float a) { return {float_to_bf16(a)}; } };
template <> struct Store<f16_t> { static f16_t from(float a) { return {float_to_f16(a)}; } };

}  // namespace FMHA_ISA_TAG
}  // namespace fmha
