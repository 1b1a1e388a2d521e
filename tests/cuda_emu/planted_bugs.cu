// Planted bugs: small kernels with the classic CUDA mistakes, each beside its fixed twin, to
// show that CI catches them without a GPU.
//   (a) planted.fragment.*  a wrong mma fragment index: the emulator computes what the
//                           tensor cores would, so the product is wrong (plain build)
//   (b) planted.race.*      a missing __syncthreads: flagged by the race checker
//                           (racecheck build) and by ThreadSanitizer (tsan build);
//       planted.race_pipeline.*  the same in a cp.async pipeline (racecheck build)
//   (c) planted.oob.*       an out-of-bounds read of global and of dynamic shared memory:
//                           flagged by AddressSanitizer (asan build)
// The buggy cases are expected to FAIL (or to be stopped by the sanitizer); the fixed ones
// to PASS -- in every build.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/primitives.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::pass;
using emu_test::Result;

namespace {

// ---------------------------------------------------------------- (a) fragment index
// One warp computes D = A*B for a 16x16 A and 16x8 B read straight from global memory into
// mma fragments (PTX ISA 9.0 §9.7.14.5.8). The bug: registers a1 and a2 swapped -- as if
// a1 held columns 8-15 of rows 0-7 instead of columns 0-7 of rows 8-15.
template <bool kBug>
__global__ void fragment_kernel(const uint16_t* A, const uint16_t* B, float* D) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto a_pair = [&](int row, int col) {
    return uint32_t(A[row * 16 + col]) | (uint32_t(A[row * 16 + col + 1]) << 16);
  };
  uint32_t a[4];
  a[0] = a_pair(g, 2 * t);
  a[1] = kBug ? a_pair(g, 2 * t + 8) : a_pair(g + 8, 2 * t);
  a[2] = kBug ? a_pair(g + 8, 2 * t) : a_pair(g, 2 * t + 8);
  a[3] = a_pair(g + 8, 2 * t + 8);
  uint32_t b[2];
  for (int r = 0; r < 2; ++r) {
    const int k = 2 * t + 8 * r;
    b[r] = uint32_t(B[k * 8 + g]) | (uint32_t(B[(k + 1) * 8 + g]) << 16);
  }
  float c[4] = {0, 0, 0, 0}, d[4];
  mma_m16n8k16<half_t>(d, a, b, c);
  for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
}

template <bool kBug>
Result fragment_case() {
  std::vector<uint16_t> A(256), B(128);
  std::vector<float> fa(256), fb(128), D(128);
  for (int i = 0; i < 256; ++i) fa[size_t(i)] = float((i * 7) % 11 - 5);
  for (int i = 0; i < 128; ++i) fb[size_t(i)] = float((i * 5) % 9 - 4);
  for (int i = 0; i < 256; ++i) A[size_t(i)] = bits_of(from_float<half_t>(fa[size_t(i)]));
  for (int i = 0; i < 128; ++i) B[size_t(i)] = bits_of(from_float<half_t>(fb[size_t(i)]));
  auto kernel = &fragment_kernel<kBug>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(32), 0, nullptr, A.data(), B.data(), D.data());
  int wrong = 0;
  char first[160] = "";
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      float want = 0;
      for (int k = 0; k < 16; ++k) want += fa[size_t(r * 16 + k)] * fb[size_t(k * 8 + n)];
      if (D[size_t(r * 8 + n)] != want && wrong++ == 0)
        std::snprintf(first, sizeof first, "D[%d][%d] = %g, expected %g", r, n,
                      double(D[size_t(r * 8 + n)]), double(want));
    }
  if (wrong) return fail("mismatch in " + std::to_string(wrong) + " of 128 elements; first: " + first);
  return pass();
}

EMU_TEST("planted.fragment.buggy", "(a) wrong mma A-fragment register order; §9.7.14.5.8") {
  return fragment_case<true>();
}
EMU_TEST("planted.fragment.fixed", "(a) the same kernel with the ISA's register order") {
  return fragment_case<false>();
}

// ---------------------------------------------------------------- (b) missing barrier
// Each thread stages its element in shared memory and reads its neighbour's. Without the
// __syncthreads the neighbour may not have written yet (across warps: nothing orders them).
template <bool kSync>
__global__ void rotate_kernel(const float* in, float* out) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = in[t];
  if constexpr (kSync) __syncthreads();  // every element is staged before any is read
  out[t] = s[(t + 1) % 128];
}

template <bool kSync>
Result race_case() {
  std::vector<float> in(128), out(128);
  for (int i = 0; i < 128; ++i) in[size_t(i)] = float(i);
  auto kernel = &rotate_kernel<kSync>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(128), 0, nullptr, in.data(), out.data());
  for (int i = 0; i < 128; ++i)
    if (out[size_t(i)] != float((i + 1) % 128)) return fail("wrong value at " + std::to_string(i));
  return pass();
}

