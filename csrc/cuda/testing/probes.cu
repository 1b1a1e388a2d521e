// Probe kernels (see probes.h).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/primitives.cuh"
#include "cuda/testing/probes.h"

namespace fmha {
namespace gpu {

template <typename T>
__global__ void probe_convert_kernel(const float* in, uint16_t* out, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = bits_of(from_float<T>(in[i]));
}

void probe_convert(const float* in, uint16_t* out, int64_t n, DType to, void* stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
#if defined(__CUDACC__)
  const unsigned blocks = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
#else
  const unsigned blocks = 1;  // emulated blocks run one at a time: one, grid-stride loop
#endif
  const Stream s = static_cast<Stream>(stream);
  if (to == DType::kFloat16) {
    auto kernel = &probe_convert_kernel<half_t>;
    FMHA_LAUNCH(kernel, dim3(blocks), dim3(kThreads), 0, s, in, out, n);
  } else if (to == DType::kBFloat16) {
    auto kernel = &probe_convert_kernel<bf16_t>;
    FMHA_LAUNCH(kernel, dim3(blocks), dim3(kThreads), 0, s, in, out, n);
  } else {
    throw std::invalid_argument(std::string("probe_convert: to=") + dtype_name(to) +
                                ", expected float16 or bfloat16");
  }
}

}  // namespace gpu
}  // namespace fmha
