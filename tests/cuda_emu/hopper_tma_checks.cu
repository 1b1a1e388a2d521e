// TMA (cp.async.bulk.tensor) through the emulator: tiles with out-of-bounds edges in every
// swizzle mode, a 3D box with a traversal stride, a store clipped at the tensor's edge, a
// pipelined TMA -> wgmma GEMM (producer warp, two-stage ring of full/empty mbarriers), and
// the planted bug of reading a TMA destination before its mbarrier phase completes.
//
// Expected tiles are computed on the host from the tensor map's definition (box at the
// coordinates, zeros outside the tensor, dense rows, the swizzle atom's chunk permutation
// c ^ ((r * span / 128) mod (span / 16)) for rows of span bytes), independently of the
// emulator.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/hopper.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::launch_error;
using emu_test::pass;
using emu_test::Result;

namespace {

#define CITE_TMA                                                                               \
  "PTX ISA cp.async.bulk.tensor (tile mode, mbarrier::complete_tx::bytes), Tensor-map (box, " \
  "traversal strides, swizzle modes, out-of-bounds fill); cuTensorMapEncodeTiled"

constexpr int kStageBytes = 4096;

// Thread 0 loads `tiles` boxes (one stage each, 4 KiB apart) on one mbarrier; every thread
// waits for the phase (unless kSkipWait: the planted bug), then the block copies the stages
// out byte for byte.
template <bool kSkipWait>
__global__ void tma_tiles_kernel(const __grid_constant__ TensorMap map, const int32_t* coords,
                                 int tiles, uint32_t tile_bytes, uint8_t* out) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + tiles * kStageBytes);
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar, uint32_t(tiles) * tile_bytes);
    for (int t = 0; t < tiles; ++t) {
      const int32_t c[2] = {coords[2 * t], coords[2 * t + 1]};
      tma_load<2>(smem + t * kStageBytes, &map, c, bar);
    }
  }
  if (!kSkipWait) mbarrier_wait(bar, 0);
  __syncthreads();
  for (int i = threadIdx.x; i < tiles * kStageBytes; i += blockDim.x) out[i] = smem[i];
}

// 37 rows x 40 columns of f16 (row pitch 80 bytes); boxes of 16 rows x `box_cols`.
Result tma_2d_case(int span, bool skip_wait = false) {
  const int rows = 37, cols = 40, box_rows = 16, box_cols = span ? span / 2 : 24;
  std::vector<uint16_t> g(size_t(rows * cols));
  for (int i = 0; i < rows * cols; ++i) g[size_t(i)] = uint16_t(0x1000 + i);  // nonzero, distinct
  const uint64_t dims[2] = {uint64_t(cols), uint64_t(rows)}, strides[1] = {uint64_t(cols) * 2};
  const uint32_t box[2] = {uint32_t(box_cols), uint32_t(box_rows)}, es[2] = {1, 1};
  const TensorMap map = encode_tensor_map(TmaDtype::kF16, 2, g.data(), dims, strides, box, es,
                                          span == 128 ? SmemSwizzle::k128B
                                          : span == 64 ? SmemSwizzle::k64B
                                          : span == 32 ? SmemSwizzle::k32B : SmemSwizzle::kNone);
  // (column, row): above-left corner, right/bottom edge, interior, fully outside
  const std::vector<int32_t> coords = {-8, -3, cols - box_cols / 2, rows - 5, 8, 4, cols + 4, -40};
  const int tiles = 4;
  const uint32_t tile_bytes = uint32_t(box_rows * box_cols * 2);
  std::vector<uint8_t> out(size_t(tiles * kStageBytes), 0xAB);
  auto kernel = skip_wait ? &tma_tiles_kernel<true> : &tma_tiles_kernel<false>;
  FMHA_LAUNCH(kernel, dim3(1), dim3(64), tiles * kStageBytes + 8, nullptr, map, coords.data(),
              tiles, tile_bytes, out.data());
  const int row_bytes = box_cols * 2;
  for (int t = 0; t < tiles; ++t)
    for (int r = 0; r < box_rows; ++r)
      for (int c = 0; c < box_cols; ++c) {
        const int x = coords[size_t(2 * t)] + c, y = coords[size_t(2 * t + 1)] + r;
        const uint16_t want = (x >= 0 && x < cols && y >= 0 && y < rows) ? g[size_t(y * cols + x)] : 0;
        int chunk = c * 2 / 16;
        if (span) chunk ^= (r * span / 128) % (span / 16);
        const size_t at = size_t(t * kStageBytes + r * row_bytes + chunk * 16 + (c * 2) % 16);
        uint16_t got;
        std::memcpy(&got, &out[at], 2);
        if (got != want) {
          char msg[160];
          std::snprintf(msg, sizeof msg, "tile %d element (row %d, col %d): 0x%04x, expected 0x%04x",
                        t, r, c, got, want);
          return fail(msg);
        }
      }
  return pass(std::to_string(tiles) + " boxes of " + std::to_string(box_rows) + " x " +
              std::to_string(box_cols) + ", out-of-bounds parts zero");
}

