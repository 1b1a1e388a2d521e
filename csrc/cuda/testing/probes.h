// Probe kernels that apply one primitive of cuda/primitives.cuh to an array, so that tests
// can compare it with an independent implementation (NumPy, torch) over many inputs.
#pragma once

#include <cstdint>

#include "fmha/params.h"

namespace fmha {
namespace gpu {

// out[i] = bits of the conversion of in[i] to `to` (float16 or bfloat16) with the kernels'
// from_float (cvt.rn). in, out: device memory on the GPU, host memory under emulation.
void probe_convert(const float* in, uint16_t* out, int64_t n, DType to, void* stream);

}  // namespace gpu
}  // namespace fmha
