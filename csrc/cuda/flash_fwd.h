// The host interface of the CUDA FlashAttention-2 forward (cuda/flash_fwd.cuh): plain C++,
// so that bindings include it without CUDA or emulator headers.
#pragma once

#include "fmha/params.h"

namespace fmha {
namespace gpu {

// out and lse of p: float16 or bfloat16; head_dim == head_dim_v <= 128; causal / sliding
// window in either alignment, GQA, any seqlen_q / seqlen_k, softcap, bias, ALiBi, boolean
// mask, dropout.
// `stream`: a cudaStream_t on the GPU, ignored under emulation. Throws
// std::invalid_argument for what the kernel does not support yet (other dtypes,
// head_dim > 128, head_dim_v != head_dim, varlen).
void launch_flash_fwd(const FwdParams& p, void* stream = nullptr);

}  // namespace gpu
}  // namespace fmha
