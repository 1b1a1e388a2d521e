// Softmax steps on a transposed score tile Sᵀ (keys x query rows, leading dimension kBr):
// query row r is column r, so every step runs across query rows in SIMD vectors and never
// needs a horizontal reduction. Float uses VecF; float64 plain loops.
#pragma once

#include <cmath>

#include "cpu/gemm.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

// Online softmax (Milakov & Gimelshein 2018) over one key tile, for rows [0, nrp):
//   m_new = max(m, max_c S[c][r]);  P[c][r] = exp(S[c][r] - m_new);
//   alpha[r] = exp(m - m_new);      l = l * alpha + sum_c P[c][r];  m = m_new.
// A row with nothing visible so far keeps m = -inf and gets P = 0 (no NaN): the exponent is
// taken against 0 there, and exp(-inf) = 0.
// `scale`: the score scale when Sᵀ still holds the raw products q·k (the forward folds it in
// here when nothing else touches the scores between the GEMM and the softmax), 1 when Sᵀ
// already holds the final scores. Only a scale > 0 may be folded: it keeps every column's
// maximum where it was, so max(scale * s) = scale * max(s) exactly (rounding is monotonic),
// and every exponent sees the same float scale * s as an unfolded pass would compute.
// kLean: exp_lean (vexp.h), for 16-bit inputs.
template <bool kScale, bool kLean>
inline void online_softmax_T_impl(float* S, int64_t ld, int nc, int nrp, float* m, float* l,
                                  float* alpha, float scale) {
  const VecF neg_inf = VecF::set1(-__builtin_huge_valf()), lowest = VecF::set1(-3.4e38f);
  const VecF c_scale = VecF::set1(scale);
  // One strip of kW rows, given its column maxima mx: the new maxima, the exponentials, l.
  auto finish_strip = [&](int r0, VecF mx) {
    const VecF m_old = VecF::load(m + r0);
    const VecF m_new = max(m_old, kScale ? mx * c_scale : mx);
    const VecF m_ref = m_new.select_lt(m_new, lowest, VecF::zero());  // -inf -> 0
    const VecF a = kLean ? vexp_lean(m_old - m_ref) : vexp(m_old - m_ref);
    VecF sum = VecF::zero();
    for (int c = 0; c < nc; ++c) {
      const VecF x = VecF::load(S + c * ld + r0);
      const VecF x_m = (kScale ? (x * c_scale).unfused() : x) - m_ref;
      const VecF e = kLean ? vexp_lean(x_m) : vexp(x_m);
      e.store(S + c * ld + r0);
      sum = sum + e;
    }
    fma(VecF::load(l + r0), a, sum).store(l + r0);
    m_new.store(m + r0);
    a.store(alpha + r0);
  };
  // The column maxima of 4 strips side by side: one strip's is a chain of dependent max
  // instructions, one per key, so 4 chains in flight take about a quarter of the time. Each
  // lane still takes max(mx, S[c][r]) over c ascending: the same bits as a strip alone.
  int r0 = 0;
  for (; r0 + 4 * kW <= nrp; r0 += 4 * kW) {
    VecF mx[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) mx[q] = neg_inf;
    for (int c = 0; c < nc; ++c)
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) mx[q] = max(mx[q], VecF::load(S + c * ld + r0 + q * kW));
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) finish_strip(r0 + q * kW, mx[q]);
  }
  for (; r0 < nrp; r0 += kW) {
    VecF mx = neg_inf;
    for (int c = 0; c < nc; ++c) mx = max(mx, VecF::load(S + c * ld + r0));
    finish_strip(r0, mx);
  }
}

template <bool kLean = false>
inline void online_softmax_T(float* S, int64_t ld, int nc, int nrp, float* m, float* l,
                             float* alpha, float scale = 1.0f) {
  if (scale == 1.0f)
    return online_softmax_T_impl<false, kLean>(S, ld, nc, nrp, m, l, alpha, scale);
  online_softmax_T_impl<true, kLean>(S, ld, nc, nrp, m, l, alpha, scale);
}

