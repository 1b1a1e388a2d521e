// The SIMT emulator's runtime: launches, barriers, warp collectives, cp.async. The model is
// described at the top of cuda_emu.h. PTX ISA sections are cited by name and by their
// number in PTX ISA 9.0 (numbers shift between versions; names do not).
#include <cxxabi.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "cuda/emu/runtime_internal.h"

// How a block's CUDA threads run. Fibers (FMHA_EMU_FIBERS=1, the default): user-space
// contexts on the launching OS thread, one stack each, switched round-robin whenever one
// waits at a barrier -- a warp collective then costs a few context switches instead of
// waking 31 OS threads through the kernel. OS threads (0): one per CUDA thread, kept for
// AddressSanitizer and ThreadSanitizer, which follow real threads but not unannotated
// stack switches. The barriers, checks and results are the same in both: only the order
// in which runnable threads proceed differs, and a correct kernel does not depend on it.
// (One difference: fibers are never preempted, so a thread spinning on a flag that another
// thread of its block sets hangs, as spinning on another block already does.)
// A compile-time switch: -DFMHA_EMU_FIBERS=0 forces OS threads.
#if !defined(FMHA_EMU_FIBERS)
#if defined(__has_feature)  // Clang (older releases do not define GCC's macros below)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FMHA_EMU_FIBERS 0
#endif
#endif
#if !defined(FMHA_EMU_FIBERS)
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FMHA_EMU_FIBERS 0
#else
#define FMHA_EMU_FIBERS 1
#endif
#endif
#endif

namespace emu {

__thread const ThreadState* g_thread = nullptr;

namespace detail {

const RaceChecker* g_race_checker = nullptr;

namespace {

// Thrown on a thread whose block was aborted by another thread's error: it unwinds the
// kernel; the error itself was recorded by whoever found it.
struct Abort {};

enum Op : int {
  kOpSyncwarp = 0, kOpShfl, kOpBallot, kOpMma, kOpLdmatrix, kOpElect,
  // warpgroup collectives (Hopper)
  kOpWgmmaWait, kOpSetmaxnreg
};
const char* op_name(int op) {
  switch (op) {
    case kOpSyncwarp: return "__syncwarp";
    case kOpShfl: return "shfl.sync";
    case kOpBallot: return "vote.sync.ballot";
    case kOpMma: return "mma.sync";
    case kOpLdmatrix: return "ldmatrix";
    case kOpElect: return "elect.sync";
    case kOpWgmmaWait: return "wgmma.wait_group";
    case kOpSetmaxnreg: return "setmaxnreg";
  }
  return "?";
}

// One warp-collective operand: the largest is mma's (4 + 2 registers of A/B, 4 floats of C).
struct alignas(16) Slot {
  unsigned char bytes[48];
};

// A warp-level cp.async request under construction (see WarpState::cp_requests).
struct CpRequest {
  struct Lane {
    uintptr_t dst = 0, src = 0;
    int cp_size = 0, src_size = 0;
  } lanes[32];
  uint32_t present = 0;  // the lanes that issued it
  int count = 0;
};

struct WarpState {
  int size = 0, live = 0;  // lanes that exist / have not exited
  int arrived = 0;         // lanes waiting at the barrier in progress
  uint64_t generation = 0;
  int op = 0;  // the operation of the barrier in progress, for the divergence check
  const char* file = nullptr;  // the call site: file:line, or a code address (pc)
  int line = 0;
  const void* pc = nullptr;
  std::condition_variable cv;
  Slot slots[2][32];  // double-buffered by the lanes' parity: see warp_exchange
  // cp.async requests some lane has issued but not every lane yet (traffic counters), by
  // (barrier epochs, index since the last barrier): the lanes of a convergent warp issue
  // the same cp.async at the same point between the same two barriers.
  std::map<std::pair<uint64_t, uint32_t>, CpRequest> cp_requests;
};

// Memory-traffic counters (runtime.h, KernelTraffic) of one launch, or summed per kernel.
struct Traffic {
  uint64_t launches = 0, ldsm_requests = 0, ldsm_wavefronts = 0, ldsm_ideal = 0;
  uint64_t cp_requests = 0, cp_wavefronts = 0, cp_ideal = 0, sectors = 0, bytes = 0;
  uint64_t wgmma_requests = 0, wgmma_wavefronts = 0, wgmma_ideal = 0;
  uint64_t tma_requests = 0, tma_wavefronts = 0, tma_ideal = 0;
  void add(const Traffic& o) {
    launches += o.launches;
    ldsm_requests += o.ldsm_requests;
    ldsm_wavefronts += o.ldsm_wavefronts;
    ldsm_ideal += o.ldsm_ideal;
    cp_requests += o.cp_requests;
    cp_wavefronts += o.cp_wavefronts;
    cp_ideal += o.cp_ideal;
    sectors += o.sectors;
    bytes += o.bytes;
    wgmma_requests += o.wgmma_requests;
    wgmma_wavefronts += o.wgmma_wavefronts;
    wgmma_ideal += o.wgmma_ideal;
    tma_requests += o.tma_requests;
    tma_wavefronts += o.tma_wavefronts;
    tma_ideal += o.tma_ideal;
  }
};

// Shared-memory wavefronts of one phase of a request: its lanes' accesses, as the 4-byte
// words they touch. A phase takes one wavefront per 32 distinct words at best, and as many
// as the most distinct words any one bank holds (each bank serves one word per wavefront;
// lanes reading the same word share it). Returns {wavefronts, ideal}.
std::pair<uint64_t, uint64_t> phase_wavefronts(std::vector<uintptr_t>& words) {
  if (words.empty()) return {0, 0};
  std::sort(words.begin(), words.end());
  words.erase(std::unique(words.begin(), words.end()), words.end());
  int per_bank[32] = {};
  int most = 0;
  for (const uintptr_t word : words) most = std::max(most, ++per_bank[word % 32]);
  return {uint64_t(most), (words.size() + 31) / 32};
}

void add_words(std::vector<uintptr_t>& words, uintptr_t address, int bytes) {
  for (uintptr_t w = address / 4; w < (address + uintptr_t(bytes) + 3) / 4; ++w)
    words.push_back(w);
}

// The kernel's name for messages: its symbol (demangled) when it can be found, else the
// expression the launch named it by. Resolved only when a message needs it.
struct KernelName {
  const char* expression;
  const void* fn;
  mutable std::once_flag once;
  mutable std::string name;
  const std::string& get() const;
};

}  // namespace

std::pair<uint64_t, uint64_t> core_matrix_wavefronts(const uint32_t (&rows)[8]) {
  std::vector<uintptr_t> words;
  for (const uint32_t a : rows) add_words(words, a, 16);
  return phase_wavefronts(words);
}

struct BlockState {
  const KernelName* kernel = nullptr;
  uint3 block_idx{};
  dim3 block_dim, grid_dim;
  int nthreads = 0, nwarps = 0;

  // Everything below is guarded by m.
  std::mutex m;
  std::condition_variable cv;  // __syncthreads
  int live = 0;                // threads that have not exited
  int exited = 0;
  int arrived = 0;  // threads waiting at the __syncthreads in progress
  int vote = 0;     // __syncthreads_or: the OR of the predicates that have arrived so far
  int vote_result = 0;  // ... and of all of them, once the barrier completed
  int blocked = 0;  // threads waiting at any barrier that has not completed
  uint64_t generation = 0;
  const char* file = "";
  int line = 0;
  std::unique_ptr<WarpState[]> warps;
  bool aborted = false;
  std::string error;

  unsigned char* dynamic_smem = nullptr;
  size_t dynamic_smem_bytes = 0;
  Traffic traffic;  // this block's memory traffic (guarded by m)

