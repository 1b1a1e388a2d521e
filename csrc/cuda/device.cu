// CUDA runtime queries. Linked with the static CUDA runtime, so importing fmha needs no
// driver: without one, cudaGetDeviceCount fails and fmha reports "no GPU".
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/flash_bwd.h"
#include "cuda/flash_decode.h"
#include "cuda/flash_fwd.h"

#include "fmha/api.h"
#include "fmha/error.h"
#include "fmha/validate.h"

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

std::pair<int, int> cuda_capability(int device) {
  const int n = cuda_device_count();
  if (device < 0 || device >= n)
    throw Unsupported(concat("CUDA device ", device, " is not available: ", cuda_status()));
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return {major, minor};
}

namespace {

// Makes `device` current for one launch and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) {
      const cudaError_t err = cudaSetDevice(device);
      if (err != cudaSuccess)
        throw std::runtime_error(concat("cudaSetDevice(", device, "): ", cudaGetErrorString(err)));
    }
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

void check_capability(int device) {
  const auto [major, minor] = cuda_capability(device);
  if (major < 8)
    throw Unsupported(concat("CUDA device ", device, " has compute capability ", major, ".",
                             minor, "; fmha's CUDA kernels need sm_80 or newer (Ampere+)"));
}

// The launchers check p against the validation contract themselves; checking it here too,
// before the device, makes a bad call fail as such on a machine without a usable GPU.
template <typename Params, typename Launch>
void launch(const Params& p, int device, void* stream, Launch&& run) {
  check_params(p, Backend::kCuda);
  check_capability(device);
  DeviceGuard guard(device);
  run(p, stream);
}

}  // namespace

void cuda_forward(const FwdParams& p, int device, void* stream) {
  launch(p, device, stream, [](const FwdParams& q, void* s) {
    if (q.cache_seqlens) gpu::launch_flash_decode(q, s);
    else gpu::launch_flash_fwd(q, s);
  });
}

int cuda_kvcache_refusals(int device, bool clear) {
  check_capability(device);
  DeviceGuard guard(device);
  return gpu::kvcache_refusals(clear);
}

void cuda_backward(const BwdParams& p, int device, void* stream) {
  launch(p, device, stream, [](const BwdParams& q, void* s) { gpu::launch_flash_bwd(q, s); });
}

}  // namespace fmha
