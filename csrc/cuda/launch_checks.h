// The checks every CUDA launcher makes of the params before choosing kernels (host only).
// The Python layer has already produced friendlier messages for anything a user can pass;
// these guard direct callers of the core and keep bad params from becoming bad launches.
#pragma once

#include <stdexcept>
#include <string>

#include "fmha/params.h"

namespace fmha {
namespace gpu {

// Throws std::invalid_argument("<who>: ...") for what no CUDA kernel supports.
inline void check_launch_params(const FwdParams& p, const char* who) {
  auto unsupported = [&](const std::string& what) {
    throw std::invalid_argument(std::string(who) + ": " + what);
  };
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16)
    unsupported(std::string("dtype ") + dtype_name(p.dtype) + ", expected float16 or bfloat16");
  if (p.head_dim < 1 || p.head_dim > 256)
    unsupported("head_dim " + std::to_string(p.head_dim) + ", expected 1..256");
  if (p.head_dim_v < 1 || p.head_dim_v > 256)
    unsupported("head_dim_v " + std::to_string(p.head_dim_v) + ", expected 1..256");
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0)
    unsupported("heads_q " + std::to_string(p.heads_q) + " is not a multiple of heads_kv " +
                std::to_string(p.heads_kv));
  if (!p.cu_seqlens_q != !p.cu_seqlens_k)
    unsupported("cu_seqlens_q and cu_seqlens_k must be given together");
  if (!(p.dropout_p >= 0.0 && p.dropout_p < 1.0))
    unsupported("dropout_p " + std::to_string(p.dropout_p) + ", expected [0, 1)");
  if (!(p.softcap >= 0.0)) unsupported("softcap " + std::to_string(p.softcap) + ", expected >= 0");
  if (p.num_splits < 0)
    unsupported("num_splits " + std::to_string(p.num_splits) + ", expected >= 0 (0 = automatic)");
  if (p.seqlen_q < 0 || p.seqlen_k < 0)
    unsupported("seqlen_q " + std::to_string(p.seqlen_q) + " / seqlen_k " +
                std::to_string(p.seqlen_k) + ", expected >= 0");
}

}  // namespace gpu
}  // namespace fmha