EMU_TEST("planted.race.buggy", "(b) shared memory read by another thread with no __syncthreads") {
  return race_case<false>();
}
EMU_TEST("planted.race.fixed", "(b) the same kernel with the __syncthreads") {
  return race_case<true>();
}

// The same mistake in a cp.async double-buffered pipeline (the GEMM's and attention's
// structure): without the trailing __syncthreads, the prefetch of tile kt+2 overwrites the
// stage that slower threads are still reading for tile kt. The race checker treats a
// cp.async as writing anywhere between its issue and its wait, so it sees this too.
template <bool kSync>
__global__ void pipeline_kernel(const float* in, float* out, int tiles) {
  FMHA_DYNAMIC_SHARED(float, stage);  // [2][64]
  const int t = threadIdx.x;
  auto load = [&](int kt) {  // 64 floats = 16 chunks of 16 bytes, one per thread 0..15
    if (t < 16) cp_async_16(stage + (kt % 2) * 64 + 4 * t, in + kt * 64 + 4 * t);
  };
  load(0);
  cp_async_commit();
  float acc = 0.0f;
  for (int kt = 0; kt < tiles; ++kt) {
    if (kt + 1 < tiles) load(kt + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // tile kt has landed, for every thread
    acc += stage[(kt % 2) * 64 + (63 - t)];
    if constexpr (kSync) __syncthreads();  // all reads of this stage precede its next refill
  }
  cp_async_wait<0>();
  out[t] = acc;
}

template <bool kSync>
Result pipeline_case() {
  const int tiles = 6;
  std::vector<float> in(size_t(tiles) * 64), out(64);
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i % 97);
  auto kernel = &pipeline_kernel<kSync>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(64), 2 * 64 * sizeof(float), nullptr, in.data(), out.data(),
              tiles);
  for (int t = 0; t < 64; ++t) {
    float want = 0.0f;
    for (int kt = 0; kt < tiles; ++kt) want += in[size_t(kt * 64 + 63 - t)];
    if (out[size_t(t)] != want) return fail("wrong sum at " + std::to_string(t));
  }
  return pass();
}

EMU_TEST("planted.race_pipeline.buggy",
         "(b) cp.async double buffering without the barrier that protects the stage being read") {
  return pipeline_case<false>();
}
EMU_TEST("planted.race_pipeline.fixed", "(b) the same pipeline with the trailing __syncthreads") {
  return pipeline_case<true>();
}

// ---------------------------------------------------------------- (c) out of bounds
// A two-point stencil out[i] = in[i] + in[i + 1] whose guard is off by one: the last
// thread reads in[n], one past the end of the buffer.
template <bool kBug>
__global__ void stencil_kernel(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float next = (kBug ? i + 1 <= n : i + 1 < n) ? in[i + 1] : 0.0f;
  out[i] = in[i] + next;
}

template <bool kBug>
Result oob_global_case() {
  const int n = 100;
  const size_t count = static_cast<size_t>(n);  // buffers of exactly n elements
  std::vector<float> in(count, 1.0f), out(count);
  auto kernel = &stencil_kernel<kBug>;
  FMHA_LAUNCH(kernel, dim3(4), dim3(32), 0, nullptr, in.data(), out.data(), n);
  for (int i = 0; i < n; ++i)
    if (out[size_t(i)] != (i + 1 < n ? 2.0f : 1.0f)) return fail("wrong value at " + std::to_string(i));
  return pass();
}

EMU_TEST("planted.oob.global.buggy", "(c) a read one element past a global buffer") {
  return oob_global_case<true>();
}
EMU_TEST("planted.oob.global.fixed", "(c) the same kernel with the right guard") {
  return oob_global_case<false>();
}

// The same mistake in shared memory: a tile of blockDim floats, and the last thread reads
// the element after it.
template <bool kBug>
__global__ void smem_shift_kernel(const float* in, float* out) {
  FMHA_DYNAMIC_SHARED(float, tile);
  const int t = threadIdx.x;
  tile[t] = in[t];
  __syncthreads();  // the tile is staged before it is read
  out[t] = tile[kBug ? t + 1 : (t + 1) % int(blockDim.x)];
}

template <bool kBug>
Result oob_shared_case() {
  std::vector<float> in(64), out(64);
  for (int i = 0; i < 64; ++i) in[size_t(i)] = float(i);
  auto kernel = &smem_shift_kernel<kBug>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(64), 64 * sizeof(float), nullptr, in.data(), out.data());
  for (int i = 0; i < 64; ++i)
    if (out[size_t(i)] != float((i + 1) % 64)) return fail("wrong value at " + std::to_string(i));
  return pass();
}

EMU_TEST("planted.oob.shared.buggy", "(c) a read one element past a dynamic shared-memory tile") {
  return oob_shared_case<true>();
}
EMU_TEST("planted.oob.shared.fixed", "(c) the same kernel with the wrap-around") {
  return oob_shared_case<false>();
}

}  // namespace
