// The CPU backend's forward pass against the double reference, over a covering matrix: every shape
// meets every mask kind × softcap on/off × dtype, while GQA ratio, head dims, layout, input kind,
// scale and return_lse rotate through their values. Plus a 4224-token sequence checked on sampled
// rows, and checks that the tolerances reject the mistakes they are there to catch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"

namespace fa4::test {
namespace {

// The forward matrix's shapes: the (seqlen_q, seqlen_k) pairs docs/testing.md names (the 4224 one
// is CpuForwardLong), sq > sk with seqused_k, and varlen batches with odd and zero lengths.
const std::vector<CaseShape>& forward_shapes() {
  static const std::vector<CaseShape> shapes = {
      {"q1_k1", 2, 1, 1, {}, {}, {}},
      {"q1_k4096", 1, 1, 4096, {}, {}, {}},
      {"q17_k17", 2, 17, 17, {}, {}, {}},
      {"q113_k203", 2, 113, 203, {}, {}, {}},
      {"q128_k217", 1, 128, 217, {}, {}, {}},
      {"q512_k256", 1, 512, 256, {}, {}, {}},
      {"q2048_k1", 1, 2048, 1, {}, {}, {}},
      {"q203_k113_used", 2, 203, 113, {}, {}, {113, 50}},
      {"varlen_odd", 0, 0, 0, {177, 366, 479}, {257, 0, 766}, {}},
      {"varlen_self_used", 0, 0, 0, {177, 366, 479}, {177, 366, 479}, {177, 200, 0}},
      {"varlen_empty_q", 0, 0, 0, {0, 1, 64, 33, 2}, {5, 17, 0, 130, 1}, {}},
  };
  return shapes;
}

// pairs × heads × (dqk + dv) per case: keeps the double reference near half a second at most.
constexpr int64_t kForwardBudget = 120'000'000;

std::vector<Case> forward_cases() { return covering_cases(forward_shapes(), kForwardBudget, "f"); }

// Runs the CPU forward on a case and checks it against the exact and low-precision references;
// `sample` restricts the comparison to those rows (the reference is O(n²) in double).
void run_forward(const Case& c, const std::vector<ref::RowSample>& sample = {}) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  const Problem& p = setup->problem;
  const bool padded_outputs = setup->packed || setup->layout == Layout::kPadded;

  HostTensor out(p.dtype, query_dims(p, p.heads_q, p.head_dim_v),
                 setup->packed ? Layout::kPadded : setup->layout);
  HostLse lse = make_lse(p, padded_outputs);
  const std::vector<double> q_before = setup->q.dense(), k_before = setup->k.dense(),
                            v_before = setup->v.dense();

  ForwardTensors t;
  t.q = setup->q.view();
  t.k = setup->k.view();
  t.v = setup->v.view();
  t.out = out.view();
  if (p.return_lse) t.lse = lse.view();
  size_t bytes = 0;
  ASSERT_TRUE(workspace_size(p, Backend::kCpu, Pass::kForward, &bytes).ok());
  HostWorkspace workspace(bytes);
  const Status status = forward(p, t, workspace.view(), nullptr, Backend::kCpu);
  ASSERT_TRUE(status.ok()) << to_string(status.code) << ": " << status.message;

  // Every element that must be written was, with a number; nothing else was touched.
  const std::vector<unsigned char> q_rows = rows_in_sequences(p, /*keys=*/false);
  const CheckResult written = check_written("out", out, q_rows);
  EXPECT_TRUE(written.ok) << written.message;
  EXPECT_EQ(HostTensor::stray_writes({&out}), 0) << "out: elements outside the view were written";
  if (p.return_lse) {
    const CheckResult lse_written = check_written("lse", lse, q_rows);
    EXPECT_TRUE(lse_written.ok) << lse_written.message;
    EXPECT_EQ(lse.stray_writes(), 0) << "lse: elements outside the view were written";
  }
  EXPECT_TRUE(setup->q.dense() == q_before && setup->k.dense() == k_before &&
              setup->v.dense() == v_before)
      << "the forward pass modified its inputs";

