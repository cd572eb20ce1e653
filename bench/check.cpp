#include "check.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>

#include "common/numeric.hpp"
#include "common/reference.hpp"
#include "problem.hpp"

namespace fa4::bench {
namespace {

// The accuracy rule (docs/testing.md, after flash_attn's tests): the kernel may be at most rtol
// times as far from the exact reference as the low-precision reference is, plus a small absolute
// slack.
constexpr double kRtol = 2.0;
constexpr double kRtolSoftcap = 3.0;  // tanh adds its own rounding on top
constexpr double kForwardAtol = 1e-5;
constexpr double kBackwardAtol = 1e-4;
constexpr uint64_t kSampleStream = 0x5eed5a3b1e;  // keeps the row sample apart from the input data

double rtol_for(const Problem& p) { return p.softcap > 0.0f ? kRtolSoftcap : kRtol; }

double element(const std::vector<std::byte>& data, DType dtype, int64_t index) {
  return visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return double(to_float(reinterpret_cast<const T*>(data.data())[index]));
  });
}

// |a − b| with equal infinities at distance 0 (a row that sees no key has LSE +inf in both).
double distance(double a, double b) { return a == b ? 0.0 : std::fabs(a - b); }

// Accumulates one Comparison element by element.
class Tracker {
 public:
  explicit Tracker(std::string output) { c_.output = std::move(output); }

  void add(double x, double ref, double lp, std::string_view row_name, int64_t b,
           int64_t h, int64_t row, int64_t col) {
    ++c_.elements;
    const double err = distance(x, ref);
    if (std::isnan(x) || (std::isinf(x) && !std::isinf(ref))) {
      if (c_.non_finite++ == 0) first_non_finite_ = locate(b, h, row, col, row_name);
    } else if (err > c_.max_error) {
      c_.max_error = err;
      c_.worst = locate(b, h, row, col, row_name);
    }
    const double base = distance(lp, ref);
    if (std::isfinite(base)) c_.baseline = std::max(c_.baseline, base);
  }

  Comparison finish(double rtol, double atol) {
    c_.tolerance = rtol * c_.baseline + atol;
    c_.pass = c_.non_finite == 0 && c_.max_error <= c_.tolerance;
    if (c_.non_finite > 0) c_.worst = "first non-finite at " + first_non_finite_;
    return c_;
  }

 private:
  static std::string locate(int64_t b, int64_t h, int64_t row, int64_t col, std::string_view row_name) {
    std::ostringstream s;
    s << "b=" << b << " h=" << h << " " << row_name << "=" << row;
    if (col >= 0) s << " col=" << col;
    return s.str();
  }
  Comparison c_;
  std::string first_non_finite_;
};

// Row of sequence b's first query / key in the dense [rows][heads][dim] layouts.
int64_t first_query_row(const Problem& p, int64_t b) {
  return p.is_varlen() ? p.varlen.cu_seqlens_q[b] : b * p.seqlen_q;
}
int64_t first_key_row(const Problem& p, int64_t b) {
  return p.is_varlen() ? p.varlen.cu_seqlens_k[b] : b * p.seqlen_k;
}
// Key rows of sequence b that are written (seqused_k shortens what is read, not what is written).
int64_t written_key_rows(const Problem& p, int64_t b) {
  return p.is_varlen() ? p.varlen.cu_seqlens_k[b + 1] - p.varlen.cu_seqlens_k[b] : p.seqlen_k;
}

int64_t lse_index(const Problem& p, int64_t b, int64_t h, int64_t row) {
  if (p.is_varlen()) return h * p.varlen.total_q + p.varlen.cu_seqlens_q[b] + row;
  return (b * p.heads_q + h) * p.seqlen_q + row;
}

