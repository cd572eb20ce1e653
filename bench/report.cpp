#include "report.hpp"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>

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

// A small streaming JSON writer: enough for flat objects, arrays and nesting, with commas handled.
class Json {
 public:
  explicit Json(std::ostream& os) : os_(os) {}

  Json& begin_object(const char* key = nullptr) { return open(key, '{'); }
  Json& end_object() { return close('}'); }
  Json& begin_array(const char* key = nullptr) { return open(key, '['); }
  Json& end_array() { return close(']'); }

  Json& field(const char* key, const std::string& v) { prefix(key); quote(v); return *this; }
  Json& field(const char* key, const char* v) { return field(key, std::string(v)); }
  Json& field(const char* key, bool v) { prefix(key); os_ << (v ? "true" : "false"); return *this; }
  Json& field(const char* key, int64_t v) { prefix(key); os_ << v; return *this; }
  Json& field(const char* key, int v) { return field(key, int64_t(v)); }
  Json& field(const char* key, uint64_t v) { prefix(key); os_ << v; return *this; }
  Json& field(const char* key, double v) {
    prefix(key);
    if (std::isfinite(v)) os_ << format("%.9g", v);
    else os_ << "null";  // JSON has no inf / nan
    return *this;
  }
  Json& null(const char* key) { prefix(key); os_ << "null"; return *this; }
  template <typename T>
  Json& value(T v) { return field(nullptr, v); }

 private:
  Json& open(const char* key, char bracket) {
    prefix(key);
    os_ << bracket;
    first_ = true;
    ++depth_;
    return *this;
  }
  Json& close(char bracket) {
    --depth_;
    newline();
    os_ << bracket;
    first_ = false;
    if (depth_ == 0) os_ << "\n";
    return *this;
  }
  void prefix(const char* key) {
    if (depth_ > 0) {
      if (!first_) os_ << ",";
      newline();
    }
    first_ = false;
    if (key != nullptr) {
      quote(key);
      os_ << ": ";
    }
  }
  void newline() {
    os_ << "\n";
    for (int i = 0; i < depth_; ++i) os_ << "  ";
  }
  void quote(const std::string& s) {
    os_ << '"';
    for (unsigned char ch : s) {
      if (ch == '"' || ch == '\\') {
        os_ << '\\' << ch;
      } else if (ch < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(ch));
        os_ << buf;
      } else {
        os_ << ch;
      }
    }
    os_ << '"';
  }

  std::ostream& os_;
  int depth_ = 0;
  bool first_ = true;
};

const char* check_state(const CheckResult& c) {
  switch (c.state) {
    case CheckResult::State::kOff: return "off";
    case CheckResult::State::kSkipped: return "skipped";
    case CheckResult::State::kDone: return c.failed() ? "failed" : "passed";
  }
  return "?";
}

void write_lengths(Json& j, const char* key, const Problem& p, bool keys_side) {
  j.begin_array(key);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t* cu = keys_side ? p.varlen.cu_seqlens_k : p.varlen.cu_seqlens_q;
    j.value(int64_t(cu[b + 1] - cu[b]));
  }
  j.end_array();
}

void write_problem(Json& j, const Problem& p) {
  j.begin_object("problem");
  j.field("dtype", dtype_name(p.dtype));
  j.field("batch", p.batch);
  j.field("seqlen_q", p.seqlen_q);
  j.field("seqlen_k", p.seqlen_k);
  j.field("heads_q", p.heads_q);
  j.field("heads_kv", p.heads_kv);
  j.field("head_dim_qk", p.head_dim_qk);
  j.field("head_dim_v", p.head_dim_v);
  j.field("causal", p.causal);
  j.field("window_left", p.window.left);
  j.field("window_right", p.window.right);
  j.field("softcap", double(p.softcap));
  j.field("softmax_scale", double(p.scale()));
  if (p.is_varlen()) {
    write_lengths(j, "varlen_seqlens_q", p, false);
    write_lengths(j, "varlen_seqlens_k", p, true);
  } else {
    j.null("varlen_seqlens_q").null("varlen_seqlens_k");
  }
  if (p.seqused_k != nullptr) {
    j.begin_array("seqused_k");
    for (int64_t b = 0; b < p.batch; ++b) j.value(int64_t(p.seqused_k[b]));
    j.end_array();
  } else {
    j.null("seqused_k");
  }
  j.field("return_lse", p.return_lse);
  j.field("deterministic", p.deterministic);
  j.field("visible_pairs_per_head", visible_pairs(p));
  j.end_object();
}

void write_check(Json& j, const CheckResult& c) {
  j.begin_object("check");
  j.field("state", check_state(c));
  j.field("scope", c.scope);
  j.begin_array("outputs");
  for (const Comparison& cmp : c.comparisons) {
    j.begin_object();
    j.field("output", cmp.output);
    j.field("pass", cmp.pass);
    j.field("elements", cmp.elements);
    j.field("non_finite", cmp.non_finite);
    j.field("max_error", cmp.max_error);
    j.field("baseline_error", cmp.baseline);
    j.field("tolerance", cmp.tolerance);
    j.field("worst", cmp.worst);
    j.end_object();
  }
  j.end_array();
  j.end_object();
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
  std::ofstream file(path);
  if (!file) return "cannot open '" + path + "' for writing";
  Json j(file);
  j.begin_object();
  j.field("tool", "fa4-bench");
  j.field("version", version());
  j.field("git_sha", git_sha());
  j.field("timestamp_utc", info.timestamp_utc);
  j.field("backend", info.backend);
  j.begin_object("device");
  if (info.backend == "cpu") {
    j.field("kind", "cpu");
    j.field("threads", info.cpu_threads);
  } else {
    j.field("kind", "gpu");
    j.field("name", info.gpu.name);
    j.field("compute_capability", info.gpu.compute_capability);
    j.field("sm_count", info.gpu.sm_count);
    j.field("sm_clock_mhz", info.gpu.sm_clock_mhz);
    j.field("memory_clock_mhz", info.gpu.memory_clock_mhz);
  }
  j.end_object();
  j.field("seed", info.seed);
  j.field("warmup", info.warmup);
  j.field("iters", info.iters);
  write_problem(j, p);
  j.begin_array("passes");
  for (const PassReport& pass : passes) {
    j.begin_object();
    j.field("pass", pass.pass);
    j.field("median_ms", pass.median_ms);
    j.begin_array("times_ms");
    for (double t : pass.times_ms) j.value(t);
    j.end_array();
    j.field("flops", pass.flops);
    j.field("tflops", pass.tflops);
    write_check(j, pass.check);
    j.end_object();
  }
  j.end_array();
  j.end_object();
  file.flush();
  if (!file) return "error writing '" + path + "'";
  return {};
}

double tflops(double flops, double ms) {
  return ms > 0.0 ? flops / (ms / kMsPerSecond) / kFlopsPerTeraflop : 0.0;
}

}  // namespace fa4::bench