  const ref::ForwardResult exact = ref::forward(p, t.q, t.k, t.v, ref::Precision::kExact, sample);
  const ref::ForwardResult lp =
      ref::forward(p, t.q, t.k, t.v, ref::Precision::kLowPrecision, sample);

  // Elements the reference computed: the sample, or every row of every sequence.
  int64_t rows_checked = 0;
  if (sample.empty()) {
    rows_checked = std::count(q_rows.begin(), q_rows.end(), 1) * p.heads_q;
  } else {
    rows_checked = int64_t(sample.size());
  }

  const std::vector<double> o = out.dense();
  const DenseShape out_shape = tensor_shape(out.dims());
  const CheckResult bounded =
      check_bounded("out vs fp32 bound", out_shape, o, exact.out, cpu_out_bound(p, exact));
  EXPECT_TRUE(bounded.ok) << bounded.message;
  EXPECT_EQ(bounded.compared, rows_checked * p.head_dim_v) << "reference rows missing";
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const double score_abs_max = max_finite_abs(exact.score_abs);
  const double magnitude = max_finite_abs(exact.out);
  const CheckResult flash = check_flash_rule("out vs §4 rule", out_shape, o, exact.out, lp.out,
                                             rule.multiplier,
                                             rule.atol + alibi_slack(p, magnitude, score_abs_max));
  EXPECT_TRUE(flash.ok) << flash.message;

  if (p.return_lse) {
    const std::vector<double> l = lse.dense();
    const CheckResult lse_bounded =
        check_bounded("lse vs fp32 bound", lse_shape(p), l, exact.lse, cpu_lse_bound(p, exact));
    EXPECT_TRUE(lse_bounded.ok) << lse_bounded.message;
    EXPECT_EQ(lse_bounded.compared, rows_checked) << "reference rows missing";
    const CheckResult lse_flash =
        check_flash_rule("lse vs §4 rule", lse_shape(p), l, exact.lse, lp.lse, rule.multiplier,
                         rule.atol + alibi_slack(p, 1.0, score_abs_max));
    EXPECT_TRUE(lse_flash.ok) << lse_flash.message;
  }
}

// The score variants over every other case of a second covering matrix: sinks, ALiBi per head,
// and both together with ALiBi per (batch, head), in turn.
std::vector<Case> variant_cases(const std::vector<Case>& cases) {
  std::vector<Case> picked;
  for (size_t n = 0; n < cases.size(); n += 2) picked.push_back(with_variant(cases[n], n / 2));
  return picked;
}

class CpuForward : public ::testing::TestWithParam<Case> {};

TEST_P(CpuForward, MatchesReference) { run_forward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, CpuForward, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return param_info.param.name;
                         });
INSTANTIATE_TEST_SUITE_P(
    Variants, CpuForward,
    ::testing::ValuesIn(variant_cases(covering_cases(forward_shapes(), kForwardBudget / 2, "v"))),
    [](const ::testing::TestParamInfo<Case>& param_info) { return param_info.param.name; });

