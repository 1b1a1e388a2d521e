// The host interface of the CUDA FlashAttention-2 backward (cuda/flash_bwd.cuh): plain C++,
// so that bindings include it without CUDA or emulator headers.
#pragma once

#include "fmha/params.h"

namespace fmha {
namespace gpu {

// dq, dk, dv (and dbias when p.dbias) of the attention whose forward wrote p.o and p.lse
// (float32), for float16 / bfloat16 inputs; every forward feature. p.deterministic: dQ is
// summed in a fixed order (bitwise-reproducible) instead of by float32 atomics.
// `stream`: a cudaStream_t on the GPU, ignored under emulation. Throws InvalidArgument
// (fmha/error.h) for params the validation contract (fmha/validate.h) rejects.
void launch_flash_bwd(const BwdParams& p, void* stream = nullptr);

}  // namespace gpu
}  // namespace fmha
