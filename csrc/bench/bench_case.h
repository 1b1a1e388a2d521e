// What the CPU and CUDA modes of fmha-bench share: a case (one attention shape), the
// contiguous (batch, seqlen, heads, dim) strides of its tensors, and its FLOP count.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fmha/params.h"

namespace fmha_bench {

struct Case {
  int b, hq, hkv, sq, sk, d;
  bool causal;
};

// Sets the shape of `p` and contiguous strides for q/o/dout/dq (b, sq, hq, d), k/v/dk/dv
// (b, sk, hkv, d) and lse (b, hq, sq); pointers are left to the caller.
inline void set_shape(fmha::BwdParams& p, const Case& c, fmha::DType dt) {
  p.dtype = dt;
  p.batch = c.b; p.heads_q = c.hq; p.heads_kv = c.hkv;
  p.seqlen_q = c.sq; p.seqlen_k = c.sk; p.head_dim = p.head_dim_v = c.d;
  auto set = [&](int64_t& bs, int64_t& rs, int64_t& hs, int s, int h) {
    hs = c.d; rs = int64_t(h) * c.d; bs = int64_t(s) * rs;
  };
  set(p.q_batch_stride, p.q_row_stride, p.q_head_stride, c.sq, c.hq);
  set(p.o_batch_stride, p.o_row_stride, p.o_head_stride, c.sq, c.hq);
  set(p.do_batch_stride, p.do_row_stride, p.do_head_stride, c.sq, c.hq);
  set(p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, c.sq, c.hq);
  set(p.k_batch_stride, p.k_row_stride, p.k_head_stride, c.sk, c.hkv);
  set(p.v_batch_stride, p.v_row_stride, p.v_head_stride, c.sk, c.hkv);
  set(p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, c.sk, c.hkv);
  set(p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, c.sk, c.hkv);
  p.lse_batch_stride = int64_t(c.hq) * c.sq; p.lse_head_stride = c.sq; p.lse_row_stride = 1;
  p.scale = 1.0 / std::sqrt(double(c.d));
  p.window_right = c.causal ? 0 : -1;
}

// Forward FLOPs 4·b·h·sq·sk·d, halved for causal (the masked half is skipped).
inline double forward_flops(const Case& c) {
  return 4.0 * c.b * c.hq * double(c.sq) * c.sk * c.d * (c.causal ? 0.5 : 1.0);
}

// fmha-bench --cuda (fmha_bench_cuda.cu, compiled only when CUDA is): times the cases on
// device 0 for the dtypes ("f16", "bf16" or "all") and passes ("fwd", "bwd", "fwd+bwd" or
// "all"). Returns the process exit status.
int run_cuda(const std::vector<Case>& cases, const std::string& dtype, const std::string& pass,
             int device, int reps);

}  // namespace fmha_bench
