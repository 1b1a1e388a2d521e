// The emulator runtime's per-thread state and the interface of the optional race checker
// (racecheck.cpp). Not for kernels: they see cuda_emu.h only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/emu/cuda_emu.h"
#include "cuda/emu/hopper_emu.h"

namespace emu {
namespace detail {

struct BlockState;

struct PendingCopy {
  void* dst;
  const void* src;
  int cp_size, src_size;
  const void* pc;  // where the kernel issued it (for race reports)
};

// A wgmma.mma_async issued by one thread and not yet retired (runtime.cpp, "wgmma").
struct WgmmaOp {
  WgmmaArgs args;
  uint32_t a_regs[4];  // the A fragment as it was at the issue (A from registers)
  float c[128];        // the accumulator's input, when it was not a pending wgmma's output
  bool chained;        // the input is the output of an earlier pending wgmma on the same d
  const void* pc;
  uint64_t seq;        // the issuing thread's count of wgmmas before this one
};

// A TMA store issued and not yet performed (cp.async.bulk.tensor ... .bulk_group).
struct PendingBulkStore {
  TmaDescriptor tensor_map;  // a copy: the kernel's parameter may be gone when it is performed
  int32_t coords[5];
  const void* smem_src;
  const void* pc;
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
  // wgmma: the ops issued since the last commit, the committed groups (oldest first), the
  // results of retired ops whose accumulator a later pending op still targets, and
  // whether a wgmma.fence came since the last wgmma.wait_group.
  std::vector<WgmmaOp> wgmma_uncommitted;
  std::vector<std::vector<WgmmaOp>> wgmma_groups;
  std::vector<std::pair<float*, std::vector<float>>> wgmma_carry;
  bool wgmma_fenced = false;
  uint64_t wgmma_issued = 0;
  // TMA stores (bulk async-groups): uncommitted, and committed groups oldest first.
  std::vector<PendingBulkStore> bulk_uncommitted;
  std::vector<std::vector<PendingBulkStore>> bulk_groups;
};

// The shared-memory wavefronts of one core-matrix read of a wgmma operand (traffic counters,
// runtime.h): its eight 16-byte rows at these shared-window addresses, in one phase.
// Returns {wavefronts, the conflict-free ideal}.
std::pair<uint64_t, uint64_t> core_matrix_wavefronts(const uint32_t (&rows)[8]);

// Performs the thread's TMA stores still in flight (at a bulk wait_group, and at its exit).
void flush_bulk_stores(ThreadImpl& t);

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
  // The async proxy (Hopper). A TMA wrote [address, address + bytes), counted in the
  // transactions of phase `phase` (0-based) of mbarrier `bar`: a generic access of those
  // bytes by a thread that has not seen that phase complete is a hazard.
  void (*async_write)(const void* address, size_t bytes, const void* bar, uint64_t phase,
                      const void* pc);
  // An async-proxy read (a wgmma operand, a TMA store's source) by the calling thread: the
  // bytes' last generic write must be ordered before it and followed by a
  // fence.proxy.async of its writer; a TMA write must be in a phase the thread has seen.
  void (*async_read)(const void* address, size_t bytes, const void* pc, const char* what);
  // The calling thread saw mbarrier `bar` complete `completed` phases (a successful wait).
  void (*observed)(const void* bar, uint64_t completed);
  // The calling thread executed fence.proxy.async.
  void (*proxy_fence)();
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
