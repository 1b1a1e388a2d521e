// Checks of the emulator itself: the execution model (thread and block indices, blocks one
// after another in a random order, shared memory per block) and that it reports, instead of hanging or
// silently passing, the CUDA rules kernels break: barriers not reached by every thread,
// divergent warp collectives, misaligned ldmatrix, reading cp.async data before waiting,
// dynamic shared memory without the opt-in, __trap.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/primitives.cuh"
#include "cuda/strong_zero.cuh"
#include "cuda/tile_io.cuh"
#include "emu_test.h"

using namespace fmha::gpu;
using emu_test::fail;
using emu_test::launch_error;
using emu_test::pass;
using emu_test::Result;
using emu_test::expect_error;

namespace {

// ---- indices and scheduling ----
struct Ids {
  unsigned t[3], b[3], bd[3], gd[3];
  float order;  // the block's position in the sequence of blocks run
};

__global__ void ids_kernel(Ids* out, float* sequence) {
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  __shared__ float order;
  if (tid == 0) order = atomic_add(sequence, 1.0f);
  __syncthreads();  // order is written before the block's threads read it
  Ids& o = out[block * (blockDim.x * blockDim.y * blockDim.z) + tid];
  o = {{threadIdx.x, threadIdx.y, threadIdx.z}, {blockIdx.x, blockIdx.y, blockIdx.z},
       {blockDim.x, blockDim.y, blockDim.z}, {gridDim.x, gridDim.y, gridDim.z}, order};
}

EMU_TEST("emu.indices", "CUDA Programming Guide, Thread Hierarchy: threadIdx/blockIdx/blockDim/"
                        "gridDim; the emulator runs blocks one after another, in a random order") {
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  const int nb = 12, nt = 64;
  std::vector<float> orders[2];
  for (std::vector<float>& order : orders) {
    std::vector<Ids> out(size_t(nb * nt));
    float sequence = 0;
    FMHA_LAUNCH(ids_kernel, grid, block, 0, nullptr, out.data(), &sequence);
    std::vector<bool> seen(size_t(nb), false);
    for (int b = 0; b < nb; ++b)
      for (int t = 0; t < nt; ++t) {
        const Ids& o = out[size_t(b * nt + t)];
        const unsigned want_t[3] = {unsigned(t % 8), unsigned(t / 8 % 4), unsigned(t / 32)};
        const unsigned want_b[3] = {unsigned(b % 3), unsigned(b / 3 % 2), unsigned(b / 6)};
        for (int d = 0; d < 3; ++d)
          if (o.t[d] != want_t[d] || o.b[d] != want_b[d])
            return fail("block " + std::to_string(b) + " thread " + std::to_string(t) + ": wrong index");
        if (o.bd[0] != 8 || o.bd[1] != 4 || o.bd[2] != 2 || o.gd[0] != 3 || o.gd[1] != 2 || o.gd[2] != 2)
          return fail("wrong blockDim/gridDim");
        if (o.order != out[size_t(b * nt)].order)
          return fail("the threads of a block saw different positions in the sequence");
        if (t == 0) {
          const int at = int(o.order);
          if (at < 0 || at >= nb || seen[size_t(at)])
            return fail("blocks did not run one after another (positions repeat or skip)");
          seen[size_t(at)] = true;
          order.push_back(o.order);
        }
      }
  }
  // FMHA_EMU_SCHEDULE_SEED gives every launch the same seed: the same order (a replay).
  // Otherwise two launches in the same order: 1 chance in 12! with random orders.
  const char* seed = std::getenv("FMHA_EMU_SCHEDULE_SEED");
  if (seed && *seed) {
    if (orders[0] != orders[1]) return fail("FMHA_EMU_SCHEDULE_SEED did not replay the order");
  } else if (orders[0] == orders[1]) {
    return fail("two launches ran their 12 blocks in the same order");
  }
  return pass();
}

// ---- shared memory ----
__global__ void static_shared_kernel(int* out) {
  __shared__ int s[64];
  const int t = threadIdx.x;
  s[t] = t + 1000 * int(blockIdx.x);
  __syncthreads();  // every element is written before any is read
  out[blockIdx.x * 64 + t] = s[63 - t];
}
EMU_TEST("emu.static_shared", "static __shared__ arrays are shared by the threads of a block") {
  std::vector<int> out(3 * 64);
  FMHA_LAUNCH(static_shared_kernel, dim3(3), dim3(64), 0, nullptr, out.data());
  for (int b = 0; b < 3; ++b)
    for (int t = 0; t < 64; ++t)
      if (out[size_t(b * 64 + t)] != 63 - t + 1000 * b) return fail("wrong value");
  return pass();
}

__global__ void poison_kernel(uint32_t* out) {
  FMHA_DYNAMIC_SHARED(uint32_t, s);
  out[threadIdx.x] = s[threadIdx.x];  // never written: the emulator's poison
}
EMU_TEST("emu.dynamic_smem_poison",
         "dynamic shared memory starts as 0xFF bytes (NaN as f16/bf16/f32), not zeros") {
  uint32_t out[32];
  FMHA_LAUNCH(poison_kernel, dim3(1), dim3(32), 32 * 4, nullptr, out);
  for (uint32_t v : out)
    if (v != 0xFFFFFFFFu) return fail("not poisoned");
  return pass();
}

__global__ void big_smem_kernel(float* out) {
  FMHA_DYNAMIC_SHARED(float, s);
  s[threadIdx.x] = 1.0f;
  __syncthreads();  // written before read
  out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}
EMU_TEST("emu.dynamic_smem_optin",
         "CUDA Programming Guide: more than 48 KiB of dynamic shared memory needs "
         "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)") {
  float out[32];
  const size_t bytes = 64 * 1024;
  auto kernel = &big_smem_kernel;
  Result r = expect_error(launch_error([&] { FMHA_LAUNCH(kernel, dim3(1), dim3(32), bytes, nullptr, out); }),
                          {"cudaFuncSetAttribute", "big_smem_kernel"});
  if (!r.ok) return r;
  set_max_dynamic_smem(kernel, bytes);
  FMHA_LAUNCH(kernel, dim3(1), dim3(32), bytes, nullptr, out);
  return out[0] == 1.0f ? pass() : fail("wrong result after the opt-in");
}

// ---- barrier rules ----
__global__ void divergent_syncthreads_kernel(int* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();  // a different barrier: undefined behaviour in CUDA
  }
  out[threadIdx.x] = 1;
}
EMU_TEST("emu.divergent_syncthreads",
         "CUDA Programming Guide: __syncthreads is allowed in conditional code only if the "
         "condition is the same across the block") {
  int out[64];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(divergent_syncthreads_kernel, dim3(1), dim3(64), 0, nullptr, out);
  }), {"divergent __syncthreads", "emulator_checks.cu"});
}

