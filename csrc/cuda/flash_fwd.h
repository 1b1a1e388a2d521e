// The host interface of the CUDA FlashAttention-2 forward (cuda/flash_fwd.cuh): plain C++,
// so that bindings include it without CUDA or emulator headers.
#pragma once

#include <string>

#include "fmha/params.h"

namespace fmha {
namespace gpu {

// out and lse of p: float16 or bfloat16; head_dim and head_dim_v each 1..256, equal or not
// (run in the smallest built head-dim tile >= the larger of the two); causal / sliding window
// in either alignment, GQA, any seqlen_q / seqlen_k, varlen (cu_seqlens_q/k on the device,
// never validated: each sequence is clamped to total_q/k and to seqlen_q/k, the maxima), softcap, bias, ALiBi, boolean mask, dropout; split-KV by
// p.num_splits (0 = by occupancy). `stream`: a cudaStream_t on the GPU, ignored under
// emulation. Returns the number of key splits used (1 = none). Throws InvalidArgument
// (fmha/error.h) for params the validation contract (fmha/validate.h) rejects and for head
// dims beyond the built tiles.
int launch_flash_fwd(const FwdParams& p, void* stream = nullptr);

// Which forward kernel launch_flash_fwd runs (the choice: cuda/flash_fwd.cu, kernel_choice):
// the Hopper one (cuda/flash_fwd_sm90.cuh) takes the calls flash_fwd_sm90_claims accepts on an
// sm_90 device of a build with sm_90a code, unless FMHA_CUDA_KERNEL=sm80; under the emulator
// with FMHA_CUDA_KERNEL=sm90, and for float8 inputs. The rest run in the sm_80 kernel
// (cuda/flash_fwd.cuh); float8 calls the Hopper kernel does not take are refused
// (Unsupported, naming the argument flash_fwd_sm90_refusal gives).
bool flash_fwd_sm90_claims(const FwdParams& p);
std::string flash_fwd_sm90_refusal(const FwdParams& p);
int launch_flash_fwd_sm90(const FwdParams& p, void* stream);
// "sm90" or "sm80": the kernel of this thread's last launch_flash_fwd since the previous
// call ("": none). For tests of the routing.
const char* flash_fwd_take_last_kernel();

}  // namespace gpu
}  // namespace fmha
