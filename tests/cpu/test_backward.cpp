// The CPU backend's backward pass: dQ, dK, dV against the double reference's gradients over a
// covering matrix like the forward one (smaller shapes), and gradient checks by finite differences
// — first of the reference itself, tightly, in double, then of the backend against them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"

namespace fa4::test {
namespace {

const std::vector<CaseShape>& backward_shapes() {
  static const std::vector<CaseShape> shapes = {
      {"q1_k1", 2, 1, 1, {}, {}, {}},
      {"q17_k17", 2, 17, 17, {}, {}, {}},
      {"q113_k203", 1, 113, 203, {}, {}, {}},
      {"q128_k217", 1, 128, 217, {}, {}, {}},
      {"q256_k128", 1, 256, 128, {}, {}, {}},
      {"q1_k1024", 1, 1, 1024, {}, {}, {}},
      {"q2048_k1", 1, 2048, 1, {}, {}, {}},
      {"q77_k77_used", 2, 77, 77, {}, {}, {77, 30}},
      {"varlen_odd", 0, 0, 0, {17, 66, 79}, {57, 0, 166}, {}},
      {"varlen_self_used", 0, 0, 0, {45, 0, 130, 7}, {45, 0, 130, 7}, {45, 0, 100, 0}},
  };
  return shapes;
}

// pairs × heads × (dqk + dv) per case: the backward reference does about three times the forward's
// work per pair, in exact and low precision.
constexpr int64_t kBackwardBudget = 30'000'000;

std::vector<Case> backward_cases() {
  return covering_cases(backward_shapes(), kBackwardBudget, "b");
}

// A full set of backward inputs and outputs for a case: the forward run by the backend (as a user
// would, so `out` is stored in the dtype and the LSE in fp32), a random dO, poisoned gradients.
struct BackwardRun {
  std::unique_ptr<CaseData> setup;
  HostTensor out, dout;
  HostLse lse;
  std::vector<HostTensor> grads;  // dq, dk, dv
  std::vector<float> dsinks;      // with sinks: heads_q, poisoned (NaN) before the run
  BackwardTensors tensors;
};

// Rounds every element to a multiple of `grid`.
void quantize(HostTensor& t, double grid) {
  for (int64_t e = 0; e < t.size(); ++e) t.set(e, std::nearbyint(t.get(e) / grid) * grid);
}

// `grid` > 0: inputs rounded to multiples of it first (see kGrid below).
void prepare(const Case& c, BackwardRun& run, double grid = 0.0) {
  std::mt19937_64 rng = make_rng(c.name);
  run.setup = make_setup(c, rng);
  CaseData& s = *run.setup;
  Problem p = s.problem;
  p.return_lse = true;
  const Layout layout = s.packed ? Layout::kPadded : s.layout;
  run.out = HostTensor(p.dtype, query_dims(p, p.heads_q, p.head_dim_v), layout);
  run.lse = make_lse(p, layout == Layout::kPadded);
  run.dout = HostTensor(p.dtype, query_dims(p, p.heads_q, p.head_dim_v), layout);
  run.dout.fill_normal(rng);
  if (grid > 0.0) {
    for (HostTensor* t : {&s.q, &s.k, &s.v, &run.dout}) quantize(*t, grid);
    for (float& x : s.sinks) x = float(std::nearbyint(double(x) / grid) * grid);
  }

  ForwardTensors f;
  f.q = s.q.view();
  f.k = s.k.view();
  f.v = s.v.view();
  f.out = run.out.view();
  f.lse = run.lse.view();
  size_t bytes = 0;
  ASSERT_TRUE(workspace_size(p, Backend::kCpu, Pass::kForward, &bytes).ok());
  HostWorkspace workspace(bytes);
  const Status status = forward(p, f, workspace.view(), nullptr, Backend::kCpu);
  ASSERT_TRUE(status.ok()) << "forward: " << to_string(status.code) << ": " << status.message;

  if (s.packed) {
    // The gradients of a packed qkv input come back packed too.
    const Dims qd = query_dims(p, p.heads_q, p.head_dim_qk);
    run.grads =
        HostTensor::packed_qkv(p.dtype, qd.batch, qd.seq, p.heads_q, p.heads_kv, p.head_dim_qk);
  } else {
    run.grads = {HostTensor(p.dtype, query_dims(p, p.heads_q, p.head_dim_qk), layout),
                 HostTensor(p.dtype, key_dims(p, p.heads_kv, p.head_dim_qk), layout),
                 HostTensor(p.dtype, key_dims(p, p.heads_kv, p.head_dim_v), layout)};
  }
  BackwardTensors& t = run.tensors;
  t.q = f.q;
  t.k = f.k;
  t.v = f.v;
  t.out = f.out;
  t.lse = f.lse;
  t.dout = run.dout.view();
  t.dq = run.grads[0].view();
  t.dk = run.grads[1].view();
  t.dv = run.grads[2].view();
  if (p.sinks != nullptr) {
    run.dsinks.assign(size_t(p.heads_q), std::numeric_limits<float>::quiet_NaN());
    t.dsinks = run.dsinks.data();
  }
}

// d(sinks) against the reference: within its fp32 scale (the terms' size times 2⁻¹⁶, far above
// the LSE's and D's fp32 errors) and the rule against lp.
void check_dsinks(const Problem& p, const std::vector<float>& got, const ref::BackwardResult& exact,
                  const ref::BackwardResult& lp) {
  const std::vector<double> actual(got.begin(), got.end());
  std::vector<double> bound(exact.dsinks_abs);
  for (double& b : bound) b = b * 0x1p-16 + 1e-6;
  const DenseShape shape{{"h"}, {p.heads_q}};
  const CheckResult b = check_bounded("dsinks vs fp32 bound", shape, actual, exact.dsinks, bound);
  EXPECT_TRUE(b.ok) << b.message;
  EXPECT_EQ(b.compared, p.heads_q);
  const FlashRule rule = flash_rule(p, Pass::kBackward);
  double magnitude = 0.0;
  for (double x : exact.dsinks_abs) magnitude = std::max(magnitude, x);
  const double atol = rule.atol + alibi_slack(p, magnitude, exact.score_abs_max);
  const CheckResult f = check_flash_rule("dsinks vs §4 rule", shape, actual, exact.dsinks,
                                         lp.dsinks, rule.multiplier, atol);
  EXPECT_TRUE(f.ok) << f.message;
}

Status run_backward(const Problem& p, const BackwardTensors& t) {
  size_t bytes = 0;
  const Status ws = workspace_size(p, Backend::kCpu, Pass::kBackward, &bytes);
  if (!ws.ok()) return ws;
  HostWorkspace workspace(bytes);
  return backward(p, t, workspace.view(), nullptr, Backend::kCpu);
}

const char* const kGradNames[] = {"dq", "dk", "dv"};

void check_backward(const Case& c) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  BackwardRun run;
  prepare(c, run);
  if (::testing::Test::HasFatalFailure()) return;
  const Problem& p = run.setup->problem;
  const BackwardTensors& t = run.tensors;
  const CaseData& s = *run.setup;
  const std::vector<std::vector<double>> inputs_before = {
      s.q.dense(), s.k.dense(), s.v.dense(), run.out.dense(), run.dout.dense(), run.lse.dense()};
  const Status status = run_backward(p, t);
  ASSERT_TRUE(status.ok()) << to_string(status.code) << ": " << status.message;
  const std::vector<std::vector<double>> inputs_after = {
      s.q.dense(), s.k.dense(), s.v.dense(), run.out.dense(), run.dout.dense(), run.lse.dense()};
  // (Varlen rows outside every sequence hold the poison NaN, hence the NaN-aware comparison.)
  const auto same = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  for (size_t n = 0; n < inputs_before.size(); ++n)
    EXPECT_TRUE(std::equal(inputs_before[n].begin(), inputs_before[n].end(),
                           inputs_after[n].begin(), inputs_after[n].end(), same))
        << "the backward pass modified its input #" << n << " (q, k, v, out, dout, lse)";