  // Hopper (guarded by m). The running threads (for warpgroup collectives, which read each
  // other's pending wgmma operations), the warpgroups' barriers (WarpState reused: 128
  // threads), the mbarrier objects by address, and the register pool of setmaxnreg.
  // Each slot is set by its thread at its start without the lock (a lock there would order
  // every thread after those that ran before it, hiding races from ThreadSanitizer); it is
  // read only by warpgroup collectives, after every participant has taken the lock.
  std::vector<ThreadImpl*> threads;
  // The shared-memory chunks (address >> 4) each pending wgmma of the block reads, by its
  // issuing warpgroup's first thread and that thread's issue number.
  struct InflightWgmma {
    int tid;
    uint64_t seq;
    std::vector<uint32_t> chunks;
  };
  std::vector<InflightWgmma> wgmma_inflight;
  int nwgroups = 0;
  std::unique_ptr<WarpState[]> wgroups;
  struct Mbar {
    uint32_t expected = 0, pending = 0;
    int64_t tx = 0;
    uint64_t phases = 0;  // completed phases; the current phase's parity is phases & 1
    int waiters = 0;      // threads blocked in a wait on it (counted in `blocked`)
    // fence.mbarrier_init (race checker): the initialising thread, whether it has fenced
    // since the init, and its block-barrier count at that fence.
    int init_tid = -1;
    bool init_fenced = false;
    uint32_t fence_epoch = 0;
  };
  std::map<const void*, Mbar> mbars;
  int regs_launch = 0;        // per-thread registers at launch (see setmaxnreg)
  int64_t regs_pool = 0;      // registers released to the CTA's pool, not yet claimed
  std::vector<int> wg_regs;   // per-thread register count of each warpgroup
  int regs_waiters = 0;       // threads blocked in setmaxnreg.inc (counted in `blocked`)
};

namespace {

std::atomic<uint64_t> s_launches{0}, s_blocks{0}, s_threads{0}, s_block_barriers{0},
    s_warp_barriers{0}, s_mma{0}, s_ldmatrix{0}, s_shfl{0}, s_ballot{0}, s_cp_async{0},
    s_cp_async_zero_filled{0}, s_max_groups{0};
// Device scratch in use now, and the most in use at once since the last reset_stats().
std::atomic<uint64_t> s_scratch_live{0}, s_scratch_peak{0};

void bump(std::atomic<uint64_t>& c, uint64_t n = 1) { c.fetch_add(n, std::memory_order_relaxed); }

std::mutex g_launch_mutex;  // one launch at a time: static __shared__ storage is per process
std::mutex g_optin_mutex;
std::map<const void*, size_t> g_smem_optin;  // kernel -> max dynamic shared memory

// Dynamic shared memory limits: 48 KiB without opt-in; sm_80's 163 KiB with it (the kernels
// target sm_80, whose limit is the smallest of the architectures they are built for).
constexpr size_t kDefaultDynamicSmem = 48 * 1024;
constexpr size_t kMaxDynamicSmem = 163 * 1024;
constexpr size_t kMaxDynamicSmemSm90 = 227 * 1024;  // the sm_90a-only kernels' (cuda/hopper.cuh)

ThreadImpl& me() {
  ThreadImpl* t = current();
  if (!t) not_in_kernel("a CUDA device function");
  return *t;
}

std::string where(const char* file, int line, const void* pc = nullptr) {
  if (!file) return describe_pc(pc);
  std::ostringstream os;
  os << file << ":" << line;
  return os.str();
}

#if FMHA_EMU_FIBERS
// The fiber scheduler of the calling OS thread's launch (see run_block_fibers).
struct Fiber {
  ucontext_t context;
  void* stack = nullptr;
  size_t stack_bytes = 0;
  BlockState* block = nullptr;
  int tid = 0;
  bool done = false;
};
__thread ucontext_t* t_scheduler = nullptr;  // where a waiting fiber returns to
__thread Fiber* t_fiber = nullptr;           // the fiber running now
__thread Thunk t_thunk = nullptr;
__thread void* t_closure = nullptr;

// Back to the scheduler until this fiber's turn comes again.
void fiber_yield() {
  const ThreadState* self = g_thread;
  Fiber* f = t_fiber;
  if (swapcontext(&f->context, t_scheduler) != 0) std::abort();
  g_thread = self;
}
#endif

// Waits at a barrier until ready(): on the condition variable (OS threads), or by yielding
// to the other fibers of the block, with the lock released meanwhile (fibers).
template <typename Ready>
void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lk, Ready ready) {
#if FMHA_EMU_FIBERS
  (void)cv;
  while (!ready()) {
    lk.unlock();
    fiber_yield();
    lk.lock();
  }
#else
  cv.wait(lk, ready);
#endif
}

// Records the first error of the block, aborts it and wakes every waiting thread.
void abort_locked(BlockState& b, const std::string& message) {
  if (!b.aborted) {
    b.aborted = true;
    b.error = message;
  }
  b.cv.notify_all();
  for (int w = 0; w < b.nwarps; ++w) b.warps[size_t(w)].cv.notify_all();
}

[[noreturn]] void fail_locked(BlockState& b, const std::string& message) {
  abort_locked(b, message);
  throw Abort{};
}

[[noreturn]] void fail(const std::string& message) {
  ThreadImpl& t = me();
  std::lock_guard<std::mutex> lk(t.block->m);
  fail_locked(*t.block, describe_thread(t.tid) + ": " + message);
}

// Every live thread waits at a barrier that only a live thread could complete.
void check_deadlock_locked(BlockState& b) {
  if (b.aborted || b.live == 0 || b.blocked != b.live) return;
  std::ostringstream os;
  os << "deadlock: every live thread of the block waits at a barrier that cannot complete (";
  if (b.arrived) os << b.arrived << " at __syncthreads " << where(b.file, b.line) << "; ";
  for (const auto& entry : b.mbars)
    if (entry.second.waiters)
      os << entry.second.waiters << " waiting on the mbarrier at "
         << describe_address(entry.first) << " (phase " << entry.second.phases << ", "
         << entry.second.pending << " arrivals and " << entry.second.tx
         << " transaction bytes pending); ";
  for (int g = 0; g < b.nwgroups; ++g) {
    const WarpState& ws = b.wgroups[size_t(g)];
    if (ws.arrived)
      os << "warpgroup " << g << ": " << ws.arrived << " of " << ws.live << " threads at "
         << op_name(ws.op) << " " << where(ws.file, ws.line, ws.pc) << "; ";
  }
  if (b.regs_waiters) os << b.regs_waiters << " in setmaxnreg.inc waiting for registers; ";
  for (int w = 0; w < b.nwarps; ++w) {
    const WarpState& ws = b.warps[size_t(w)];
    if (ws.arrived)
      os << "warp " << w << ": " << ws.arrived << " of " << ws.live << " lanes at "
         << op_name(ws.op) << " " << where(ws.file, ws.line, ws.pc) << "; ";
  }
  os << b.exited << " exited). A barrier must be reached by every thread it names.";
  abort_locked(b, os.str());
}

// ---- memory traffic ----

// A finished cp.async request: its shared-memory stores' wavefronts (phases of
// 128 / cp-size lanes) and the global sectors its sources touch.
void count_cp_request_locked(BlockState& b, const CpRequest& r) {
  if (!r.present) return;
  int cp_size = 4;  // one instruction has one cp-size; the largest, if lanes differ
  for (int l = 0; l < 32; ++l)
    if (r.present >> l & 1u) cp_size = std::max(cp_size, r.lanes[l].cp_size);
  const int phase = 128 / cp_size;
  std::vector<uintptr_t> words, sectors;
  uint64_t bytes = 0;
  ++b.traffic.cp_requests;
  for (int p0 = 0; p0 < 32; p0 += phase) {
    words.clear();
    for (int l = p0; l < p0 + phase; ++l)
      if (r.present >> l & 1u) add_words(words, r.lanes[l].dst, r.lanes[l].cp_size);
    const auto wf = phase_wavefronts(words);
    b.traffic.cp_wavefronts += wf.first;
    b.traffic.cp_ideal += wf.second;
  }
  for (int l = 0; l < 32; ++l) {
    const CpRequest::Lane& x = r.lanes[l];
    if (!(r.present >> l & 1u) || x.src_size == 0) continue;
    bytes += uint64_t(x.src_size);
    for (uintptr_t sec = x.src / 32; sec <= (x.src + uintptr_t(x.src_size) - 1) / 32; ++sec)
      sectors.push_back(sec);
  }
  std::sort(sectors.begin(), sectors.end());
  b.traffic.sectors += uint64_t(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
  b.traffic.bytes += bytes;
}

// Lane t issued a cp.async: file it under its warp's request (the same barrier epochs and
// index since the last barrier), and count the request once every lane of the warp has
// joined it (the rest at the block's end: a lane may skip one, or exit first, as a
// diverged warp's request has fewer lanes).
void note_cp_async(ThreadImpl& t, const void* dst, const void* src, int cp_size,
                   int src_size) {
  BlockState& b = *t.block;
  std::lock_guard<std::mutex> lk(b.m);
  WarpState& w = b.warps[size_t(t.warp)];
  const uint64_t epochs = uint64_t(t.block_epoch) << 32 | t.warp_epoch;
  if (epochs != t.cp_epochs) {
    t.cp_epochs = epochs;
    t.cp_index = 0;
  }
  const auto key = std::make_pair(epochs, t.cp_index++);
  CpRequest& r = w.cp_requests[key];
  r.lanes[t.lane] = {reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src),
                     cp_size, src_size};
  r.present |= 1u << t.lane;
  if (++r.count == w.size) {
    count_cp_request_locked(b, r);
    w.cp_requests.erase(key);
  }
}

// The block ended: requests that not every lane issued (divergent, or lanes that exited)
// count with the lanes that did.
void finish_traffic(BlockState& b) {
  std::lock_guard<std::mutex> lk(b.m);
  for (int i = 0; i < b.nwarps; ++i) {
    WarpState& w = b.warps[size_t(i)];
    for (const auto& entry : w.cp_requests) count_cp_request_locked(b, entry.second);
    w.cp_requests.clear();
  }
}

// An ldmatrix request (lane 0 counts it for the warp): one phase per 8x8 matrix, whose
// eight 16-byte rows lanes 8m..8m+7 name.
void count_ldmatrix(BlockState& b, const Slot* slots, int num) {
  std::vector<uintptr_t> words;
  uint64_t wavefronts = 0, ideal = 0;
  for (int m = 0; m < num; ++m) {
    words.clear();
    for (int row = 0; row < 8; ++row) {
      uintptr_t a;
      std::memcpy(&a, slots[m * 8 + row].bytes, sizeof a);
      add_words(words, a, 16);
    }
    const auto wf = phase_wavefronts(words);
    wavefronts += wf.first;
    ideal += wf.second;
  }
  std::lock_guard<std::mutex> lk(b.m);
  ++b.traffic.ldsm_requests;
  b.traffic.ldsm_wavefronts += wavefronts;
  b.traffic.ldsm_ideal += ideal;
}

// Per kernel (its address), summed over launches since the last reset.
std::mutex g_traffic_mutex;
std::map<const void*, std::pair<const char*, Traffic>> g_traffic;

// Releases the lanes waiting at the warp's barrier: `waiting` of them were counted in
// b.blocked (all that arrived but the last, when a lane's arrival completes it; all of them,
// when a lane's exit does).
void complete_warp_barrier_locked(BlockState& b, WarpState& w, int waiting) {
  b.blocked -= waiting;
  w.arrived = 0;
  ++w.generation;
  w.cv.notify_all();
}

// The warp meets: every live lane of the warp arrives, then all proceed. `op` must be the
// same for all lanes (.sync.aligned); collectives need all 32 lanes live.
void warp_barrier(ThreadImpl& t, int op, const char* file, int line, const void* pc) {
  BlockState& b = *t.block;
  WarpState& w = b.warps[size_t(t.warp)];
  std::unique_lock<std::mutex> lk(b.m);
  if (b.aborted) throw Abort{};
  if (op != kOpSyncwarp && w.live != 32) {
    std::ostringstream os;
    os << describe_thread(t.tid) << ": " << op_name(op) << " at " << where(file, line, pc)
       << " needs all 32 lanes of the warp, but only " << w.live
       << (w.size < 32 ? " exist (blockDim is not a multiple of 32)" : " have not exited");
    fail_locked(b, os.str());
  }
  if (w.arrived == 0) {
    w.op = op;
    w.file = file;
    w.line = line;
    w.pc = pc;
  } else if (w.op != op) {
    std::ostringstream os;
    os << "divergent warp: " << describe_thread(t.tid) << " is at " << op_name(op) << " "
       << where(file, line, pc) << " while " << w.arrived << " lanes of its warp are at "
       << op_name(w.op) << " " << where(w.file, w.line, w.pc);
    fail_locked(b, os.str());
  }
  bump(s_warp_barriers);
  if (++w.arrived == w.live) {
    complete_warp_barrier_locked(b, w, w.arrived - 1);
  } else {
    const uint64_t g = w.generation;
    ++b.blocked;
    check_deadlock_locked(b);
    wait_until(w.cv, lk, [&] { return w.generation != g || b.aborted; });
    if (w.generation == g) throw Abort{};
  }
  ++t.warp_epoch;
}

// Each lane deposits `bytes` of operand, the warp meets, and `fn` reads the whole warp's
// operands. The buffer is double-buffered by parity: lane L rewrites slot half p only at
// the collective after next, which no lane can reach before every lane has finished
// reading this one (they all pass the next collective's barrier in between).
template <typename Fn>
void warp_exchange(int op, const void* operand, size_t bytes, const void* pc, Fn&& fn) {
  ThreadImpl& t = me();
  WarpState& w = t.block->warps[size_t(t.warp)];
  Slot* half = w.slots[t.parity];
  std::memcpy(half[t.lane].bytes, operand, bytes);
  warp_barrier(t, op, nullptr, 0, pc);
  fn(half, t.lane);
  t.parity ^= 1;
}

void thread_main(BlockState* b, int tid, Thunk thunk, void* closure) {
  ThreadImpl t;
  t.block = b;
  t.tid = tid;
  t.warp = tid / 32;
  t.lane = tid % 32;
  const unsigned dx = b->block_dim.x, dy = b->block_dim.y;
  t.pub.thread_idx = {unsigned(tid) % dx, (unsigned(tid) / dx) % dy, unsigned(tid) / (dx * dy)};
  t.pub.block_idx = b->block_idx;
  t.pub.block_dim = b->block_dim;
  t.pub.grid_dim = b->grid_dim;
  t.pub.impl = &t;
#if FMHA_EMU_FIBERS
  t.stack_lo = reinterpret_cast<uintptr_t>(t_fiber->stack);
  t.stack_hi = t.stack_lo + t_fiber->stack_bytes;
#else
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* lo = nullptr;
    size_t size = 0;
    if (pthread_attr_getstack(&attr, &lo, &size) == 0) {
      t.stack_lo = reinterpret_cast<uintptr_t>(lo);
      t.stack_hi = t.stack_lo + size;
    }
    pthread_attr_destroy(&attr);
  }
#endif
  g_thread = &t.pub;
  b->threads[size_t(tid)] = &t;  // see BlockState::threads

  try {
    thunk(closure);
    flush_bulk_stores(t);  // TMA stores in flight complete even if nothing waits for them
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lk(b->m);
    abort_locked(*b, describe_thread(tid) + ": " + e.what());
  } catch (...) {
    std::lock_guard<std::mutex> lk(b->m);
    abort_locked(*b, describe_thread(tid) + ": unknown exception");
  }

  // Exit. cp.async copies still in flight are dropped: nothing can wait for them now.
  {
    std::lock_guard<std::mutex> lk(b->m);
    WarpState& w = b->warps[size_t(t.warp)];
    --b->live;
    ++b->exited;
    --w.live;
    b->threads[size_t(tid)] = nullptr;
    if (b->nwgroups > tid / 128) {
      WarpState& g = b->wgroups[size_t(tid / 128)];
      --g.live;
      if (!b->aborted && g.arrived > 0)
        abort_locked(*b, describe_thread(tid) + " exited while its warpgroup waits at " +
                             op_name(g.op) + " " + where(g.file, g.line, g.pc));
    }
    // wgmma.mma_async in flight at the exit: its results can never be read (a missing
    // wgmma.wait_group).
    const size_t inflight = t.wgmma_uncommitted.size() + [&] {
      size_t n = 0;
      for (const auto& g : t.wgmma_groups) n += g.size();
      return n;
    }();
    if (!b->aborted && inflight > 0)
      abort_locked(*b, describe_thread(tid) + " exited with " + std::to_string(inflight) +
                           " wgmma.mma_async in flight (no wgmma.wait_group retired them)");
    if (!b->aborted && b->arrived > 0) {
      abort_locked(*b, describe_thread(tid) + " exited while " + std::to_string(b->arrived) +
                           " threads wait at __syncthreads " + where(b->file, b->line) +
                           " (every thread must reach every __syncthreads)");
    }
    if (!b->aborted && w.arrived > 0) {
      if (w.op != kOpSyncwarp) {
        abort_locked(*b, describe_thread(tid) + " exited while its warp waits at " +
                             op_name(w.op) + " " + where(w.file, w.line, w.pc));
      } else if (w.arrived == w.live) {
        complete_warp_barrier_locked(*b, w, w.arrived);
      }
    }
    check_deadlock_locked(*b);
  }
  g_thread = nullptr;
}

// The random orders of the schedule: of a launch's blocks, and of the turns fibers take
// (a new permutation every round). As on a GPU, the interleaving -- say, the order in
// which atomics land -- then differs from run to run, so tests of run-to-run determinism
// can fail. Each launch draws a seed, which its errors name; FMHA_EMU_SCHEDULE_SEED=<n>
// gives every launch seed n, replaying a failed launch's orders.
struct Schedule {
  uint64_t seed, state;
  explicit Schedule(uint64_t s) : seed(s), state(s) {}
  uint64_t next() {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  template <typename I>
  void shuffle(std::vector<I>& order) {
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next() % i]);
  }
  std::string describe() const {
    return " [emulator schedule seed " + std::to_string(seed) + ": FMHA_EMU_SCHEDULE_SEED=" +
           std::to_string(seed) + " replays it]";
  }
};

uint64_t launch_seed() {
  static const char* env = std::getenv("FMHA_EMU_SCHEDULE_SEED");
  if (env && *env) return std::strtoull(env, nullptr, 10);
  static std::atomic<uint64_t> counter{(uint64_t(std::random_device{}()) << 32) |
                                       std::random_device{}()};
  return Schedule(counter.fetch_add(1, std::memory_order_relaxed)).next() % 1000000000000ull;
}

#if FMHA_EMU_FIBERS
// Fiber stacks: 1 MiB each (an OS thread's default is 8, but a kernel's locals are its
// registers and a few arrays), below each 64 KiB that fault on overflow (more than a page,
// so that a large frame cannot jump it into the next stack); mapped once and reused by
// every later block and launch of this process.
constexpr size_t kFiberStack = size_t(1) << 20, kGuard = size_t(64) << 10;
std::mutex g_stacks_mutex;
std::vector<void*> g_stacks;

