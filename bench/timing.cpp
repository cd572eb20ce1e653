#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#ifdef FA4_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fa4::bench {
namespace {

Status time_on_host(int warmup, int iters, const std::function<Status()>& run, std::vector<double>* ms) {
  for (int i = 0; i < warmup; ++i)
    if (Status s = run(); !s.ok()) return s;
  ms->clear();
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (Status s = run(); !s.ok()) return s;
    const auto stop = std::chrono::steady_clock::now();
    ms->push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return Status::success();
}

#ifdef FA4_WITH_CUDA
Status device_error(const char* what, cudaError_t err) {
  return Status{StatusCode::kDeviceError, std::string(what) + ": " + cudaGetErrorString(err)};
}

// All events are recorded first and read after one final synchronisation, so the host never
// stalls the queue between runs (back-to-back launches, as in training).
Status time_on_device(int warmup, int iters, const std::function<Status()>& run, std::vector<double>* ms) {
  for (int i = 0; i < warmup; ++i)
    if (Status s = run(); !s.ok()) return s;
  std::vector<cudaEvent_t> events(size_t(iters) + 1, nullptr);
  Status status;
  for (auto& e : events) {
    if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) {
      e = nullptr;
      status = device_error("cudaEventCreate", err);
      break;
    }
  }
  for (int i = 0; i < iters && status.ok(); ++i) {
    cudaEventRecord(events[i], nullptr);
    status = run();
  }
  if (status.ok()) {
    cudaEventRecord(events[iters], nullptr);
    cudaError_t err = cudaEventSynchronize(events[iters]);
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) status = device_error("a timed run failed on the device", err);
  }
  ms->clear();
  for (int i = 0; i < iters && status.ok(); ++i) {
    float elapsed = 0.0f;
    if (cudaError_t err = cudaEventElapsedTime(&elapsed, events[i], events[i + 1]); err != cudaSuccess)
      status = device_error("cudaEventElapsedTime", err);
    ms->push_back(elapsed);
  }
  for (auto& e : events)
    if (e != nullptr) cudaEventDestroy(e);
  return status;
}
#endif

}  // namespace

Status time_runs(Memory memory, int warmup, int iters, const std::function<Status()>& run,
                 std::vector<double>* ms) {
  if (memory == Memory::kHost) return time_on_host(warmup, iters, run, ms);
#ifdef FA4_WITH_CUDA
  return time_on_device(warmup, iters, run, ms);
#else
  return Status{StatusCode::kBackendUnavailable, "GPU timing needs a build with CUDA"};
#endif
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  if (values.size() % 2 == 1) return values[mid];
  const double upper = values[mid];
  const double lower = *std::max_element(values.begin(), values.begin() + mid);
  return 0.5 * (lower + upper);
}

}  // namespace fa4::bench
