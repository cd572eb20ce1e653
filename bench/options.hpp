// fa4-bench's command line: what to run and how to measure it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fa4/attention.hpp"

namespace fa4::bench {

struct Options {
  std::string backend_name = "auto";  // auto | cpu | sm90, as typed (resolved later)
  bool run_forward = true;  // --pass both (the default): forward and backward
  bool run_backward = true;

  int64_t batch = 2;
  int64_t seqlen_q = 1024;
  int64_t seqlen_k = 1024;
  int64_t heads_q = 16;
  int64_t heads_kv = 0;    // 0: same as heads_q
  int64_t head_dim = 128;
  int64_t head_dim_v = 0;  // 0: same as head_dim
  DType dtype = DType::kBF16;
  bool causal = false;
  Window window{};
  float softcap = 0.0f;
  float scale = 0.0f;
  std::vector<int32_t> varlen_q;   // per-sequence query lengths; non-empty ⇒ varlen mode
  std::vector<int32_t> varlen_k;   // per-sequence key lengths (default: varlen_q)
  std::vector<int32_t> seqused_k;  // optional per-sequence used key counts
  bool lse = false;
  bool deterministic = false;

  int warmup = -1;  // -1: the backend's default (see usage())
  int iters = -1;
  int check_rows = 32;
  std::string json_path;
  uint64_t seed = 0;
  bool seed_given = false;
};

// Outcome of parsing: run with `options`, or stop (help asked for, or a usage error with `error`).
struct ParseResult {
  enum Kind { kRun, kHelp, kError } kind = kRun;
  Options options;
  std::string error;
};

ParseResult parse_args(int argc, char** argv);
std::string usage();

}  // namespace fa4::bench