EMU_TEST("hopper.tma.load2d.none", CITE_TMA) { return tma_2d_case(0); }
EMU_TEST("hopper.tma.load2d.sw32", CITE_TMA) { return tma_2d_case(32); }
EMU_TEST("hopper.tma.load2d.sw64", CITE_TMA) { return tma_2d_case(64); }
EMU_TEST("hopper.tma.load2d.sw128", CITE_TMA) { return tma_2d_case(128); }

// 3D, f32, a traversal stride of 2 along dimension 1: box (8, 3, 2) loads 8 x 2 x 2.
__global__ void tma_3d_kernel(const __grid_constant__ TensorMap map, float* out) {
  FMHA_DYNAMIC_SHARED(float, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 1024);
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_barrier_init();  // the init, seen by the TMA's complete_tx
    mbarrier_arrive_expect_tx(bar, 8 * 2 * 2 * 4);
    const int32_t c[3] = {6, 1, 3};
    tma_load<3>(smem, &map, c, bar);
  }
  __syncthreads();  // the mbarrier is initialized before anyone waits on it
  mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < 32; i += blockDim.x) out[i] = smem[i];
}

EMU_TEST("hopper.tma.load3d.element_stride", CITE_TMA) {
  const int d0 = 12, d1 = 6, d2 = 5;
  std::vector<float> g(size_t(d0 * d1 * d2));
  for (size_t i = 0; i < g.size(); ++i) g[i] = float(i + 1);
  const uint64_t dims[3] = {uint64_t(d0), uint64_t(d1), uint64_t(d2)};
  const uint64_t strides[2] = {uint64_t(d0) * 4, uint64_t(d0 * d1) * 4};
  const uint32_t box[3] = {8, 3, 2}, es[3] = {1, 2, 1};
  const TensorMap map = encode_tensor_map(TmaDtype::kF32, 3, g.data(), dims, strides, box, es,
                                          SmemSwizzle::kNone);
  std::vector<float> out(32, -1.0f);
  FMHA_LAUNCH(tma_3d_kernel, dim3(1), dim3(32), 1024 * 4 + 8, nullptr, map, out.data());
  for (int z = 0; z < 2; ++z)
    for (int y = 0; y < 2; ++y)
      for (int x = 0; x < 8; ++x) {
        const int gx = 6 + x, gy = 1 + 2 * y, gz = 3 + z;
        const float want = gx < d0 ? g[size_t((gz * d1 + gy) * d0 + gx)] : 0.0f;
        const float got = out[size_t((z * 2 + y) * 8 + x)];
        if (got != want)
          return fail("element (" + std::to_string(x) + "," + std::to_string(y) + "," +
                      std::to_string(z) + "): " + std::to_string(got) + ", expected " +
                      std::to_string(want));
      }
  return pass();
}

