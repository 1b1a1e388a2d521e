#include "fmha/threads.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace fmha {
namespace {

// Work below which a helper does not pay for itself: it joins a region in about a
// microsecond when it is spinning and in tens of microseconds when it has to be woken
// (a futex wake-up on a small VM), and each helper adds a share of cache traffic. Chosen by
// measurement (docs/cpu_kernels.md, "Small calls"): a thread must get at least this much work.
constexpr int64_t kMinWorkPerThreadNs = 20000;

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

// Whether the machine is oversubscribed: more runnable threads than the cores this process
// may run on. Then a spinning thread holds a core that a runnable thread -- a helper holding
// a task of the region, or another process -- is waiting for, so the pool parks at once
// instead, and regions leave torch's OpenMP runtime (whose threads spin) for the pool.
// Read at most every kBusyCheckNs: the runnable threads of the whole system (the fourth
// field of /proc/loadavg) less this process's own (state R in /proc/self/task/*/stat: the
// pool's helpers and torch's threads count as ours), and sched_getaffinity.
constexpr int64_t kBusyCheckNs = 20000000;
std::atomic<int64_t> busy_checked_ns{std::numeric_limits<int64_t>::min()};
std::atomic<int> busy_others{0};  // runnable threads of other processes at the last reading
std::atomic<int> busy_cores{1};

// The whole file (small /proc files) into buf; its length, or -1.
ssize_t read_small(const char* path, char* buf, size_t size) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  const ssize_t n = ::read(fd, buf, size - 1);
  ::close(fd);
  if (n < 0) return -1;
  buf[n] = '\0';
  return n;
}

int runnable_in_system() {
  char buf[128];
  if (read_small("/proc/loadavg", buf, sizeof(buf)) <= 0) return -1;
  // "0.52 0.58 0.59 3/467 12345": runnable/total after the third field.
  const char* p = buf;
  for (int field = 0; field < 3 && p != nullptr; ++field) {
    p = std::strchr(p, ' ');
    if (p != nullptr) ++p;
  }
  if (p == nullptr) return -1;
  char* end = nullptr;
  const long r = std::strtol(p, &end, 10);
  return end != p && *end == '/' ? int(r) : -1;
}

int runnable_in_self() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return 1;
  int n = 0;
  char path[64], buf[512];
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::snprintf(path, sizeof(path), "/proc/self/task/%.20s/stat", e->d_name);
    if (read_small(path, buf, sizeof(buf)) <= 0) continue;
    const char* close = std::strrchr(buf, ')');  // "tid (comm) S ...": comm may hold spaces
    if (close != nullptr && close[1] == ' ' && close[2] == 'R') ++n;
  }
  closedir(dir);
  return std::max(n, 1);
}

int allowed_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return hardware_threads();
  return std::max(1, CPU_COUNT(&set));
}

// Whether the pool stops spinning on an oversubscribed machine: FMHA_POOL_PARK_WHEN_BUSY=1.
// Off by default: on a 2-core Zen 4 VM with one busy process, parking made the small call
// no faster than spinning (1.92x against 2.03x its quiet time) and the medium one slower.
bool park_when_busy() {
  static const bool on = [] {
    const char* env = std::getenv("FMHA_POOL_PARK_WHEN_BUSY");
    return env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
  }();
  return on;
}

// Whether a region on `threads` threads would oversubscribe the machine.
bool oversubscribed(int threads) {
  const int64_t now = now_ns();
  int64_t last = busy_checked_ns.load(std::memory_order_relaxed);
  if (now - last >= kBusyCheckNs &&
      busy_checked_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    const int all = runnable_in_system();
    busy_others.store(all < 0 ? 0 : std::max(0, all - runnable_in_self()),
                      std::memory_order_relaxed);
    busy_cores.store(allowed_cores(), std::memory_order_relaxed);
  }
  return busy_others.load(std::memory_order_relaxed) + threads >
         busy_cores.load(std::memory_order_relaxed);
}