// One long causal sequence with spiky inputs: many key tiles, late maxima, rescales. The backend
// computes everything; the reference checks rows at the start, around tile-sized boundaries, at
// the end, and at random.
TEST(CpuForwardLong, Seq4224CausalSampledRows) {
  Case c;
  c.name = "long_q4224_k4224_causal_bf16";
  c.batch = 1;
  c.seqlen_q = c.seqlen_k = 4224;
  c.heads_q = 4;
  c.heads_kv = 1;
  c.dim_qk = c.dim_v = 128;
  c.dtype = DType::kBF16;
  c.causal = true;
  c.spiky = true;
  std::mt19937_64 rng = make_rng(c.name + "/rows");
  std::uniform_int_distribution<int64_t> any_row(0, c.seqlen_q - 1);
  std::vector<ref::RowSample> sample;
  for (int64_t h = 0; h < c.heads_q; ++h) {
    for (int64_t row :
         {0, 1, 2, 63, 64, 65, 127, 128, 129, 2111, 2112, 4095, 4096, 4159, 4160, 4222, 4223})
      sample.push_back({0, h, row});
    for (int n = 0; n < 16; ++n) sample.push_back({0, h, any_row(rng)});
  }
  std::sort(sample.begin(), sample.end(), [](const ref::RowSample& a, const ref::RowSample& b) {
    return a.head != b.head ? a.head < b.head : a.row < b.row;
  });
  sample.erase(std::unique(sample.begin(), sample.end(),
                           [](const ref::RowSample& a, const ref::RowSample& b) {
                             return a.head == b.head && a.row == b.row;
                           }),
               sample.end());
  run_forward(c, sample);
}

// ---- The tolerances must reject the mistakes they exist to catch. A result computed exactly (then
// stored in the dtype) for a subtly wrong problem stands in for a backend with that bug; checked
// against the right problem's reference and bounds, it must fail. bf16 has the loosest bounds.

struct Mistake {
  Problem problem;                // the problem the buggy backend effectively solves
  const HostTensor* k = nullptr;  // its inputs, when the bug is in how it reads them
  const HostTensor* v = nullptr;
};

void expect_caught(const Case& c, const std::function<Mistake(const CaseData&)>& mistake) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  const Problem& p = setup->problem;
  const TensorView q = setup->q.view(), k = setup->k.view(), v = setup->v.view();
  const ref::ForwardResult exact = ref::forward(p, q, k, v);

  const Mistake m = mistake(*setup);
  const ref::ForwardResult wrong =
      ref::forward(m.problem, q, m.k ? m.k->view() : k, m.v ? m.v->view() : v);
  std::vector<double> out = wrong.out, lse = wrong.lse;
  for (double& x : out) x = round_to(p.dtype, float(x));
  for (double& x : lse) x = float(x);

  const Dims dims = query_dims(p, p.heads_q, p.head_dim_v);
  const CheckResult out_check =
      check_bounded("out", tensor_shape(dims), out, exact.out, cpu_out_bound(p, exact));
  EXPECT_FALSE(out_check.ok) << "a wrong output passed: " << out_check.message;
  const CheckResult lse_check =
      check_bounded("lse", lse_shape(p), lse, exact.lse, cpu_lse_bound(p, exact));
  EXPECT_FALSE(lse_check.ok) << "a wrong LSE passed: " << lse_check.message;
}

Case sensitivity_case(const char* name, int64_t sq, int64_t sk) {
  Case c;
  c.name = name;
  c.batch = 1;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = c.heads_kv = 2;
  c.dim_qk = c.dim_v = 64;
  c.dtype = DType::kBF16;
  return c;
}

