// Instantiations of the tensor-core GEMM test kernel (cuda/testing/gemm_tc.cuh), for nvcc and, as
// host C++, for the emulator (fmha._cuda_emu).
#include <stdexcept>

#include "cuda/testing/gemm_tc.cuh"

namespace fmha {
namespace gpu {

void gemm_tc(const GemmTcParams& p, DType dtype, void* stream) {
  switch (dtype) {
    case DType::kFloat16: gemm_tc_launch<half_t>(p, static_cast<Stream>(stream)); return;
    case DType::kBFloat16: gemm_tc_launch<bf16_t>(p, static_cast<Stream>(stream)); return;
    default: break;
  }
  throw std::invalid_argument(std::string("gemm_tc: dtype ") + dtype_name(dtype) +
                              ", expected float16 or bfloat16");
}

}  // namespace gpu
}  // namespace fmha