void* fiber_stack(size_t i) {
  std::lock_guard<std::mutex> lk(g_stacks_mutex);
  while (g_stacks.size() <= i) {
    void* p = mmap(nullptr, kFiberStack + kGuard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    if (mprotect(p, kGuard, PROT_NONE) != 0) throw std::bad_alloc();
    g_stacks.push_back(static_cast<unsigned char*>(p) + kGuard);
  }
  return g_stacks[i];
}

void fiber_main() {
  Fiber* f = t_fiber;
  thread_main(f->block, f->tid, t_thunk, t_closure);
  f->done = true;  // returning resumes the scheduler (uc_link)
}

// Runs the block's threads as fibers on this OS thread, each until it waits at a barrier
// or exits, in rounds (every unfinished fiber once per round, in a random order); a
// waiting fiber looks at its barrier again on its next turn. thread_main's own checks end
// any deadlock (every live thread waiting) by aborting the block, which releases every
// waiter.
void run_block_fibers(BlockState& b, Thunk thunk, void* closure, Schedule& schedule) {
  std::vector<Fiber> fibers(size_t(b.nthreads));
  ucontext_t scheduler;
  for (int tid = 0; tid < b.nthreads; ++tid) {
    Fiber& f = fibers[size_t(tid)];
    f.block = &b;
    f.tid = tid;
    f.stack = fiber_stack(size_t(tid));
    f.stack_bytes = kFiberStack;
    if (getcontext(&f.context) != 0) throw std::runtime_error("getcontext failed");
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = f.stack_bytes;
    f.context.uc_link = &scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  t_scheduler = &scheduler;
  t_thunk = thunk;
  t_closure = closure;
  std::vector<int> order(size_t(b.nthreads));
  for (int tid = 0; tid < b.nthreads; ++tid) order[size_t(tid)] = tid;
  while (!order.empty()) {
    schedule.shuffle(order);
    for (int tid : order) {
      Fiber& f = fibers[size_t(tid)];
      t_fiber = &f;
      if (swapcontext(&scheduler, &f.context) != 0) std::abort();
      g_thread = nullptr;
    }
    order.erase(std::remove_if(order.begin(), order.end(),
                               [&](int tid) { return fibers[size_t(tid)].done; }),
                order.end());
  }
  t_fiber = nullptr;
  t_scheduler = nullptr;
}
#endif

std::string dims(const uint3& v) {
  std::ostringstream os;
  os << "(" << v.x << "," << v.y << "," << v.z << ")";
  return os.str();
}

}  // namespace

std::string describe_thread(int tid, bool with_kernel) {
  ThreadImpl* t = current();
  std::ostringstream os;
  if (!t) return "host thread";
  const BlockState& b = *t->block;
  const unsigned dx = b.block_dim.x, dy = b.block_dim.y;
  const uint3 ti{unsigned(tid) % dx, (unsigned(tid) / dx) % dy, unsigned(tid) / (dx * dy)};
  if (with_kernel) os << b.kernel->get() << ": ";
  os << "thread " << dims(ti) << " of block " << dims(b.block_idx) << " [warp "
     << tid / 32 << " lane " << tid % 32 << "]";
  return os.str();
}

namespace {
std::string short_function_name(std::string s);
}

std::string describe_address(const void* address) {
  std::ostringstream os;
  const ThreadImpl* t = current();
  const uintptr_t a = reinterpret_cast<uintptr_t>(address);
  if (t) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(t->block->dynamic_smem);
    if (a >= lo && a < lo + t->block->dynamic_smem_bytes) {
      os << "dynamic shared memory byte " << (a - lo);
      return os.str();
    }
  }
  os << "address " << address;
  return os.str();
}

std::string describe_pc(const void* pc) {
  Dl_info info{};
  if (!pc || !dladdr(pc, &info) || !info.dli_fname) {
    std::ostringstream os;
    os << pc;
    return os.str();
  }
  const uintptr_t off = reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase);
  char cmd[4096];
  // pc is a return address: the access is the instruction before it.
  std::snprintf(cmd, sizeof cmd, "addr2line -C -f -i -e '%s' 0x%lx 2>/dev/null", info.dli_fname,
                static_cast<unsigned long>(off > 0 ? off - 1 : off));
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char line[1024];
    std::vector<std::string> lines;
    while (std::fgets(line, sizeof line, p)) {
      std::string s(line);
      while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
      lines.push_back(s);
    }
    pclose(p);
    // pairs of (function, file:line), innermost first
    for (size_t i = 0; i + 1 < lines.size(); i += 2) {
      if (lines[i + 1].rfind("??", 0) == 0) continue;
      if (!out.empty()) out += " inlined in ";
      out += lines[i + 1] + " (" + short_function_name(lines[i]) + ")";
    }
  }
  if (out.empty()) {
    std::ostringstream os;
    os << info.dli_fname << "+0x" << std::hex << off;
    out = os.str();
  }
  return out;
}

namespace {

// "void (anonymous namespace)::k<false>(float const*, float*)" -> "k<false>"
std::string short_function_name(std::string s) {
  for (const char* junk : {"(anonymous namespace)::", "void "}) {
    const size_t n = std::strlen(junk);
    for (size_t at; (at = s.find(junk)) != std::string::npos;) s.erase(at, n);
  }
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0) return s.substr(0, i);
  }
  return s;
}

std::string function_name(const void* fn) {
  Dl_info info{};
  if (!dladdr(fn, &info)) return "";
  if (info.dli_sname && info.dli_saddr == fn) {
    int status = 0;
    char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    std::string out = status == 0 && d ? d : info.dli_sname;
    std::free(d);
    return short_function_name(out);
  }
  if (!info.dli_fname) return "";
  char cmd[4096];
  std::snprintf(cmd, sizeof cmd, "addr2line -C -f -e '%s' 0x%lx 2>/dev/null", info.dli_fname,
                static_cast<unsigned long>(reinterpret_cast<uintptr_t>(fn) -
                                           reinterpret_cast<uintptr_t>(info.dli_fbase)));
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char line[1024];
    if (std::fgets(line, sizeof line, p)) out = line;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() || out[0] == '?' ? "" : short_function_name(out);
}

}  // namespace

const std::string& KernelName::get() const {
  std::call_once(once, [this] {
    name = function_name(fn);
    if (name.empty()) name = expression;
  });
  return name;
}

}  // namespace detail

using detail::BlockState;
using detail::current;
using detail::ThreadImpl;

void not_in_kernel(const char* what) {
  throw std::logic_error(std::string("cuda_emu: ") + what +
                         " used outside an emulated kernel (on a host thread)");
}

// ---------------------------------------------------------------------------- barriers

// __syncthreads (bar.sync 0; PTX ISA 9.0 §9.7.13.1 "bar, barrier"): all threads of the block.
// __syncthreads_or (bar.red.or.pred) is the same barrier that also returns whether any
// thread's predicate was nonzero; the two may not meet at one barrier (file:line differs).
void syncthreads(const char* file, int line) { syncthreads_or(0, file, line); }

int syncthreads_or(int predicate, const char* file, int line) {
  ThreadImpl& t = detail::me();
  BlockState& b = *t.block;
  std::unique_lock<std::mutex> lk(b.m);
  if (b.aborted) throw detail::Abort{};
  if (b.exited > 0) {
    detail::fail_locked(b, detail::describe_thread(t.tid) + " reached __syncthreads " +
                               detail::where(file, line) + " after " + std::to_string(b.exited) +
                               " threads of its block exited (every thread must reach every "
                               "__syncthreads)");
  }
  if (b.arrived == 0) {
    b.file = file;
    b.line = line;
  } else if (b.line != line || std::strcmp(b.file, file) != 0) {
    detail::fail_locked(b, "divergent __syncthreads: " + detail::describe_thread(t.tid) +
                               " is at " + detail::where(file, line) + " while " +
                               std::to_string(b.arrived) + " threads wait at " +
                               detail::where(b.file, b.line));
  }
  detail::bump(detail::s_block_barriers);
  b.vote |= predicate != 0;
  if (++b.arrived == b.live) {
    b.blocked -= b.arrived - 1;
    b.arrived = 0;
    // Every waiter reads the result before it can arrive at the next barrier, which
    // cannot complete without it: one result slot suffices.
    b.vote_result = b.vote;
    b.vote = 0;
    ++b.generation;
    b.cv.notify_all();
  } else {
    const uint64_t g = b.generation;
    ++b.blocked;
    detail::check_deadlock_locked(b);
    detail::wait_until(b.cv, lk, [&] { return b.generation != g || b.aborted; });
    if (b.generation == g) throw detail::Abort{};
  }
  ++t.block_epoch;
  return b.vote_result;
}

// __syncwarp (bar.warp.sync; PTX ISA 9.0 §9.7.13.2): the live lanes of the warp.
void syncwarp(unsigned mask, const char* file, int line) {
  if (mask != 0xFFFFFFFFu)
    detail::fail("__syncwarp with a partial mask: the emulator supports full warps only");
  detail::warp_barrier(detail::me(), detail::kOpSyncwarp, file, line, nullptr);
}

// ---------------------------------------------------------------------------- collectives
//
// Each lane computes its own result from the warp's operands. The layouts are written here
// as "owner" maps -- which lane, register and half holds element (row, col) -- the inverse
// of the ISA's per-lane formulas, which the known-answer tests encode directly
// (tests/cuda_emu/kat_primitives.cu); the two must agree for the tests to pass.

namespace {

// PTX ISA 9.0 §9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type",
// .f16/.bf16 multiplicands, .f32 accumulators. groupID = lane/4 selects rows of A, C and
// columns of B; threadID_in_group = lane%4 selects column pairs of A, C and row pairs of B.
struct Owner {
  int lane, reg, half;  // half: which 16-bit half of a .b32 register (0 = low bits)
};
// A (16x16, row-major): a0..a7 in registers {a0,a1} {a2,a3} {a4,a5} {a6,a7}; rows 8..15
// are registers 1 and 3, columns 8..15 are registers 2 and 3.
Owner mma_a_owner(int row, int k) {
  return {(row % 8) * 4 + (k % 8) / 2, (row / 8) + 2 * (k / 8), k % 2};
}
// B (16x8, "col": k runs down a column): b0,b1 in register 0 hold k 0..7, register 1 k 8..15.
Owner mma_b_owner(int k, int col) { return {col * 4 + (k % 8) / 2, k / 8, k % 2}; }
// C/D (16x8): c0,c1 row groupID, c2,c3 row groupID+8; columns 2*threadID_in_group + {0,1}.
Owner mma_c_owner(int row, int col) { return {(row % 8) * 4 + col / 2, 2 * (row / 8) + col % 2, 0}; }

float element_to_float(MmaType type, uint16_t bits) {
  return type == MmaType::kF16 ? f16_bits_to_f32(bits) : bf16_bits_to_f32(bits);
}

struct MmaOperands {
  uint32_t a[4], b[2];
  float c[4];
};
static_assert(sizeof(MmaOperands) <= sizeof(detail::Slot), "slot too small");

}  // namespace

// PTX ISA 9.0 §9.7.14.5.14 "Multiply-and-Accumulate Instruction: mma":
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 d, a, b, c.
void mma_m16n8k16(MmaType type, float d[4], const uint32_t a[4], const uint32_t b[2],
                  const float c[4]) {
  MmaOperands mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  std::memcpy(mine.c, c, sizeof mine.c);
  detail::bump(detail::s_mma);
  detail::warp_exchange(detail::kOpMma, &mine, sizeof mine, __builtin_return_address(0),
                        [&](const detail::Slot* slots, int lane) {
    auto ops = [&](int l) {
      MmaOperands o;
      std::memcpy(&o, slots[l].bytes, sizeof o);
      return o;
    };
    MmaOperands all[32];
    for (int l = 0; l < 32; ++l) all[l] = ops(l);
    auto half_of = [](uint32_t reg, int h) { return uint16_t(h ? reg >> 16 : reg & 0xFFFFu); };
    float A[16][16], B[16][8];
    for (int r = 0; r < 16; ++r)
      for (int k = 0; k < 16; ++k) {
        const Owner o = mma_a_owner(r, k);
        A[r][k] = element_to_float(type, half_of(all[o.lane].a[o.reg], o.half));
      }
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 8; ++n) {
        const Owner o = mma_b_owner(k, n);
        B[k][n] = element_to_float(type, half_of(all[o.lane].b[o.reg], o.half));
      }
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 8; ++n) {
        const Owner o = mma_c_owner(r, n);
        if (o.lane != lane) continue;
        // Products of f16/bf16 are exact in double, and so (to within 2^-53) is their sum.
        double s = all[lane].c[o.reg];
        for (int k = 0; k < 16; ++k) s += double(A[r][k]) * double(B[k][n]);
        d[o.reg] = float(s);
      }
  });
}

