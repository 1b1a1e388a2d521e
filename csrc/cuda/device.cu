// CUDA runtime queries. Linked with the static CUDA runtime, so importing fmha needs no
// driver: without one, cudaGetDeviceCount fails and fmha reports "no GPU".
#include <cuda_runtime.h>

#include <string>

#include "fmha/api.h"
#include "fmha/error.h"

namespace fmha {

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later queries start clean
    return 0;
  }
  return n;
}

std::string cuda_status() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return concat("no GPU (", cudaGetErrorString(err), ")");
  }
  if (n == 0) return "no GPU (no CUDA device found)";
  std::string out;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out += concat(i ? "; " : "", "cuda:", i, " ", prop.name, " (sm_", prop.major, prop.minor, ")");
  }
  return out;
}

}  // namespace fmha
