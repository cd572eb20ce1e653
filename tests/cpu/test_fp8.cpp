// e4m3 (FP8) inputs on the CPU backend: the forward against the double reference on the
// dequantized inputs over the covering matrix's shapes, masks, GQA ratios, head dims and layouts,
// with descales per (batch, kv head), shared (zero strides) or absent, and both output dtypes;
// the bound a plain fp32 computation must meet, and the accuracy rule against the low-precision
// reference that rounds P to e4m3 as the tensor cores need. Then what is refused, with nothing
// written: e4m3 backward, a bad output dtype, descales without e4m3 inputs, bad descale views;
// and the sm90 backend's answer, which depends on the build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"

namespace fa4::test {
namespace {

struct Fp8Case {
  Case c;  // dtype kE4M3
  DType out_dtype = DType::kBF16;
  Descaling descaling = Descaling::kPerHead;
};
void PrintTo(const Fp8Case& f, std::ostream* os) { *os << f.c.name; }

// The forward matrix's shapes (docs/testing.md's pairs, seqused_k, varlen with empty sequences).
std::vector<CaseShape> shapes() {
  return {{"q1_k1", 2, 1, 1, {}, {}, {}},
          {"q1_k4096", 1, 1, 4096, {}, {}, {}},
          {"q113_k203", 2, 113, 203, {}, {}, {}},
          {"q128_k217", 1, 128, 217, {}, {}, {}},
          {"q512_k256", 1, 512, 256, {}, {}, {}},
          {"q2048_k1", 1, 2048, 1, {}, {}, {}},
          {"q203_k113_used", 2, 203, 113, {}, {}, {113, 50}},
          {"varlen_odd", 0, 0, 0, {177, 366, 479}, {257, 0, 766}, {}},
          {"varlen_empty_q", 0, 0, 0, {0, 1, 64, 33, 2}, {5, 17, 0, 130, 1}, {}}};
}

// The covering matrix's bf16 cases made e4m3: each keeps its shape, mask, softcap, GQA ratio,
// head dims and layout; the output dtype and the descales rotate.
std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> cases;
  int n = 0;
  for (Case c : covering_cases(shapes(), 60'000'000, "e4m3_")) {
    if (c.dtype != DType::kBF16) continue;
    Fp8Case f;
    c.dtype = DType::kE4M3;
    const size_t at = c.name.find("_bf16");
    if (at != std::string::npos) c.name.replace(at, 5, "");
    f.out_dtype = n % 3 == 1 ? DType::kFP16 : DType::kBF16;
    f.descaling = static_cast<Descaling>(n % 3 == 2 ? 0 : n % 3 == 0 ? 2 : 1);
    c.name += std::string(f.out_dtype == DType::kFP16 ? "_fp16out" : "_bf16out") +
              descaling_tag(f.descaling);
    f.c = c;
    cases.push_back(f);
    ++n;
  }
  return cases;
}

// Descales of 1/8 to 2 per (batch, kv head), or one for all through zero strides.
struct Descales {
  std::vector<float> q, k, v;  // (batch, heads_kv), dense
};

Descales draw_descales(const Problem& p, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.125f, 2.0f);
  Descales d;
  for (auto* x : {&d.q, &d.k, &d.v})
    for (int64_t e = 0; e < std::max<int64_t>(p.batch, 1) * p.heads_kv; ++e) x->push_back(u(rng));
  return d;
}

