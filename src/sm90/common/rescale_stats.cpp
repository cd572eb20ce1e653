// The registry of the kernel instances' rescale counters (rescale_stats.cuh registers each one).
#include "sm90/common/rescale_stats.hpp"

#include <cuda_runtime_api.h>

#include <vector>

#include "common/status.hpp"

namespace fa4::sm90 {
namespace {

// Filled by static initializers of the instance units: a function-local static is constructed on
// first use, whatever their order.
std::vector<RescaleCountsSource>& sources() {
  static std::vector<RescaleCountsSource> registered;
  return registered;
}

#if FA4_SM90_RESCALE_STATS
Status device_error(const char* what, int err) {
  return detail::make_status(StatusCode::kDeviceError, "rescale counters: %s failed: %s", what,
                             cudaGetErrorString(cudaError_t(err)));
}
#endif

}  // namespace

bool register_rescale_counts_source(RescaleCountsSource source) {
  sources().push_back(source);
  return true;
}

Status read_rescale_counts(RescaleCounts* counts, bool reset) {
  *counts = RescaleCounts{};
#if FA4_SM90_RESCALE_STATS
  // The counters are added by kernels still in flight on any stream.
  if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess)
    return device_error("cudaDeviceSynchronize", err);
  for (const RescaleCountsSource& s : sources())
    if (const int err = s.add_to(counts); err != cudaSuccess) return device_error("reading", err);
  if (reset)
    for (const RescaleCountsSource& s : sources())
      if (const int err = s.reset(); err != cudaSuccess) return device_error("zeroing", err);
  return Status::success();
#else
  (void)reset;
  return detail::not_supported(
      "this build has no rescale counters (configure with -DFA4_SM90_RESCALE_STATS=ON)");
#endif
}

}  // namespace fa4::sm90

extern "C" FA4_API int fa4_debug_sm90_rescale_counts(uint64_t* counts, int reset) {
  fa4::sm90::RescaleCounts c;
  const fa4::Status status = fa4::sm90::read_rescale_counts(&c, reset != 0);
  counts[fa4::sm90::kWarpTiles] = c.warp_tiles;
  counts[fa4::sm90::kExactRescales] = c.exact_rescales;
  counts[fa4::sm90::kAdaptiveRescales] = c.adaptive_rescales;
  return int(status.code);
}