  const std::vector<unsigned char> q_rows = rows_in_sequences(p, false),
                                   k_rows = rows_in_sequences(p, true);
  for (const CheckResult& w : check_gradients_written(run.grads, q_rows, k_rows, run.setup->packed))
    EXPECT_TRUE(w.ok) << w.message;

  // D = rowsum(dO ∘ O) from the O the backend was handed, as the backend computes it.
  const ref::BackwardResult exact =
      ref::backward(p, t.q, t.k, t.v, t.dout, ref::Precision::kExact, &t.out);
  const ref::BackwardResult lp =
      ref::backward(p, t.q, t.k, t.v, t.dout, ref::Precision::kLowPrecision, &t.out);
  const GradientBounds bounds = cpu_gradient_bounds(p, exact);
  const std::vector<double>* refs[] = {&exact.dq, &exact.dk, &exact.dv};
  const std::vector<double>* lps[] = {&lp.dq, &lp.dk, &lp.dv};
  const std::vector<double>* bound[] = {&bounds.dq, &bounds.dk, &bounds.dv};
  const int64_t rows[] = {std::count(q_rows.begin(), q_rows.end(), 1) * p.heads_q,
                          std::count(k_rows.begin(), k_rows.end(), 1) * p.heads_kv,
                          std::count(k_rows.begin(), k_rows.end(), 1) * p.heads_kv};
  const int64_t widths[] = {p.head_dim_qk, p.head_dim_qk, p.head_dim_v};
  const FlashRule rule = flash_rule(p, Pass::kBackward);
  for (int g = 0; g < 3; ++g) {
    const HostTensor& x = run.grads[size_t(g)];
    const std::vector<double> actual = x.dense();
    const DenseShape shape = tensor_shape(x.dims());
    const std::string name = kGradNames[g];
    const CheckResult b =
        check_bounded(name + " vs fp32 bound", shape, actual, *refs[g], *bound[g]);
    EXPECT_TRUE(b.ok) << b.message;
    EXPECT_EQ(b.compared, rows[g] * widths[g]) << name << ": reference rows missing";
    // fp32 inputs: lp is itself fp32 with its sums in another order, so twice its error bounds
    // nothing about the backend's (spiky rows missed it by 1.05×); the derived fp32 bound above
    // is the check there.
    if (p.dtype == DType::kFP32) continue;
    const double atol =
        rule.atol + alibi_slack(p, max_finite_abs(*refs[g]), exact.score_abs_max);
    const CheckResult f = check_flash_rule(name + " vs §4 rule", shape, actual, *refs[g], *lps[g],
                                           rule.multiplier, atol);
    EXPECT_TRUE(f.ok) << f.message;
  }
  if (p.sinks != nullptr) check_dsinks(p, run.dsinks, exact, lp);

