// The host-side interface of the SIMT emulator: what code that launches emulated kernels
// (bindings, tests) may use without including the kernel-facing cuda_emu.h and its macros.
#pragma once

#include <cstdint>
#include <stdexcept>

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
void reset_stats();

}  // namespace emu