// PTX ISA 9.0 §9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix", .m8n8 .b16.
// Threads 8i..8i+7 give the row addresses of matrix i (only the first 8*num are used); each
// row is 16 bytes and must be 16-byte aligned. In the destination, lane L holds, of each
// matrix, row L/4, columns 2*(L%4) and 2*(L%4)+1 (the lower column in the low half); with
// .trans the matrix is read column-major: rows 2*(L%4), 2*(L%4)+1 of column L/4.
void ldmatrix(int num, bool trans, uint32_t* r, const void* row_address) {
  ThreadImpl& t = detail::me();
  if (num != 1 && num != 2 && num != 4) detail::fail("ldmatrix: .num must be .x1, .x2 or .x4");
  const bool supplies = t.lane < 8 * num;
  if (supplies && (reinterpret_cast<uintptr_t>(row_address) % 16) != 0) {
    std::ostringstream os;
    os << "ldmatrix row address " << row_address << " (lane " << t.lane
       << ") is not 16-byte aligned";
    detail::fail(os.str());
  }
  detail::bump(detail::s_ldmatrix);
  const void* pc = __builtin_return_address(0);
  detail::warp_exchange(detail::kOpLdmatrix, &row_address, sizeof row_address, pc,
                        [&](const detail::Slot* slots, int lane) {
    auto row_ptr = [&](int matrix, int row) {
      const unsigned char* p;
      std::memcpy(&p, slots[matrix * 8 + row].bytes, sizeof p);
      return p;
    };
    if (supplies) detail::race_access(row_address, 16, false, pc);
    if (lane == 0) detail::count_ldmatrix(*t.block, slots, num);
    for (int m = 0; m < num; ++m) {
      uint16_t lo, hi;
      if (!trans) {
        const unsigned char* row = row_ptr(m, lane / 4);
        std::memcpy(&lo, row + 4 * (lane % 4), 2);
        std::memcpy(&hi, row + 4 * (lane % 4) + 2, 2);
      } else {
        std::memcpy(&lo, row_ptr(m, 2 * (lane % 4)) + 2 * (lane / 4), 2);
        std::memcpy(&hi, row_ptr(m, 2 * (lane % 4) + 1) + 2 * (lane / 4), 2);
      }
      r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  });
}

// PTX ISA 9.0 §9.7.9.6 "Data Movement and Conversion Instructions: shfl.sync": with
// b = source lane or offset, c = (segment mask << 8) | clamp,
//   maxLane = (lane & segmask) | (clamp & ~segmask), minLane = lane & segmask;
//   up: j = lane - b, ok = j >= maxLane;  down: j = lane + b, ok = j <= maxLane;
//   bfly: j = lane ^ b, ok = j <= maxLane; idx: j = minLane | (b & ~segmask), ok = j <= maxLane;
// the lane reads a from lane j when ok, else keeps its own a.
uint32_t shfl(ShflMode mode, uint32_t a, uint32_t b, uint32_t c) {
  detail::bump(detail::s_shfl);
  uint32_t out = 0;
  detail::warp_exchange(detail::kOpShfl, &a, sizeof a, __builtin_return_address(0),
                        [&](const detail::Slot* slots, int lane) {
    const int bval = int(b & 31), clamp = int(c & 31), segmask = int((c >> 8) & 31);
    const int max_lane = (lane & segmask) | (clamp & ~segmask), min_lane = lane & segmask;
    int j = lane;
    bool ok = false;
    switch (mode) {
      case ShflMode::kUp: j = lane - bval; ok = j >= max_lane; break;
      case ShflMode::kDown: j = lane + bval; ok = j <= max_lane; break;
      case ShflMode::kBfly: j = lane ^ bval; ok = j <= max_lane; break;
      case ShflMode::kIdx: j = min_lane | (bval & ~segmask); ok = j <= max_lane; break;
    }
    if (!ok) j = lane;
    std::memcpy(&out, slots[j].bytes, sizeof out);
  });
  return out;
}

// PTX ISA 9.0 §9.7.13.9 "vote.sync": .ballot.b32 sets bit L of the result iff lane L's
// predicate is true.
uint32_t ballot(bool p) {
  detail::bump(detail::s_ballot);
  uint32_t out = 0;
  const uint32_t mine = p ? 1u : 0u;
  detail::warp_exchange(detail::kOpBallot, &mine, sizeof mine, __builtin_return_address(0),
                        [&](const detail::Slot* slots, int) {
    for (int l = 0; l < 32; ++l) {
      uint32_t v;
      std::memcpy(&v, slots[l].bytes, sizeof v);
      out |= (v ? 1u : 0u) << l;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------- cp.async
//
// PTX ISA 9.0 §9.7.9.25.3 "Non-bulk copy": cp.async copies cp-size bytes, reading src-size
// of them from src and filling the rest with zeros; commit_group closes the thread's group
// of uncommitted copies; wait_group N waits until at most the N most recent groups are
// pending. The writes are visible to the executing thread only after the wait, so the
// emulator performs them there (and the race checker counts them as happening anywhere from
// the cp.async to that wait).

void cp_async(void* dst, const void* src, int cp_size, int src_size) {
  ThreadImpl& t = detail::me();
  if (cp_size != 4 && cp_size != 8 && cp_size != 16)
    detail::fail("cp.async: cp-size must be 4, 8 or 16");
  if (src_size < 0 || src_size > cp_size)
    detail::fail("cp.async: src-size " + std::to_string(src_size) + " exceeds cp-size " +
                 std::to_string(cp_size));
  if (reinterpret_cast<uintptr_t>(dst) % unsigned(cp_size) ||
      (src_size > 0 && reinterpret_cast<uintptr_t>(src) % unsigned(cp_size))) {
    std::ostringstream os;
    os << "cp.async of " << cp_size << " bytes from " << src << " to " << dst
       << ": both addresses must be " << cp_size << "-byte aligned";
    detail::fail(os.str());
  }
  detail::bump(detail::s_cp_async);
  if (src_size < cp_size) detail::bump(detail::s_cp_async_zero_filled);
  const void* pc = __builtin_return_address(0);
  // The hardware may move the bytes at any time between here and the wait that retires
  // them: the race checker sees the accesses at both ends.
  detail::race_access(src, size_t(src_size), false, pc);
  detail::race_access(dst, size_t(cp_size), true, pc);
  detail::note_cp_async(t, dst, src, cp_size, src_size);
  t.uncommitted.push_back({dst, src, cp_size, src_size, pc});
}

void cp_async_commit() {
  ThreadImpl& t = detail::me();
  t.groups.push_back(std::move(t.uncommitted));
  t.uncommitted.clear();
  const uint64_t pending = t.groups.size();
  uint64_t seen = detail::s_max_groups.load(std::memory_order_relaxed);
  while (pending > seen &&
         !detail::s_max_groups.compare_exchange_weak(seen, pending, std::memory_order_relaxed)) {
  }
}

void cp_async_wait(int n) {
  ThreadImpl& t = detail::me();
  while (t.groups.size() > size_t(std::max(n, 0))) {
    for (const detail::PendingCopy& c : t.groups.front()) {
      if (c.src_size > 0) std::memcpy(c.dst, c.src, size_t(c.src_size));
      if (c.src_size < c.cp_size)
        std::memset(static_cast<unsigned char*>(c.dst) + c.src_size, 0,
                    size_t(c.cp_size - c.src_size));
      detail::race_access(c.src, size_t(c.src_size), false, c.pc);
      detail::race_access(c.dst, size_t(c.cp_size), true, c.pc);
    }
    t.groups.erase(t.groups.begin());
  }
}

// ---------------------------------------------------------------------------- Hopper
//
// The sm_90a asynchronous machinery (cuda/emu/hopper_emu.h). PTX ISA sections are cited by
// name. What is modelled and what is not: README.md, "Hopper".

namespace detail {
namespace {

// The shared-window address of a byte of dynamic shared memory.
uint32_t smem_offset_of(ThreadImpl& t, const void* p, size_t bytes, const char* what) {
  const BlockState& b = *t.block;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), lo = reinterpret_cast<uintptr_t>(b.dynamic_smem);
  if (a < lo || a + bytes > lo + b.dynamic_smem_bytes) {
    std::ostringstream os;
    os << what << ": address " << p << " (" << bytes
       << " bytes) is not in the block's dynamic shared memory (the emulator gives shared-window "
          "addresses to dynamic shared memory only)";
    fail(os.str());
  }
  return uint32_t(a - lo);
}

// The swizzle patterns of wgmma's canonical layouts and of TMA (PTX ISA "Shared Memory
// Matrix Layout" / "Tensor-map" swizzle modes): the 16-byte chunk index inside a
// 128-byte line (address bits 4..6) is XORed with the line's index (bits 7..9), of which
// 128B swizzle uses three bits, 64B two and 32B one. A function of the address, so TMA
// writes and wgmma reads agree whatever tile they cut from a swizzle atom.
uint32_t swizzle_address(uint32_t address, int span_bytes) {
  const uint32_t mask = span_bytes == 128 ? 7u : span_bytes == 64 ? 3u : span_bytes == 32 ? 1u : 0u;
  return address ^ (((address >> 7) & mask) << 4);
}

// ---- mbarrier ----

BlockState::Mbar& mbar_locked(ThreadImpl& t, const void* bar, const char* what) {
  BlockState& b = *t.block;
  if (reinterpret_cast<uintptr_t>(bar) % 8 != 0)
    fail_locked(b, describe_thread(t.tid) + ": " + what + " on an address that is not 8-byte aligned");
  auto it = b.mbars.find(bar);
  if (it == b.mbars.end())
    fail_locked(b, describe_thread(t.tid) + ": " + what + " on " + describe_address(bar) +
                       ", which is not an initialized mbarrier (mbarrier.init first, and "
                       "__syncthreads before other threads use it)");
  return it->second;
}

// "Phase completion": when the pending arrival count and the tx-count are both zero, the
// phase completes: the barrier moves to the next phase (its parity flips), the pending count
// is reloaded with the expected count, and the waiters of the completed phase are released.
void mbar_maybe_complete_locked(BlockState& b, BlockState::Mbar& m) {
  if (m.pending != 0 || m.tx != 0) return;
  ++m.phases;
  m.pending = m.expected;
  b.blocked -= m.waiters;
  m.waiters = 0;
  b.cv.notify_all();
}

constexpr int64_t kMaxTx = (int64_t(1) << 20) - 1;  // tx-count range: +-(2^20 - 1)

void mbar_add_tx_locked(ThreadImpl& t, BlockState::Mbar& m, int64_t delta, const char* what) {
  m.tx += delta;
  if (m.tx > kMaxTx || m.tx < -kMaxTx) {
    std::ostringstream os;
    os << describe_thread(t.tid) << ": " << what << ": the mbarrier's tx-count " << m.tx
       << " leaves the range +-(2^20 - 1) of the PTX ISA";
    fail_locked(*t.block, os.str());
  }
}

// The complete_tx of a TMA comes through the async proxy, which sees the mbarrier.init (a
// generic-proxy write) only once the initialising thread has made it visible with
// fence.mbarrier_init, and the issuing thread is ordered after that fence: the same thread,
// or one that passed a __syncthreads after it (PTX ISA "membar / fence": fence.mbarrier_init;
// "mbarrier.init"). Checked by the race checker, as the other async-proxy orderings.
void check_init_fenced_locked(ThreadImpl& t, const BlockState::Mbar& m, const void* bar,
                              const void* pc) {
  std::string why;
  if (!m.init_fenced)
    why = "whose initialising thread (" + describe_thread(m.init_tid, false) +
          ") has executed no fence.mbarrier_init (fence_barrier_init) since its mbarrier.init";
  else if (t.tid != m.init_tid && t.block_epoch <= m.fence_epoch)
    why = "with no __syncthreads between the initialising thread's fence.mbarrier_init (" +
          describe_thread(m.init_tid, false) + ") and this thread";
  if (!why.empty())
    fail_locked(*t.block, "racecheck: async-proxy hazard: " + describe_thread(t.tid) +
                              ": the cp.async.bulk.tensor at " + describe_pc(pc) +
                              " completes its transactions on " +
                              describe_address(bar) + ", " + why +
                              ": the async proxy may not see the initialised mbarrier");
}

// A blocking wait until `done(m)`, with the deadlock check of every barrier.
template <typename Done>
void mbar_wait_locked(ThreadImpl& t, std::unique_lock<std::mutex>& lk, BlockState::Mbar& m,
                      Done done) {
  BlockState& b = *t.block;
  if (done(m)) return;
  ++m.waiters;
  ++b.blocked;
  check_deadlock_locked(b);
  wait_until(b.cv, lk, [&] { return done(m) || b.aborted; });
  if (!done(m)) throw Abort{};
}

// Consecutive unsuccessful test_waits of a thread: a kernel spinning on a phase that no
// thread will complete would otherwise spin forever (fibers are not preempted).
__thread uint64_t t_failed_tests = 0;
constexpr uint64_t kMaxFailedTests = 10000000;

void after_failed_test() {
  if (++t_failed_tests == kMaxFailedTests)
    fail("mbarrier.test_wait failed 10^7 times in a row: the phase it waits for never completes");
#if FMHA_EMU_FIBERS
  fiber_yield();
#else
  std::this_thread::yield();
#endif
}

void mbar_observed(const void* bar, uint64_t completed) {
  t_failed_tests = 0;
  if (g_race_checker) g_race_checker->observed(bar, completed);
}

// ---- warpgroup collectives ----

// The 128 threads of the caller's warpgroup meet (.sync.aligned); the last to arrive runs
// `last()` with the block's lock held while the others wait, then all proceed.
template <typename Fn>
void warpgroup_meet(ThreadImpl& t, int op, const void* pc, Fn&& last) {
  BlockState& b = *t.block;
  std::unique_lock<std::mutex> lk(b.m);
  if (b.aborted) throw Abort{};
  WarpState& g = b.wgroups[size_t(t.tid / 128)];
  if (g.live != 128) {
    std::ostringstream os;
    os << describe_thread(t.tid) << ": " << op_name(op) << " at " << where(nullptr, 0, pc)
       << " needs all 128 threads of the warpgroup (warps " << 4 * (t.tid / 128) << ".."
       << 4 * (t.tid / 128) + 3 << "), but only " << g.live
       << (g.size < 128 ? " exist" : " have not exited");
    fail_locked(b, os.str());
  }
  if (g.arrived == 0) {
    g.op = op;
    g.pc = pc;
  } else if (g.op != op) {
    std::ostringstream os;
    os << "divergent warpgroup: " << describe_thread(t.tid) << " is at " << op_name(op) << " "
       << where(nullptr, 0, pc) << " while " << g.arrived << " threads of its warpgroup are at "
       << op_name(g.op) << " " << where(nullptr, 0, g.pc);
    fail_locked(b, os.str());
  }
  if (++g.arrived == g.live) {
    last(lk);
    b.blocked -= g.arrived - 1;
    g.arrived = 0;
    ++g.generation;
    b.cv.notify_all();
  } else {
    const uint64_t gen = g.generation;
    ++b.blocked;
    check_deadlock_locked(b);
    wait_until(b.cv, lk, [&] { return g.generation != gen || b.aborted; });
    if (g.generation == gen) throw Abort{};
  }
}

// ---- wgmma ----

constexpr uint32_t kAccPoison = 0x7FC0BAD5u;  // a quiet NaN: "accumulator in flight"

bool is_8bit(WgmmaType ty) { return ty == WgmmaType::kE4M3 || ty == WgmmaType::kE5M2; }

// The exact value of an element (all of these widen to float exactly). e4m3: 1 sign, 4
// exponent (bias 7), 3 mantissa bits, no infinities, S.1111.111 is NaN; e5m2: the upper
// byte of an f16 (PTX ISA "Alternate Floating-Point Data Formats").
float element_value(WgmmaType ty, uint16_t bits) {
  switch (ty) {
    case WgmmaType::kF16: return f16_bits_to_f32(bits);
    case WgmmaType::kBF16: return bf16_bits_to_f32(bits);
    case WgmmaType::kE5M2: return f16_bits_to_f32(uint16_t(bits << 8));
    case WgmmaType::kE4M3: {
      const int sign = bits >> 7 & 1, e = bits >> 3 & 15, m = bits & 7;
      float v;
      if (e == 15 && m == 7) v = NAN;
      else if (e == 0) v = std::ldexp(float(m), -9);
      else v = std::ldexp(float(8 + m), e - 10);
      return sign ? -v : v;
    }
  }
  return NAN;
}

struct Desc {
  uint32_t start, lbo, sbo;
  int base_offset, span;  // span: swizzle bytes (0 = none)
};

// PTX ISA "Matrix Descriptor Format": bits 0-13 start address >> 4, 16-29 leading-dimension
// byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 49-51 matrix base offset,
// 62-63 swizzle mode (0 none, 1 128B, 2 64B, 3 32B).
Desc decode_desc(uint64_t d) {
  static const int spans[4] = {0, 128, 64, 32};
  return {uint32_t(d & 0x3FFF) << 4, uint32_t(d >> 16 & 0x3FFF) << 4,
          uint32_t(d >> 32 & 0x3FFF) << 4, int(d >> 49 & 7), spans[d >> 62 & 3]};
}

// The shared-window address of element (mn, k) of an operand (mn: the row of A or column of
// B; k along K) in the canonical layouts of PTX ISA "Shared Memory Matrix Layout", for a
// descriptor `d` and elements of `eb` bytes (T = 16 / eb per 16-byte chunk). Core matrices
// are 8 x 16 bytes.
//  K-major (the default; transpose = 0), no swizzle: the 8 rows of a core matrix are 16
//    bytes apart; core matrices adjacent in K are LBO apart, in M/N SBO apart.
//  K-major, swizzle S bytes: rows S bytes apart (K contiguous inside a row), groups of 8
//    rows SBO apart; LBO is not used (one instruction's K is 32 bytes, within one row).
//  M/N-major (transpose = 1), no swizzle: a core matrix holds 8 K-rows of 16 bytes of M/N;
//    core matrices adjacent in M/N are SBO apart, in K LBO apart.
//  M/N-major, swizzle S bytes: S bytes of M/N contiguous per K-row, K-rows S bytes apart,
//    groups of 8 K-rows SBO apart, S-byte M/N blocks LBO apart.
// Then the swizzle pattern is applied to the address.
uint32_t operand_address(const Desc& d, bool mn_major, int eb, int mn, int k) {
  const int T = 16 / eb;
  uint32_t off;
  if (!mn_major) {
    if (d.span == 0)
      off = uint32_t(mn % 8) * 16 + uint32_t(mn / 8) * d.sbo + uint32_t(k % T) * eb +
            uint32_t(k / T) * d.lbo;
    else
      off = uint32_t(mn % 8) * uint32_t(d.span) + uint32_t(mn / 8) * d.sbo + uint32_t(k * eb);
  } else {
    if (d.span == 0)
      off = uint32_t(mn % T) * eb + uint32_t(mn / T) * d.sbo + uint32_t(k % 8) * 16 +
            uint32_t(k / 8) * d.lbo;
    else {
      const int row = d.span / eb;  // elements of M/N per K-row of the swizzle atom
      off = uint32_t(mn % row) * eb + uint32_t(mn / row) * d.lbo +
            uint32_t(k % 8) * uint32_t(d.span) + uint32_t(k / 8) * d.sbo;
    }
  }
  return swizzle_address(d.start + off, d.span);
}

// The 16-byte chunks (shared-window address >> 4) an operand of rows x K elements reads.
std::vector<uint32_t> operand_chunks(const Desc& d, bool mn_major, int eb, int rows, int K) {
  std::vector<uint32_t> chunks;
  for (int mn = 0; mn < rows; ++mn)
    for (int k = 0; k < K; ++k) chunks.push_back(operand_address(d, mn_major, eb, mn, k) >> 4);
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  return chunks;
}

// The shared-memory wavefronts of one operand's read (runtime.h, KernelTraffic), added to
// `tr`. The canonical layouts of PTX ISA "Shared Memory Matrix Layout" are built from core
// matrices of 8 rows x 16 bytes (K-major: 8 rows of M/N, 16 bytes of K each; M/N-major: 8
// K-rows of 16 bytes of M/N), and each swizzle mode places a core matrix's eight rows in
// eight different 16-byte bank groups -- the reason the modes exist (CuTe's sm_90 GMMA
// layout atoms are the same: 8 rows of the span, Swizzle<B,4,3>, the XOR of address bits 4..
// with bits 7..). The ISA does not say how the tensor cores fetch, so the model reads one
// core matrix per phase, at its addresses after the swizzle; a layout whose core-matrix
// rows share banks is counted as conflicting (core_matrix_wavefronts).
void count_operand_reads(Traffic& tr, const Desc& d, bool mn_major, int eb, int rows, int K) {
  const int T = 16 / eb;  // elements per 16-byte row of a core matrix
  // K-major: groups of 8 M/N rows x K chunks; M/N-major: groups of 8 K-rows x M/N chunks.
  const int lines = mn_major ? K : rows, chunks = mn_major ? rows / T : K / T;
  for (int l0 = 0; l0 < lines; l0 += 8)
    for (int c = 0; c < chunks; ++c) {
      uint32_t row_address[8];
      for (int r = 0; r < 8; ++r)
        row_address[r] = mn_major ? operand_address(d, true, eb, c * T, l0 + r)
                                  : operand_address(d, false, eb, l0 + r, c * T);
      const auto wf = core_matrix_wavefronts(row_address);
      tr.wgmma_wavefronts += wf.first;
      tr.wgmma_ideal += wf.second;
    }
}

void check_operand(ThreadImpl& t, const Desc& d, bool mn_major, int eb, int rows, int K,
                   const char* which) {
  std::ostringstream os;
  if (d.base_offset != 0)
    os << "the matrix base offset (descriptor bits 49-51) is " << d.base_offset
       << "; the emulator models only 0 (swizzle atoms aligned to their repeat)";
  else if (d.span == 0 && !mn_major && (d.lbo == 0 || d.sbo == 0))
    os << "a no-swizzle K-major operand needs nonzero leading and stride byte offsets";
  const BlockState& b = *t.block;
  for (int mn = 0; os.str().empty() && mn < rows; ++mn)
    for (int k = 0; k < K; ++k) {
      const uint32_t a = operand_address(d, mn_major, eb, mn, k);
      if (size_t(a) + size_t(eb) > b.dynamic_smem_bytes) {
        os << "element (" << mn << ", " << k << ") is at shared address " << a
           << ", past the block's " << b.dynamic_smem_bytes << " bytes of dynamic shared memory";
        break;
      }
    }
  if (!os.str().empty()) fail(std::string("wgmma.mma_async operand ") + which + ": " + os.str());
}

// Accumulator fragment of a warpgroup (PTX ISA "Register Fragments and Shared Memory Matrix
// Layouts", the figure for the m64nNk16/k32 accumulator D): warp w of the warpgroup holds
// rows 16w..16w+15; in each 8-column block j, register 4j+i of lane L holds row
// 16w + L/4 + 8*(i/2), column 8j + 2*(L%4) + i%2 -- the mma.m16n8 C layout, repeated.
void acc_position(int tid_in_group, int reg, int* row, int* col) {
  const int w = tid_in_group / 32, lane = tid_in_group % 32, j = reg / 4, i = reg % 4;
  *row = 16 * w + lane / 4 + 8 * (i / 2);
  *col = 8 * j + 2 * (lane % 4) + i % 2;
}

// A from registers (PTX ISA, the figure for the m64nNk16/k32 register fragment of A): warp w
// holds rows 16w..16w+15 as the mma.m16n8k16 A fragment: register r of lane L holds, for
// 16-bit types, row L/4 + 8*(r%2), columns 2*(L%4) + 8*(r/2) + {0,1} (the lower column in
// the low half); for 8-bit types, row L/4 + 8*(r%2), columns 4*(L%4) + 16*(r/2) + {0..3}
// (the lowest in the lowest byte).
struct AOwner {
  int tid, reg, shift, bits;
};
AOwner a_owner(bool eight_bit, int row, int k) {
  const int w = row / 16, r = row % 16;
  if (!eight_bit)
    return {32 * w + (r % 8) * 4 + (k % 8) / 2, r / 8 + 2 * (k / 8), 16 * (k % 2), 16};
  return {32 * w + (r % 8) * 4 + (k % 16) / 4, r / 8 + 2 * (k / 16), 8 * (k % 4), 8};
}

bool targets(const std::vector<WgmmaOp>& ops, const float* d) {
  for (const WgmmaOp& o : ops)
    if (o.args.d == d) return true;
  return false;
}

bool pending_on(const ThreadImpl& t, const float* d) {
  if (targets(t.wgmma_uncommitted, d)) return true;
  for (const auto& g : t.wgmma_groups)
    if (targets(g, d)) return true;
  return false;
}

std::string args_mismatch(const WgmmaArgs& x, const WgmmaArgs& y) {
  if (x.n != y.n) return "N";
  if (x.type_a != y.type_a || x.type_b != y.type_b) return "the types";
  if ((x.a_regs == nullptr) != (y.a_regs == nullptr)) return "the source of A";
  if (!x.a_regs && x.a_desc != y.a_desc) return "the A descriptor";
  if (x.b_desc != y.b_desc) return "the B descriptor";
  if (x.scale_d != y.scale_d || x.scale_a != y.scale_a || x.scale_b != y.scale_b)
    return "the scale operands";
  if (x.trans_a != y.trans_a || x.trans_b != y.trans_b) return "the transpose operands";
  return "";
}

// Executes op number `index` of the oldest committed group of every thread of the
// warpgroup `ts` (the same instruction: .sync.aligned), reading shared memory as it is now.
// Called with the block's lock held by the last thread to reach wgmma.wait_group.
void execute_wgmma(BlockState& b, ThreadImpl* const* ts, size_t index) {
  const WgmmaOp& op0 = ts[0]->wgmma_groups.front()[index];
  const WgmmaArgs& a = op0.args;
  for (int i = 1; i < 128; ++i) {
    const std::string what = args_mismatch(a, ts[i]->wgmma_groups.front()[index].args);
    if (!what.empty())
      fail_locked(b, describe_thread(ts[i]->tid) + ": wgmma.mma_async number " +
                         std::to_string(index) + " of its group differs in " + what +
                         " from that of " + describe_thread(ts[0]->tid, false) +
                         " (.sync.aligned: the warpgroup executes the same instruction)");
  }
  const bool eight = is_8bit(a.type_a);
  const int K = eight ? 32 : 16, eb = eight ? 1 : 2, N = a.n;
  auto read_elem = [&](WgmmaType ty, uint32_t address) {
    uint16_t bits = 0;
    std::memcpy(&bits, b.dynamic_smem + address, size_t(eb));
    return double(element_value(ty, bits));
  };
  std::vector<double> A(size_t(64 * K)), B(size_t(K * N));
  if (a.a_regs) {
    for (int row = 0; row < 64; ++row)
      for (int k = 0; k < K; ++k) {
        const AOwner o = a_owner(eight, row, k);
        const uint32_t reg = ts[o.tid]->wgmma_groups.front()[index].a_regs[o.reg];
        const uint16_t bits = uint16_t((reg >> o.shift) & ((1u << o.bits) - 1u));
        A[size_t(row * K + k)] = double(element_value(a.type_a, bits));
      }
  } else {
    const Desc d = decode_desc(a.a_desc);
    for (int row = 0; row < 64; ++row)
      for (int k = 0; k < K; ++k)
        A[size_t(row * K + k)] = read_elem(a.type_a, operand_address(d, a.trans_a, eb, row, k));
  }
  const Desc db = decode_desc(a.b_desc);
  ++b.traffic.wgmma_requests;
  if (!a.a_regs) count_operand_reads(b.traffic, decode_desc(a.a_desc), a.trans_a, eb, 64, K);
  count_operand_reads(b.traffic, db, a.trans_b, eb, N, K);
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n)
      B[size_t(k * N + n)] = read_elem(a.type_b, operand_address(db, a.trans_b, eb, n, k));
  // The race checker sees the operand reads again here, at the end of the window in which
  // the hardware may read them (as cp.async's copies are seen at both ends).
  if (g_race_checker) {
    // Attributed to the warpgroup's first thread, as at the issue (whoever arrived last).
    const ThreadState* self = g_thread;
    g_thread = &ts[0]->pub;
    const void* pc = op0.pc;
    if (!a.a_regs)
      for (uint32_t c : operand_chunks(decode_desc(a.a_desc), a.trans_a, eb, 64, K))
        race_access(b.dynamic_smem + size_t(c) * 16, 16, false, pc);
    for (uint32_t c : operand_chunks(db, a.trans_b, eb, N, K))
      race_access(b.dynamic_smem + size_t(c) * 16, 16, false, pc);
    g_thread = self;
  }
  const double sa = a.scale_a, sb = a.scale_b;
  for (int i = 0; i < 128; ++i) {
    ThreadImpl& t = *ts[i];
    const WgmmaOp& op = t.wgmma_groups.front()[index];
    if (op.args.a_regs && std::memcmp(op.args.a_regs, op.a_regs, sizeof op.a_regs) != 0)
      fail_locked(b, describe_thread(t.tid) + ": the A-fragment registers of a wgmma.mma_async "
                                              "were modified before the wgmma.wait_group that "
                                              "retires it");
    // The accumulator's input: the snapshot taken at the issue, or the output of the
    // earlier pending wgmma on the same registers.
    std::vector<float> in(op.c, op.c + N / 2);
    if (op.chained) {
      auto it = std::find_if(t.wgmma_carry.begin(), t.wgmma_carry.end(),
                             [&](const auto& e) { return e.first == op.args.d; });
      if (it == t.wgmma_carry.end()) fail_locked(b, "emulator bug: a chained wgmma has no input");
      in = std::move(it->second);
      t.wgmma_carry.erase(it);
    }
    std::vector<float> out(size_t(N / 2));
    for (int r = 0; r < N / 2; ++r) {
      int row, col;
      acc_position(i, r, &row, &col);
      // Products of f16/bf16/fp8 values are exact in double, and so (to within 2^-53)
      // is their sum: rounded once to float, as mma.sync is modelled (cuda_emu.h).
      double s = a.scale_d ? double(in[size_t(r)]) : 0.0;
      for (int k = 0; k < K; ++k) s += sa * A[size_t(row * K + k)] * sb * B[size_t(k * N + col)];
      out[size_t(r)] = float(s);
    }
    // Does a later pending wgmma of this thread accumulate into the same registers?
    bool later = targets(t.wgmma_uncommitted, op.args.d);
    const auto& first = t.wgmma_groups.front();
    for (size_t j = index + 1; !later && j < first.size(); ++j) later = first[j].args.d == op.args.d;
    for (size_t g = 1; !later && g < t.wgmma_groups.size(); ++g)
      later = targets(t.wgmma_groups[g], op.args.d);
    if (later) {
      t.wgmma_carry.emplace_back(op.args.d, std::move(out));
      continue;
    }
    for (int r = 0; r < N / 2; ++r)
      if (f32_bits(op.args.d[r]) != kAccPoison)
        fail_locked(b, describe_thread(t.tid) +
                           ": accumulator registers of a wgmma.mma_async in flight were "
                           "written before the wgmma.wait_group that retires it");
    std::memcpy(op.args.d, out.data(), sizeof(float) * size_t(N / 2));
  }
}

// Does a pending wgmma of the block read a chunk in [chunk_lo, chunk_hi)? (lock held)
bool overlaps_pending_wgmma(BlockState& b, uint32_t chunk_lo, uint32_t chunk_hi) {
  for (const BlockState::InflightWgmma& w : b.wgmma_inflight)
    for (uint32_t c : w.chunks)
      if (c >= chunk_lo && c < chunk_hi) return true;
  return false;
}

// ---- TMA ----

const TmaDescriptor& tensor_map_of(const void* p) {
  const auto* m = static_cast<const TmaDescriptor*>(p);
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0 || m->magic != kTmaMagic)
    fail("cp.async.bulk.tensor: the tensor map is not 64-byte aligned or was not made by "
         "encode_tensor_map");
  return *m;
}

// Walks the box of a tile-mode copy (PTX ISA "Tensor Access Modes": tile mode; the tensor
// map's traversal strides): element j_i of dimension i is at coordinate
// coords[i] + j_i * element_strides[i], j_i < ceil(box[i] / element_strides[i]); in shared
// memory the elements are dense, dimension 0 fastest, then swizzled. fn(global_ptr or null
// when out of bounds, shared-window address).
template <typename Fn>
uint64_t for_each_box_element(const TmaDescriptor& m, const int32_t* coords, uint32_t smem_base,
                              Fn&& fn) {
  int64_t count[5] = {1, 1, 1, 1, 1};
  uint64_t total = 1;
  for (int i = 0; i < m.rank; ++i) {
    count[i] = (m.box[i] + m.element_strides[i] - 1) / m.element_strides[i];
    total *= uint64_t(count[i]);
  }
  const int span = m.swizzle == 1 ? 32 : m.swizzle == 2 ? 64 : m.swizzle == 3 ? 128 : 0;
  int64_t j[5] = {0, 0, 0, 0, 0};
  for (uint64_t e = 0; e < total; ++e) {
    uint64_t rem = e;
    bool in = true;
    int64_t offset = 0;  // bytes from the global base, meaningful when in bounds
    for (int i = 0; i < m.rank; ++i) {
      j[i] = int64_t(rem % uint64_t(count[i]));
      rem /= uint64_t(count[i]);
      const int64_t c = int64_t(coords[i]) + j[i] * int64_t(m.element_strides[i]);
      if (c < 0 || c >= int64_t(m.dims[i])) in = false;
      offset += c * int64_t(i == 0 ? m.element_bytes : m.strides[i - 1]);
    }
    const unsigned char* g = in ? static_cast<const unsigned char*>(m.global) + offset : nullptr;
    fn(g, swizzle_address(smem_base + uint32_t(e * m.element_bytes), span));
  }
  return total * m.element_bytes;
}

// The shared-memory wavefronts of a TMA tile copy (runtime.h, KernelTraffic), added to the
// block's counters (lock held): the box moves in its dense order (PTX ISA "Tensor Access
// Modes", tile mode: dimension 0 fastest), 128 bytes per phase, each byte at its address
// after the tensor map's swizzle ("Tensor-map" swizzle modes). The swizzle permutes 16-byte
// chunks within a 128-byte line and the shared-memory end of a copy is 128-byte aligned, so
// each phase fills one line: conflict-free by construction in this model, counted so that a
// change of either shows.
void count_tma_locked(BlockState& b, uint32_t smem_base, uint64_t bytes, int span) {
  std::vector<uintptr_t> words;
  ++b.traffic.tma_requests;
  for (uint64_t p0 = 0; p0 < bytes; p0 += 128) {
    words.clear();
    for (uint64_t c = p0; c < std::min(bytes, p0 + 128); c += 16)
      add_words(words, swizzle_address(smem_base + uint32_t(c), span), int(std::min<uint64_t>(16, bytes - c)));
    const auto wf = phase_wavefronts(words);
    b.traffic.tma_wavefronts += wf.first;
    b.traffic.tma_ideal += wf.second;
  }
}

uint64_t box_bytes(const TmaDescriptor& m) {
  uint64_t total = m.element_bytes;
  for (int i = 0; i < m.rank; ++i)
    total *= (m.box[i] + m.element_strides[i] - 1) / m.element_strides[i];
  return total;
}

}  // namespace

namespace {
void perform_bulk_stores(ThreadImpl& t, const std::vector<PendingBulkStore>& group) {
  for (const PendingBulkStore& s : group) {
    const TmaDescriptor& m = s.tensor_map;
    const uint32_t base = smem_offset_of(t, s.smem_src, box_bytes(m), "cp.async.bulk.tensor store");
    unsigned char* smem = t.block->dynamic_smem;
    for_each_box_element(m, s.coords, base, [&](const unsigned char* g, uint32_t a) {
      if (g) std::memcpy(const_cast<unsigned char*>(g), smem + a, m.element_bytes);
    });
  }
}
}  // namespace

void flush_bulk_stores(ThreadImpl& t) {
  for (const auto& group : t.bulk_groups) perform_bulk_stores(t, group);
  t.bulk_groups.clear();
  perform_bulk_stores(t, t.bulk_uncommitted);
  t.bulk_uncommitted.clear();
}

}  // namespace detail

uint32_t smem_address(const void* p) {
  return detail::smem_offset_of(detail::me(), p, 0, "cvta.to.shared");
}

void* smem_pointer(uint32_t address) {
  ThreadImpl& t = detail::me();
  if (address > t.block->dynamic_smem_bytes)
    detail::fail("shared-window address " + std::to_string(address) +
                 " is past the block's dynamic shared memory");
  return t.block->dynamic_smem + address;
}

// ---- mbarrier: PTX ISA "Parallel Synchronization and Communication Instructions:
// mbarrier" (its "Contents of the mbarrier object", "Phase Completion", "tx-count"). An
// mbarrier holds a phase, a pending arrival count, the expected arrival count (reloaded into
// the pending count at each phase completion) and a tx-count (transaction bytes announced by
// expect-tx and not yet completed by complete-tx). The emulator keeps this state beside the
// object, by address, for the running block.

void mbarrier_init(uint64_t* bar, uint32_t count) {
  ThreadImpl& t = detail::me();
  if (count < 1 || count > uint32_t(detail::kMaxTx))
    detail::fail("mbarrier.init: the count must be in [1, 2^20 - 1], not " + std::to_string(count));
  BlockState& b = *t.block;
  std::lock_guard<std::mutex> lk(b.m);
  if (reinterpret_cast<uintptr_t>(bar) % 8 != 0)
    detail::fail_locked(b, detail::describe_thread(t.tid) + ": mbarrier.init on an address that is not 8-byte aligned");
  auto it = b.mbars.find(bar);
  if (it != b.mbars.end() && it->second.waiters)
    detail::fail_locked(b, detail::describe_thread(t.tid) + ": mbarrier.init of an mbarrier that threads wait on");
  BlockState::Mbar m;
  m.expected = m.pending = count;
  m.init_tid = t.tid;
  b.mbars[bar] = m;
  std::memset(bar, 0, sizeof *bar);  // the object's bytes: opaque; the state is beside it
}

void mbarrier_inval(uint64_t* bar) {
  ThreadImpl& t = detail::me();
  std::lock_guard<std::mutex> lk(t.block->m);
  BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.inval");
  if (m.waiters) detail::fail_locked(*t.block, "mbarrier.inval of an mbarrier that threads wait on");
  t.block->mbars.erase(bar);
}

// mbarrier.arrive{.expect_tx}: the arrive-on operation decrements the pending count by
// `count`; arriving more often than the phase expects is undefined behaviour in the PTX
// ISA, an error here. Returns the phase the arrival belongs to (the state operand).
uint64_t mbarrier_arrive(uint64_t* bar, uint32_t count) {
  ThreadImpl& t = detail::me();
  BlockState& b = *t.block;
  std::lock_guard<std::mutex> lk(b.m);
  BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.arrive");
  if (count < 1 || count > m.pending) {
    std::ostringstream os;
    os << detail::describe_thread(t.tid) << ": mbarrier.arrive with count " << count << " on "
       << detail::describe_address(bar) << ", whose current phase (" << m.phases
       << ") expects only " << m.pending << " more arrivals (over-arrival)";
    detail::fail_locked(b, os.str());
  }
  const uint64_t state = m.phases;
  m.pending -= count;
  detail::mbar_maybe_complete_locked(b, m);
  return state;
}

// expect-tx increments the tx-count of the current phase (before the arrival, for
// mbarrier.arrive.expect_tx).
void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  ThreadImpl& t = detail::me();
  std::lock_guard<std::mutex> lk(t.block->m);
  BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.expect_tx");
  detail::mbar_add_tx_locked(t, m, int64_t(tx_bytes), "mbarrier.expect_tx");
}

uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t tx_bytes) {
  mbarrier_expect_tx(bar, tx_bytes);
  return mbarrier_arrive(bar, 1);
}

