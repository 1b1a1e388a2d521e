// The host interface of the tensor-core GEMM test kernel (cuda/testing/gemm_tc.cuh): plain C++, so
// that bindings include it without CUDA or emulator headers.
#pragma once

#include <cstdint>

#include "fmha/params.h"

namespace fmha {
namespace gpu {

struct GemmTcParams {
  const void* a;  // M x K, element (i, k) at a[i * lda + k]
  const void* b;  // K x N, element (k, j) at b[k * ldb + j]
  float* c;       // M x N, element (i, j) at c[i * ldc + j]
  int m, n, k;
  int64_t lda, ldb, ldc;  // row strides, in elements
};

// C = A * B for float16 or bfloat16 A and B, f32 C. `stream`: a cudaStream_t on the GPU,
// ignored under emulation. Throws std::invalid_argument for another dtype.
void gemm_tc(const GemmTcParams& p, DType dtype, void* stream);

}  // namespace gpu
}  // namespace fmha
