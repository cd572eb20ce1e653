// The CPU backend's only threading primitive: independent tasks handed out by a shared counter.
// No pool is kept between calls: the tasks are large (a tile of attention each), so starting a few
// threads per call costs little next to them.
#pragma once

#include <cstdint>
#include <functional>

namespace fa4::cpu {

// `requested` when positive (at most kMaxThreads), else the hardware's thread count (at least 1).
int thread_count(int requested);

// The number of threads parallel_for should use for n tasks: min(n, thread_count(requested)), at
// least 1.
int worker_count(int64_t n, int requested);

// Runs task(i, worker) once for every i in [0, n) on `workers` threads, the calling thread being
// worker 0; each thread takes the next index from a shared counter, so uneven tasks balance
// themselves. `worker` (< workers) lets callers give each thread its own scratch. Returns once
// every task has finished. Tasks must not throw. Should the system refuse a thread, the threads
// that did start take over its share.
void parallel_for(int64_t n, int workers,
                  const std::function<void(int64_t task, int worker)>& task);

}  // namespace fa4::cpu