// 5D, bytes: box (16, 2, 2, 1, 2) at (0, 2, -1, 1, 2) of a (16, 3, 2, 2, 3) tensor with
// padded strides: every dimension but the first has an out-of-bounds part or an offset.
__global__ void tma_5d_kernel(const __grid_constant__ TensorMap map, uint8_t* out) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 1024);
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_barrier_init();  // the init, seen by the TMA's complete_tx
    mbarrier_arrive_expect_tx(bar, 16 * 2 * 2 * 1 * 2);
    const int32_t c[5] = {0, 2, -1, 1, 2};
    tma_load<5>(smem, &map, c, bar);
  }
  __syncthreads();
  mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < 128; i += blockDim.x) out[i] = smem[i];
}

EMU_TEST("hopper.tma.load5d", CITE_TMA) {
  const uint64_t dims[5] = {16, 3, 2, 2, 3};
  const uint64_t strides[4] = {32, 32 * 4, 32 * 4 * 2, 32 * 4 * 2 * 3};  // padded pitches
  std::vector<uint8_t> g(size_t(strides[3] * 3));
  for (size_t i = 0; i < g.size(); ++i) g[i] = uint8_t(1 + i % 251);
  const uint32_t box[5] = {16, 2, 2, 1, 2}, es[5] = {1, 1, 1, 1, 1};
  const TensorMap map = encode_tensor_map(TmaDtype::kU8, 5, g.data(), dims, strides, box, es,
                                          SmemSwizzle::kNone);
  std::vector<uint8_t> out(128, 0xEE);
  FMHA_LAUNCH(tma_5d_kernel, dim3(1), dim3(32), 1024 + 8, nullptr, map, out.data());
  const int c[5] = {0, 2, -1, 1, 2};
  size_t at = 0;
  for (int i4 = 0; i4 < 2; ++i4)
    for (int i3 = 0; i3 < 1; ++i3)
      for (int i2 = 0; i2 < 2; ++i2)
        for (int i1 = 0; i1 < 2; ++i1)
          for (int i0 = 0; i0 < 16; ++i0, ++at) {
            const int x[5] = {c[0] + i0, c[1] + i1, c[2] + i2, c[3] + i3, c[4] + i4};
            bool in = true;
            size_t off = size_t(x[0]);
            for (int d = 0; d < 5; ++d) in = in && x[d] >= 0 && x[d] < int(dims[d]);
            for (int d = 1; d < 5 && in; ++d) off += size_t(x[d]) * size_t(strides[d - 1]);
            const uint8_t want = in ? g[off] : 0;
            if (out[at] != want)
              return fail("element " + std::to_string(at) + ": " + std::to_string(out[at]) +
                          ", expected " + std::to_string(want));
          }
  return pass();
}

// Encoder rules (cuTensorMapEncodeTiled's): a swizzled box's inner dimension fits the span.
EMU_TEST("hopper.tma.encode_rules", CITE_TMA) {
  std::vector<uint16_t> g(64 * 64);
  const uint64_t dims[2] = {64, 64}, strides[1] = {128};
  const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
  try {
    encode_tensor_map(TmaDtype::kF16, 2, g.data(), dims, strides, box, es, SmemSwizzle::k64B);
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find("swizzle span") == std::string::npos)
      return fail(std::string("wrong reason: ") + e.what());
    const uint64_t bad_strides[1] = {120};
    try {
      encode_tensor_map(TmaDtype::kF16, 2, g.data(), dims, bad_strides, box, es, SmemSwizzle::kNone);
    } catch (const std::invalid_argument& e2) {
      return pass(e2.what());
    }
    return fail("a stride of 120 bytes was accepted");
  }
  return fail("a 128-byte box row was accepted with the 64B swizzle");
}

// TMA store: a 16 x 32 f16 smem tile written at (24, 30) of a 40 x 37 tensor: the parts
// past the edges are not written.
__global__ void tma_store_kernel(const __grid_constant__ TensorMap map, int bug) {
  FMHA_DYNAMIC_SHARED(uint16_t, tile);
  for (int i = threadIdx.x; i < 16 * 32; i += blockDim.x) tile[i] = uint16_t(0x4000 + i);
  if (bug != 1) fence_proxy_async();  // each writer, before the barrier
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t c[2] = {24, 30};
    tma_store<2>(&map, c, tile);
    bulk_commit_group();
    if (bug != 2) bulk_wait_group_read<0>();  // 2: the store still completes (at the exit)
  }
}