TEST(CpuForwardTolerance, CatchesOneKeyMoreOrLessInAWindow) {
  Case c = sensitivity_case("tol_window", 113, 203);
  c.window = {32, 0};
  for (int64_t left : {31, 33})
    expect_caught(c, [&](const CaseData& s) {
      Mistake m{s.problem};
      m.problem.window.left = left;
      return m;
    });
  expect_caught(c, [](const CaseData& s) {
    Mistake m{s.problem};
    m.problem.window.right = 1;
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesCausalOffByOne) {
  Case c = sensitivity_case("tol_causal", 512, 512);
  c.causal = true;
  static const int32_t kOneKeyShort[] = {511};
  expect_caught(c, [](const CaseData& s) {  // the diagonal key left out: j ≤ i + sk − sq − 1
    Mistake m{s.problem};
    m.problem.seqused_k = kOneKeyShort;  // shifts the bottom-right diagonal one key left
    return m;
  });
  expect_caught(c, [](const CaseData& s) {  // one key past the diagonal
    Mistake m{s.problem};
    m.problem.causal = false;
    m.problem.window = {-1, 1};
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesOneKeyDroppedOutOf4096) {
  Case c = sensitivity_case("tol_last_key", 1, 4096);
  static const int32_t kAllButOne[] = {4095};
  expect_caught(c, [](const CaseData& s) {
    Mistake m{s.problem};
    m.problem.seqused_k = kAllButOne;
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesTopLeftCausalAlignment) {
  Case c = sensitivity_case("tol_top_left", 203, 113);
  c.causal = true;
  expect_caught(c, [](const CaseData& s) {
    Mistake m{s.problem};
    m.problem.causal = false;  // j ≤ i instead of j ≤ i + sk − sq
    m.problem.window = {-1, s.problem.seqlen_q - s.problem.seqlen_k};
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesWrongScale) {
  Case c = sensitivity_case("tol_scale_dims", 128, 217);
  c.dim_qk = 192;
  c.dim_v = 128;
  expect_caught(c, [](const CaseData& s) {  // 1/sqrt(head_dim_v) instead of 1/sqrt(head_dim_qk)
    Mistake m{s.problem};
    m.problem.softmax_scale = float(1.0 / std::sqrt(double(s.problem.head_dim_v)));
    return m;
  });
  Case custom = sensitivity_case("tol_scale_custom", 128, 217);
  custom.scale = 0.1f;
  expect_caught(custom, [](const CaseData& s) {  // the caller's scale ignored
    Mistake m{s.problem};
    m.problem.softmax_scale = 0.0f;
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesMissingOrMisplacedSoftcap) {
  Case c = sensitivity_case("tol_softcap", 128, 217);
  c.softcap = 30.0f;  // a mild cap: normal scores are barely bent by it
  expect_caught(c, [](const CaseData& s) {
    Mistake m{s.problem};
    m.problem.softcap = 0.0f;
    return m;
  });
  c.softcap = 5.0f;
  expect_caught(c, [](const CaseData& s) {  // cap·tanh(qk / cap)·scale: capped before scaling
    Mistake m{s.problem};
    m.problem.softcap = s.problem.softcap * s.problem.scale();
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesWrongGqaMapping) {
  Case c = sensitivity_case("tol_gqa", 113, 203);
  c.heads_q = 8;
  c.heads_kv = 2;
  HostTensor k_modulo, v_modulo;
  expect_caught(c, [&](const CaseData& s) {  // query head h reading kv head h % heads_kv
    const Problem& p = s.problem;
    Mistake m{p};
    m.problem.heads_kv = p.heads_q;
    k_modulo = HostTensor(p.dtype, key_dims(p, p.heads_q, p.head_dim_qk));
    v_modulo = HostTensor(p.dtype, key_dims(p, p.heads_q, p.head_dim_v));
    for (HostTensor* t : {&k_modulo, &v_modulo}) {
      const HostTensor& src = t == &k_modulo ? s.k : s.v;
      const Dims d = t->dims();
      for (int64_t r = 0; r < d.batch * d.seq; ++r)
        for (int64_t h = 0; h < d.heads; ++h)
          for (int64_t e = 0; e < d.dim; ++e)
            t->set((r * d.heads + h) * d.dim + e,
                   src.get((r * p.heads_kv + h % p.heads_kv) * d.dim + e));
    }
    m.k = &k_modulo;
    m.v = &v_modulo;
    return m;
  });
}

TEST(CpuForwardTolerance, CatchesIgnoredSequsedK) {
  Case c = sensitivity_case("tol_seqused", 113, 203);
  c.batch = 2;
  c.causal = true;
  c.seqused_k = {150, 203};
  expect_caught(c, [](const CaseData& s) {
    Mistake m{s.problem};
    m.problem.seqused_k = nullptr;
    return m;
  });
}

}  // namespace
}  // namespace fa4::test