// complete-tx decrements the tx-count (what a TMA does as its bytes land).
void mbarrier_complete_tx(uint64_t* bar, uint32_t tx_bytes) {
  ThreadImpl& t = detail::me();
  BlockState& b = *t.block;
  std::lock_guard<std::mutex> lk(b.m);
  BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.complete_tx");
  detail::mbar_add_tx_locked(t, m, -int64_t(tx_bytes), "mbarrier.complete_tx");
  detail::mbar_maybe_complete_locked(b, m);
}

// test_wait / try_wait with a state: has the phase the state names completed?
// .parity variants: phaseParity names the current phase or the one just before it; the wait
// succeeds once the phase of that parity has completed, i.e. when the current phase's parity
// differs from it.
bool mbarrier_test_wait(uint64_t* bar, uint64_t state) {
  ThreadImpl& t = detail::me();
  bool done;
  uint64_t phases;
  {
    std::lock_guard<std::mutex> lk(t.block->m);
    BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.test_wait");
    done = m.phases > state;
    phases = m.phases;
  }
  if (done) detail::mbar_observed(bar, phases);
  else detail::after_failed_test();
  return done;
}

bool mbarrier_test_wait_parity(uint64_t* bar, uint32_t parity) {
  ThreadImpl& t = detail::me();
  bool done;
  uint64_t phases;
  {
    std::lock_guard<std::mutex> lk(t.block->m);
    BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.test_wait.parity");
    done = (m.phases & 1) != (parity & 1);
    phases = m.phases;
  }
  if (done) detail::mbar_observed(bar, phases);
  else detail::after_failed_test();
  return done;
}

bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  ThreadImpl& t = detail::me();
  uint64_t phases;
  {
    std::unique_lock<std::mutex> lk(t.block->m);
    BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.try_wait.parity");
    detail::mbar_wait_locked(t, lk, m, [&](const BlockState::Mbar& x) {
      return (x.phases & 1) != (parity & 1);
    });
    phases = m.phases;
  }
  detail::mbar_observed(bar, phases);
  return true;
}

bool mbarrier_try_wait(uint64_t* bar, uint64_t state) {
  ThreadImpl& t = detail::me();
  uint64_t phases;
  {
    std::unique_lock<std::mutex> lk(t.block->m);
    BlockState::Mbar& m = detail::mbar_locked(t, bar, "mbarrier.try_wait");
    detail::mbar_wait_locked(t, lk, m, [&](const BlockState::Mbar& x) { return x.phases > state; });
    phases = m.phases;
  }
  detail::mbar_observed(bar, phases);
  return true;
}

// ---- wgmma: PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
// Instructions" (wgmma.mma_async, wgmma.fence, wgmma.commit_group, wgmma.wait_group).
//
// Asynchrony as modelled here:
//  * wgmma.mma_async records the operation; the product is computed when the
//    wgmma.wait_group that retires its group runs -- from the shared memory as it is THEN,
//    so a kernel that overwrites an operand before the wait computes with the new bytes
//    (and the race checker sees the operand reads at both ends of that window).
//  * At the issue the accumulator registers are saved (as the input) and overwritten with a
//    NaN (0x7FC0BAD5): a kernel that reads them before the wait reads NaN; one that writes
//    them before the wait is reported at the wait; the wait stores the result.
//  * Chained wgmmas on the same accumulator registers (no wait between, as the ISA allows for
//    the same shape) take the previous one's output as their input.
//  * A wgmma.mma_async needs a wgmma.fence after the thread's last wgmma.wait_group (the ISA
//    asks for one before the first wgmma and whenever the registers it reads were accessed
//    since; a wait is followed by such accesses in every real kernel). Stricter than the
//    hardware for a kernel that waits and then issues without touching any register.
//  * The A-fragment registers must not change until the wait (checked there).

void wgmma_fence() { detail::me().wgmma_fenced = true; }