EMU_TEST("hopper.tma.store2d", CITE_TMA "; cp.async.bulk.tensor .global.shared::cta .bulk_group") {
  const int rows = 37, cols = 40;
  std::vector<uint16_t> g(size_t(rows * cols), 0x1111);
  const uint64_t dims[2] = {uint64_t(cols), uint64_t(rows)}, strides[1] = {uint64_t(cols) * 2};
  const uint32_t box[2] = {32, 16}, es[2] = {1, 1};
  const TensorMap map = encode_tensor_map(TmaDtype::kF16, 2, g.data(), dims, strides, box, es,
                                          SmemSwizzle::kNone);
  for (int variant : {0, 2}) {
    std::fill(g.begin(), g.end(), uint16_t(0x1111));
    FMHA_LAUNCH(tma_store_kernel, dim3(1), dim3(64), 16 * 32 * 2, nullptr, map, variant);
    for (int y = 0; y < rows; ++y)
      for (int x = 0; x < cols; ++x) {
        const bool in = x >= 24 && y >= 30;  // the box's part inside the tensor
        const uint16_t want = in ? uint16_t(0x4000 + (y - 30) * 32 + (x - 24)) : 0x1111;
        if (g[size_t(y * cols + x)] != want)
          return fail("global (" + std::to_string(y) + ", " + std::to_string(x) + ") wrong" +
                      (variant ? " (no bulk wait before the exit)" : ""));
      }
  }
  return pass();
}

Result tma_store_fence_case(int bug) {
  const int rows = 37, cols = 40;
  std::vector<uint16_t> g(size_t(rows * cols), 0x1111);
  const uint64_t dims[2] = {uint64_t(cols), uint64_t(rows)}, strides[1] = {uint64_t(cols) * 2};
  const uint32_t box[2] = {32, 16}, es[2] = {1, 1};
  const TensorMap map = encode_tensor_map(TmaDtype::kF16, 2, g.data(), dims, strides, box, es,
                                          SmemSwizzle::kNone);
  FMHA_LAUNCH(tma_store_kernel, dim3(1), dim3(64), 16 * 32 * 2, nullptr, map, bug);
  return pass();
}

EMU_TEST("planted.tma_store_fence.buggy", "(racecheck) a TMA store of shared memory written "
                                          "without fence.proxy.async") {
  return tma_store_fence_case(1);
}
EMU_TEST("planted.tma_store_fence.fixed", "the same store with each writer's fence.proxy.async") {
  return tma_store_fence_case(0);
}

// ---- TMA -> wgmma, pipelined: C (64 x 64) = A (64 x 256) * B (256 x 64), f16, in k-tiles
// of 64 through a two-stage ring. Warp 4 produces (one elected lane issues the TMA loads
// after the stage's "empty" phase), warpgroup 0 consumes (waits on "full", runs four wgmma
// k-steps, waits for them, and releases the stage). B is loaded K-major (from B^T, N x K)
// or N-major (from B, K x N) -- the two layouts attention's QK^T and PV use.
struct PipeParams {
  int span;       // 128 or 64: the swizzle of both tiles
  bool b_nmajor;  // B tile N-major (transposed B)
  int k_tiles;
  float* c;
  // planted (race checker): 1 no fence.mbarrier_init after the inits, 2 the fence only after
  // the __syncthreads that publishes them (the producer is not ordered after it)
  int bug = 0;
};