__global__ void early_exit_kernel(int* out) {
  if (threadIdx.x >= 32) return;  // these threads never reach the barrier below
  __syncthreads();
  out[threadIdx.x] = 1;
}
EMU_TEST("emu.exit_before_syncthreads",
         "every thread of the block must reach every __syncthreads (no hang: an error)") {
  int out[64];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(early_exit_kernel, dim3(1), dim3(64), 0, nullptr, out);
  }), {"__syncthreads", "exited"});
}

__global__ void deadlock_kernel(int* out) {
  if (threadIdx.x == 0)
    __syncwarp();  // waits for lanes that wait at __syncthreads: nobody can proceed
  else
    __syncthreads();
  out[threadIdx.x] = 1;
}
EMU_TEST("emu.deadlock", "a barrier no thread can complete is reported as a deadlock") {
  int out[64];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(deadlock_kernel, dim3(1), dim3(64), 0, nullptr, out);
  }), {"deadlock", "__syncwarp", "__syncthreads"});
}

// Lane 31 of warp 0 exits while lanes 0-30 wait at __syncwarp, so its exit completes that
// barrier; warp 1 meets at __syncwarp meanwhile. A correct count of waiting threads lets
// the block finish; an off-by-one left after such an exit reads as a deadlock when warp 1
// waits while warp 0 has gone. The order varies between launches: 64 launches.
__global__ void exit_completes_syncwarp_kernel(int* out) {
  if (threadIdx.x == 31) return;
  __syncwarp();
  out[threadIdx.x] = 1;
}
EMU_TEST("emu.exit_completes_syncwarp",
         "a lane's exit completes the __syncwarp its warp's other lanes wait at") {
  int out[64];
  for (int run = 0; run < 64; ++run) {
    const std::string err = launch_error([&] {
      FMHA_LAUNCH(exit_completes_syncwarp_kernel, dim3(1), dim3(64), 0, nullptr, out);
    });
    if (!err.empty()) return fail("launch " + std::to_string(run) + ": " + err);
  }
  return pass();
}

