// The CPU GEMM micro-kernel: one register-blocked routine behind all five products of
// attention, forward and backward:
//   S  = Q Kᵀ        (A = Q tile,      B = Kᵀ packed)      dP = dO Vᵀ   (A = dO, B = Vᵀ)
//   O += P V         (A = P,           B = V)              dQ += dS K   (A = dS, B = K)
//   dV += Pᵀ dO      (A = Pᵀ: a strided view of P)         dK += dSᵀ Q  (A = dSᵀ)
//
//   C[M x N] (+)= A[M x K] · B[K x N],  A(i, k) = A[i*a_rs + k*a_cs],  B, C row-major.
//
// A block of kGemmRows rows x kGemmVecs vectors of C lives in registers for the whole k loop;
// each k step loads kGemmVecs vectors of B once and reuses each for kGemmRows broadcasts of
// A, so the loop is bound by FMA throughput rather than loads (simd.h sizes the block to the
// ISA's register file). N must be a multiple of the vector width kW: tile buffers are padded.
#pragma once

#include <cstdint>

#include "cpu/simd.h"

namespace fmha::cpu::FMHA_CPU_ISA_NS {

template <int RB, int NV, bool kAcc>
inline void gemm_block(int K, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                       int64_t ldb, float* C, int64_t ldc) {
  // The loops over r and n are unrolled before GCC's scalar replacement runs (the pragmas):
  // otherwise acc stays an array on the stack, written at entry and after the k loop and read
  // back for C's stores -- ~70 vector memory operations per 6 x 4 block, beside its 24 stores.
  VecF acc[RB][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n)
      acc[r][n] = kAcc ? VecF::load(C + r * ldc + n * kW) : VecF::zero();
  for (int k = 0; k < K; ++k) {
    VecF b[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) b[n] = VecF::load(B + k * ldb + n * kW);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const VecF a = VecF::set1(A[r * a_rs + k * a_cs]);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) acc[r][n] = fma(a, b[n], acc[r][n]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) acc[r][n].store(C + r * ldc + n * kW);
}

#if defined(__AVX512BF16__)
// bfloat16 operands in pairs along the reduction (AVX512-BF16 vdpbf16ps: 16 lanes x 2
// products per instruction, twice the float FMA rate): A(i, kp) is the 32-bit word holding
// (A[i][2kp], A[i][2kp+1]); row kp of B holds words (B[2kp][n], B[2kp+1][n]). K counts pairs.
// Products are exact in float and accumulated in float.
constexpr bool kBf16Dot = true;
template <int RB, int NV, bool kAcc>
inline void gemm_block(int K, const uint32_t* A, int64_t a_rs, int64_t a_cs, const uint32_t* B,
                       int64_t ldb, float* C, int64_t ldc) {
  __m512 acc[RB][NV];  // in registers: the pragmas, as in the float block above
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n)
      acc[r][n] = kAcc ? _mm512_loadu_ps(C + r * ldc + n * kW) : _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m512i b[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) b[n] = _mm512_loadu_si512(B + k * ldb + n * kW);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512i a = _mm512_set1_epi32(int(A[r * a_rs + k * a_cs]));
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n)
        acc[r][n] = _mm512_dpbf16_ps(acc[r][n], (__m512bh)a, (__m512bh)b[n]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) _mm512_storeu_ps(C + r * ldc + n * kW, acc[r][n]);
}
#else
constexpr bool kBf16Dot = false;
#endif

// Rows [0, M) for one column strip of NV vectors: full blocks, then one block of the rest.
template <int NV, bool kAcc, int R = kGemmRows - 1, typename TA, typename TB>
inline void gemm_row_tail(int rows, int K, const TA* A, int64_t a_rs, int64_t a_cs,
                          const TB* B, int64_t ldb, float* C, int64_t ldc) {
  if constexpr (R >= 1) {
    if (rows == R) return gemm_block<R, NV, kAcc>(K, A, a_rs, a_cs, B, ldb, C, ldc);
    gemm_row_tail<NV, kAcc, R - 1, TA, TB>(rows, K, A, a_rs, a_cs, B, ldb, C, ldc);
  }
}