template <int kTransB>
__global__ void tma_wgmma_kernel(const __grid_constant__ TensorMap a_map,
                                 const __grid_constant__ TensorMap b_map, PipeParams p) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  constexpr int kTileBytes = 64 * 64 * 2;  // one 64 x 64 f16 operand tile
  uint8_t* a_stage[2] = {smem, smem + kTileBytes};
  uint8_t* b_stage[2] = {smem + 2 * kTileBytes, smem + 3 * kTileBytes};
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + 4 * kTileBytes);
  uint64_t* empty = full + 2;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 128);
    }
    if (p.bug == 0) fence_barrier_init();
  }
  __syncthreads();
  if (tid == 0 && p.bug == 2) fence_barrier_init();
  const int span = p.span, inner = span / 2;  // box columns per TMA: one swizzle row
  if (tid >= 128) {  // producer warp
    const bool leader = elect_one();
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      const int s = kt % 2;
      mbarrier_wait(&empty[s], uint32_t((kt / 2) & 1) ^ 1u);  // first pass: free
      // Every lane has seen the stage free before the leader refills it: the other lanes wait
      // but never arrive, so nothing else holds them back, and a lane still to wait once the
      // refill has been consumed would wait on a parity that names the next phase -- forever.
      __syncwarp();
      if (leader) {
        mbarrier_arrive_expect_tx(&full[s], 2 * kTileBytes);
        for (int part = 0; part < 64 / inner; ++part) {  // A: (k columns, m rows)
          const int32_t ca[2] = {kt * 64 + part * inner, 0};
          tma_load<2>(a_stage[s] + part * 64 * span, &a_map, ca, &full[s]);
        }
        if (!kTransB) {  // B^T: (k columns, n rows), K-major like A
          for (int part = 0; part < 64 / inner; ++part) {
            const int32_t cb[2] = {kt * 64 + part * inner, 0};
            tma_load<2>(b_stage[s] + part * 64 * span, &b_map, cb, &full[s]);
          }
        } else {  // B: (n columns, k rows), N-major
          for (int part = 0; part < 64 / inner; ++part) {
            const int32_t cb[2] = {part * inner, kt * 64};
            tma_load<2>(b_stage[s] + part * 64 * span, &b_map, cb, &full[s]);
          }
        }
      }
    }
    return;
  }
  // consumers: warpgroup 0
  float d[32];
  for (float& v : d) v = 0.0f;
  const SmemSwizzle swz = span == 128 ? SmemSwizzle::k128B : SmemSwizzle::k64B;
  for (int kt = 0; kt < p.k_tiles; ++kt) {
    const int s = kt % 2;
    mbarrier_wait(&full[s], uint32_t((kt / 2) & 1));
    wgmma_fence();
    for (int ks = 0; ks < 4; ++ks) {
      const int k0 = ks * 16;  // element offset along K of this k16 step
      // K-major: atoms of 8 rows x span bytes stacked along M (SBO = 8 * span); the
      // k-step starts (k0 / inner) boxes in, (k0 % inner) elements into the row.
      const uint32_t a_off = uint32_t((k0 / inner) * 64 * span + (k0 % inner) * 2);
      const uint64_t adesc = make_smem_desc(a_stage[s] + a_off, 16, uint32_t(8 * span), swz);
      uint64_t bdesc;
      if (!kTransB) {
        bdesc = make_smem_desc(b_stage[s] + a_off, 16, uint32_t(8 * span), swz);
      } else {
        // N-major: rows of span bytes of N per k; boxes of `inner` columns 64 * span bytes
        // apart (LBO), groups of 8 k-rows 8 * span apart (SBO); the k-step starts k0 rows in.
        bdesc = make_smem_desc(b_stage[s] + k0 * span, uint32_t(64 * span), uint32_t(8 * span), swz);
      }
      wgmma_ss<64, half_t, half_t, 0, kTransB>(d, adesc, bdesc, true);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    mbarrier_arrive(&empty[s]);  // this thread is done reading the stage
  }
  const int w = tid / 32, lane = tid % 32;
  for (int r = 0; r < 32; ++r) {
    const int row = 16 * w + lane / 4 + 8 * ((r % 4) / 2), col = 8 * (r / 4) + 2 * (lane % 4) + r % 2;
    p.c[row * 64 + col] = d[r];
  }
}

