// racecheck: the emulator's deterministic detector of memory races between the threads of a
// block -- above all, shared-memory accesses not separated by the __syncthreads they need.
//
// How it sees accesses: kernel translation units are compiled with -fsanitize=thread (and
// --param=tsan-instrument-func-entry-exit=0), which makes GCC call __tsan_read<N>(address)
// / __tsan_write<N>(address) before each memory access. This file defines those functions
// -- the binary is linked WITHOUT ThreadSanitizer's runtime -- and keeps a shadow of every
// byte a block touches. The emulator's own operations report theirs explicitly: ldmatrix
// reads each 16-byte row as the lane that gave its address; a cp.async writes its shared
// destination (and reads its source) both when it is issued and when cp.async.wait_group
// retires it -- the hardware may move the bytes at any moment in between.
//
// The clock: each thread counts the __syncthreads it has passed (the block epoch) and the
// barriers of its warp it has passed (__syncwarp and every warp collective: the warp
// epoch). Two accesses to a byte by different threads, at least one a write, are ordered
// iff a __syncthreads lies between them (the earlier one's block epoch is smaller) or, for
// two lanes of one warp, a warp barrier does (warp epoch smaller, same block epoch).
// Anything else is a hazard, reported whatever the OS scheduler did. Per byte the shadow
// keeps the last write and a summary of the reads since it; the shadow is cleared at each
// block (blocks run one after another; accesses of different blocks are not compared).
//
// The async proxy (Hopper; runtime.cpp, "Hopper"). A TMA load's writes are not ordered by
// barriers but by the mbarrier phase that counts their bytes: each 16-byte chunk it wrote
// remembers (mbarrier, phase), and a generic access to it by a thread that has not seen that
// phase complete (a successful mbarrier wait of its own, or a __syncthreads after another
// thread's) is a hazard. Async-proxy reads -- wgmma operands, a TMA store's source -- are
// ordinary reads for the clock above, and more: bytes last written through the generic proxy
// must have been followed by a fence.proxy.async of their writer (PTX ISA "Memory
// Consistency Model": proxies). Not modelled: the ordering an mbarrier gives to generic
// accesses (a producer's plain stores read by a consumer after an mbarrier wait are reported
// as a race), and a TMA's write against earlier generic accesses of the same bytes.
//
// Not seen: accesses inside uninstrumented code (libc's memcpy called by the kernel,
// atomics), accesses to a thread's own stack (private by construction).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "cuda/emu/runtime_internal.h"

