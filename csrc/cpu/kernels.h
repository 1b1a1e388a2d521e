// The CPU kernels, compiled once per instruction set (instantiate_<isa>.cpp) from the same
// templated sources: forward.h (the CPU forward) and backward.h (the CPU backward).
#pragma once

#include <cstdint>

#include "fmha/params.h"

namespace fmha::cpu {
#define FMHA_DECLARE_ISA(ns)                \
  namespace ns {                            \
  void forward(const FwdParams& p);         \
  void backward(const BwdParams& p);        \
  double fma_peak_gflops(int threads);      \
  double bf16_dot_peak_gflops(int threads); \
  double read_bandwidth_gbs(int threads, int64_t bytes); \
  void exp_array(const float* x, float* y, int64_t n, bool lean); \
  void decode_kv_codes(int code, const uint8_t* x, float* y, int64_t n); \
  }
// Whether a GEMM's B operand whose rows lie at another stride (the forward's V, the
// backward's Q and dO) is copied into a dense tile first (forward.h, rows_as_acc): a choice
// per microarchitecture, measured, with the same results either way. Defined in
// fmha/dispatch.cpp.
bool copies_b_rows_dense();

FMHA_DECLARE_ISA(scalar)
FMHA_DECLARE_ISA(avx2)
FMHA_DECLARE_ISA(avx512)
FMHA_DECLARE_ISA(avx512bf16)
#undef FMHA_DECLARE_ISA
// The amx level (instantiate_amx.cpp, built on top of avx512bf16): its forward and backward;
// its probes are the avx512bf16 level's.
namespace amx_tiles {
void forward(const FwdParams& p);
void backward(const BwdParams& p);
}  // namespace amx_tiles
}  // namespace fmha::cpu