Result tma_wgmma_case(int span, bool b_nmajor, int bug = 0) {
  const int M = 64, N = 64, K = 256;
  std::vector<uint16_t> A(size_t(M * K)), Bt(size_t(N * K)), B(size_t(K * N));
  std::vector<int> av(A.size()), bv(size_t(K * N));
  uint32_t seed = 99u + uint32_t(span);
  auto rnd = [&] {
    seed = seed * 1664525u + 1013904223u;
    return int((seed >> 9) % 7u) - 3;
  };
  for (size_t i = 0; i < A.size(); ++i) {
    av[i] = rnd();
    A[i] = bits_of(from_float<half_t>(float(av[i])));
  }
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n) {
      const int v = rnd();
      bv[size_t(k * N + n)] = v;
      B[size_t(k * N + n)] = Bt[size_t(n * K + k)] = bits_of(from_float<half_t>(float(v)));
    }
  const SmemSwizzle swz = span == 128 ? SmemSwizzle::k128B : SmemSwizzle::k64B;
  const uint32_t inner = uint32_t(span / 2), es[2] = {1, 1};
  const uint64_t a_dims[2] = {uint64_t(K), uint64_t(M)}, a_str[1] = {uint64_t(K) * 2};
  const uint32_t a_box[2] = {inner, 64};
  const TensorMap a_map = encode_tensor_map(TmaDtype::kF16, 2, A.data(), a_dims, a_str, a_box, es, swz);
  TensorMap b_map;
  if (!b_nmajor) {
    const uint64_t dims[2] = {uint64_t(K), uint64_t(N)}, str[1] = {uint64_t(K) * 2};
    b_map = encode_tensor_map(TmaDtype::kF16, 2, Bt.data(), dims, str, a_box, es, swz);
  } else {
    const uint64_t dims[2] = {uint64_t(N), uint64_t(K)}, str[1] = {uint64_t(N) * 2};
    const uint32_t box[2] = {inner, 64};
    b_map = encode_tensor_map(TmaDtype::kF16, 2, B.data(), dims, str, box, es, swz);
  }
  std::vector<float> C(size_t(M * N), -1.0f);
  PipeParams p{span, b_nmajor, K / 64, C.data(), bug};
  const size_t smem = 4 * 64 * 64 * 2 + 64;
  auto kernel = b_nmajor ? &tma_wgmma_kernel<1> : &tma_wgmma_kernel<0>;
  set_max_dynamic_smem(kernel, smem);
  emu::reset_stats();
  FMHA_LAUNCH(kernel, dim3(1), dim3(160), smem, nullptr, a_map, b_map, p);
  // Shared-memory traffic (runtime.h, KernelTraffic): every TMA box fills whole 128-byte
  // lines, and every core matrix a wgmma reads through the swizzle spans the 32 banks once:
  // 2 x 4 boxes of 64 x 128 bytes per k-tile over (64 / inner) boxes, 4 x 4 wgmma k-steps of
  // 16 + 16 core matrices (A: 64 rows x 32 bytes, B: 64 x 32 bytes).
  const std::vector<emu::KernelTraffic> traffic = emu::traffic();
  if (traffic.size() != 1) return fail("expected the traffic of one kernel");
  const emu::KernelTraffic& t = traffic[0];
  const uint64_t boxes = uint64_t(4 * 2 * (64 / inner)), lines = uint64_t(4 * 2 * 64 * 64 * 2 / 128);
  if (t.tma_requests != boxes || t.tma_ideal_wavefronts != lines || t.tma_wavefronts != lines ||
      t.wgmma_requests != 16 || t.wgmma_ideal_wavefronts != 16 * 32 || t.wgmma_wavefronts != 16 * 32)
    return fail("traffic: TMA " + std::to_string(t.tma_requests) + " requests " +
                std::to_string(t.tma_wavefronts) + "/" + std::to_string(t.tma_ideal_wavefronts) +
                " wavefronts, wgmma " + std::to_string(t.wgmma_requests) + " requests " +
                std::to_string(t.wgmma_wavefronts) + "/" + std::to_string(t.wgmma_ideal_wavefronts) +
                " wavefronts");
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double want = 0;
      for (int k = 0; k < K; ++k) want += double(av[size_t(m * K + k)]) * double(bv[size_t(k * N + n)]);
      if (double(C[size_t(m * N + n)]) != want)
        return fail("C[" + std::to_string(m) + "][" + std::to_string(n) + "] = " +
                    std::to_string(C[size_t(m * N + n)]) + ", expected " + std::to_string(want));
    }
  return pass("4 k-tiles through 2 stages; conflict-free TMA and wgmma shared-memory traffic");
}

