// 8-bit KV caches: the one-byte encodings and their scales, one definition for every backend
// (CPU and CUDA, host and device), the same as python/fmha/kvquant.py (docs/semantics.md,
// "8-bit KV caches"): an element's value is decode(code) * scale.
//   int8           symmetric integers -127..127 (-128 is never written)
//   float8_e4m3fn  1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN = S.1111.111
//   float8_e5m2    1 sign, 5 exponent (bias 15), 2 mantissa bits: the top byte of an IEEE half
// Quantising x: y = float(x) / scale, rounded to the nearest code (ties to even), saturating
// at +-qmax; NaN stays NaN in float8 (code 0x7F) and becomes 0 in int8.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fmha/params.h"
#include "fmha/philox.h"  // FMHA_HD and the per-ISA namespace tag

namespace fmha {
inline namespace FMHA_ISA_TAG {
namespace kvq {

// The bits of a float, on the host and the device.
FMHA_HD uint32_t float_bits_hd(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

struct Format {
  int ebits, mbits, bias;
  float qmax;  // largest finite magnitude
};
FMHA_HD Format format_of(KvCode c) {
  return c == KvCode::kE4M3 ? Format{4, 3, 7, 448.0f}
         : c == KvCode::kE5M2 ? Format{5, 2, 15, 57344.0f}
                              : Format{0, 0, 0, 127.0f};
}
FMHA_HD float qmax(KvCode c) { return format_of(c).qmax; }

// The value of one code (exact in float).
FMHA_HD float decode(KvCode c, uint8_t x) {
  if (c == KvCode::kInt8) return float(int8_t(x));
  const Format f = format_of(c);
  const int e = (x >> f.mbits) & ((1 << f.ebits) - 1), m = x & ((1 << f.mbits) - 1);
  const float sign = (x & 0x80) ? -1.0f : 1.0f;
  if (c == KvCode::kE4M3 ? (x & 0x7F) == 0x7F : e == (1 << f.ebits) - 1)
    return (c == KvCode::kE5M2 && m == 0) ? sign * INFINITY : NAN;
  const float mant = e == 0 ? float(m) : float(m + (1 << f.mbits));
  return sign * ldexpf(mant, (e == 0 ? 1 : e) - f.bias - f.mbits);
}

// The code of y (already divided by the scale): nearest, ties to even, saturating.
FMHA_HD uint8_t encode(KvCode c, float y) {
  if (c == KvCode::kInt8) {
    if (y != y) return 0;
    const float r = rintf(y < -127.0f ? -127.0f : y > 127.0f ? 127.0f : y);
    return uint8_t(int8_t(r));
  }
  if (y != y) return 0x7F;
  const Format f = format_of(c);
  const uint8_t sign = (y < 0.0f || (y == 0.0f && 1.0f / y < 0.0f)) ? 0x80 : 0x00;
  float a = fabsf(y);
  if (a > f.qmax) a = f.qmax;
  // The code without its sign is (biased exponent << mbits) + mantissa for normal numbers
  // and the mantissa alone for subnormals; rounding the mantissa up carries into the exponent
  // by that very addition.
  // a = frac * 2^e with frac in [0.5, 1) (frexp's e, read from the exponent bits: a float
  // subnormal gets -126, which is below every format's smallest normal as frexp's would be).
  const int e = int((float_bits_hd(a) >> 23) & 0xFF) - 126;
  const int min_exp = 1 - f.bias;  // exponent of the smallest normal
  int code;
  if (a == 0.0f || e - 1 < min_exp) {
    code = int(rintf(ldexpf(a, f.mbits - min_exp)));  // units of the smallest subnormal
  } else {
    const float m = ldexpf(ldexpf(a, 1 - e) - 1.0f, f.mbits);  // a = (1 + m / 2^mbits) 2^(e-1)
    code = ((e - 1 + f.bias) << f.mbits) + int(rintf(m));
  }
  return uint8_t(sign | code);
}

// A dynamic scale for a row whose largest finite |x| is top: top / qmax, 1 when that is 0.
FMHA_HD float dynamic_scale(KvCode c, float top) {
  const float s = top / qmax(c);
  return s > 0.0f ? s : 1.0f;
}

// Element offset of the scale of cache row j of sequence b, kv head h (K and V scales share
// the layout): one per kv head (static) or per (row, kv head) laid out like the cache rows
// (dynamic; through the block table for a paged cache).
// The same from where the row lives: `slot` is the sequence b (contiguous cache) or its
// block (paged), `row` the row in it.
FMHA_HD int64_t scale_offset_at(const FwdParams& p, int64_t slot, int row, int h) {
  const int64_t o = h * p.scale_head_stride;
  if (p.scale_row_stride == 0) return o;
  return o + slot * p.scale_batch_stride + int64_t(row) * p.scale_row_stride;
}
FMHA_HD int64_t scale_offset(const FwdParams& p, int b, int j, int h) {
  if (p.scale_row_stride == 0 || !p.block_table) return scale_offset_at(p, b, j, h);
  const int block = p.block_table[b * p.block_table_stride + j / p.block_size];
  return scale_offset_at(p, block, j % p.block_size, h);
}

}  // namespace kvq
}  // namespace FMHA_ISA_TAG
}  // namespace fmha
