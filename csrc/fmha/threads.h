// A small persistent thread pool for the CPU kernels.
//
// Determinism comes from the decomposition, not the schedule: every task writes a disjoint
// part of the output and computes it in a fixed order, so which thread runs a task (and how
// many threads there are) cannot change a single bit of the result.
//
// Small calls are cheap: a region whose estimated work cannot pay for a helper runs on the
// calling thread alone, helpers that finish a region spin for a short while before they
// park (so the next call of a model's layer loop finds them awake), and the caller never
// waits for a helper that has not started on the region (a late helper finds the region
// closed and goes back to waiting). docs/architecture.md, "The CPU thread pool".
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

namespace fmha {

// Estimated work of a region in nanoseconds of one thread; kUnknownWork: as many helpers as
// there are tasks and threads.
inline constexpr int64_t kUnknownWork = std::numeric_limits<int64_t>::max();

// Runs fn(task) for task in [0, n_tasks) on up to n_threads threads (the caller is one of
// them) and returns when all are done; the first exception thrown by a task is rethrown.
// work_ns: what the whole region would take on one thread (an estimate: it only decides
// how many helpers are worth waking, never which task runs where).
void parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t)>& fn,
                  int64_t work_ns = kUnknownWork);

// The helpers parallel_for would use for a region (for tests and fmha-bench).
int pool_helpers_for(int64_t n_tasks, int n_threads, int64_t work_ns);

int hardware_threads();

// Runs parallel regions on the OpenMP runtime at `path`, a shared library the process has
// already loaded (torch's libgomp), instead of on fmha's own pool; "" returns to the pool.
// Returns false, changing nothing, when no such runtime is loaded.
bool use_openmp_runtime(const std::string& path);
bool using_openmp_runtime();

}  // namespace fmha
