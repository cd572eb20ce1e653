// fa4-bench's output: one console line per pass, and the --json record.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "check.hpp"
#include "fa4/attention.hpp"
#include "gpu_info.hpp"

namespace fa4::bench {

struct PassReport {
  std::string pass;           // "fwd" or "bwd"
  std::vector<double> times_ms;
  double median_ms = 0.0;
  double flops = 0.0;         // per run, over the visible (query, key) pairs
  double tflops = 0.0;        // flops / median time
  CheckResult check;
};

struct RunInfo {
  std::string backend;  // "cpu" or "sm90"
  int cpu_threads = 0;  // CPU backend: the threads it uses
  GpuInfo gpu;          // GPU backend
  uint64_t seed = 0;
  int warmup = 0;
  int iters = 0;
  std::string timestamp_utc;  // ISO 8601, when the run started
};

// TFLOP/s of `flops` FLOPs done in `ms` milliseconds.
double tflops(double flops, double ms);

std::string utc_timestamp();
std::string git_sha();  // of the source tree at build time ("-dirty" if modified), or "unknown"

// "fa4-bench 0.1.0 (sha) | cpu, 2 threads | bf16 b=2 ... | seed 42, 1 warm-up + 5 timed runs"
std::string header_line(const Problem& problem, const RunInfo& info);
// "fwd     0.8660 ms     634.9 TFLOP/s  check passed (64 sampled rows); O err ..."
std::string pass_line(const PassReport& pass);

// Writes one JSON object; returns an empty string, or why the file could not be written.
std::string write_json(const std::string& path, const Problem& problem, const RunInfo& info,
                       const std::vector<PassReport>& passes);

}  // namespace fa4::bench
