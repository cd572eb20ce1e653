#include "cpu/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace fa4::cpu {

namespace {
// A typo such as cpu_threads = 100000 should not try to start that many threads.
constexpr int kMaxThreads = 1024;
}  // namespace

int thread_count(int requested) {
  if (requested > 0) return std::min(requested, kMaxThreads);
  const unsigned hw = std::thread::hardware_concurrency();  // 0 when unknown
  return hw > 0 ? int(hw) : 1;
}

int worker_count(int64_t n, int requested) {
  return int(std::max<int64_t>(1, std::min<int64_t>(n, thread_count(requested))));
}

void parallel_for(int64_t n, int workers, const std::function<void(int64_t, int)>& task) {
  if (n <= 0) return;
  // Relaxed is enough: the counter only hands out indices; join() publishes the tasks' results.
  std::atomic<int64_t> next{0};
  auto drain = [&](int worker) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      task(i, worker);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(size_t(std::max(workers - 1, 0)));
  for (int w = 1; w < workers; ++w) {
    try {
      helpers.emplace_back(drain, w);
    } catch (const std::system_error&) {
      break;  // out of threads: the ones running still empty the counter
    }
  }
  drain(0);
  for (std::thread& t : helpers) t.join();
}

}  // namespace fa4::cpu
