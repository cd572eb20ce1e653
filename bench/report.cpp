#include "report.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/numeric.hpp"
#include "fa4_bench_git_sha.hpp"  // generated at build time (bench/write_git_sha.cmake)
#include "options.hpp"
#include "problem.hpp"

namespace fa4::bench {
namespace {

constexpr double kFlopsPerTeraflop = 1e12;
constexpr double kMsPerSecond = 1e3;

std::string format(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, value);
  return buf;
}

// Keeps the fields in the order written (nlohmann::json would sort them by name).
using Json = nlohmann::ordered_json;

// A number as the record holds it: JSON has no inf / nan, so those are null. 9 significant digits
// read back as the same float (the GPU times are floats), which printed as a double would take 17.
Json number(double v) {
  if (!std::isfinite(v)) return nullptr;
  return std::strtod(format("%.9g", v).c_str(), nullptr);
}

const char* check_state(const CheckResult& c) {
  switch (c.state) {
    case CheckResult::State::kOff: return "off";
    case CheckResult::State::kSkipped: return "skipped";
    case CheckResult::State::kDone: return c.failed() ? "failed" : "passed";
  }
  return "?";
}

Json lengths(const Problem& p, bool keys_side) {
  const int32_t* cu = keys_side ? p.varlen.cu_seqlens_k : p.varlen.cu_seqlens_q;
  Json a = Json::array();
  for (int64_t b = 0; b < p.batch; ++b) a.push_back(int64_t(cu[b + 1] - cu[b]));
  return a;
}

Json problem_json(const Problem& p) {
  Json j;
  j["dtype"] = dtype_name(p.dtype);
  j["batch"] = p.batch;
  j["seqlen_q"] = p.seqlen_q;
  j["seqlen_k"] = p.seqlen_k;
  j["heads_q"] = p.heads_q;
  j["heads_kv"] = p.heads_kv;
  j["head_dim_qk"] = p.head_dim_qk;
  j["head_dim_v"] = p.head_dim_v;
  j["causal"] = p.causal;
  j["window_left"] = p.window.left;
  j["window_right"] = p.window.right;
  j["softcap"] = number(p.softcap);
  j["softmax_scale"] = number(p.scale());
  j["varlen_seqlens_q"] = p.is_varlen() ? lengths(p, false) : Json(nullptr);
  j["varlen_seqlens_k"] = p.is_varlen() ? lengths(p, true) : Json(nullptr);
  Json used = nullptr;
  if (p.seqused_k != nullptr) {
    used = Json::array();
    for (int64_t b = 0; b < p.batch; ++b) used.push_back(int64_t(p.seqused_k[b]));
  }
  j["seqused_k"] = used;
  j["return_lse"] = p.return_lse;
  j["deterministic"] = p.deterministic;
  j["visible_pairs_per_head"] = visible_pairs(p);
  return j;
}

Json check_json(const CheckResult& c) {
  Json j;
  j["state"] = check_state(c);
  j["scope"] = c.scope;
  j["outputs"] = Json::array();
  for (const Comparison& cmp : c.comparisons) {
    Json o;
    o["output"] = cmp.output;
    o["pass"] = cmp.pass;
    o["elements"] = cmp.elements;
    o["non_finite"] = cmp.non_finite;
    o["max_error"] = number(cmp.max_error);
    o["baseline_error"] = number(cmp.baseline);
    o["tolerance"] = number(cmp.tolerance);
    o["worst"] = cmp.worst;
    j["outputs"].push_back(o);
  }
  return j;
}

}  // namespace

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

std::string git_sha() { return FA4_BENCH_GIT_SHA; }

std::string header_line(const Problem& p, const RunInfo& info) {
  std::ostringstream s;
  s << "fa4-bench " << version() << " (" << git_sha() << ") | " << info.backend;
  if (info.backend == "cpu") s << ", " << info.cpu_threads << " threads";
  if (!info.gpu.name.empty()) s << ", " << info.gpu.name;
  s << " | " << describe(p) << " | seed " << info.seed << ", " << info.warmup << " warm-up + "
    << info.iters << " timed run" << (info.iters == 1 ? "" : "s");
  return s.str();
}

std::string pass_line(const PassReport& pass) {
  std::ostringstream s;
  // One decimal suits GPU rates; CPU rates are far below 1 TFLOP/s and need significant digits.
  s << pass.pass << "  " << format("%10.4f", pass.median_ms) << " ms  "
    << format(pass.tflops >= 1.0 ? "%9.1f" : "%9.3g", pass.tflops) << " TFLOP/s  " << pass.check.summary();
  return s.str();
}

std::string write_json(const std::string& path, const Problem& p, const RunInfo& info,
                       const std::vector<PassReport>& passes) {
  Json j;
  j["tool"] = "fa4-bench";
  j["version"] = version();
  j["git_sha"] = git_sha();
  j["timestamp_utc"] = info.timestamp_utc;
  j["backend"] = info.backend;
  Json device;
  if (info.backend == "cpu") {
    device["kind"] = "cpu";
    device["threads"] = info.cpu_threads;
  } else {
    device["kind"] = "gpu";
    device["name"] = info.gpu.name;
    device["compute_capability"] = info.gpu.compute_capability;
    device["sm_count"] = info.gpu.sm_count;
    device["sm_clock_mhz"] = info.gpu.sm_clock_mhz;
    device["memory_clock_mhz"] = info.gpu.memory_clock_mhz;
  }
  j["device"] = device;
  j["seed"] = info.seed;
  j["warmup"] = info.warmup;
  j["iters"] = info.iters;
  j["problem"] = problem_json(p);
  j["passes"] = Json::array();
  for (const PassReport& pass : passes) {
    Json r;
    r["pass"] = pass.pass;
    r["median_ms"] = number(pass.median_ms);
    r["times_ms"] = Json::array();
    for (double t : pass.times_ms) r["times_ms"].push_back(number(t));
    r["flops"] = number(pass.flops);
    r["tflops"] = number(pass.tflops);
    r["check"] = check_json(pass.check);
    j["passes"].push_back(r);
  }

  std::ofstream file(path);
  if (!file) return "cannot open '" + path + "' for writing";
  // Invalid UTF-8 (in a device name, say) becomes U+FFFD rather than an exception.
  file << j.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  file.flush();
  if (!file) return "error writing '" + path + "'";
  return {};
}

double tflops(double flops, double ms) {
  return ms > 0.0 ? flops / (ms / kMsPerSecond) / kFlopsPerTeraflop : 0.0;
}

}  // namespace fa4::bench