template <int NV, bool kAcc, typename TA, typename TB>
inline void gemm_strip(int M, int K, const TA* A, int64_t a_rs, int64_t a_cs, const TB* B,
                       int64_t ldb, float* C, int64_t ldc) {
  int i = 0;
  for (; i + kGemmRows <= M; i += kGemmRows)
    gemm_block<kGemmRows, NV, kAcc>(K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc);
  if (i < M)
    gemm_row_tail<NV, kAcc>(M - i, K, A + i * a_rs, a_rs, a_cs, B, ldb, C + i * ldc, ldc);
}

template <bool kAcc, int NV = kGemmVecs - 1, typename TA, typename TB>
inline void gemm_col_tail(int vecs, int M, int K, const TA* A, int64_t a_rs, int64_t a_cs,
                          const TB* B, int64_t ldb, float* C, int64_t ldc) {
  if constexpr (NV >= 1) {
    if (vecs == NV) return gemm_strip<NV, kAcc>(M, K, A, a_rs, a_cs, B, ldb, C, ldc);
    gemm_col_tail<kAcc, NV - 1, TA, TB>(vecs, M, K, A, a_rs, a_cs, B, ldb, C, ldc);
  }
}

// float operands (TA = TB = float) or, with AVX512-BF16, bfloat16 pairs (uint32_t).
template <bool kAcc, typename TA, typename TB>
inline void gemm(int M, int N, int K, const TA* A, int64_t a_rs, int64_t a_cs,
                 const TB* B, int64_t ldb, float* C, int64_t ldc) {
  constexpr int strip = kGemmVecs * kW;
  int n0 = 0;
  for (; n0 + strip <= N; n0 += strip)
    gemm_strip<kGemmVecs, kAcc>(M, K, A, a_rs, a_cs, B + n0, ldb, C + n0, ldc);
  if (n0 < N) gemm_col_tail<kAcc>((N - n0) / kW, M, K, A, a_rs, a_cs, B + n0, ldb, C + n0, ldc);
}

// float64 (the exact path): plain loops, vectorised by the compiler along N.
template <bool kAcc>
inline void gemm(int M, int N, int K, const double* A, int64_t a_rs, int64_t a_cs,
                 const double* B, int64_t ldb, double* C, int64_t ldc) {
  for (int i = 0; i < M; ++i) {
    double* c = C + i * ldc;
    if (!kAcc)
      for (int n = 0; n < N; ++n) c[n] = 0;
    for (int k = 0; k < K; ++k) {
      const double a = A[i * a_rs + k * a_cs];
      const double* b = B + k * ldb;
#pragma omp simd
      for (int n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

// Leading dimension of a tile row of n elements: padded to the vector width for float.
template <typename A> inline int padded(int n) { return n; }
template <> inline int padded<float>(int n) { return round_up_w(n); }

// Row reductions and the softmax exponent, vectorised for float.
inline float row_max(const float* x, int n) {
  int c = 0;
  float m = -__builtin_huge_valf();
  if (n >= kW) {
    VecF v = VecF::load(x);
    for (c = kW; c + kW <= n; c += kW) v = max(v, VecF::load(x + c));
    m = hmax(v);
  }
  for (; c < n; ++c) m = x[c] > m ? x[c] : m;
  return m;
}
inline double row_max(const double* x, int n) {
  double m = -__builtin_huge_val();
  for (int c = 0; c < n; ++c) m = x[c] > m ? x[c] : m;
  return m;
}

// x <- exp(x - m) (kLean: exp_lean, vexp.h); returns the sum of the new x.
template <bool kLean = false>
inline float exp_sub_sum(float* x, int n, float m) {
  const VecF vm = VecF::set1(m);
  VecF acc = VecF::zero();
  int c = 0;
  for (; c + kW <= n; c += kW) {
    const VecF x_m = VecF::load(x + c) - vm;
    const VecF e = kLean ? vexp_lean(x_m) : vexp(x_m);
    e.store(x + c);
    acc = acc + e;
  }
  float sum = hsum(acc);
  for (; c < n; ++c) {
    x[c] = softmax_exp<kLean>(x[c] - m);
    sum += x[c];
  }
  return sum;
}
template <bool kLean = false>
inline double exp_sub_sum(double* x, int n, double m) {
  double sum = 0;
  for (int c = 0; c < n; ++c) {
    x[c] = std::exp(x[c] - m);
    sum += x[c];
  }
  return sum;
}

}  // namespace fmha::cpu::FMHA_CPU_ISA_NS