__global__ void inactive_lane_kernel(int* out) {
  if (threadIdx.x == 31) return;
  out[threadIdx.x] = shfl_xor(int(threadIdx.x), 1);
}
EMU_TEST("emu.collective_inactive_lanes",
         "PTX ISA 9.0 §9.7.9.6 shfl.sync: undefined if a lane named in membermask has exited") {
  int out[32];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(inactive_lane_kernel, dim3(1), dim3(32), 0, nullptr, out);
  }), {"shfl.sync", "exited", "inactive_lane_kernel"});
}

__global__ void partial_warp_kernel(int* out) {
  __syncwarp();  // fine: the 8 lanes of the last warp meet
  out[threadIdx.x] = warp_ballot(true);  // not fine: a full-warp operation in a warp of 8
}
EMU_TEST("emu.partial_warp", "blockDim 40: __syncwarp works; a full-warp collective is an error") {
  int out[40];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(partial_warp_kernel, dim3(1), dim3(40), 0, nullptr, out);
  }), {"vote.sync", "blockDim is not a multiple of 32"});
}

__global__ void divergent_collective_kernel(uint32_t* out) {
  if (threadIdx.x < 16)
    out[threadIdx.x] = shfl_idx(uint32_t(threadIdx.x), 0);
  else
    out[threadIdx.x] = warp_ballot(true);
}
EMU_TEST("emu.divergent_collective",
         "PTX ISA 9.0 .sync.aligned: all threads of the warp execute the same instruction") {
  uint32_t out[32];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(divergent_collective_kernel, dim3(1), dim3(32), 0, nullptr, out);
  }), {"divergent warp"});
}

__global__ void misaligned_ldmatrix_kernel(uint32_t* out) {
  __shared__ __align__(16) uint16_t s[8 * 8 + 8];
  for (int i = threadIdx.x; i < 72; i += 32) s[i] = uint16_t(i);
  __syncthreads();  // filled before the warp loads
  uint32_t r[1];
  ldmatrix<1>(r, &s[1 + (threadIdx.x % 8) * 8]);  // 2 bytes past a 16-byte boundary
  out[threadIdx.x] = r[0];
}
EMU_TEST("emu.ldmatrix_misaligned",
         "PTX ISA 9.0 §9.7.14.5.15 ldmatrix: row addresses must be 16-byte aligned") {
  uint32_t out[32];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(misaligned_ldmatrix_kernel, dim3(1), dim3(32), 0, nullptr, out);
  }), {"ldmatrix", "16-byte aligned"});
}

struct alignas(16) DeferredIo {
  uint32_t src[32][4];
  uint32_t before[32], after[32];
};
__global__ void cp_async_deferred_kernel(DeferredIo* io) {
  FMHA_DYNAMIC_SHARED(uint32_t, s);
  const int t = threadIdx.x;
  cp_async_16(s + 4 * t, io->src[t]);
  cp_async_commit();
  io->before[t] = s[4 * t];  // too early: the data may not have landed (here: it has not)
  cp_async_wait<0>();
  io->after[t] = s[4 * t];
}
EMU_TEST("emu.cp_async_deferred",
         "PTX ISA 9.0 §9.7.9.25.3.3: cp.async writes are visible only after the wait; the "
         "emulator performs them there, so reading early sees stale data") {
  static DeferredIo io;
  for (int t = 0; t < 32; ++t) io.src[t][0] = uint32_t(t + 1);
  FMHA_LAUNCH(cp_async_deferred_kernel, dim3(1), dim3(32), 32 * 16, nullptr, &io);
  for (int t = 0; t < 32; ++t) {
    if (io.before[t] != 0xFFFFFFFFu) return fail("data visible before cp.async.wait_group");
    if (io.after[t] != uint32_t(t + 1)) return fail("data missing after cp.async.wait_group");
  }
  return pass();
}

// ---- memory-traffic counters (runtime.h, KernelTraffic): planted access patterns ----