// Distinct (batch, head, row) triples, uniformly over all query rows of all heads, plus the first
// and the last one (the edges of the masks).
std::vector<ref::RowSample> sample_rows(const Problem& p, int count, uint64_t seed) {
  std::vector<int64_t> seq_start(size_t(p.batch) + 1, 0);  // in units of (head, row) pairs
  for (int64_t b = 0; b < p.batch; ++b)
    seq_start[b + 1] = seq_start[b] + p.heads_q * sequence_queries(p, b);
  const int64_t total = seq_start.back();

  std::set<int64_t> picked;
  if (total <= count) {
    for (int64_t i = 0; i < total; ++i) picked.insert(i);
  } else if (count > 0) {
    picked.insert(0);
    if (count > 1) picked.insert(total - 1);
    std::mt19937_64 rng(seed ^ kSampleStream);
    std::uniform_int_distribution<int64_t> pick(0, total - 1);
    while (int64_t(picked.size()) < count) picked.insert(pick(rng));
  }

  std::vector<ref::RowSample> rows;
  for (int64_t i : picked) {
    const int64_t b = std::upper_bound(seq_start.begin(), seq_start.end(), i) - seq_start.begin() - 1;
    const int64_t sq = sequence_queries(p, b);
    const int64_t within = i - seq_start[b];
    rows.push_back({b, within / sq, within % sq});
  }
  return rows;
}

// The view `t` moved to sequence b's first row and head `head`, as a batch of one.
TensorView slice_view(const Problem& p, TensorView t, int64_t b, int64_t first_row, int64_t head) {
  const int64_t offset = (p.is_varlen() ? first_row * t.seq_stride : b * t.batch_stride) + head * t.head_stride;
  t.data = static_cast<std::byte*>(t.data) + offset * int64_t(dtype_size(p.dtype));
  return t;
}

// The reference gradients of the whole problem, computed slice by slice on every core: one slice
// is one sequence and one kv head with its group of query heads, a fixed-length problem of batch
// 1 of its own (masks align within a sequence, so nothing couples slices). The double reference
// is single-threaded, and a problem near kMaxBackwardCheckScores takes minutes on one core.
ref::BackwardResult reference_gradients(const Problem& p, const HostTensors& in, ref::Precision precision) {
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  ref::BackwardResult full;
  const int64_t q_rows = p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
  const int64_t k_rows = p.is_varlen() ? p.varlen.total_k : p.batch * p.seqlen_k;
  full.dq.assign(size_t(q_rows * p.heads_q * dqk), 0.0);
  full.dk.assign(size_t(k_rows * p.heads_kv * dqk), 0.0);
  full.dv.assign(size_t(k_rows * p.heads_kv * dv), 0.0);

  const int64_t slices = p.batch * p.heads_kv;
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < slices;) {
      const int64_t b = i / p.heads_kv, g = i % p.heads_kv;
      const int64_t q0 = first_query_row(p, b), k0 = first_key_row(p, b);
      Problem s = p;
      s.batch = 1;
      s.seqlen_q = sequence_queries(p, b);
      s.seqlen_k = written_key_rows(p, b);
      s.heads_q = group;
      s.heads_kv = 1;
      s.varlen = VarLen{};
      s.seqused_k = p.seqused_k != nullptr ? p.seqused_k + b : nullptr;
      const ref::BackwardResult r = ref::backward(
          s, slice_view(p, in.q, b, q0, g * group), slice_view(p, in.k, b, k0, g),
          slice_view(p, in.v, b, k0, g), slice_view(p, in.dout, b, q0, g * group), precision);
      for (int64_t row = 0; row < s.seqlen_q; ++row)
        std::copy_n(&r.dq[size_t(row * group * dqk)], group * dqk,
                    &full.dq[size_t(((q0 + row) * p.heads_q + g * group) * dqk)]);
      for (int64_t row = 0; row < s.seqlen_k; ++row) {
        std::copy_n(&r.dk[size_t(row * dqk)], dqk, &full.dk[size_t(((k0 + row) * p.heads_kv + g) * dqk)]);
        std::copy_n(&r.dv[size_t(row * dv)], dv, &full.dv[size_t(((k0 + row) * p.heads_kv + g) * dv)]);
      }
    }
  };
  const int64_t threads = std::min<int64_t>(slices, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return full;
}

}  // namespace

bool CheckResult::failed() const {
  return std::any_of(comparisons.begin(), comparisons.end(), [](const Comparison& c) { return !c.pass; });
}

