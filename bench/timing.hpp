// Timing of one pass: untimed warm-up runs, then timed runs, each timed on its own so that the
// median is robust to outliers (a preempted CPU thread, a GPU clock change).
#pragma once

#include <functional>
#include <vector>

#include "buffers.hpp"
#include "fa4/attention.hpp"

namespace fa4::bench {

// Calls `run` warmup + iters times; CPU runs are timed with std::chrono::steady_clock, GPU runs
// (memory == kDevice) with CUDA events on the legacy default stream, which `run` must use.
// Stops at the first failed run and returns its status; on success `ms` holds one time per timed run.
Status time_runs(Memory memory, int warmup, int iters, const std::function<Status()>& run,
                 std::vector<double>* ms);

double median(std::vector<double> values);

}  // namespace fa4::bench
