// Planted for tools/ptxas_check.py: a per-thread array indexed at run time cannot live in
// registers, so ptxas gives the kernel a local-memory stack frame -- exactly what the check
// must reject in the attention kernels. Compiled by nvcc only (never launched).
#include "cuda/primitives.cuh"

__global__ void planted_stack_frame_kernel(const int* index, float* out, int n) {
  float tile[256];
#pragma unroll
  for (int i = 0; i < 256; ++i) tile[i] = out[i * 64 + threadIdx.x];
  for (int i = 0; i < n; ++i) tile[index[i] & 255] += 1.0f;  // run-time index
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 256; ++i) sum += tile[i] * float(i);
  out[threadIdx.x] = sum;
}