// The counters of the one kernel whose name contains `name` (after a reset_stats()).
emu::KernelTraffic traffic_of(const char* name) {
  for (const emu::KernelTraffic& k : emu::traffic())
    if (k.kernel.find(name) != std::string::npos) return k;
  return {};
}
std::string counts(const emu::KernelTraffic& k) {
  return k.kernel + ": ldmatrix " + std::to_string(k.ldmatrix_requests) + " requests " +
         std::to_string(k.ldmatrix_wavefronts) + "/" + std::to_string(k.ldmatrix_ideal_wavefronts) +
         " wavefronts; cp.async " + std::to_string(k.cp_async_requests) + " requests " +
         std::to_string(k.cp_async_wavefronts) + "/" + std::to_string(k.cp_async_ideal_wavefronts) +
         " wavefronts, " + std::to_string(k.cp_async_global_sectors) + " sectors, " +
         std::to_string(k.cp_async_global_bytes) + " bytes";
}

// One ldmatrix.x4 per warp whose 32 row addresses lie `stride` bytes apart in a tile of
// 32 rows. stride 16: the 8 rows of each matrix are 128 consecutive bytes, all 32 banks
// once (1 wavefront per matrix); stride 128: the 8 rows of a matrix all start at bank 0,
// so each of banks 0-3 holds 8 distinct words (8 wavefronts per matrix).
template <int kStride>
__global__ void ldmatrix_stride_kernel(uint32_t* out) {
  FMHA_DYNAMIC_SHARED(unsigned char, s);
  for (int i = threadIdx.x; i < 32 * kStride; i += 32) s[i] = uint8_t(i);
  __syncthreads();  // the tile is written before the warp loads it
  uint32_t r[4];
  ldmatrix<4>(r, s + threadIdx.x * kStride);
  out[threadIdx.x] = r[0] ^ r[1] ^ r[2] ^ r[3];
}
EMU_TEST("emu.traffic_ldmatrix",
         "Nsight Compute shared-memory wavefronts: 32 banks of 4 bytes, one wavefront per 8x8 "
         "matrix without conflicts; rows 128 bytes apart make an 8-way conflict") {
  uint32_t out[32];
  emu::reset_stats();
  FMHA_LAUNCH(ldmatrix_stride_kernel<16>, dim3(1), dim3(32), 32 * 16, nullptr, out);
  FMHA_LAUNCH(ldmatrix_stride_kernel<128>, dim3(1), dim3(32), 32 * 128, nullptr, out);
  const emu::KernelTraffic good = traffic_of("ldmatrix_stride_kernel<16>");
  const emu::KernelTraffic bad = traffic_of("ldmatrix_stride_kernel<128>");
  if (good.ldmatrix_requests != 1 || good.ldmatrix_wavefronts != 4 ||
      good.ldmatrix_ideal_wavefronts != 4)
    return fail("conflict-free ldmatrix.x4: expected 1 request, 4/4 wavefronts; " + counts(good));
  if (bad.ldmatrix_requests != 1 || bad.ldmatrix_wavefronts != 32 ||
      bad.ldmatrix_ideal_wavefronts != 4)
    return fail("8-way conflicting ldmatrix.x4: expected 1 request, 32/4 wavefronts; " +
                counts(bad));
  return pass(counts(bad));
}