void run_fp8(const Fp8Case& f) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(f.c));
  std::mt19937_64 rng = make_rng(f.c.name);
  const std::unique_ptr<CaseData> setup = make_setup(f.c, rng);
  Problem p = setup->problem;
  p.fp8.out_dtype = f.out_dtype;
  const Descales d = draw_descales(p, rng);

  HostTensor out(f.out_dtype, query_dims(p, p.heads_q, p.head_dim_v), Layout::kPadded);
  HostLse lse = make_lse(p, /*padded=*/true);
  ForwardTensors t;
  t.q = setup->q.view();
  t.k = setup->k.view();
  t.v = setup->v.view();
  t.out = out.view();
  if (p.return_lse) t.lse = lse.view();
  t.q_descale = descale_view(d.q.data(), p, f.descaling);
  t.k_descale = descale_view(d.k.data(), p, f.descaling);
  t.v_descale = descale_view(d.v.data(), p, f.descaling);
  size_t bytes = 0;
  ASSERT_TRUE(workspace_size(p, Backend::kCpu, Pass::kForward, &bytes).ok());
  HostWorkspace ws(bytes);
  const Status st = forward(p, t, ws.view(), nullptr, Backend::kCpu);
  ASSERT_TRUE(st.ok()) << to_string(st.code) << ": " << st.message;

  const std::vector<unsigned char> q_rows = rows_in_sequences(p, /*keys=*/false);
  const CheckResult written = check_written("out", out, q_rows);
  EXPECT_TRUE(written.ok) << written.message;
  EXPECT_EQ(HostTensor::stray_writes({&out}), 0) << "out: elements outside the view were written";

  const ref::Descales descales{t.q_descale, t.k_descale, t.v_descale};
  const ref::ForwardResult exact =
      ref::forward(p, t.q, t.k, t.v, ref::Precision::kExact, {}, nullptr, &descales);
  const ref::ForwardResult lp =
      ref::forward(p, t.q, t.k, t.v, ref::Precision::kLowPrecision, {}, nullptr, &descales);
  const std::vector<double> o = out.dense();
  const DenseShape shape = tensor_shape(out.dims());
  // The inputs are exact in fp32 and P stays fp32: the plain fp32 bound holds.
  const CheckResult bounded =
      check_bounded("out vs fp32 bound", shape, o, exact.out, cpu_out_bound(p, exact));
  EXPECT_TRUE(bounded.ok) << bounded.message;
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const CheckResult flash = check_flash_rule("out vs the rule (P in e4m3)", shape, o, exact.out,
                                             lp.out, rule.multiplier, rule.atol);
  EXPECT_TRUE(flash.ok) << flash.message;
  if (p.return_lse) {
    const CheckResult l = check_bounded("lse vs fp32 bound", lse_shape(p), lse.dense(), exact.lse,
                                        cpu_lse_bound(p, exact));
    EXPECT_TRUE(l.ok) << l.message;
  }
  // The descales take part: the reference without them is far off (where they are not all 1).
  if (f.descaling != Descaling::kNone && bounded.compared > 0 && p.seqlen_k > 1) {
    const ref::ForwardResult plain = ref::forward(p, t.q, t.k, t.v, ref::Precision::kExact);
    EXPECT_FALSE(check_bounded("out vs no descales", shape, o, plain.out,
                               cpu_out_bound(p, plain)).ok)
        << "the output does not depend on the descales";
  }
}

class CpuFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(CpuFp8, MatchesReference) { run_fp8(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, CpuFp8, ::testing::ValuesIn(fp8_cases()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) {
                           return info.param.c.name;
                         });

// ---- Refusals: a clear status naming the cause, the output left as it was.

struct Small {
  Problem p;
  HostTensor q, k, v, out;
  std::vector<float> descale{0.5f, 0.25f};
  ForwardTensors t;
  Small() {
    p.batch = 1;
    p.seqlen_q = p.seqlen_k = 8;
    p.heads_q = 4;
    p.heads_kv = 2;
    p.head_dim_qk = p.head_dim_v = 32;
    p.dtype = DType::kE4M3;
    std::mt19937_64 rng = make_rng("fp8_small");
    q = HostTensor(DType::kE4M3, {1, 8, 4, 32});
    k = HostTensor(DType::kE4M3, {1, 8, 2, 32});
    v = HostTensor(DType::kE4M3, {1, 8, 2, 32});
    out = HostTensor(DType::kBF16, {1, 8, 4, 32});
    for (HostTensor* x : {&q, &k, &v}) x->fill_normal(rng, 4.0);
    t.q = q.view();
    t.k = k.view();
    t.v = v.view();
    t.out = out.view();
    t.k_descale = {descale.data(), 0, 1};
  }
  Status run() { return forward(p, t, {}, nullptr, Backend::kCpu); }
};

void expect_refused(Small& s, StatusCode code, const char* named) {
  s.out.poison();
  const Status st = s.run();
  EXPECT_EQ(st.code, code) << st.message;
  EXPECT_NE(st.message.find(named), std::string::npos) << st.message;
  for (int64_t e = 0; e < s.out.size(); ++e)
    ASSERT_TRUE(s.out.is_poison(e)) << "out was written by a refused call";
}

TEST(CpuFp8Refusals, Fp8SmallRuns) {
  Small s;
  EXPECT_TRUE(s.run().ok());
}

TEST(CpuFp8Refusals, BackwardIsForwardOnly) {
  Small s;
  EXPECT_EQ(can_implement(s.p, Backend::kCpu, Pass::kBackward).code, StatusCode::kNotSupported);
  size_t bytes = 0;
  const Status st = workspace_size(s.p, Backend::kCpu, Pass::kBackward, &bytes);
  EXPECT_EQ(st.code, StatusCode::kNotSupported);
  EXPECT_NE(st.message.find("e4m3"), std::string::npos) << st.message;
}

TEST(CpuFp8Refusals, OutputDtype) {
  for (DType bad : {DType::kFP32, DType::kE4M3, static_cast<DType>(9)}) {
    Small s;
    s.p.fp8.out_dtype = bad;
    expect_refused(s, StatusCode::kInvalidArgument, "out_dtype");
  }
}

TEST(CpuFp8Refusals, DescalesNeedE4m3) {
  Small s;
  s.p.dtype = DType::kBF16;
  s.q = HostTensor(DType::kBF16, {1, 8, 4, 32});
  s.k = HostTensor(DType::kBF16, {1, 8, 2, 32});
  s.v = HostTensor(DType::kBF16, {1, 8, 2, 32});
  std::mt19937_64 rng = make_rng("fp8_bf16");
  for (HostTensor* x : {&s.q, &s.k, &s.v}) x->fill_normal(rng);
  s.t.q = s.q.view();
  s.t.k = s.k.view();
  s.t.v = s.v.view();
  expect_refused(s, StatusCode::kInvalidArgument, "k_descale");
}

TEST(CpuFp8Refusals, DescaleViews) {
  {
    Small s;
    s.t.v_descale = {s.descale.data(), 0, -1};
    expect_refused(s, StatusCode::kInvalidArgument, "v_descale");
  }
  {
    Small s;
    const char* bytes = reinterpret_cast<const char*>(s.descale.data());
    s.t.q_descale = {reinterpret_cast<const float*>(bytes + 1), 0, 0};
    expect_refused(s, StatusCode::kInvalidArgument, "aligned");
  }
}

// The sm90 backend's answer depends on the build, and any of them is one of three: unavailable
// (no CUDA, or no Hopper GPU), kNotSupported naming e4m3 (no e4m3 kernel for these head dims in
// FA4_SM90_KERNELS, the default), or accepted (an e4m3 kernel and a Hopper GPU). Head dim 128,
// which the e4m3 kernel table has.
TEST(CpuFp8Refusals, Sm90AnswerDependsOnTheBuild) {
  Small s;
  s.p.head_dim_qk = s.p.head_dim_v = 128;
  const Status st = can_implement(s.p, Backend::kSm90, Pass::kForward);
  if (st.code == StatusCode::kNotSupported) {
    EXPECT_NE(st.message.find("e4m3"), std::string::npos) << st.message;
  } else {
    EXPECT_TRUE(st.ok() || st.code == StatusCode::kBackendUnavailable)
        << to_string(st.code) << ": " << st.message;
  }
}

}  // namespace
}  // namespace fa4::test
