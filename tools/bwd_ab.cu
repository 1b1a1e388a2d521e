// Times fmha's CUDA backward (launch_flash_bwd) alone on the GPU: the timer of
// tools/bwd_ab.sh, which builds it once against the working tree's kernels and once against an
// earlier commit's, so that two backward designs run side by side without both living in the
// sources. Inputs are random (fixed seed), lse a finite constant (the plain path's timing does
// not depend on the values); one line per shape: milliseconds per call and TFLOP/s (the
// backward's 5 GEMMs: 10 b h s^2 d flops non-causal, half that causal).
//
//   bwd_ab [reps]          the shapes below, fp16, atomic dQ
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/flash_bwd.h"
#include "fmha/params.h"

namespace {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "bwd_ab: %s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

struct Shape {
  int batch, seqlen, heads, d;
  bool causal;
};

// One shape: returns milliseconds per call over `reps` calls after 3 warm-up calls.
float time_shape(const Shape& c, int reps) {
  const size_t n = size_t(c.batch) * c.seqlen * c.heads * c.d;
  std::vector<uint16_t> host(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  // fp16 bit patterns of N(0, 1) samples (round to nearest via the float's top bits suffices
  // for timing inputs).
  for (auto& x : host) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const int e = int((u >> 23) & 0xff) - 127 + 15;
    x = e <= 0 ? uint16_t((u >> 16) & 0x8000)
               : uint16_t(((u >> 16) & 0x8000) | (e << 10) | ((u >> 13) & 0x3ff));
  }
  void* buf[8];
  for (auto*& b : buf) {
    check(cudaMalloc(&b, n * 2), "cudaMalloc");
    check(cudaMemcpy(b, host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  float* lse = nullptr;
  const size_t rows = size_t(c.batch) * c.heads * c.seqlen;
  check(cudaMalloc(&lse, rows * 4), "cudaMalloc");
  std::vector<float> lse_host(rows, 10.0f);
  check(cudaMemcpy(lse, lse_host.data(), rows * 4, cudaMemcpyHostToDevice), "cudaMemcpy");

  fmha::BwdParams p;
  p.q = buf[0], p.k = buf[1], p.v = buf[2], p.o = buf[3], p.dout = buf[4];
  p.dq = buf[5], p.dk = buf[6], p.dv = buf[7], p.lse = lse;
  const int64_t row = int64_t(c.heads) * c.d, batch = row * c.seqlen;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = p.do_row_stride = row;
  p.dq_row_stride = p.dk_row_stride = p.dv_row_stride = row;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = c.d;
  p.do_head_stride = p.dq_head_stride = p.dk_head_stride = p.dv_head_stride = c.d;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = batch;
  p.do_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = batch;
  p.lse_batch_stride = int64_t(c.heads) * c.seqlen, p.lse_head_stride = c.seqlen;
  p.lse_row_stride = 1;
  p.batch = c.batch, p.heads_q = p.heads_kv = c.heads;
  p.seqlen_q = p.seqlen_k = c.seqlen, p.head_dim = p.head_dim_v = c.d;
  p.dtype = fmha::DType::kFloat16;
  p.scale = 1.0 / std::sqrt(double(c.d));
  p.window_left = -1, p.window_right = c.causal ? 0 : -1, p.bottom_right = true;
  p.num_splits = 1;
  p.deterministic = false;

  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  for (int i = 0; i < 3; ++i) fmha::gpu::launch_flash_bwd(p, stream);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) fmha::gpu::launch_flash_bwd(p, stream);
  check(cudaEventRecord(stop, stream), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "the backward");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  for (auto* b : buf) cudaFree(b);
  cudaFree(lse);
  cudaStreamDestroy(stream);
  return ms / float(reps);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const Shape shapes[] = {{4, 2048, 16, 64, false}, {4, 2048, 16, 128, false},
                          {4, 4096, 16, 128, true}, {16, 1024, 16, 128, false}};
  std::printf("shape\tms\tTFLOP/s\n");
  for (const Shape& c : shapes) {
    const float ms = time_shape(c, reps);
    const double flops = 10.0 * c.batch * c.heads * double(c.seqlen) * c.seqlen * c.d *
                         (c.causal ? 0.5 : 1.0);
    std::printf("b%d s%d h%d d%d%s\t%.3f\t%.1f\n", c.batch, c.seqlen, c.heads, c.d,
                c.causal ? " causal" : "", ms, flops / (ms * 1e-3) / 1e12);
  }
  return 0;
}