// Each of 32 lanes copies 16 bytes: from global offset kSrc * lane (+ kShift), to shared
// offset kDst * lane. 16-byte copies are served in phases of 8 lanes.
template <int kDst, int kSrc, int kShift>
__global__ void cp_async_pattern_kernel(const unsigned char* src, uint32_t* out) {
  FMHA_DYNAMIC_SHARED(unsigned char, s);
  const int t = threadIdx.x;
  cp_async_16(s + kDst * t, src + kShift + kSrc * t);
  cp_async_commit();
  cp_async_wait<0>();
  out[t] = *reinterpret_cast<const uint32_t*>(s + kDst * t);
}
EMU_TEST("emu.traffic_cp_async",
         "Nsight Compute: cp.async shared stores in 8-lane phases (4/4 wavefronts contiguous, "
         "32/4 when every lane's 16 bytes start at bank 0), global 32-byte sectors per "
         "request (16 contiguous, 17 when 16 bytes off a sector, 32 at a 64-byte stride)") {
  alignas(256) static unsigned char src[32 * 64 + 64];
  uint32_t out[32];
  emu::reset_stats();
  FMHA_LAUNCH((cp_async_pattern_kernel<16, 16, 0>), dim3(1), dim3(32), 32 * 16, nullptr, src, out);
  FMHA_LAUNCH((cp_async_pattern_kernel<128, 16, 16>), dim3(1), dim3(32), 32 * 128, nullptr, src,
              out);
  FMHA_LAUNCH((cp_async_pattern_kernel<16, 64, 0>), dim3(1), dim3(32), 32 * 16, nullptr, src, out);
  struct Want {
    const char* name;
    uint64_t wavefronts, sectors;
  };
  for (const Want& w : {Want{"cp_async_pattern_kernel<16, 16, 0>", 4, 16},
                        Want{"cp_async_pattern_kernel<128, 16, 16>", 32, 17},
                        Want{"cp_async_pattern_kernel<16, 64, 0>", 4, 32}}) {
    const emu::KernelTraffic k = traffic_of(w.name);
    if (k.cp_async_requests != 1 || k.cp_async_wavefronts != w.wavefronts ||
        k.cp_async_ideal_wavefronts != 4 || k.cp_async_global_sectors != w.sectors ||
        k.cp_async_global_bytes != 512)
      return fail(std::string(w.name) + ": expected 1 request, " + std::to_string(w.wavefronts) +
                  "/4 wavefronts, " + std::to_string(w.sectors) + " sectors, 512 bytes; " +
                  counts(k));
  }
  return pass();
}

// ---- the strong zero's vote reads back only what each thread copied ----
// tile::load's copies of a 32-wide tile pair rows r and r + 4 in each phase (tile_io.cuh,
// FullBlock::kPairRows). strong_zero::has_nonfinite runs right after each thread's own
// cp.async wait, before the barrier that ORs the votes: it must read the chunks its thread
// copied, in the same order, or it reads another thread's before they land (a hazard for the
// race checker, and a missed NaN on a GPU).
__global__ void vote_own_chunks_kernel(const half_t* g, int rows, int* out) {
  using Layout = tile::Padded<40>;
  FMHA_DYNAMIC_SHARED(half_t, s);
  const int tid = threadIdx.x;
  tile::load<half_t, 64, 32, Layout, 128>(s, g, 32, rows, 32, 0, true, tid);
  cp_async_commit();
  cp_async_wait<0>();
  const int nonfinite =
      __syncthreads_or(strong_zero::has_nonfinite<half_t, 64, 32, Layout, 128>(s, true, tid));
  if (tid == 0) *out = nonfinite;
}
EMU_TEST("emu.vote_reads_own_chunks",
         "cuda/strong_zero.cuh has_nonfinite: each thread checks the chunks it copied itself, "
         "in tile::load's order (rows paired in the 32 tile), so the vote needs no barrier") {
  static_assert(tile::FullBlock<half_t, 64, 32, tile::Padded<40>, 128>::kPairRows,
                "the 32 tile's rows are paired");
  alignas(256) static half_t g[64 * 32];
  for (int i = 0; i < 64 * 32; ++i) g[i] = from_float<half_t>(0.25f * float(i % 7));
  // whole block (FullBlock) and a tail of 60 rows (the checked copy), with and without a NaN
  for (int rows : {64, 60})
    for (bool nan : {false, true}) {
      g[41 * 32 + 5] = from_float<half_t>(nan ? NAN : 1.0f);
      int out = -1;
      FMHA_LAUNCH(vote_own_chunks_kernel, dim3(1), dim3(128), 64 * 40 * 2, nullptr, g, rows,
                  &out);
      if (out != int(nan))
        return fail("rows " + std::to_string(rows) + (nan ? ", a NaN in row 41" : ", all finite") +
                    ": the vote said " + std::to_string(out));
    }
  return pass();
}

__global__ void trap_kernel(int* out) {
  if (threadIdx.x == 5) __trap();
  out[threadIdx.x] = 1;
}
EMU_TEST("emu.trap", "__trap() aborts the launch, naming the thread") {
  int out[32];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(trap_kernel, dim3(1), dim3(32), 0, nullptr, out);
  }), {"__trap()", "thread (5,0,0)", "trap_kernel"});
}

EMU_TEST("emu.bad_launch", "CUDA launch limits: at most 1024 threads per block") {
  int out[1];
  return expect_error(launch_error([&] {
    FMHA_LAUNCH(trap_kernel, dim3(1), dim3(2048), 0, nullptr, out);
  }), {"invalid launch configuration"});
}

}  // namespace
