// The emulator runtime's per-thread state and the interface of the optional race checker
// (racecheck.cpp). Not for kernels: they see cuda_emu.h only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/emu/cuda_emu.h"

namespace emu {
namespace detail {

struct BlockState;

struct PendingCopy {
  void* dst;
  const void* src;
  int cp_size, src_size;
  const void* pc;  // where the kernel issued it (for race reports)
};

struct ThreadImpl {
  ThreadState pub;
  BlockState* block = nullptr;
  int tid = 0, warp = 0, lane = 0;  // linear thread index, warp, lane
  // Barriers this thread has passed in the current block: the race checker's clock.
  uint32_t block_epoch = 0, warp_epoch = 0;
  int parity = 0;  // which half of the warp's exchange buffer the next collective uses
  // Which warp-level request this lane's next cp.async joins (traffic counters): the
  // barriers passed (epochs) and the cp.async count since the last of them.
  uint64_t cp_epochs = ~uint64_t(0);
  uint32_t cp_index = 0;
  uintptr_t stack_lo = 0, stack_hi = 0;  // this OS thread's stack: private, never raced on
  std::vector<PendingCopy> uncommitted;
  std::vector<std::vector<PendingCopy>> groups;  // committed, oldest first
};

// The calling CUDA thread, or null.
inline ThreadImpl* current() {
  return g_thread ? static_cast<ThreadImpl*>(g_thread->impl) : nullptr;
}

// Installed by racecheck.cpp when it is linked in.
struct RaceChecker {
  void (*block_begin)();
  // An access by the calling CUDA thread; `pc` is the instruction that made it.
  void (*access)(const void* address, size_t bytes, bool write, const void* pc);
  // The hazards found in the block that just ended (empty: none).
  std::vector<std::string> (*block_end)();
};
extern const RaceChecker* g_race_checker;

inline void race_access(const void* address, size_t bytes, bool write, const void* pc) {
  if (g_race_checker) g_race_checker->access(address, bytes, write, pc);
}

// "file:line" (or "module+0xoffset") for a code address, via addr2line when present.
std::string describe_pc(const void* pc);
// "dynamic shared memory + offset", or the address.
std::string describe_address(const void* address);
// "kernel: thread (x,y,z) of block (x,y,z) [warp w lane l]" for a thread of the caller's block.
std::string describe_thread(int tid, bool with_kernel = true);

}  // namespace detail
}  // namespace emu