template <bool kLean = false>
inline void online_softmax_T(double* S, int64_t ld, int nc, int nrp, double* m, double* l,
                             double* alpha, double scale = 1.0) {
  for (int r = 0; r < nrp; ++r) {
    double mx = -__builtin_huge_val();
    for (int c = 0; c < nc; ++c) mx = std::max(mx, S[c * ld + r]);
    mx = std::max(m[r], unfused(mx * scale));
    const double m_ref = mx == -__builtin_huge_val() ? 0.0 : mx;
    alpha[r] = std::exp(m[r] - m_ref);
    double sum = 0;
    for (int c = 0; c < nc; ++c) {
      const double e = std::exp(unfused(S[c * ld + r] * scale) - m_ref);
      S[c * ld + r] = e;
      sum += e;
    }
    l[r] = l[r] * alpha[r] + sum;
    m[r] = mx;
  }
}

// Backward: P = exp(S - L) with L the forward's lse (L_ref = +inf for rows that saw no key,
// which makes their P exactly 0), then dS = P ∘ (dP - D), in place of dP. P is 0 wherever
// S = -inf, also in a row whose L is NaN, and dS is 0 wherever P is, even when dP or D is
// not finite (docs/semantics.md, non-finite inputs).
inline void probs_and_dS_T(float* S, float* dP, int64_t ld, int nc, int nrp, const float* L_ref,
                           const float* D) {
  for (int r0 = 0; r0 < nrp; r0 += kW) {
    const VecF L = VecF::load(L_ref + r0), d = VecF::load(D + r0), zero = VecF::zero();
    const VecF neg_inf = VecF::set1(-__builtin_huge_valf());
    for (int c = 0; c < nc; ++c) {
      const VecF x = VecF::load(S + c * ld + r0);
      const VecF p = vexp(x - L).select_eq(x, neg_inf, zero);
      p.store(S + c * ld + r0);
      (p * (VecF::load(dP + c * ld + r0) - d)).select_eq(p, zero, zero).store(dP + c * ld + r0);
    }
  }
}

inline void probs_and_dS_T(double* S, double* dP, int64_t ld, int nc, int nrp,
                           const double* L_ref, const double* D) {
  for (int c = 0; c < nc; ++c)
    for (int r = 0; r < nrp; ++r) {
      const double x = S[c * ld + r];
      const double p = x == -__builtin_huge_val() ? 0.0 : std::exp(x - L_ref[r]);
      S[c * ld + r] = p;
      dP[c * ld + r] = p == 0 ? 0.0 : p * (dP[c * ld + r] - D[r]);
    }
}

// The same on a row-major tile S (query rows x keys, leading dimension ld), for the pass that
// keeps a key tile fixed and streams query rows: per row r, vectors run along the keys.
inline void probs_and_dS_rows(float* S, float* dP, int64_t ld, int nr, int ncp, const float* L_ref,
                              const float* D) {
  for (int r = 0; r < nr; ++r) {
    const VecF L = VecF::set1(L_ref[r]), d = VecF::set1(D[r]), zero = VecF::zero();
    const VecF neg_inf = VecF::set1(-__builtin_huge_valf());
    float* s = S + r * ld;
    float* g = dP + r * ld;
    for (int c = 0; c < ncp; c += kW) {
      const VecF x = VecF::load(s + c);
      const VecF p = vexp(x - L).select_eq(x, neg_inf, zero);
      p.store(s + c);
      (p * (VecF::load(g + c) - d)).select_eq(p, zero, zero).store(g + c);
    }
  }
}

inline void probs_and_dS_rows(double* S, double* dP, int64_t ld, int nr, int ncp,
                              const double* L_ref, const double* D) {
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < ncp; ++c) {
      const double x = S[r * ld + c];
      const double p = x == -__builtin_huge_val() ? 0.0 : std::exp(x - L_ref[r]);
      S[r * ld + c] = p;
      dP[r * ld + c] = p == 0 ? 0.0 : p * (dP[r * ld + c] - D[r]);
    }
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
