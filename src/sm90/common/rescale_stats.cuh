// Debug counters of the forward softmax's O rescales, device side (rescale_stats.hpp is the host
// side). Only with FA4_SM90_RESCALE_STATS: otherwise this header is empty and softmax.cuh keeps no
// tally, so normal kernels carry no counting code.
#pragma once

#if FA4_SM90_RESCALE_STATS

#include <cuda_runtime_api.h>

#include <cstdint>

#include <cute/config.hpp>

#include "sm90/common/rescale_stats.hpp"

namespace fa4::sm90 {
namespace {

// One array per translation unit, that is per kernel instance (fwd_*.cu): internal linkage keeps
// the instances apart without relocatable device code.
__device__ unsigned long long g_rescale_counts[kRescaleCountFields];

int add_instance_counts(RescaleCounts* sum) {
  unsigned long long c[kRescaleCountFields];
  const cudaError_t err = cudaMemcpyFromSymbol(c, g_rescale_counts, sizeof c);
  if (err == cudaSuccess) {
    sum->warp_tiles += c[kWarpTiles];
    sum->exact_rescales += c[kExactRescales];
    sum->adaptive_rescales += c[kAdaptiveRescales];
  }
  return int(err);
}

int reset_instance_counts() {
  const unsigned long long zero[kRescaleCountFields] = {};
  return int(cudaMemcpyToSymbol(g_rescale_counts, zero, sizeof zero));
}

[[maybe_unused]] const bool g_rescale_counts_registered =
    register_rescale_counts_source({&add_instance_counts, &reset_instance_counts});

}  // namespace

// One warp's counts, the same in all its lanes (every decision is a warp vote); kept in registers
// and added to the instance's counters once per query tile.
struct RescaleTally {
  uint32_t tiles = 0;
  uint32_t exact_rescales = 0;
  uint32_t adaptive_rescales = 0;

  CUTE_DEVICE void flush() {
    if (threadIdx.x % 32 == 0) {
      atomicAdd(&g_rescale_counts[kWarpTiles], tiles);
      atomicAdd(&g_rescale_counts[kExactRescales], exact_rescales);
      atomicAdd(&g_rescale_counts[kAdaptiveRescales], adaptive_rescales);
    }
    tiles = exact_rescales = adaptive_rescales = 0;
  }
};

}  // namespace fa4::sm90

#endif  // FA4_SM90_RESCALE_STATS