  if (p.deterministic) {
    // Bitwise the same gradients from a second run into fresh buffers.
    BackwardRun again;
    prepare(c, again);
    if (::testing::Test::HasFatalFailure()) return;
    const Status s2 = run_backward(again.setup->problem, again.tensors);
    ASSERT_TRUE(s2.ok()) << s2.message;
    for (int g = 0; g < 3; ++g) {
      int64_t differ = 0;
      for (int64_t e = 0; e < run.grads[size_t(g)].size(); ++e)
        differ += run.grads[size_t(g)].bits(e) != again.grads[size_t(g)].bits(e);
      EXPECT_EQ(differ, 0) << kGradNames[g] << ": deterministic runs differ in " << differ
                           << " elements";
    }
  }
}

class CpuBackward : public ::testing::TestWithParam<Case> {};

TEST_P(CpuBackward, MatchesReferenceGradients) { check_backward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, CpuBackward, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return param_info.param.name;
                         });

// The score variants over every other case of a second covering matrix: sinks (with d(sinks)),
// ALiBi per head, both with ALiBi per (batch, head), in turn.
std::vector<Case> backward_variant_cases() {
  std::vector<Case> picked;
  const std::vector<Case> cases = covering_cases(backward_shapes(), kBackwardBudget / 2, "bv");
  for (size_t n = 0; n < cases.size(); n += 2) picked.push_back(with_variant(cases[n], n / 2));
  return picked;
}

INSTANTIATE_TEST_SUITE_P(Variants, CpuBackward, ::testing::ValuesIn(backward_variant_cases()),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return param_info.param.name;
                         });

// ---- Finite differences. The loss is L = Σ out ∘ dO, out from the exact reference in double.
// Central differences with Richardson extrapolation, (4·D(h/2) − D(h)) / 3, leave an O(h⁴)
// truncation error. The fp32 inputs are multiples of 2⁻¹² below 2¹¹ in magnitude, so x ± h and
// x ± h/2 are exact fp32 values for h = 2⁻¹⁰ (an arbitrary fp32 x near a power of two would lose
// its last bit stepping up a binade). Two errors remain: the truncation, bounded relative to the
// tensor's largest gradient (kReferenceTolerance), and the double rounding of L, which does not
// shrink with the gradient: L off by δ moves D(h) by up to δ / h and the extrapolation by up to
// 3δ / h. δ is charged as kLossUlps units of 2⁻⁵² of Σ |out ∘ dO| (the whole difference, truncation
// included, measured at most 5.8 units over 1,500 seeds of these tests). Both terms stay orders of
// magnitude below what a wrong gradient is off by.
constexpr double kGrid = 0x1p-12;
constexpr double kStep = 0x1p-10;
constexpr double kReferenceTolerance = 1e-9;  // relative to the largest gradient of the tensor
constexpr double kLossUlps = 32;

