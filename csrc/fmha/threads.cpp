#include "fmha/threads.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fmha {
namespace {

class Pool {
 public:
  void run(int64_t n_tasks, int n_threads, const std::function<void(int64_t)>& fn) {
    // One parallel region at a time: concurrent callers (several Python threads) queue
    // here instead of oversubscribing the cores.
    std::lock_guard<std::mutex> region(region_mu_);
    const int helpers = int(std::min<int64_t>(n_threads, n_tasks)) - 1;
    grow(helpers);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      active_helpers_ = helpers;
      pending_ = helpers;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  // After fork() only the forking thread exists in the child: forget the workers (their
  // handles are leaked on purpose) and start new ones on the next call.
  void forget_after_fork() {
    new (&mu_) std::mutex();
    new (&region_mu_) std::mutex();
    new (&cv_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    new (&workers_) std::vector<std::thread*>();
    generation_ = 0;
  }

 private:
  void grow(int helpers) {
    while (int(workers_.size()) < helpers) {
      const int index = int(workers_.size());
      workers_.push_back(new std::thread([this, index] { loop(index); }));
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= active_helpers_) continue;  // not needed for this region
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
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
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread*> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int active_helpers_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

Pool& pool() {
  // Leaked on purpose: destroying it at exit would join threads that may be blocked.
  static Pool* p = [] {
    auto* created = new Pool();
    pthread_atfork(nullptr, nullptr, [] { pool().forget_after_fork(); });
    return created;
  }();
  return *p;
}

}  // namespace

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

void parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  if (n_threads <= 0) n_threads = hardware_threads();
  if (n_threads == 1 || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  pool().run(n_tasks, n_threads, fn);
}

}  // namespace fmha