// Spins while busy() holds, for at most `ns`; returns whether it still holds.
template <typename Busy>
bool spin_while(Busy&& busy, int64_t ns) {
  if (ns <= 0) return busy();
  const int64_t deadline = now_ns() + ns;
  for (int i = 1; busy(); ++i) {
    cpu_relax();
    if ((i & 63) == 0 && now_ns() >= deadline) return busy();
  }
  return false;
}

// A counter of one region: the region's generation in the bits above kCountBits, what is
// left to take below. A thread that was descheduled across regions cannot take from a later
// region than the one it joined: its compare-and-swap carries the old generation and fails.
constexpr int kCountBits = 40;
constexpr uint64_t kCountMask = (uint64_t(1) << kCountBits) - 1;
inline uint64_t tagged(uint64_t generation, int64_t count) {
  return (generation << kCountBits) | (uint64_t(count) & kCountMask);
}

// Takes one from the counter of region `generation` while it is above zero: the count
// before, or 0 (another region's counter, or nothing left).
int64_t take(std::atomic<uint64_t>& counter, uint64_t generation) {
  const uint64_t tag = tagged(generation, 0);
  uint64_t c = counter.load(std::memory_order_acquire);
  for (;;) {
    if ((c & ~kCountMask) != tag || (c & kCountMask) == 0) return 0;
    if (counter.compare_exchange_weak(c, c - 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire))
      return int64_t(c & kCountMask);
  }
}

// The CPU this thread runs on, or -1 where the OS does not say.
int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

// A thread working for a region that finds itself on the CPU the region's caller started on
// moves to its other CPUs: the two would share one core for the whole region. With more
// runnable threads than cores (one busy process next to a 2-thread call on 2 cores) the
// scheduler's balancing sees a 2 + 1 split as balanced whichever two threads share a core,
// and waking a helper on its waker's CPU makes caller and helper the pair that sticks: the
// call then gets one core where its fair share is one and a half (docs/cpu_kernels.md,
// "Shared CPUs"). On a quiet machine the scheduler keeps them apart already, so this costs a
// vDSO read per region. The thread takes the CPUs it had when it first came here, less the
// caller's: should the caller later come to its CPU, the next collision moves it back onto
// the one the caller left.
void keep_off_cpu(int caller_cpu) {
#if defined(__linux__)
  // Read on every thread's first region, not its first collision: by then an outside pin
  // may have narrowed the set to the caller's CPU alone.
  thread_local const std::pair<bool, cpu_set_t> allowed = [] {
    std::pair<bool, cpu_set_t> a;
    a.first = sched_getaffinity(0, sizeof(a.second), &a.second) == 0;
    return a;
  }();
  if (caller_cpu < 0 || caller_cpu >= CPU_SETSIZE || sched_getcpu() != caller_cpu) return;
  if (!allowed.first) return;
  cpu_set_t set = allowed.second;
  CPU_CLR(caller_cpu, &set);
  if (CPU_COUNT(&set) > 0) sched_setaffinity(0, sizeof(set), &set);
#else
  (void)caller_cpu;
#endif
}