struct Loss {
  double value = 0.0;
  double magnitude = 0.0;  // Σ |out ∘ dO|, what L's rounding is relative to
};

Loss loss_terms(const Problem& p, const CaseData& s, const std::vector<double>& dout) {
  const ref::ForwardResult f = ref::forward(p, s.q.view(), s.k.view(), s.v.view());
  Loss l;
  for (size_t e = 0; e < f.out.size(); ++e)
    if (!std::isnan(f.out[e])) {
      l.value += f.out[e] * dout[e];
      l.magnitude += std::fabs(f.out[e] * dout[e]);
    }
  return l;
}

double loss(const Problem& p, const CaseData& s, const std::vector<double>& dout) {
  return loss_terms(p, s, dout).value;
}

// What the extrapolated differences may be off by through L's rounding alone.
double rounding_floor(const Problem& p, const CaseData& s, const std::vector<double>& dout) {
  return 3 * kLossUlps * 0x1p-52 * loss_terms(p, s, dout).magnitude / kStep;
}

// dL/dx of element e of `t` (an input of `s`), by central differences with Richardson steps.
double numeric_gradient(const Problem& p, CaseData& s, HostTensor& t, int64_t e,
                        const std::vector<double>& dout) {
  const double x = t.get(e);
  auto central = [&](double h) {
    t.set(e, x + h);
    const double up = loss(p, s, dout);
    t.set(e, x - h);
    const double down = loss(p, s, dout);
    t.set(e, x);
    return (up - down) / (2 * h);
  };
  return (4 * central(kStep / 2) - central(kStep)) / 3;
}

void check_gradients_numerically(const Case& c) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  ASSERT_EQ(c.dtype, DType::kFP32) << "finite differences need inputs that can move by small steps";
  BackwardRun run;
  prepare(c, run, kGrid);
  if (::testing::Test::HasFatalFailure()) return;
  CaseData& s = *run.setup;
  const Problem& p = s.problem;
  const std::vector<double> dout = run.dout.dense();

  const ref::BackwardResult exact =
      ref::backward(p, s.q.view(), s.k.view(), s.v.view(), run.dout.view());
  const Status status = run_backward(p, run.tensors);
  ASSERT_TRUE(status.ok()) << to_string(status.code) << ": " << status.message;
  const GradientBounds bounds = cpu_gradient_bounds(p, exact);
  const double floor = rounding_floor(p, s, dout);

  HostTensor* inputs[] = {&s.q, &s.k, &s.v};
  const std::vector<double>* refs[] = {&exact.dq, &exact.dk, &exact.dv};
  const std::vector<double>* bound[] = {&bounds.dq, &bounds.dk, &bounds.dv};
  for (int g = 0; g < 3; ++g) {
    const std::vector<double>& r = *refs[g];
    double scale = 0.0;
    for (double x : r)
      if (!std::isnan(x)) scale = std::max(scale, std::fabs(x));
    ASSERT_GT(scale, 0.0) << kGradNames[g] << ": an all-zero gradient checks nothing";
    std::vector<double> numeric(r.size(), std::numeric_limits<double>::quiet_NaN());
    double ref_error = 0.0;
    int64_t worst = -1;
    for (int64_t e = 0; e < int64_t(r.size()); ++e) {
      if (std::isnan(r[size_t(e)])) continue;  // varlen rows outside every sequence
      numeric[size_t(e)] = numeric_gradient(p, s, *inputs[g], e, dout);
      const double err = std::fabs(numeric[size_t(e)] - r[size_t(e)]);
      if (err > ref_error) {
        ref_error = err;
        worst = e;
      }
    }
    const DenseShape shape = tensor_shape(inputs[g]->dims());
    EXPECT_LE(ref_error, kReferenceTolerance * scale + floor)
        << kGradNames[g] << ": the reference's gradient differs from finite differences by "
        << ref_error << " at " << shape.where(worst) << " (largest gradient " << scale << ")";

    // The backend against the finite differences: its fp32 bound plus what the differences
    // themselves may be off by.
    std::vector<double> allowed(*bound[g]);
    for (double& a : allowed) a += kReferenceTolerance * scale + floor;
    const CheckResult b = check_bounded(std::string(kGradNames[g]) + " (cpu) vs finite differences",
                                        shape, run.grads[size_t(g)].dense(), numeric, allowed);
    EXPECT_TRUE(b.ok) << b.message;
  }
  if (p.sinks == nullptr) return;
  // d(sinks): each logit stepped as the inputs are (multiples of kGrid, exact in fp32).
  double scale = 0.0;
  for (double x : exact.dsinks) scale = std::max(scale, std::fabs(x));
  ASSERT_GT(scale, 0.0) << "dsinks: an all-zero gradient checks nothing";
  for (int64_t h = 0; h < p.heads_q; ++h) {
    float& logit = s.sinks[size_t(h)];
    const float x = logit;
    auto central = [&](double step) {
      logit = float(x + step);
      const double up = loss(p, s, dout);
      logit = float(x - step);
      const double down = loss(p, s, dout);
      logit = x;
      return (up - down) / (2 * step);
    };
    const double numeric = (4 * central(kStep / 2) - central(kStep)) / 3;
    EXPECT_NEAR(exact.dsinks[size_t(h)], numeric, kReferenceTolerance * scale + floor)
        << "dsinks[" << h << "]: the reference against finite differences";
    EXPECT_NEAR(run.dsinks[size_t(h)], numeric,
                kReferenceTolerance * scale + floor + exact.dsinks_abs[size_t(h)] * 0x1p-16 + 1e-6)
        << "dsinks[" << h << "]: the cpu backend against finite differences";
  }
}

