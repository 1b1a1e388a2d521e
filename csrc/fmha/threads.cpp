#include "fmha/threads.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fmha {
namespace {

// Work below which a helper does not pay for itself: it joins a region in about a
// microsecond when it is spinning and in tens of microseconds when it has to be woken
// (a futex wake-up on a small VM), and each helper adds a share of cache traffic. Chosen by
// measurement (docs/cpu_kernels.md, "Small calls"): a thread must get at least this much work.
constexpr int64_t kMinWorkPerThreadNs = 20000;

// How long a helper spins for the next region before it parks. Long enough for the next
// attention call of a layer loop, short enough not to keep a core busy for torch's own
// threads between calls. FMHA_POOL_SPIN_US overrides it (0: park at once).
int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* env = std::getenv("FMHA_POOL_SPIN_US");
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long us = std::strtol(env, &end, 10);
      if (end != env && *end == '\0' && us >= 0) return int64_t(us) * 1000;
    }
    return int64_t(100000);
  }();
  return ns;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spins while busy() holds, for at most spin_ns(); returns whether it still holds.
template <typename Busy>
bool spin_while(Busy&& busy) {
  const int64_t deadline = now_ns() + spin_ns();
  for (int i = 1; busy(); ++i) {
    cpu_relax();
    if ((i & 63) == 0 && now_ns() >= deadline) return busy();
  }
  return false;
}

class Pool {
 public:
  void run(int64_t n_tasks, int helpers, const std::function<void(int64_t)>& fn) {
    // One parallel region at a time: concurrent callers (several Python threads) queue
    // here instead of oversubscribing the cores.
    std::lock_guard<std::mutex> region(region_mu_);
    const uint64_t before = generation_.load(std::memory_order_relaxed);
    grow(helpers, before);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0, std::memory_order_relaxed);
      wanted_ = helpers;
      joined_ = 0;
      open_ = true;
      error_ = nullptr;
      generation_.store(before + 1, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) wake_cv_.notify_all();
    work();
    {
      // Close the region: a helper that has not joined yet stays out, so the caller waits
      // only for helpers that are running a task of it.
      std::lock_guard<std::mutex> lk(mu_);
      open_ = false;
    }
    spin_while([&] { return inside_.load(std::memory_order_acquire) != 0; });
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return inside_.load(std::memory_order_relaxed) == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int helpers, uint64_t generation) {
    while (int(workers_.size()) < helpers)
      workers_.push_back(new std::thread([this, generation] { loop(generation); }));
  }

  void loop(uint64_t seen) {
    for (;;) {
      wait_for_region(seen);
      std::unique_lock<std::mutex> lk(mu_);
      seen = generation_.load(std::memory_order_relaxed);
      if (!open_ || joined_ >= wanted_) continue;  // closed already, or not needed
      ++joined_;
      inside_.fetch_add(1, std::memory_order_relaxed);
      lk.unlock();
      work();
      lk.lock();
      if (inside_.fetch_sub(1, std::memory_order_release) == 1) done_cv_.notify_one();
    }
  }

  // Returns once the generation differs from `seen`: spinning first, then parked.
  void wait_for_region(uint64_t seen) {
    if (!spin_while([&] { return generation_.load(std::memory_order_acquire) == seen; }))
      return;
    std::unique_lock<std::mutex> lk(mu_);
    ++sleepers_;
    wake_cv_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
    --sleepers_;
  }

  void work() {
    for (;;) {
      const int64_t t = next_.fetch_add(1);
      if (t >= n_tasks_) return;
      try {
        (*fn_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_tasks_);  // stop handing out work
      }
    }
  }

  std::mutex region_mu_, mu_, err_mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::vector<std::thread*> workers_;
  std::atomic<uint64_t> generation_{0};
  // The open region, written under mu_ before generation_ moves.
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int wanted_ = 0, joined_ = 0, sleepers_ = 0;
  bool open_ = false;
  std::atomic<int> inside_{0};  // helpers running tasks of the current region
  std::exception_ptr error_;
};