EMU_TEST("hopper.tma_wgmma.kmajor.sw128", CITE_TMA "; wgmma descriptors over TMA-swizzled tiles") {
  return tma_wgmma_case(128, false);
}
EMU_TEST("hopper.tma_wgmma.nmajor.sw128", CITE_TMA "; wgmma descriptors over TMA-swizzled tiles") {
  return tma_wgmma_case(128, true);
}
EMU_TEST("hopper.tma_wgmma.kmajor.sw64", CITE_TMA "; wgmma descriptors over TMA-swizzled tiles") {
  return tma_wgmma_case(64, false);
}
EMU_TEST("hopper.tma_wgmma.nmajor.sw64", CITE_TMA "; wgmma descriptors over TMA-swizzled tiles") {
  return tma_wgmma_case(64, true);
}

// A TMA load into the operand of a wgmma still in flight is an error.
__global__ void tma_overwrite_kernel(const __grid_constant__ TensorMap map) {
  FMHA_DYNAMIC_SHARED(uint8_t, smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 8192);
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    fence_barrier_init();
  }
  for (int i = threadIdx.x; i < 8192; i += 128) smem[i] = 0;
  fence_proxy_async();
  __syncthreads();
  float d[4] = {0, 0, 0, 0};
  wgmma_fence();
  const uint64_t desc = make_smem_desc(smem, 128, 256, SmemSwizzle::kNone);
  wgmma_ss<8, half_t>(d, desc, desc, true);
  wgmma_commit_group();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar, 16 * 64 * 2);
    const int32_t c[2] = {0, 0};
    tma_load<2>(smem, &map, c, bar);  // rewrites the operands before the wait
  }
  wgmma_wait_group<0>();
}

EMU_TEST("hopper.tma.overwrite_inflight_operand", CITE_TMA "; wgmma operands are read until "
                                                  "wgmma.wait_group") {
  std::vector<uint16_t> g(64 * 64, 0);
  const uint64_t dims[2] = {64, 64}, strides[1] = {128};
  const uint32_t box[2] = {64, 16}, es[2] = {1, 1};
  const TensorMap map = encode_tensor_map(TmaDtype::kF16, 2, g.data(), dims, strides, box, es,
                                          SmemSwizzle::kNone);
  const std::string err = launch_error(
      [&] { FMHA_LAUNCH(tma_overwrite_kernel, dim3(1), dim3(128), 8192 + 8, nullptr, map); });
  if (err.find("an operand of a wgmma.mma_async still in flight") == std::string::npos)
    return fail("expected the in-flight operand error, got: " + (err.empty() ? "success" : err));
  return pass();
}

// ---- planted: mbarriers used by TMA's complete_tx (the async proxy) without
// fence.mbarrier_init after their init, or with the fence not published by a __syncthreads
// to the producer. The race checker reports both.
EMU_TEST("planted.mbarrier_init_fence.buggy", "(racecheck) mbarriers initialised without "
                                              "fence.mbarrier_init, then completed by TMA") {
  return tma_wgmma_case(128, false, 1);
}
EMU_TEST("planted.mbarrier_init_fence.fixed", "the same pipeline with fence.mbarrier_init") {
  return tma_wgmma_case(128, false, 0);
}
EMU_TEST("planted.mbarrier_init_sync.buggy", "(racecheck) fence.mbarrier_init after the "
                                             "__syncthreads that publishes the inits") {
  return tma_wgmma_case(128, false, 2);
}
EMU_TEST("planted.mbarrier_init_sync.fixed", "the fence before the __syncthreads") {
  return tma_wgmma_case(128, false, 0);
}

// ---- planted: consumers read a TMA destination without waiting for its mbarrier phase
// (a __syncthreads does not order the async proxy's writes). The race checker reports it.
EMU_TEST("planted.tma_wait.buggy", "(racecheck) a TMA destination read before its mbarrier "
                                   "phase completes") {
  return tma_2d_case(128, true);
}
EMU_TEST("planted.tma_wait.fixed", "the same tiles read after mbarrier_wait") {
  return tma_2d_case(128, false);
}

}  // namespace