std::string CheckResult::summary() const {
  if (state == State::kOff) return "check off";
  if (state == State::kSkipped) return "check skipped (" + scope + ")";
  std::ostringstream s;
  s << "check " << (failed() ? "FAILED" : "passed") << " (" << scope << ")";
  char buf[160];
  for (const Comparison& c : comparisons) {
    if (c.non_finite > 0)
      std::snprintf(buf, sizeof buf, "; %s: %lld non-finite, %s", c.output.c_str(),
                    static_cast<long long>(c.non_finite), c.worst.c_str());
    else
      std::snprintf(buf, sizeof buf, "; %s err %.2e %s tol %.2e", c.output.c_str(), c.max_error,
                    c.pass ? "<=" : ">", c.tolerance);
    s << buf;
    if (!c.pass && c.non_finite == 0) s << " at " << c.worst;
  }
  return s.str();
}

CheckResult check_forward(const Problem& p, const HostTensors& in, const std::vector<std::byte>& out,
                          const std::vector<std::byte>* lse, int rows, uint64_t seed) {
  CheckResult result;
  if (rows <= 0) return result;
  const std::vector<ref::RowSample> sample = sample_rows(p, rows, seed);
  result.state = CheckResult::State::kDone;
  result.scope = std::to_string(sample.size()) + " sampled rows";
  if (sample.empty()) {
    result.scope = "no query rows";
    return result;
  }
  const ref::ForwardResult exact = ref::forward(p, in.q, in.k, in.v, ref::Precision::kExact, sample);
  const ref::ForwardResult lp = ref::forward(p, in.q, in.k, in.v, ref::Precision::kLowPrecision, sample);

  Tracker o("O"), l("LSE");
  const int64_t dv = p.head_dim_v;
  for (const ref::RowSample& r : sample) {
    const int64_t base = ((first_query_row(p, r.batch) + r.row) * p.heads_q + r.head) * dv;
    for (int64_t c = 0; c < dv; ++c)
      o.add(element(out, p.dtype, base + c), exact.out[base + c], lp.out[base + c], "row", r.batch,
            r.head, r.row, c);
    if (lse != nullptr) {
      const int64_t i = lse_index(p, r.batch, r.head, r.row);
      const double x = reinterpret_cast<const float*>(lse->data())[i];
      l.add(x, exact.lse[i], lp.lse[i], "row", r.batch, r.head, r.row, -1);
    }
  }
  result.comparisons.push_back(o.finish(rtol_for(p), kForwardAtol));
  if (lse != nullptr) result.comparisons.push_back(l.finish(rtol_for(p), kForwardAtol));
  return result;
}

CheckResult check_backward(const Problem& p, const HostTensors& in, const std::vector<std::byte>& dq,
                           const std::vector<std::byte>& dk, const std::vector<std::byte>& dv) {
  CheckResult result;
  const int64_t scores = score_elements(p);
  if (scores > kMaxBackwardCheckScores) {
    result.state = CheckResult::State::kSkipped;
    result.scope = "too large: " + std::to_string(scores) + " scores > 2^26";
    return result;
  }
  result.state = CheckResult::State::kDone;
  result.scope = "all rows";
  const ref::BackwardResult exact = reference_gradients(p, in, ref::Precision::kExact);
  const ref::BackwardResult lp = reference_gradients(p, in, ref::Precision::kLowPrecision);

  auto compare = [&](const char* name, const std::vector<std::byte>& x, const std::vector<double>& ref,
                     const std::vector<double>& low, bool query_side, int64_t heads, int64_t dim) {
    Tracker t(name);
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t first = query_side ? first_query_row(p, b) : first_key_row(p, b);
      const int64_t count = query_side ? sequence_queries(p, b) : written_key_rows(p, b);
      for (int64_t row = 0; row < count; ++row)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t c = 0; c < dim; ++c) {
            const int64_t i = ((first + row) * heads + h) * dim + c;
            t.add(element(x, p.dtype, i), ref[i], low[i],
                  query_side ? "row" : "key", b, h, row, c);
          }
    }
    result.comparisons.push_back(t.finish(rtol_for(p), kBackwardAtol));
  };
  compare("dQ", dq, exact.dq, lp.dq, true, p.heads_q, p.head_dim_qk);
  compare("dK", dk, exact.dk, lp.dk, false, p.heads_kv, p.head_dim_qk);
  compare("dV", dv, exact.dv, lp.dv, false, p.heads_kv, p.head_dim_v);
  return result;
}

}  // namespace fa4::bench