namespace emu {
namespace detail {
namespace {

constexpr int32_t kNone = -1, kSeveral = -2;
constexpr size_t kMaxReports = 8;

struct Cell {
  // the last write
  int32_t w_tid = kNone;
  uint32_t w_block_epoch = 0, w_warp_epoch = 0;
  const void* w_pc = nullptr;
  // the reads since it, in block epoch r_block_epoch
  int32_t r_tid = kNone;  // the reader, or kSeveral
  uint32_t r_block_epoch = 0, r_warps = 0, r_warp_epoch_max = 0;
  const void* r_pc = nullptr;
  uint32_t w_fences = 0;  // the writer's fence.proxy.async count at the write
};

// A 16-byte chunk a TMA load wrote: readable by threads that saw `phase` of `bar` complete.
struct AsyncWrite {
  const void* bar;
  uint64_t phase;
  int32_t tid;
  const void* pc;
};
struct BarSeen {
  std::unordered_map<int32_t, uint64_t> by_thread;  // completed phases each thread has seen
  std::vector<uint32_t> first_epoch;  // [k]: block epoch at which phase k was first seen done
};

std::mutex g_mu;
std::unordered_map<uintptr_t, Cell> g_shadow;
std::vector<std::string> g_reports;
std::set<std::pair<const void*, const void*>> g_seen;  // (pc, other pc) already reported
size_t g_hazards = 0;
std::unordered_map<uintptr_t, AsyncWrite> g_async;  // by chunk (address >> 4)
std::unordered_map<const void*, BarSeen> g_bars;
std::unordered_map<int32_t, uint32_t> g_fences;  // fence.proxy.async count per thread

// Is an earlier access by `tid` at (block_epoch, warp_epoch) ordered before `t`'s access now?
bool ordered(const ThreadImpl& t, int32_t tid, uint32_t block_epoch, uint32_t warp_epoch) {
  return tid == t.tid || block_epoch < t.block_epoch ||
         (tid / 32 == t.warp && warp_epoch < t.warp_epoch);
}

void report(const char* kind, uintptr_t address, const ThreadImpl& t, const void* pc,
            bool write, int32_t other, const void* other_pc, bool other_write) {
  ++g_hazards;
  if (g_reports.size() >= kMaxReports || !g_seen.insert({pc, other_pc}).second) return;
  std::ostringstream os;
  os << kind << " hazard at " << describe_address(reinterpret_cast<const void*>(address)) << ": "
     << describe_thread(t.tid, false) << (write ? " writes" : " reads") << " at " << describe_pc(pc)
     << "; ";
  if (other == kSeveral)
    os << "other threads read it";
  else
    os << describe_thread(other, false) << (other_write ? " wrote" : " read") << " it";
  os << " at " << describe_pc(other_pc)
     << ", with no __syncthreads (or, in one warp, __syncwarp) between the two";
  g_reports.push_back(os.str());
}

// Counts a hazard; true if it is to be described (the first of its pair of pcs, within the
// report limit). Describing calls addr2line: only then.
bool counts_new_report(const void* pc, const void* other_pc) {
  ++g_hazards;
  return g_reports.size() < kMaxReports && g_seen.insert({pc, other_pc}).second;
}

// Has thread t seen the phase that completes the TMA write w? (g_mu held)
bool seen_locked(const ThreadImpl& t, const AsyncWrite& w) {
  auto it = g_bars.find(w.bar);
  if (it == g_bars.end()) return false;
  const BarSeen& s = it->second;
  auto mine = s.by_thread.find(t.tid);
  if (mine != s.by_thread.end() && mine->second > w.phase) return true;
  // another thread saw it, and a __syncthreads came after
  return s.first_epoch.size() > w.phase && s.first_epoch[size_t(w.phase)] < t.block_epoch;
}

// Generic (or async-proxy) access of TMA-written chunks (g_mu held). A write that is ordered
// makes the bytes the generic proxy's again.
void check_async_locked(const ThreadImpl& t, uintptr_t a0, size_t bytes, bool write,
                        const void* pc, const char* what) {
  for (uintptr_t c = a0 >> 4; c <= (a0 + bytes - 1) >> 4; ++c) {
    auto it = g_async.find(c);
    if (it == g_async.end()) continue;
    const AsyncWrite& w = it->second;
    if (!seen_locked(t, w)) {
      if (!counts_new_report(pc, w.pc)) continue;
      std::ostringstream os;
      os << "async-proxy hazard at " << describe_address(reinterpret_cast<const void*>(c << 4))
         << ": " << describe_thread(t.tid, false) << (write ? " writes" : " reads") << " "
         << (what ? what : "it") << " at " << describe_pc(pc) << ", a TMA destination that "
         << describe_thread(w.tid, false) << " loaded at " << describe_pc(w.pc)
         << ", before it has seen phase " << w.phase << " of the mbarrier at "
         << describe_address(w.bar)
         << " complete (wait on the mbarrier: mbarrier.try_wait.parity)";
      g_reports.push_back(os.str());
    } else if (write) {
      g_async.erase(it);
    }
  }
}

}  // namespace

// Called for every instrumented access, also before static initialization is complete: it
// returns at once unless the calling thread runs an emulated kernel.
void racecheck_access(const void* address, size_t bytes, bool write, const void* pc) {
  ThreadImpl* tp = current();
  if (!tp || bytes == 0) return;
  const ThreadImpl& t = *tp;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(address);
  if (a0 >= t.stack_lo && a0 < t.stack_hi) return;  // the thread's own stack: private
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_async.empty()) check_async_locked(t, a0, bytes, write, pc, nullptr);
  bool reported = false;  // one report per access, however many bytes
  for (uintptr_t a = a0; a < a0 + bytes; ++a) {
    Cell& c = g_shadow[a];
    if (!reported && c.w_tid != kNone && !ordered(t, c.w_tid, c.w_block_epoch, c.w_warp_epoch)) {
      report(write ? "write-after-write" : "read-after-write", a, t, pc, write, c.w_tid, c.w_pc,
             true);
      reported = true;
    }
    if (write) {
      if (!reported && c.r_tid != kNone && c.r_block_epoch == t.block_epoch) {
        const bool other_warp = (c.r_warps & ~(1u << t.warp)) != 0;
        const bool same_warp_unsynced = c.r_tid != t.tid && c.r_warp_epoch_max >= t.warp_epoch;
        if (other_warp || same_warp_unsynced) {
          report("write-after-read", a, t, pc, true, c.r_tid, c.r_pc, false);
          reported = true;
        }
      }
      c.w_tid = t.tid;
      c.w_block_epoch = t.block_epoch;
      c.w_warp_epoch = t.warp_epoch;
      c.w_pc = pc;
      c.w_fences = g_fences.empty() ? 0 : g_fences[t.tid];
      c.r_tid = kNone;
    } else if (c.r_tid == kNone || c.r_block_epoch != t.block_epoch) {
      c.r_tid = t.tid;
      c.r_block_epoch = t.block_epoch;
      c.r_warps = 1u << t.warp;
      c.r_warp_epoch_max = t.warp_epoch;
      c.r_pc = pc;
    } else {
      if (c.r_tid != t.tid) c.r_tid = kSeveral;
      c.r_warps |= 1u << t.warp;
      c.r_warp_epoch_max = std::max(c.r_warp_epoch_max, t.warp_epoch);
    }
  }
}

namespace {

void async_write(const void* address, size_t bytes, const void* bar, uint64_t phase,
                 const void* pc) {
  ThreadImpl* tp = current();
  if (!tp || bytes == 0) return;
  std::lock_guard<std::mutex> lk(g_mu);
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(address);
  for (uintptr_t a = a0; a < a0 + bytes; ++a) g_shadow.erase(a);  // now the async proxy's
  for (uintptr_t c = a0 >> 4; c <= (a0 + bytes - 1) >> 4; ++c)
    g_async[c] = AsyncWrite{bar, phase, int32_t(tp->tid), pc};
}

void async_read(const void* address, size_t bytes, const void* pc, const char* what) {
  ThreadImpl* tp = current();
  if (!tp || bytes == 0) return;
  const ThreadImpl& t = *tp;
  racecheck_access(address, bytes, false, pc);  // ordered after the bytes' last write?
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_async.empty())
    check_async_locked(t, reinterpret_cast<uintptr_t>(address), bytes, false, pc, what);
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(address);
  for (uintptr_t a = a0; a < a0 + bytes; ++a) {
    auto it = g_shadow.find(a);
    if (it == g_shadow.end() || it->second.w_tid == kNone) continue;
    const Cell& c = it->second;
    if (g_fences[c.w_tid] != c.w_fences) continue;  // the writer fenced since
    if (!counts_new_report(pc, c.w_pc)) break;
    std::ostringstream os;
    os << "proxy hazard at " << describe_address(reinterpret_cast<const void*>(a)) << ": "
       << describe_thread(t.tid, false) << " reads " << what << " at " << describe_pc(pc)
       << " through the async proxy; " << describe_thread(c.w_tid, false)
       << " wrote it through the generic proxy at " << describe_pc(c.w_pc)
       << " with no fence.proxy.async after the write";
    g_reports.push_back(os.str());
    break;
  }
}

void observed(const void* bar, uint64_t completed) {
  ThreadImpl* tp = current();
  if (!tp) return;
  std::lock_guard<std::mutex> lk(g_mu);
  BarSeen& s = g_bars[bar];
  uint64_t& mine = s.by_thread[tp->tid];
  mine = std::max(mine, completed);
  while (s.first_epoch.size() < completed) s.first_epoch.push_back(tp->block_epoch);
}

void proxy_fence() {
  ThreadImpl* tp = current();
  if (!tp) return;
  std::lock_guard<std::mutex> lk(g_mu);
  ++g_fences[tp->tid];
}

void clear_async_locked() {
  g_async.clear();
  g_bars.clear();
  g_fences.clear();
}

void block_begin() {
  std::lock_guard<std::mutex> lk(g_mu);
  clear_async_locked();
  g_shadow.clear();
  g_reports.clear();
  g_seen.clear();
  g_hazards = 0;
}

std::vector<std::string> block_end() {
  std::lock_guard<std::mutex> lk(g_mu);
  std::vector<std::string> out = std::move(g_reports);
  if (g_hazards > out.size())
    out.push_back("(" + std::to_string(g_hazards - out.size()) + " more hazardous accesses)");
  g_reports.clear();
  g_shadow.clear();
  clear_async_locked();
  return out;
}

const RaceChecker kChecker{&block_begin, &racecheck_access, &block_end, &async_write,
                          &async_read, &observed, &proxy_fence};

struct Install {
  Install() { g_race_checker = &kChecker; }
} install;

}  // namespace
}  // namespace detail
}  // namespace emu