class Pool {
 public:
  void run(int64_t n_tasks, int helpers, const std::function<void(int64_t)>& fn) {
    // One parallel region at a time: concurrent callers (several Python threads) queue
    // here instead of oversubscribing the cores.
    std::lock_guard<std::mutex> region(region_mu_);
    const uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;
    grow(helpers, gen - 1);
    const bool busy = park_when_busy() && oversubscribed(helpers + 1);
    parked_spin_.store(busy ? 0 : spin_ns(), std::memory_order_relaxed);
    fn_ = &fn;
    caller_cpu_.store(current_cpu(), std::memory_order_relaxed);
    n_tasks_.store(n_tasks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    joins_.store(tagged(gen, helpers), std::memory_order_relaxed);
    claims_.store(tagged(gen, n_tasks), std::memory_order_release);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.store(gen, std::memory_order_release);
      wake = sleepers_.load(std::memory_order_relaxed) > 0;
    }
    if (wake) wake_cv_.notify_all();
    work(gen);
    // Every task is claimed: wait for those a helper is still running -- only those, a
    // helper that has not claimed one by now gets none. Spinning would hold a core the
    // running helper may be waiting for on a busy machine: then the caller blocks at once.
    auto running = [&] { return done_.load(std::memory_order_acquire) < n_tasks; };
    if (spin_while(running, busy ? 0 : spin_ns())) {
      std::unique_lock<std::mutex> lk(mu_);
      caller_waiting_ = true;
      done_cv_.wait(lk, [&] { return !running(); });
      caller_waiting_ = false;
    }
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // How long a helper spins for the next region before it parks, and the caller for the
  // helpers' last tasks before it blocks, on a machine that is not oversubscribed. Long
  // enough for the next attention call of a layer loop, short enough not to keep a core
  // busy for torch's own threads between calls. FMHA_POOL_SPIN_US overrides it (0: park
  // at once).
  static int64_t spin_ns() {
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

  void grow(int helpers, uint64_t generation) {
    while (int(workers_.size()) < helpers)
      workers_.push_back(new std::thread([this, generation] { loop(generation); }));
  }

  void loop(uint64_t seen) {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "fmha-pool");
#endif
    for (;;) {
      wait_for_region(seen);
      seen = generation_.load(std::memory_order_acquire);
      if (take(joins_, seen) == 0) continue;  // another region's, or enough helpers
      keep_off_cpu(caller_cpu_.load(std::memory_order_relaxed));
      work(seen);
    }
  }

  // Returns once the generation differs from `seen`: spinning first (not on a busy
  // machine: parked_spin_ is 0 then), then parked.
  void wait_for_region(uint64_t seen) {
    auto same = [&] { return generation_.load(std::memory_order_acquire) == seen; };
    if (!spin_while(same, parked_spin_.load(std::memory_order_relaxed))) return;
    std::unique_lock<std::mutex> lk(mu_);
    sleepers_.fetch_add(1, std::memory_order_relaxed);
    wake_cv_.wait(lk, [&] { return !same(); });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

  // Runs tasks of region `gen` while there are unclaimed ones. A claim succeeds only while
  // the region is open (the caller waits for every claimed task), so fn_ and n_tasks_ read
  // after it are the region's; tasks are handed out in increasing order.
  void work(uint64_t gen) {
    for (;;) {
      const int64_t left = take(claims_, gen);
      if (left == 0) return;
      const int64_t n = n_tasks_.load(std::memory_order_relaxed);
      int64_t finished = 1;
      try {
        (*fn_)(n - left);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!error_) error_ = std::current_exception();
        // Stop handing out work: the tasks nobody claimed count as finished.
        uint64_t c = claims_.load(std::memory_order_acquire);
        while (!claims_.compare_exchange_weak(c, tagged(gen, 0), std::memory_order_acq_rel)) {
        }
        finished += int64_t(c & kCountMask);
      }
      if (done_.fetch_add(finished, std::memory_order_acq_rel) + finished == n) {
        std::lock_guard<std::mutex> lk(mu_);
        if (caller_waiting_) done_cv_.notify_one();
      }
    }
  }

  std::mutex region_mu_, mu_, err_mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::vector<std::thread*> workers_;
  std::atomic<uint64_t> generation_{0};
  // The open region, written before generation_ moves.
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<uint64_t> joins_{0};    // tagged: helpers the region still takes
  std::atomic<uint64_t> claims_{0};   // tagged: tasks not handed out yet
  std::atomic<int64_t> done_{0};      // tasks finished (or skipped after an exception)
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> parked_spin_{0};  // how long an idle helper spins before it parks
  std::atomic<int> caller_cpu_{-1};      // the CPU the open region's caller started on
  bool caller_waiting_ = false;       // under mu_
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
  std::thread::id caller;
  int caller_cpu = -1;
  std::atomic<int64_t> next{0};
  std::mutex err_mu;
  std::exception_ptr error;
};

void gomp_body(void* data) {
  GompRegion& r = *static_cast<GompRegion*>(data);
  if (std::this_thread::get_id() != r.caller) keep_off_cpu(r.caller_cpu);
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
    r.caller = std::this_thread::get_id();
    r.caller_cpu = current_cpu();
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