void wgmma_mma_async(const WgmmaArgs& a) {
  ThreadImpl& t = detail::me();
  const bool eight = detail::is_8bit(a.type_a);
  std::string bad;
  if (a.n < 8 || a.n > 256 || a.n % 8 != 0) bad = "N must be a multiple of 8 in [8, 256]";
  else if (eight != detail::is_8bit(a.type_b) || (!eight && a.type_a != a.type_b))
    bad = "A and B must both be f16, both bf16, or both e4m3/e5m2";
  else if (eight && (a.trans_a || a.trans_b))
    bad = "the transpose operands are for 16-bit types only (8-bit operands are K-major)";
  else if (a.a_regs && a.trans_a) bad = "imm-trans-a applies to A in shared memory only";
  else if ((a.scale_a != 1 && a.scale_a != -1) || (a.scale_b != 1 && a.scale_b != -1))
    bad = "imm-scale-a/b must be 1 or -1";
  else if (!t.wgmma_fenced)
    bad = "no wgmma.fence since this thread's last wgmma.wait_group (or the kernel's start): the "
          "PTX ISA requires one before a wgmma.mma_async whose registers were accessed";
  if (!bad.empty()) detail::fail("wgmma.mma_async: " + bad);
  const int K = eight ? 32 : 16, eb = eight ? 1 : 2;
  if (!a.a_regs)
    detail::check_operand(t, detail::decode_desc(a.a_desc), a.trans_a, eb, 64, K, "A");
  detail::check_operand(t, detail::decode_desc(a.b_desc), a.trans_b, eb, a.n, K, "B");

  detail::WgmmaOp op{};
  op.args = a;
  op.pc = __builtin_return_address(0);
  if (a.a_regs) std::memcpy(op.a_regs, a.a_regs, sizeof op.a_regs);
  op.chained = detail::pending_on(t, a.d);
  if (op.chained) {
    for (int r = 0; r < a.n / 2; ++r)
      if (f32_bits(a.d[r]) != detail::kAccPoison)
        detail::fail("wgmma.mma_async: its accumulator registers, the target of a wgmma still in "
                     "flight, were written since that wgmma was issued (wait with "
                     "wgmma.wait_group first)");
  } else {
    std::memcpy(op.c, a.d, sizeof(float) * size_t(a.n / 2));
  }
  for (int r = 0; r < a.n / 2; ++r) a.d[r] = f32_from_bits(detail::kAccPoison);
  op.seq = t.wgmma_issued++;
  if (t.tid % 128 == 0) {  // the warpgroup's operands, for TMA loads that would overwrite them
    std::vector<uint32_t> chunks =
        detail::operand_chunks(detail::decode_desc(a.b_desc), a.trans_b, eb, a.n, K);
    if (!a.a_regs) {
      const auto more = detail::operand_chunks(detail::decode_desc(a.a_desc), a.trans_a, eb, 64, K);
      chunks.insert(chunks.end(), more.begin(), more.end());
    }
    std::lock_guard<std::mutex> lk(t.block->m);
    t.block->wgmma_inflight.push_back({t.tid, op.seq, std::move(chunks)});
  }
  // The operand reads, as the race checker sees them at the issue: once per warpgroup.
  if (detail::g_race_checker && t.tid % 128 == 0) {
    unsigned char* smem = t.block->dynamic_smem;
    if (!a.a_regs)
      for (uint32_t c : detail::operand_chunks(detail::decode_desc(a.a_desc), a.trans_a, eb, 64, K))
        detail::g_race_checker->async_read(smem + size_t(c) * 16, 16, op.pc, "a wgmma.mma_async operand (A)");
    for (uint32_t c : detail::operand_chunks(detail::decode_desc(a.b_desc), a.trans_b, eb, a.n, K))
      detail::g_race_checker->async_read(smem + size_t(c) * 16, 16, op.pc, "a wgmma.mma_async operand (B)");
  }
  t.wgmma_uncommitted.push_back(op);
}

void wgmma_commit_group() {
  ThreadImpl& t = detail::me();
  t.wgmma_groups.push_back(std::move(t.wgmma_uncommitted));
  t.wgmma_uncommitted.clear();
}

// wgmma.wait_group N: waits until at most N of the thread's most recent wgmma-groups are
// pending (and all earlier ones complete). .sync.aligned: the warpgroup meets here, and the
// last thread to arrive performs the retired groups' products for all 128.
void wgmma_wait_group(int n) {
  ThreadImpl& t = detail::me();
  if (n < 0 || n > 7) detail::fail("wgmma.wait_group: N must be in [0, 7]");
  detail::warpgroup_meet(t, detail::kOpWgmmaWait, __builtin_return_address(0),
                         [&](std::unique_lock<std::mutex>&) {
    BlockState& b = *t.block;
    ThreadImpl* ts[128];
    const int base = t.tid / 128 * 128;
    for (int i = 0; i < 128; ++i) ts[i] = b.threads[size_t(base + i)];
    for (int i = 1; i < 128; ++i)
      if (ts[i]->wgmma_groups.size() != ts[0]->wgmma_groups.size())
        detail::fail_locked(b, detail::describe_thread(ts[i]->tid) + " has " +
                                   std::to_string(ts[i]->wgmma_groups.size()) +
                                   " wgmma groups pending, " + detail::describe_thread(ts[0]->tid, false) +
                                   " " + std::to_string(ts[0]->wgmma_groups.size()) +
                                   " (the warpgroup must issue the same wgmma instructions)");
    while (ts[0]->wgmma_groups.size() > size_t(n)) {
      const size_t ops = ts[0]->wgmma_groups.front().size();
      for (int i = 1; i < 128; ++i)
        if (ts[i]->wgmma_groups.front().size() != ops)
          detail::fail_locked(b, "the threads of a warpgroup committed wgmma groups of different sizes");
      for (size_t k = 0; k < ops; ++k) detail::execute_wgmma(b, ts, k);
      for (const detail::WgmmaOp& op : ts[0]->wgmma_groups.front()) {
        auto& in = b.wgmma_inflight;
        in.erase(std::remove_if(in.begin(), in.end(), [&](const BlockState::InflightWgmma& w) {
                   return w.tid == ts[0]->tid && w.seq == op.seq;
                 }), in.end());
      }
      for (int i = 0; i < 128; ++i) ts[i]->wgmma_groups.erase(ts[i]->wgmma_groups.begin());
    }
    for (int i = 0; i < 128; ++i) ts[i]->wgmma_fenced = false;
  });
}

// ---- TMA: PTX ISA "Data Movement and Conversion Instructions: cp.async.bulk.tensor"
// (tile mode), "Tensor-map", and cuTensorMapEncodeTiled's rules (CUDA Driver API, "Tensor
// Map Object Management"). The load is performed at the issue -- the bytes land, then
// complete_tx is performed on the mbarrier with the box's full size, out-of-bounds elements
// included (they are filled with zeros). A consumer that reads the tile without having
// waited for that phase is reported by the race checker (the async proxy's writes are
// visible only through the mbarrier); a TMA that overwrites an operand of a wgmma still in
// flight is an error.

void tma_encode(TmaDescriptor* out, TmaDtype dtype, int rank, const void* global,
                const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                const uint32_t* estrides, TmaSwizzle swizzle) {
  auto bad = [](const std::string& why) {
    throw std::invalid_argument("encode_tensor_map: " + why);
  };
  const int eb = dtype == TmaDtype::kU8 ? 1 : dtype == TmaDtype::kF32 ? 4 : 2;
  if (rank < 1 || rank > 5) bad("rank must be 1..5");
  if (reinterpret_cast<uintptr_t>(global) % 16 != 0) bad("the global address must be 16-byte aligned");
  TmaDescriptor m{};
  m.magic = kTmaMagic;
  m.element_bytes = uint8_t(eb);
  m.rank = uint8_t(rank);
  m.swizzle = uint8_t(swizzle);
  m.dtype = uint8_t(dtype);
  m.global = global;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 1 || dims[i] > (uint64_t(1) << 32)) bad("each dimension must be in [1, 2^32]");
    if (box[i] < 1 || box[i] > 256) bad("each box dimension must be in [1, 256]");
    if (estrides[i] < 1 || estrides[i] > 8) bad("each element stride must be in [1, 8]");
    m.dims[i] = dims[i];
    m.box[i] = box[i];
    m.element_strides[i] = estrides[i];
    if (i > 0) {
      if (strides[i - 1] % 16 != 0 || strides[i - 1] >= (uint64_t(1) << 40))
        bad("each global stride must be a multiple of 16 below 2^40 bytes");
      m.strides[i - 1] = strides[i - 1];
    }
  }
  const uint64_t inner = uint64_t(box[0]) * uint64_t(eb);
  if (inner % 16 != 0) bad("the box's inner dimension must be a multiple of 16 bytes");
  const int span = swizzle == TmaSwizzle::k32B ? 32 : swizzle == TmaSwizzle::k64B ? 64
                   : swizzle == TmaSwizzle::k128B ? 128 : 0;
  if (span && inner > uint64_t(span))
    bad("with a swizzle, the box's inner dimension must be at most the swizzle span (" +
        std::to_string(span) + " bytes), not " + std::to_string(inner));
  *out = m;
}

void tma_load(void* dst, const void* tensor_map, const int32_t* coords, uint64_t* bar) {
  ThreadImpl& t = detail::me();
  const TmaDescriptor& m = detail::tensor_map_of(tensor_map);
  if (reinterpret_cast<uintptr_t>(dst) % 128 != 0)
    detail::fail("cp.async.bulk.tensor: the shared-memory destination must be 128-byte aligned");
  const uint64_t bytes = detail::box_bytes(m);
  const uint32_t base = detail::smem_offset_of(t, dst, bytes, "cp.async.bulk.tensor");
  const void* pc = __builtin_return_address(0);
  BlockState& b = *t.block;
  std::lock_guard<std::mutex> lk(b.m);
  BlockState::Mbar& mb = detail::mbar_locked(t, bar, "cp.async.bulk.tensor (its mbarrier)");
  if (detail::g_race_checker) detail::check_init_fenced_locked(t, mb, bar, pc);
  // The chunks the tile covers: the swizzle permutes 16-byte chunks within 128-byte lines.
  std::vector<uint32_t> chunks;
  const int span = m.swizzle == 1 ? 32 : m.swizzle == 2 ? 64 : m.swizzle == 3 ? 128 : 0;
  for (uint64_t c = 0; c < (bytes + 15) / 16; ++c)
    chunks.push_back(detail::swizzle_address(base + uint32_t(c * 16), span) >> 4);
  std::sort(chunks.begin(), chunks.end());
  if (detail::overlaps_pending_wgmma(b, chunks.front(), chunks.back() + 1)) {
    for (uint32_t c : chunks)
      if (detail::overlaps_pending_wgmma(b, c, c + 1))
        detail::fail_locked(b, detail::describe_thread(t.tid) + ": cp.async.bulk.tensor writes " +
                                   detail::describe_address(b.dynamic_smem + size_t(c) * 16) +
                                   ", an operand of a wgmma.mma_async still in flight");
  }
  detail::count_tma_locked(b, base, bytes, span);
  unsigned char* smem = b.dynamic_smem;
  detail::for_each_box_element(m, coords, base, [&](const unsigned char* g, uint32_t a) {
    if (g) std::memcpy(smem + a, g, m.element_bytes);
    else std::memset(smem + a, 0, m.element_bytes);
  });
  if (detail::g_race_checker)
    for (uint32_t c : chunks)
      detail::g_race_checker->async_write(smem + size_t(c) * 16, 16, bar, mb.phases, pc);
  detail::mbar_add_tx_locked(t, mb, -int64_t(bytes), "cp.async.bulk.tensor complete_tx");
  detail::mbar_maybe_complete_locked(b, mb);
}

// The store reads shared memory at the wait (bulk wait_group.read) that retires its group,
// or at the thread's exit: overwriting the source before that is seen in the result.
void tma_store(const void* tensor_map, const int32_t* coords, const void* src) {
  ThreadImpl& t = detail::me();
  const TmaDescriptor& m = detail::tensor_map_of(tensor_map);
  if (reinterpret_cast<uintptr_t>(src) % 128 != 0)
    detail::fail("cp.async.bulk.tensor: the shared-memory source must be 128-byte aligned");
  const uint64_t bytes = detail::box_bytes(m);
  const uint32_t base = detail::smem_offset_of(t, src, bytes, "cp.async.bulk.tensor store");
  const void* pc = __builtin_return_address(0);
  const int span = m.swizzle == 1 ? 32 : m.swizzle == 2 ? 64 : m.swizzle == 3 ? 128 : 0;
  {
    std::lock_guard<std::mutex> lk(t.block->m);
    detail::count_tma_locked(*t.block, base, bytes, span);
  }
  if (detail::g_race_checker) {
    for (uint64_t c = 0; c < (bytes + 15) / 16; ++c)
      detail::g_race_checker->async_read(
          t.block->dynamic_smem + (detail::swizzle_address(base + uint32_t(c * 16), span) & ~15u),
          16, pc, "a cp.async.bulk.tensor store's source");
  }
  detail::PendingBulkStore s{m, {0, 0, 0, 0, 0}, src, pc};
  for (int i = 0; i < m.rank; ++i) s.coords[i] = coords[i];
  t.bulk_uncommitted.push_back(s);
}

void bulk_commit_group() {
  ThreadImpl& t = detail::me();
  t.bulk_groups.push_back(std::move(t.bulk_uncommitted));
  t.bulk_uncommitted.clear();
}

void bulk_wait_group_read(int n) {
  ThreadImpl& t = detail::me();
  while (t.bulk_groups.size() > size_t(std::max(n, 0))) {
    const std::vector<detail::PendingBulkStore> group = std::move(t.bulk_groups.front());
    t.bulk_groups.erase(t.bulk_groups.begin());
    detail::perform_bulk_stores(t, group);
  }
}

// ---- FP8 conversion (PTX ISA "cvt" with .rn.satfinite and the .e4m3x2/.e5m2x2 types;
// the formats: "Alternate Floating-Point Data Formats"). The nearest representable value,
// ties to the even code (the one whose mantissa's last bit is 0); beyond the largest finite
// value (or infinite): the largest finite value (.satfinite); NaN: 0x7F.

namespace detail {
namespace {
// The values of the positive finite codes 0..max_code, increasing with the code.
std::vector<double> fp8_values(bool e4m3) {
  std::vector<double> v;
  const int max_code = e4m3 ? 0x7E : 0x7B;
  for (int c = 0; c <= max_code; ++c)
    v.push_back(double(element_value(e4m3 ? WgmmaType::kE4M3 : WgmmaType::kE5M2, uint16_t(c))));
  return v;
}

uint8_t f32_to_fp8(bool e4m3, float x) {
  static const std::vector<double> k4 = fp8_values(true), k5 = fp8_values(false);
  const std::vector<double>& v = e4m3 ? k4 : k5;
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(double(x));
  if (a >= v.back()) return uint8_t(sign | (v.size() - 1));  // saturate (also infinity)
  const size_t hi = size_t(std::upper_bound(v.begin(), v.end(), a) - v.begin());  // v[hi] > a
  const size_t lo = hi - 1;                                                         // v[lo] <= a
  const double dlo = a - v[lo], dhi = v[hi] - a;
  const size_t code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return uint8_t(sign | code);
}
}  // namespace
}  // namespace detail

uint8_t f32_to_e4m3(float x) { return detail::f32_to_fp8(true, x); }
uint8_t f32_to_e5m2(float x) { return detail::f32_to_fp8(false, x); }

// ---- fence.proxy.async, fence.mbarrier_init, setmaxnreg, elect.sync ----

