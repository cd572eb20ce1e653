// Debug counters of the sm90 forward softmax's O rescales, host side: how many times the adaptive
// rule (softmax.cuh) rescaled O, beside how many times an exact (threshold-0) online softmax would
// have. Counting is compiled into the kernels only with FA4_SM90_RESCALE_STATS=ON
// (cmake/fa4_sm90.cmake); other builds report kNotSupported and carry no counting code.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// Counts over all warps of all forward kernels run since the last reset. A "warp tile" is one key
// tile seen by one consumer warp (16 query rows); an O rescale is counted per warp tile.
struct RescaleCounts {
  uint64_t warp_tiles = 0;
  uint64_t exact_rescales = 0;     // warp tiles on which a threshold-0 softmax rescales O
  uint64_t adaptive_rescales = 0;  // warp tiles on which the built softmax rescaled O
};

// The device counters' layout, shared by the kernels' atomics and the host reads.
enum RescaleCountField : int { kWarpTiles, kExactRescales, kAdaptiveRescales, kRescaleCountFields };

// Sums the counters of every forward kernel instance of the library on the current device, after
// waiting for the device to finish its work; with `reset`, zeroes them afterwards.
Status read_rescale_counts(RescaleCounts* counts, bool reset);

// One kernel instance's counters (its translation unit's __device__ array, read and zeroed from
// that unit: without relocatable device code no other unit can name it). Returns cudaError_t values.
struct RescaleCountsSource {
  int (*add_to)(RescaleCounts* sum);
  int (*reset)();
};
bool register_rescale_counts_source(RescaleCountsSource source);

}  // namespace fa4::sm90

// For callers without the C++ headers (bench/sweep.py through ctypes): counts[0..2] = warp tiles,
// exact rescales, adaptive rescales. Returns a StatusCode value: 0, kNotSupported (2) in builds
// without the counters, kDeviceError (5).
extern "C" FA4_API int fa4_debug_sm90_rescale_counts(uint64_t* counts, int reset);
