// Linked instead of csrc/cuda when fmha is built without CUDA.
#include <string>

#include "fmha/api.h"

namespace fmha {
bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_status() { return "no GPU (fmha was built without CUDA)"; }
}  // namespace fmha