// ---- the instrumentation hooks GCC's -fsanitize=thread emits ----
#define EMU_RC_PC __builtin_return_address(0)
extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

#define EMU_RC_SIZED(n)                                                                         \
  void __tsan_read##n(void* a) { emu::detail::racecheck_access(a, n, false, EMU_RC_PC); }  \
  void __tsan_write##n(void* a) { emu::detail::racecheck_access(a, n, true, EMU_RC_PC); }  \
  void __tsan_unaligned_read##n(void* a) {                                                      \
    emu::detail::racecheck_access(a, n, false, EMU_RC_PC);                                \
  }                                                                                             \
  void __tsan_unaligned_write##n(void* a) {                                                     \
    emu::detail::racecheck_access(a, n, true, EMU_RC_PC);                                 \
  }                                                                                             \
  void __tsan_volatile_read##n(void* a) {                                                       \
    emu::detail::racecheck_access(a, n, false, EMU_RC_PC);                                \
  }                                                                                             \
  void __tsan_volatile_write##n(void* a) {                                                      \
    emu::detail::racecheck_access(a, n, true, EMU_RC_PC);                                 \
  }
EMU_RC_SIZED(1)
EMU_RC_SIZED(2)
EMU_RC_SIZED(4)
EMU_RC_SIZED(8)
EMU_RC_SIZED(16)
#undef EMU_RC_SIZED

