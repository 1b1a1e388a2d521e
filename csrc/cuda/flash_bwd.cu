// Placeholder until the CUDA backward lands: the host interface exists so that bindings
// link; calling it reports that the kernels are missing.
#include <stdexcept>

#include "cuda/flash_bwd.h"

namespace fmha {
namespace gpu {

void launch_flash_bwd(const BwdParams&, void*) {
  throw std::invalid_argument("launch_flash_bwd: the CUDA backward is not implemented yet");
}

}  // namespace gpu
}  // namespace fmha