// fence.mbarrier_init: the calling thread's earlier mbarrier.init become visible to the
// async proxy (tma_load checks it, with the race checker).
void fence_mbarrier_init() {
  ThreadImpl& t = detail::me();
  std::lock_guard<std::mutex> lk(t.block->m);
  for (auto& entry : t.block->mbars) {
    BlockState::Mbar& m = entry.second;
    if (m.init_tid == t.tid && !m.init_fenced) {
      m.init_fenced = true;
      m.fence_epoch = t.block_epoch;
    }
  }
}

void fence_proxy_async() {
  detail::me();
  if (detail::g_race_checker) detail::g_race_checker->proxy_fence();
}

// setmaxnreg (PTX ISA "setmaxnreg"): the warpgroup's per-thread register maximum becomes
// `count` (a multiple of 8 in [24, 256]); .dec releases registers to the CTA's pool
// (count <= current), .inc takes them from it (count >= current), blocking until the pool
// has enough. The pool starts empty: the launch gave every register to the threads.
void setmaxnreg(bool inc, int count) {
  ThreadImpl& t = detail::me();
  if (count < 24 || count > 256 || count % 8 != 0)
    detail::fail("setmaxnreg: the register count must be a multiple of 8 in [24, 256], not " +
                 std::to_string(count));
  detail::warpgroup_meet(t, detail::kOpSetmaxnreg, __builtin_return_address(0),
                         [&](std::unique_lock<std::mutex>& lk) {
    BlockState& b = *t.block;
    const int g = t.tid / 128;
    int& cur = b.wg_regs[size_t(g)];
    if (inc ? count < cur : count > cur) {
      std::ostringstream os;
      os << detail::describe_thread(t.tid) << ": setmaxnreg." << (inc ? "inc" : "dec") << " "
         << count << " from the warpgroup's current " << cur << " registers per thread ("
         << (inc ? ".inc may not lower it" : ".dec may not raise it") << ")";
      detail::fail_locked(b, os.str());
    }
    if (!inc) {
      b.regs_pool += int64_t(cur - count) * 128;
      cur = count;
      b.blocked -= b.regs_waiters;
      b.regs_waiters = 0;
      b.cv.notify_all();
      return;
    }
    const int64_t need = int64_t(count - cur) * 128;
    while (b.regs_pool < need) {
      ++b.regs_waiters;
      ++b.blocked;
      detail::check_deadlock_locked(b);
      const int64_t seen = b.regs_pool;
      detail::wait_until(b.cv, lk, [&] { return b.regs_pool != seen || b.aborted; });
      if (b.aborted) throw detail::Abort{};
    }
    b.regs_pool -= need;
    cur = count;
  });
}

int setmaxnreg_current() {
  ThreadImpl& t = detail::me();
  std::lock_guard<std::mutex> lk(t.block->m);
  return t.block->wg_regs[size_t(t.tid / 128)];
}

// elect.sync (PTX ISA "elect.sync"): one leader among the (here: all 32) lanes; the ISA only
// promises the same leader for the same membermask every time -- here the lowest lane.
bool elect_one() {
  bool leader = false;
  const uint32_t mine = 1;
  detail::warp_exchange(detail::kOpElect, &mine, sizeof mine, __builtin_return_address(0),
                        [&](const detail::Slot*, int lane) { leader = lane == 0; });
  return leader;
}

// ---------------------------------------------------------------------------- memory

// PTX ISA 9.0 §9.7.13.5 "atom": atom.global.add.f32 returns the old value.
float atomic_add(float* address, float value) {
  uint32_t* word = reinterpret_cast<uint32_t*>(address);
  uint32_t old = __atomic_load_n(word, __ATOMIC_RELAXED);
  for (;;) {
    const uint32_t desired = f32_bits(f32_from_bits(old) + value);
    if (__atomic_compare_exchange_n(word, &old, desired, true, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED))
      return f32_from_bits(old);
  }
}

void* dynamic_smem() { return detail::me().block->dynamic_smem; }
size_t dynamic_smem_bytes() { return detail::me().block->dynamic_smem_bytes; }

namespace detail {
void opt_in_smem(const void* kernel, size_t bytes, size_t limit, const char* arch) {
  if (bytes > limit)
    throw std::invalid_argument("cudaFuncSetAttribute: " + std::to_string(bytes) +
                                " bytes of dynamic shared memory exceed " + arch + "'s " +
                                std::to_string(limit));
  std::lock_guard<std::mutex> lk(g_optin_mutex);
  g_smem_optin[kernel] = bytes;
}
}  // namespace detail

void set_max_dynamic_smem(const void* kernel, size_t bytes) {
  detail::opt_in_smem(kernel, bytes, detail::kMaxDynamicSmem, "sm_80");
}

void set_max_dynamic_smem_sm90(const void* kernel, size_t bytes) {
  detail::opt_in_smem(kernel, bytes, detail::kMaxDynamicSmemSm90, "sm_90");
}

void scratch_taken(size_t bytes) {
  const uint64_t live = detail::s_scratch_live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  uint64_t seen = detail::s_scratch_peak.load(std::memory_order_relaxed);
  while (live > seen &&
         !detail::s_scratch_peak.compare_exchange_weak(seen, live, std::memory_order_relaxed)) {
  }
}

void scratch_returned(size_t bytes) {
  detail::s_scratch_live.fetch_sub(bytes, std::memory_order_relaxed);
}

void trap(const char* message, const char* file, int line) {
  detail::fail(std::string(message) + " at " + detail::where(file, line));
}

// ---------------------------------------------------------------------------- launch

void launch_impl(const char* name, const void* kernel, dim3 grid, dim3 block, size_t smem,
                 Thunk thunk, void* closure) {
  const uint64_t nthreads = uint64_t(block.x) * block.y * block.z;
  const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
  const detail::KernelName kname{name, kernel, {}, {}};
  auto bad = [&](const std::string& why) {
    throw LaunchError(kname.get() + ": invalid launch configuration: " + why);
  };
  if (nthreads == 0 || nthreads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    bad("block (" + std::to_string(block.x) + "," + std::to_string(block.y) + "," +
        std::to_string(block.z) + ") (at most 1024 threads; x, y <= 1024, z <= 64)");
  if (nblocks == 0 || grid.y > 65535 || grid.z > 65535 || nblocks > (uint64_t(1) << 26))
    bad("grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
        std::to_string(grid.z) + ") (y, z <= 65535; the emulator runs at most 2^26 blocks)");
  size_t limit = detail::kDefaultDynamicSmem;
  {
    std::lock_guard<std::mutex> lk(detail::g_optin_mutex);
    auto it = detail::g_smem_optin.find(kernel);
    if (it != detail::g_smem_optin.end()) limit = std::max(limit, it->second);
  }
  if (smem > limit)
    bad(std::to_string(smem) + " bytes of dynamic shared memory; the limit is " +
        std::to_string(limit) +
        (limit == detail::kDefaultDynamicSmem
             ? " without cudaFuncSetAttribute(MaxDynamicSharedMemorySize)"
             : ""));

  if (current())
    throw LaunchError(kname.get() + ": launched from inside a kernel (dynamic parallelism is not "
                      "emulated)");
  std::lock_guard<std::mutex> launch_lock(detail::g_launch_mutex);
  detail::bump(detail::s_launches);
  detail::Traffic traffic;
  traffic.launches = 1;
  // Counted into the per-kernel totals however the launch ends.
  struct Record {
    const detail::KernelName& kname;
    detail::Traffic& traffic;
    ~Record() {
      std::lock_guard<std::mutex> lk(detail::g_traffic_mutex);
      auto& entry = detail::g_traffic[kname.fn];
      entry.first = kname.expression;
      entry.second.add(traffic);
    }
  } record{kname, traffic};
  // The blocks one after another, in a random order: CUDA promises none, and atomics from
  // different blocks then land in a different order on every run, as on a GPU.
  detail::Schedule schedule(detail::launch_seed());
  std::vector<int64_t> blocks(static_cast<size_t>(nblocks));
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = int64_t(i);
  schedule.shuffle(blocks);
  for (const int64_t linear : blocks) {
    const unsigned bx = unsigned(linear % grid.x), by = unsigned(linear / grid.x % grid.y),
                   bz = unsigned(linear / (int64_t(grid.x) * grid.y));
    BlockState b;
    b.kernel = &kname;
    b.block_idx = {bx, by, bz};
    b.block_dim = block;
    b.grid_dim = grid;
    b.nthreads = int(nthreads);
    b.nwarps = int((nthreads + 31) / 32);
    b.live = b.nthreads;
    b.warps.reset(new detail::WarpState[size_t(b.nwarps)]);
    b.threads.assign(size_t(nthreads), nullptr);
    b.nwgroups = int((nthreads + 127) / 128);
    b.wgroups.reset(new detail::WarpState[size_t(b.nwgroups)]);
    for (int g = 0; g < b.nwgroups; ++g) {
      detail::WarpState& ws = b.wgroups[size_t(g)];
      ws.size = ws.live = int(std::min<uint64_t>(128, nthreads - uint64_t(g) * 128));
    }
    // setmaxnreg: the launch gives every thread the most registers the SM's 64K-register
    // file allows for this block size (a multiple of 8, at most 248: 255 rounded down).
    b.regs_launch = int(std::min<uint64_t>(248, (65536 / nthreads) & ~uint64_t(7)));
    b.wg_regs.assign(size_t(b.nwgroups), b.regs_launch);
    for (int w = 0; w < b.nwarps; ++w) {
      detail::WarpState& ws = b.warps[size_t(w)];
      ws.size = ws.live = int(std::min<uint64_t>(32, nthreads - uint64_t(w) * 32));
    }
    // Exactly `smem` bytes, so that AddressSanitizer flags any access past the end;
    // 0xFF bytes are NaN in f16, bf16 and f32: an unwritten element poisons the result.
    void* p = nullptr;
    // 1024-byte aligned: the swizzle patterns of wgmma and TMA read address bits 4..9, and
    // the shared-window addresses (emu::smem_address) are offsets from this base.
    if (posix_memalign(&p, 1024, std::max<size_t>(smem, 1)) != 0) throw std::bad_alloc();
    std::unique_ptr<unsigned char, void (*)(void*)> dyn(static_cast<unsigned char*>(p),
                                                         std::free);
    std::memset(dyn.get(), 0xFF, std::max<size_t>(smem, 1));
    b.dynamic_smem = dyn.get();
    b.dynamic_smem_bytes = smem;

    if (detail::g_race_checker) detail::g_race_checker->block_begin();
#if FMHA_EMU_FIBERS
    detail::run_block_fibers(b, thunk, closure, schedule);
#else
    std::vector<std::thread> threads;
    threads.reserve(size_t(nthreads));
    try {
      for (int tid = 0; tid < b.nthreads; ++tid)
        threads.emplace_back(detail::thread_main, &b, tid, thunk, closure);
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lk(b.m);
        detail::abort_locked(b, std::string("could not start the block's threads: ") +
                                    e.what());
        b.live -= b.nthreads - int(threads.size());  // those never started
        detail::check_deadlock_locked(b);
      }
      for (std::thread& th : threads) th.join();
      throw LaunchError(kname.get() + ": " + b.error);
    }
    for (std::thread& th : threads) th.join();
#endif
    detail::finish_traffic(b);
    traffic.add(b.traffic);
    detail::bump(detail::s_blocks);
    detail::bump(detail::s_threads, nthreads);

    std::vector<std::string> races;
    if (detail::g_race_checker) races = detail::g_race_checker->block_end();
    if (b.aborted) throw LaunchError(b.error + schedule.describe());
    if (!races.empty()) {
      std::string msg = kname.get() + ": racecheck: memory hazards in block " +
                        detail::dims(b.block_idx) + schedule.describe() + ":";
      for (const std::string& r : races) msg += "\n  " + r;
      throw LaunchError(msg);
    }
  }
}

Stats stats() {
  using namespace detail;
  auto g = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  return {g(s_launches), g(s_blocks), g(s_threads), g(s_block_barriers), g(s_warp_barriers),
          g(s_mma), g(s_ldmatrix), g(s_shfl), g(s_ballot), g(s_cp_async),
          g(s_cp_async_zero_filled), g(s_max_groups), g(s_scratch_peak)};
}

std::vector<KernelTraffic> traffic() {
  std::vector<std::pair<const void*, std::pair<const char*, detail::Traffic>>> entries;
  {
    std::lock_guard<std::mutex> lk(detail::g_traffic_mutex);
    entries.assign(detail::g_traffic.begin(), detail::g_traffic.end());
  }
  std::vector<KernelTraffic> out;
  for (const auto& [fn, e] : entries) {
    const detail::Traffic& t = e.second;
    KernelTraffic k;
    k.kernel = detail::function_name(fn);
    if (k.kernel.empty()) k.kernel = e.first;
    k.launches = t.launches;
    k.ldmatrix_requests = t.ldsm_requests;
    k.ldmatrix_wavefronts = t.ldsm_wavefronts;
    k.ldmatrix_ideal_wavefronts = t.ldsm_ideal;
    k.cp_async_requests = t.cp_requests;
    k.cp_async_wavefronts = t.cp_wavefronts;
    k.cp_async_ideal_wavefronts = t.cp_ideal;
    k.cp_async_global_sectors = t.sectors;
    k.cp_async_global_bytes = t.bytes;
    k.wgmma_requests = t.wgmma_requests;
    k.wgmma_wavefronts = t.wgmma_wavefronts;
    k.wgmma_ideal_wavefronts = t.wgmma_ideal;
    k.tma_requests = t.tma_requests;
    k.tma_wavefronts = t.tma_wavefronts;
    k.tma_ideal_wavefronts = t.tma_ideal;
    out.push_back(std::move(k));
  }
  std::sort(out.begin(), out.end(),
            [](const KernelTraffic& a, const KernelTraffic& b) { return a.kernel < b.kernel; });
  return out;
}

void reset_stats() {
  using namespace detail;
  {
    std::lock_guard<std::mutex> lk(g_traffic_mutex);
    g_traffic.clear();
  }
  for (auto* c : {&s_launches, &s_blocks, &s_threads, &s_block_barriers, &s_warp_barriers, &s_mma,
                  &s_ldmatrix, &s_shfl, &s_ballot, &s_cp_async, &s_cp_async_zero_filled,
                  &s_max_groups})
    c->store(0, std::memory_order_relaxed);
  s_scratch_peak.store(s_scratch_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace emu
