// The validation contract of the core: what every backend requires of a FwdParams /
// BwdParams before it touches memory. Each backend's entry calls check_params with its
// Backend (cpu_forward / cpu_backward, and the CUDA launchers launch_flash_fwd /
// launch_flash_bwd, which serve the GPU, the emulator and the C++ tests alike), so that a
// direct C++ caller gets an error, never a fault, for params the kernels cannot run.
//
// Layers: the Python layer (python/fmha/_validate.py) checks everything a user can pass and
// words the errors for the user; the bindings (bindings/params_from_dlpack.h) check only
// what building params from DLPack tensors needs (dtype, device, rank, extents, strides of
// each tensor); this contract checks the params themselves.
//
// The backends' limits -- dtypes, head dims, 8-bit caches, features -- come from the
// capability table (fmha/capabilities.h), which the Python layer reads too.
//
// Throws InvalidArgument (fmha/error.h), which the Python modules turn into ValueError.
#pragma once

#include <string>

#include "fmha/capabilities.h"
#include "fmha/params.h"

namespace fmha {

void check_params(const FwdParams& p, Backend backend);

// "float16/bfloat16": the dtypes a backend takes (capability table), as errors list them.
std::string dtype_list(const BackendCaps& c);
// The forward's rules, plus the gradient tensors and dbias.
void check_params(const BwdParams& p, Backend backend);

}  // namespace fmha
