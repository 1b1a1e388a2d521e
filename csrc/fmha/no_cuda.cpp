// Linked instead of csrc/cuda when fmha is built without CUDA.
#include <string>
#include <utility>

#include "fmha/api.h"
#include "fmha/error.h"

namespace fmha {
bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_status() { return "no GPU (fmha was built without CUDA)"; }
namespace {
[[noreturn]] void no_cuda() {
  throw Unsupported("fmha was built without CUDA (no nvcc at build time, or FMHA_DISABLE_CUDA)"
                    ": CUDA arrays are not supported by this build; reinstall with nvcc on PATH");
}
}  // namespace
std::pair<int, int> cuda_capability(int) { no_cuda(); }
void cuda_forward(const FwdParams&, int, void*) { no_cuda(); }
void cuda_backward(const BwdParams&, int, void*) { no_cuda(); }
int cuda_kvcache_refusals(int, bool) { no_cuda(); }
}  // namespace fmha
