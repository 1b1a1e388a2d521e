// A small persistent thread pool for the CPU kernels.
//
// Determinism comes from the decomposition, not the schedule: every task writes a disjoint
// part of the output and computes it in a fixed order, so which thread runs a task (and how
// many threads there are) cannot change a single bit of the result.
#pragma once

#include <cstdint>
#include <functional>

namespace fmha {

// Runs fn(task) for task in [0, n_tasks) on up to n_threads threads (the caller is one of
// them) and returns when all are done; the first exception thrown by a task is rethrown.
void parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t)>& fn);

int hardware_threads();

}  // namespace fmha
