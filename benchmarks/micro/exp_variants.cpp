// The forward softmax's exponential pass (csrc/cpu/softmax.h, finish_strip: load a score
// vector, scale it, subtract the row max, exp, store, add to the row sum) over a 64 x 64
// tile in L1, with the library's vexp / vexp_lean (csrc/cpu/simd.h) and with the cheaper
// float32 variants one could write instead, to see what each would take off the softmax.
// Best of 15 timings of 4000 tiles; ns per 16 scores and the ratio to a degree-6 exp (the
// first row). Each variant's
// largest relative error against double exp over [-87, 0] is printed beside it (vexp's test
// bound is 4e-7: tests/kernels/test_core.py::test_kernel_exp_accuracy). docs/cpu_kernels.md ("A
// cheaper exponential", 2026-12-03) quotes it. Build and run from the repository root:
//
//   g++ -O3 -std=gnu++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -Icsrc \
//       benchmarks/micro/exp_variants.cpp -o /tmp/exp_variants && /tmp/exp_variants
#define FMHA_CPU_ISA_NS avx512
#include <chrono>
#include <cmath>
#include <cstdio>

#include "cpu/simd.h"

using namespace fmha::cpu::avx512;

namespace {

alignas(64) float S[64 * 64], out[64 * 64];

// exp(r) on [-ln2/2, ln2/2] by a degree-5 polynomial with p(0) = 1, its other coefficients
// fitted for the least maximum relative error (9.2e-8): one multiply-add fewer than poly6.
// vexp's since 2026-12-03.
VecF poly5(VecF r) {
  VecF p = VecF::set1(8.290272206068039e-3f);
  p = fma(p, r, VecF::set1(4.189816117286682e-2f));
  p = fma(p, r, VecF::set1(1.666763871908188e-1f));
  p = fma(p, r, VecF::set1(4.999914765357971e-1f));
  p = fma(p, r, VecF::set1(9.999997019767761e-1f));
  return fma(p, r, VecF::set1(1.f));
}

// vexp as it was before 2026-12-03: the degree-6 Taylor polynomial (1.6e-7 relative error on
// [-ln2/2, ln2/2]).
VecF poly6(VecF r) {
  VecF p = VecF::set1(1.f / 720.f);
  p = fma(p, r, VecF::set1(1.f / 120.f));
  p = fma(p, r, VecF::set1(1.f / 24.f));
  p = fma(p, r, VecF::set1(1.f / 6.f));
  p = fma(p, r, VecF::set1(0.5f));
  p = fma(p, r, VecF::set1(1.f));
  return fma(p, r, VecF::set1(1.f));
}

// kDegree6: poly6 instead of poly5 (with two ln 2 constants and vscalefps: the old vexp).
// kOneLn2: the reduction with one ln 2 constant (one multiply-add fewer again).
// kIntExp: 2^n added to the exponent bits from the rounding constant's sum (vpslld + vpaddd
// for vscalefps): exact for the normal results, but a NaN's payload can leak into the
// exponent field and turn it into a number, so it would need one more step to be correct.
template <bool kOneLn2, bool kIntExp, bool kDegree6 = false>
VecF exp_variant(VecF x) {
  const VecF lo = VecF::set1(-87.0f);
  const VecF xc = min(VecF::set1(88.0f), max(lo, x));
  const VecF magic = VecF::set1(12582912.f);
  const VecF t = fma(xc, VecF::set1(1.44269504088896341f), magic);
  const VecF n = t - magic;
  VecF r;
  if (kOneLn2) {
    r = fma(n, VecF::set1(-0.693147182464599609375f), xc);
  } else {
    r = fma(n, VecF::set1(-0.693145751953125f), xc);
    r = fma(n, VecF::set1(-1.42860682030941723212e-6f), r);
  }
  const VecF p = kDegree6 ? poly6(r) : poly5(r);
  VecF y;
  if (kIntExp) {
    const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(t.v), 23);
    y = {_mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p.v), e))};
  } else {
    y = VecF::mul_pow2(p, n);
  }
  return y.select_lt(x, lo, VecF::zero());
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One tile's exponential pass, as finish_strip runs it for 4 strips of 16 query rows.
template <typename Exp>
float tile_pass(Exp exp_fn) {
  const VecF scale = VecF::set1(0.125f), m = VecF::set1(2.0f);
  VecF total = VecF::zero();
  for (int r0 = 0; r0 < 64; r0 += 16) {
    VecF sum = VecF::zero();
    for (int c = 0; c < 64; ++c) {
      const VecF x = VecF::load(S + c * 64 + r0);
      const VecF e = exp_fn((x * scale).unfused() - m);
      e.store(out + c * 64 + r0);
      sum = sum + e;
    }
    total = total + sum;
  }
  return hsum(total);
}

template <typename Exp>
double ns_per_vector(Exp exp_fn) {
  double best = 1e30;
  volatile float sink = 0;
  for (int t = 0; t < 15; ++t) {
    const double t0 = now();
    for (int i = 0; i < 4000; ++i) sink = sink + tile_pass(exp_fn);
    best = std::min(best, (now() - t0) / 4000 / 256 * 1e9);
  }
  return best;
}

template <typename Exp>
double max_rel_error(Exp exp_fn) {
  double worst = 0;
  alignas(64) float x[16], y[16];
  for (int i = 0; i < 2000000; i += 16) {
    for (int j = 0; j < 16; ++j) x[j] = -87.0f * float(i + j) / 2000000.0f;
    exp_fn(VecF::load(x)).store(y);
    for (int j = 0; j < 16; ++j) {
      const double e = std::exp(double(x[j]));
      worst = std::max(worst, std::fabs(y[j] - e) / e);
    }
  }
  return worst;
}

}  // namespace

// Lambdas, so that each variant is inlined into the timed loop as vexp is.
constexpr auto F6 = [](VecF x) { return exp_variant<false, false, true>(x); };
constexpr auto F5_1 = [](VecF x) { return exp_variant<true, false>(x); };
constexpr auto F5_i = [](VecF x) { return exp_variant<false, true>(x); };
constexpr auto F5_1i = [](VecF x) { return exp_variant<true, true>(x); };

int main() {
  for (int i = 0; i < 64 * 64; ++i) S[i] = -40.0f + float((i * 7919) % 4096) / 64.0f;
  struct Row {
    const char* name;
    double ns, err;
  } rows[] = {
      {"degree-6 Taylor, two ln 2 constants, vscalefps (vexp before)",
       ns_per_vector(F6), max_rel_error(F6)},
      {"degree-5 fitted polynomial (vexp now)",
       ns_per_vector([](VecF x) { return vexp(x); }), max_rel_error([](VecF x) { return vexp(x); })},
      {"degree 5, one ln 2 constant",
       ns_per_vector(F5_1), max_rel_error(F5_1)},
      {"degree 5, integer exponent (NaN payloads unsafe)",
       ns_per_vector(F5_i), max_rel_error(F5_i)},
      {"degree 5, one constant, integer exponent",
       ns_per_vector(F5_1i), max_rel_error(F5_1i)},
      {"vexp_lean (16-bit inputs only: degree 4, one constant)",
       ns_per_vector([](VecF x) { return vexp_lean(x); }),
       max_rel_error([](VecF x) { return vexp_lean(x); })},
  };
  for (const Row& r : rows)
    std::printf("%-58s %6.3f ns / 16 scores  %5.3f of degree 6  max rel error %.2e\n", r.name, r.ns,
                r.ns / rows[0].ns, r.err);
}