void __tsan_read_range(void* a, unsigned long n) {
  emu::detail::racecheck_access(a, n, false, EMU_RC_PC);
}
void __tsan_write_range(void* a, unsigned long n) {
  emu::detail::racecheck_access(a, n, true, EMU_RC_PC);
}

// Atomics in instrumented code (e.g. inside standard-library headers) are performed, not
// tracked: an atomic access never races.
#define EMU_RC_ATOMICS(bits, T)                                                                 \
  T __tsan_atomic##bits##_load(const volatile T* a, int) {                                      \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                \
  }                                                                                             \
  void __tsan_atomic##bits##_store(volatile T* a, T v, int) {                                   \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                   \
  }                                                                                             \
  T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) {                                   \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                         \
  }                                                                                             \
  T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) {                                  \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) {                                  \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) {                                  \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) {                                   \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                             \
  T __tsan_atomic##bits##_fetch_xor(volatile T* a, T v, int) {                                  \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  T __tsan_atomic##bits##_fetch_nand(volatile T* a, T v, int) {                                 \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                         \
  }                                                                                             \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {       \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
  }                                                                                             \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {         \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);      \
  }                                                                                             \
  T __tsan_atomic##bits##_compare_exchange_val(volatile T* a, T c, T v, int, int) {             \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);           \
    return c;                                                                                   \
  }
EMU_RC_ATOMICS(8, uint8_t)
EMU_RC_ATOMICS(16, uint16_t)
EMU_RC_ATOMICS(32, uint32_t)
EMU_RC_ATOMICS(64, uint64_t)
#undef EMU_RC_ATOMICS
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}  // extern "C"
