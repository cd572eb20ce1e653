// fa4-bench's correctness check against the double-precision reference (tests/common/reference.hpp),
// by the accuracy rule of docs/testing.md: pass iff max|X − ref| ≤ rtol·max|lp − ref| + atol,
// where lp is the reference computed the kernel's way in low precision; NaN never passes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fa4/attention.hpp"

namespace fa4::bench {

struct Comparison {
  std::string output;      // "O", "LSE", "dQ", "dK", "dV"
  int64_t elements = 0;    // elements compared
  int64_t non_finite = 0;  // NaN, or infinite where the reference is finite (never passes)
  double max_error = 0.0;  // max |X − ref|
  double baseline = 0.0;   // max |lp − ref|
  double tolerance = 0.0;  // rtol · baseline + atol
  std::string worst;       // where max_error occurs, e.g. "b=0 h=3 row=17 col=5"
  bool pass = false;
};

struct CheckResult {
  enum class State { kOff, kSkipped, kDone };
  State state = State::kOff;
  std::string scope;  // what was compared ("32 sampled rows") or why it was skipped
  std::vector<Comparison> comparisons;

  bool failed() const;  // a comparison failed (kOff / kSkipped never fail)
  std::string summary() const;  // one line for the console
};

// The tensors live in host memory and use fa4-bench's contiguous layouts (which match the
// reference's dense results); `problem` has host cu_seqlens / seqused_k arrays.
struct HostTensors {
  TensorView q, k, v, dout;
};

// Compares `rows` sampled query rows (distinct (batch, head, row) triples, the first and the last
// row always among them) of `out` (dtype of the problem) and, when `lse` is non-null, of the LSE.
CheckResult check_forward(const Problem& problem, const HostTensors& in, const std::vector<std::byte>& out,
                          const std::vector<std::byte>* lse, int rows, uint64_t seed);

// Compares dQ, dK, dV in full (every row inside a sequence) when the problem has at most
// kMaxBackwardCheckScores score elements; otherwise returns kSkipped.
CheckResult check_backward(const Problem& problem, const HostTensors& in, const std::vector<std::byte>& dq,
                           const std::vector<std::byte>& dk, const std::vector<std::byte>& dv);

constexpr int64_t kMaxBackwardCheckScores = int64_t(1) << 26;

}  // namespace fa4::bench