Case gradcheck_case(const char* name) {
  Case c;
  c.name = name;
  c.dtype = DType::kFP32;
  return c;
}

TEST(CpuBackwardGradcheck, GqaCausalSoftcap) {
  Case c = gradcheck_case("grad_gqa_causal_softcap");
  c.batch = 2;
  c.seqlen_q = 5;
  c.seqlen_k = 7;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.dim_qk = 8;
  c.dim_v = 6;
  c.causal = true;
  c.softcap = 2.0f;  // strong enough that tanh's curvature matters
  c.spiky = true;
  check_gradients_numerically(c);
}

TEST(CpuBackwardGradcheck, VarlenWindowSeqused) {
  Case c = gradcheck_case("grad_varlen_window_used");
  c.lens_q = {3, 0, 4, 2};
  c.lens_k = {5, 2, 0, 6};
  c.seqused_k = {4, 2, 0, 5};
  c.heads_q = 3;
  c.heads_kv = 1;
  c.dim_qk = 6;
  c.dim_v = 4;
  c.window = {2, 1};
  c.scale = 0.7f;
  c.layout = Layout::kPadded;
  check_gradients_numerically(c);
}

TEST(CpuBackwardGradcheck, WideValuesNoMask) {
  Case c = gradcheck_case("grad_wide_v");
  c.batch = 1;
  c.seqlen_q = 6;
  c.seqlen_k = 3;
  c.heads_q = c.heads_kv = 2;
  c.dim_qk = 4;
  c.dim_v = 10;
  c.layout = Layout::kHeadMajor;
  check_gradients_numerically(c);
}

TEST(CpuBackwardGradcheck, MoreQueriesThanKeysCausalWindow) {
  Case c = gradcheck_case("grad_sq_gt_sk");
  c.batch = 1;
  c.seqlen_q = 9;
  c.seqlen_k = 4;
  c.heads_q = 2;
  c.heads_kv = 1;
  c.dim_qk = c.dim_v = 5;
  c.causal = true;
  c.window = {1, -1};
  check_gradients_numerically(c);
}

TEST(CpuBackwardGradcheck, PackedSelfAttention) {
  Case c = gradcheck_case("grad_packed");
  c.batch = 2;
  c.seqlen_q = c.seqlen_k = 6;
  c.heads_q = 4;
  c.heads_kv = 1;
  c.dim_qk = c.dim_v = 4;
  c.packed_qkv = true;
  c.softcap = 3.0f;
  check_gradients_numerically(c);
}

TEST(CpuBackwardGradcheck, SinksAlibiGqaCausal) {
  Case c = gradcheck_case("grad_sinks_alibi");
  c.batch = 2;
  c.seqlen_q = 5;
  c.seqlen_k = 7;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.dim_qk = 8;
  c.dim_v = 6;
  c.causal = true;
  c.sinks = true;
  c.alibi = Case::Alibi::kPerBatchHead;
  check_gradients_numerically(c);
}

