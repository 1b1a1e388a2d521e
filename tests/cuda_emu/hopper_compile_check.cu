// Instantiates every wrapper of cuda/hopper.cuh in small kernels, so that nvcc (ptxas) assembles
// each inline-PTX form for sm_90a: tests/native/test_cuda_emu.py compiles this file with
// tools/ptxas_check.py (skipped where nvcc is missing). The emulator programs compile it too
// (tests/cuda_emu/CMakeLists.txt), so that the one source builds against both backends; its
// kernels are not run.
#include <cstdint>

#include "cuda/hopper.cuh"

namespace fmha {
namespace gpu {
namespace hopper_compile_check {

__global__ void mbarrier_kernel(int* out) {
  FMHA_DYNAMIC_SHARED(uint64_t, bar);
  mbarrier_init(bar, 2);
  fence_barrier_init();
  __syncthreads();
  const uint64_t s = mbarrier_arrive(bar);
  mbarrier_expect_tx(bar, 16);
  mbarrier_complete_tx(bar, 16);
  mbarrier_arrive_expect_tx(bar, 0);
  out[0] = mbarrier_test_wait(bar, s) + mbarrier_test_wait_parity(bar, 1);
  mbarrier_wait(bar, 0);
  if (elect_one()) out[1] = 1;
  __syncthreads();
  if (threadIdx.x == 0) mbarrier_inval(bar);
}

template <int N, typename T, typename TB, int kTransA, int kTransB>
__global__ void wgmma_kernel(float* out) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  const uint64_t a = make_smem_desc(smem, 128, 1024, SmemSwizzle::k128B);
  const uint64_t b = make_smem_desc(smem + 8192, 16, 512, SmemSwizzle::k64B);
  uint32_t frag[4] = {threadIdx.x, 1u, 2u, 3u};
  fence_proxy_async();
  wgmma_fence();
  wgmma_ss<N, T, TB, kTransA, kTransB>(d, a, b, true);
  wgmma_ss<N, T, TB, kTransA, kTransB, -1, 1>(d, a, b, false);
  wgmma_rs<N, T, TB, kTransB>(d, frag, b, true);
  wgmma_commit_group();
  wgmma_wait_group<1>();
  wgmma_wait_group<0>();
  for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = d[i];
}

template __global__ void wgmma_kernel<8, half_t, half_t, 0, 0>(float*);
template __global__ void wgmma_kernel<64, bf16_t, bf16_t, 1, 1>(float*);
template __global__ void wgmma_kernel<136, half_t, half_t, 0, 1>(float*);
template __global__ void wgmma_kernel<256, bf16_t, bf16_t, 0, 1>(float*);
template __global__ void wgmma_kernel<32, e4m3_t, e4m3_t, 0, 0>(float*);
template __global__ void wgmma_kernel<16, e4m3_t, e5m2_t, 0, 0>(float*);
template __global__ void wgmma_kernel<24, e5m2_t, e4m3_t, 0, 0>(float*);
template __global__ void wgmma_kernel<128, e5m2_t, e5m2_t, 0, 0>(float*);

__global__ void tma_kernel(const __grid_constant__ TensorMap map1, const __grid_constant__ TensorMap map2,
                           const __grid_constant__ TensorMap map3, const __grid_constant__ TensorMap map4,
                           const __grid_constant__ TensorMap map5, int x) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 65536);
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_barrier_init();
    mbarrier_arrive_expect_tx(bar, 5 * 1024);
    const int32_t c1[1] = {x};
    const int32_t c2[2] = {x, 1};
    const int32_t c3[3] = {x, 1, 2};
    const int32_t c4[4] = {x, 1, 2, 3};
    const int32_t c5[5] = {x, 1, 2, 3, 4};
    tma_load<1>(smem, &map1, c1, bar);
    tma_load<2>(smem + 1024, &map2, c2, bar);
    tma_load<3>(smem + 2048, &map3, c3, bar);
    tma_load<4>(smem + 3072, &map4, c4, bar);
    tma_load<5>(smem + 4096, &map5, c5, bar);
    mbarrier_wait(bar, 0);
    tma_store<1>(&map1, c1, smem);
    tma_store<2>(&map2, c2, smem + 1024);
    tma_store<3>(&map3, c3, smem + 2048);
    tma_store<4>(&map4, c4, smem + 3072);
    tma_store<5>(&map5, c5, smem + 4096);
    bulk_commit_group();
    bulk_wait_group_read<0>();
  }
}

__global__ void fp8_kernel(const float* in, uint16_t* out) {
  out[2 * threadIdx.x] = pack_fp8x2<e4m3_t>(in[2 * threadIdx.x], in[2 * threadIdx.x + 1]);
  out[2 * threadIdx.x + 1] = pack_fp8x2<e5m2_t>(in[2 * threadIdx.x], in[2 * threadIdx.x + 1]);
}

// setmaxnreg needs the register count at entry: launch bounds of 384 threads, one block.
__global__ void __launch_bounds__(384, 1) setmaxnreg_kernel(int* out) {
  if (threadIdx.x < 128) {
    setmaxnreg_dec<40>();
  } else {
    setmaxnreg_inc<232>();
    out[threadIdx.x] = int(threadIdx.x);
  }
}

// The host side: one encoder for both builds.
TensorMap host_encode(const void* p) {
  const uint64_t dims[2] = {64, 64}, strides[1] = {128};
  const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
  return encode_tensor_map(TmaDtype::kF16, 2, p, dims, strides, box, es, SmemSwizzle::k128B);
}

}  // namespace hopper_compile_check
}  // namespace gpu
}  // namespace fmha