// An OpenMP runtime already loaded into the process by the host framework (torch's
// libgomp), when the caller names one: fmha's regions then run as OpenMP parallel regions
// on that runtime's threads -- the threads the framework's own operators use and keep
// spinning between them -- instead of on helpers of the pool competing with those for the
// cores. Tasks are handed out in the same way, so results do not change.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
std::atomic<GompParallel> gomp_parallel{nullptr};
// The thread that chose the runtime: libgomp keeps a team per calling thread, so regions
// from other threads (several Python threads at once) stay on the pool instead of each
// starting a team of its own.
std::atomic<std::thread::id> gomp_owner{};
// Set in a child forked after this library was loaded: the runtime's threads were not
// copied, and a region there would wait for them, so the child never turns it on.
std::atomic<bool> forked_child{false};
const bool fork_watch = [] {
  pthread_atfork(nullptr, nullptr, [] {
    forked_child.store(true);
    gomp_parallel.store(nullptr);
  });
  return true;
}();
std::mutex gomp_region_mu;  // one region at a time, as in the pool

struct GompRegion {
  const std::function<void(int64_t)>* fn;
  int64_t n_tasks;
  std::atomic<int64_t> next{0};
  std::mutex err_mu;
  std::exception_ptr error;
};

void gomp_body(void* data) {
  GompRegion& r = *static_cast<GompRegion*>(data);
  for (;;) {
    const int64_t t = r.next.fetch_add(1);
    if (t >= r.n_tasks) return;
    try {
      (*r.fn)(t);
    } catch (...) {  // an exception must not leave an OpenMP thread
      std::lock_guard<std::mutex> lk(r.err_mu);
      if (!r.error) r.error = std::current_exception();
      r.next.store(r.n_tasks);
    }
  }
}

// Leaked on purpose: destroying the pool at exit would join threads that may be parked.
std::atomic<Pool*> the_pool{nullptr};

Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    the_pool.store(new Pool());
    // After fork() only the forking thread exists in the child: forget the workers (their
    // pool is leaked) and start new ones on the next call.
    pthread_atfork(nullptr, nullptr, [] { the_pool.store(new Pool()); });
  });
  return *the_pool.load();
}

}  // namespace

// Read once: std::thread::hardware_concurrency() reads /sys on every call (microseconds).
int hardware_threads() {
  static const int n = int(std::max(1u, std::thread::hardware_concurrency()));
  return n;
}

int pool_helpers_for(int64_t n_tasks, int n_threads, int64_t work_ns) {
  if (n_threads <= 0) n_threads = hardware_threads();
  int64_t threads = std::min<int64_t>(n_threads, n_tasks);
  if (work_ns != kUnknownWork) threads = std::min(threads, work_ns / kMinWorkPerThreadNs);
  return int(std::max<int64_t>(threads, 1) - 1);
}

void parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t)>& fn,
                  int64_t work_ns) {
  if (n_tasks <= 0) return;
  const int helpers = pool_helpers_for(n_tasks, n_threads, work_ns);
  if (helpers == 0) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  const GompParallel run = gomp_parallel.load(std::memory_order_acquire);
  if (run != nullptr && gomp_owner.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    std::lock_guard<std::mutex> region(gomp_region_mu);
    GompRegion r;
    r.fn = &fn;
    r.n_tasks = n_tasks;
    run(gomp_body, &r, unsigned(helpers + 1), 0);
    if (r.error) std::rethrow_exception(r.error);
    return;
  }
  pool().run(n_tasks, helpers, fn);
}

bool use_openmp_runtime(const std::string& path) {
  if (path.empty()) {
    gomp_parallel.store(nullptr, std::memory_order_release);
    return true;
  }
  if (forked_child.load()) return false;
  // RTLD_NOLOAD: only a runtime the process has loaded already (never a second copy).
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  void* sym = dlsym(lib, "GOMP_parallel");
  if (sym == nullptr) {
    dlclose(lib);
    return false;
  }
  gomp_owner.store(std::this_thread::get_id(), std::memory_order_relaxed);
  gomp_parallel.store(reinterpret_cast<GompParallel>(sym), std::memory_order_release);
  return true;
}

bool using_openmp_runtime() { return gomp_parallel.load(std::memory_order_acquire) != nullptr; }

}  // namespace fmha