TEST(CpuBackwardGradcheck, SinksVarlenWindowSoftcap) {
  Case c = gradcheck_case("grad_sinks_varlen");
  c.lens_q = {3, 0, 4, 2};
  c.lens_k = {5, 2, 0, 6};
  c.heads_q = 2;
  c.heads_kv = 1;
  c.dim_qk = c.dim_v = 4;
  c.window = {2, 0};
  c.softcap = 3.0f;
  c.sinks = true;
  c.alibi = Case::Alibi::kPerHead;
  check_gradients_numerically(c);
}

// ---- The gradient bounds must reject the mistakes they exist to catch: exact gradients of a
// subtly wrong problem, stored in the dtype (bf16: the loosest bounds), fail the right problem's
// bounds.

void expect_gradients_caught(const Case& c, const std::function<Problem(const Problem&)>& mistake) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> s = make_setup(c, rng);
  const Problem& p = s->problem;
  const Dims out_dims = query_dims(p, p.heads_q, p.head_dim_v);
  HostTensor dout(p.dtype, out_dims), out(p.dtype, out_dims);
  dout.fill_normal(rng);
  const TensorView q = s->q.view(), k = s->k.view(), v = s->v.view(), d = dout.view();
  // Both passes are handed the right forward's O, stored in the dtype.
  const std::vector<double> o = ref::forward(p, q, k, v).out;
  for (int64_t e = 0; e < out.size(); ++e) out.set(e, o[size_t(e)]);
  const TensorView given = out.view();
  const ref::BackwardResult exact = ref::backward(p, q, k, v, d, ref::Precision::kExact, &given);
  const ref::BackwardResult wrong =
      ref::backward(mistake(p), q, k, v, d, ref::Precision::kExact, &given);
  const GradientBounds bounds = cpu_gradient_bounds(p, exact);
  const std::vector<double>* rights[] = {&exact.dq, &exact.dk, &exact.dv};
  const std::vector<double>* wrongs[] = {&wrong.dq, &wrong.dk, &wrong.dv};
  const std::vector<double>* bound[] = {&bounds.dq, &bounds.dk, &bounds.dv};
  const Dims dims[] = {query_dims(p, p.heads_q, p.head_dim_qk),
                       key_dims(p, p.heads_kv, p.head_dim_qk),
                       key_dims(p, p.heads_kv, p.head_dim_v)};
  for (int g = 0; g < 3; ++g) {
    std::vector<double> stored = *wrongs[g];
    for (double& x : stored) x = round_to(p.dtype, float(x));
    const CheckResult r =
        check_bounded(kGradNames[g], tensor_shape(dims[g]), stored, *rights[g], *bound[g]);
    EXPECT_FALSE(r.ok) << "a wrong " << kGradNames[g] << " passed: " << r.message;
  }
}

Case gradient_tolerance_case(const char* name, int64_t sq, int64_t sk) {
  Case c;
  c.name = name;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = c.heads_kv = 2;
  c.dim_qk = c.dim_v = 64;
  c.dtype = DType::kBF16;
  return c;
}

TEST(CpuBackwardTolerance, CatchesOneKeyMoreOrLessInAWindow) {
  Case c = gradient_tolerance_case("gtol_window", 113, 203);
  c.window = {32, 0};
  for (int64_t left : {31, 33})
    expect_gradients_caught(c, [&](const Problem& p) {
      Problem m = p;
      m.window.left = left;
      return m;
    });
}

TEST(CpuBackwardTolerance, CatchesOneKeyDroppedOutOf1024) {
  static const int32_t kAllButOne[] = {1023};
  expect_gradients_caught(gradient_tolerance_case("gtol_last_key", 1, 1024), [](const Problem& p) {
    Problem m = p;
    m.seqused_k = kAllButOne;
    return m;
  });
}

TEST(CpuBackwardTolerance, CatchesWrongScale) {
  Case c = gradient_tolerance_case("gtol_scale", 128, 217);
  c.dim_qk = 192;
  c.dim_v = 128;
  expect_gradients_caught(c, [](const Problem& p) {  // 1/sqrt(head_dim_v)
    Problem m = p;
    m.softmax_scale = float(1.0 / std::sqrt(double(p.head_dim_v)));
    return m;
  });
}

TEST(CpuBackwardTolerance, CatchesMissingSoftcap) {
  Case c = gradient_tolerance_case("gtol_softcap", 128, 217);
  c.softcap = 30.0f;
  expect_gradients_caught(c, [](const Problem& p) {
    Problem m = p;
    m.softcap = 0.0f;
    return m;
  });
}

}  // namespace
}  // namespace fa4::test
