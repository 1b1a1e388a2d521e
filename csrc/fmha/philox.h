// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011), the counter-based generator behind dropout on every backend.
//
// Which draw decides which dropout element (the counter and key layout) is part of the score
// semantics: csrc/fmha/score.h. python/fmha/_philox.py implements the same generator and is
// checked against Random123's vectors.
#pragma once

#include <cstdint>

#include "fmha/params.h"  // FMHA_HD

// Compiled into every CPU instruction-set translation unit with different flags: the inline
// namespace gives each its own copy, so the linker never swaps an AVX-512 instantiation into
// the portable kernels (an ODR trap of per-ISA builds).
#include "fmha/isa_tag.h"

namespace fmha {
inline namespace FMHA_ISA_TAG {

struct Philox4 { uint32_t x[4]; };

FMHA_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                              uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;   // round multipliers
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;   // Weyl key increments
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(M0) * c0, p1 = uint64_t(M1) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += W0; k1 += W1;  // the bump after the last round is unused
  }
  return {{c0, c1, c2, c3}};
}

// Elements whose 32-bit draw is below this are dropped: P(drop) = threshold / 2^32 = p
// up to 2^-32.
FMHA_HD uint32_t dropout_threshold(double p) {
  const double x = p * 4294967296.0;
  return x < 4294967295.0 ? uint32_t(x) : 4294967295u;
}

}  // namespace FMHA_ISA_TAG
}  // namespace fmha
