// The host-side interface of the SIMT emulator: what code that launches emulated kernels
// (bindings, tests) may use without including the kernel-facing cuda_emu.h and its macros.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace emu {

// A launch that failed: the kernel broke a CUDA rule, trapped, or (with the race checker
// linked in) raced on memory. The message names the kernel, block and thread.
struct LaunchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Counters over all launches since the last reset (for tests: did the GEMM use cp.async
// double buffering, how many mma.sync did it issue, ...). Warp operations count once per
// lane.
struct Stats {
  uint64_t launches, blocks, threads, block_barriers, warp_barriers;
  uint64_t mma, ldmatrix, shfl, ballot, cp_async, cp_async_zero_filled;
  uint64_t max_cp_async_groups_pending;  // the most committed, unretired groups of a thread
  uint64_t scratch_peak_bytes;  // the most device scratch (Scratch) held at once
};
Stats stats();
void reset_stats();  // also clears traffic()

// Memory traffic of one kernel (all its launches since the last reset), as Nsight Compute
// would count it for the accesses the emulator sees: ldmatrix (shared-memory reads),
// cp.async (global reads, shared-memory writes), and Hopper's async proxy: wgmma operand
// reads through matrix descriptors and TMA tile copies (shared-memory writes of loads, reads
// of stores). Ordinary loads and stores are plain C++ here and are not counted. A warp-level request is the same such operation of each lane
// of a warp: for cp.async, the k-th of each lane since the same barrier (the lanes of a
// convergent warp issue them together).
//  - Shared memory: 32 banks of 4 bytes; a request takes one wavefront per 128 bytes, plus
//    one more for every additional distinct 4-byte word that falls in an already-used bank
//    (a bank conflict). ldmatrix: one phase per 8x8 matrix (eight 16-byte rows);
//    cp.async: phases of 128 / cp-size lanes. ideal = the wavefronts without conflicts.
//  - wgmma: one request per warpgroup instruction; each shared-memory operand (A unless it
//    comes from registers, and B) is read one core matrix (8 rows of 16 bytes, PTX ISA
//    "Shared Memory Matrix Layout") per phase, at its addresses after the swizzle.
//  - TMA: one request per cp.async.bulk.tensor; the box is moved 128 bytes (of its dense
//    order) per phase, at the addresses after the tensor map's swizzle.
//  - Global memory (cp.async sources): the 32-byte sectors a request touches, and the bytes
//    it asks for; efficiency = bytes / (32 * sectors) (over 1 if lanes read the same bytes).
struct KernelTraffic {
  std::string kernel;  // the kernel's name (demangled symbol, or the launch expression)
  uint64_t launches = 0;
  uint64_t ldmatrix_requests = 0, ldmatrix_wavefronts = 0, ldmatrix_ideal_wavefronts = 0;
  uint64_t cp_async_requests = 0, cp_async_wavefronts = 0, cp_async_ideal_wavefronts = 0;
  uint64_t cp_async_global_sectors = 0, cp_async_global_bytes = 0;
  uint64_t wgmma_requests = 0, wgmma_wavefronts = 0, wgmma_ideal_wavefronts = 0;
  uint64_t tma_requests = 0, tma_wavefronts = 0, tma_ideal_wavefronts = 0;
};
std::vector<KernelTraffic> traffic();

}  // namespace emu
