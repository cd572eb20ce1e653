// The sm90 e4m3 (FP8) forward against the double reference on the dequantised inputs, on device
// copies of inputs drawn as tests/cpu/test_fp8.cpp draws them: docs/testing.md's (sq, sk) pairs,
// seqused_k, varlen batches with odd and empty sequences, each causal or not; a sliding window,
// softcap, a custom scale, GQA 1 / 4 / 8, decode and split-KV (the library's splits and three
// forced through Overrides). Descales per (batch, kv head), one shared through zero strides, or
// none; bf16 and fp16 outputs; contiguous, padded (16-element units), head-major and packed-qkv
// inputs; rows no query may read hold NaN, outputs are poisoned and guarded. Every built e4m3 kernel
// (FA4_SM90_KERNELS' "*:e4m3" entries) runs: head dim 128 the full matrix, the others a share.
// Checks: every row inside a sequence written, the rest untouched; O within the rule against the
// reference that rounds P to e4m3; LSE within the fp32 bound plus the FP8 accumulation's term; O
// off the reference without descales. Plus the refusals: e4m3 backward, ALiBi, sinks and a paged
// KV cache, with nothing written.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"
#include "device_buffer.hpp"
#include "sm90_test_support.hpp"

namespace fa4::test {
namespace {

std::vector<Kernel> fp8_kernels() {
  std::vector<Kernel> kernels;
  for (const Kernel& k : built_kernels())
    if (k.dtype == DType::kE4M3) kernels.push_back(k);
  return kernels;
}

// The full matrix at head dim 128; a share of it at the others.
bool tested_in_full(const Kernel& k) { return k.dim_qk == 128 && k.dim_v == 128; }

struct Fp8Case {
  Case c;  // dtype kE4M3
  DType out_dtype = DType::kBF16;
  Descaling descaling = Descaling::kPerHead;
  int splits = 0;  // > 0: each tile's keys split this many ways (Overrides::splits)
};
void PrintTo(const Fp8Case& f, std::ostream* os) { *os << f.c.name; }

struct Heads {
  int64_t q, kv;
};
constexpr Heads kGqa[] = {{4, 4}, {8, 2}, {8, 1}};  // ratios 1, 4, 8

// Descales, output dtype, GQA ratio, layout, input kind and return_lse rotate with the case number
// r, each on its own period, so that the descale kinds meet both outputs and every ratio.
Fp8Case rotated(Case c, int r) {
  Fp8Case f;
  // Per head, shared, none, in turn.
  f.descaling = static_cast<Descaling>(2 - r % 3);
  f.out_dtype = r % 2 == 1 ? DType::kFP16 : DType::kBF16;
  if (c.heads_q == 1 && c.heads_kv == 1) {  // not chosen by the case itself
    c.heads_q = kGqa[(r / 3) % 3].q;
    c.heads_kv = kGqa[(r / 3) % 3].kv;
  }
  const bool packable = c.lens_q.empty() ? c.seqlen_q == c.seqlen_k : c.lens_q == c.lens_k;
  switch ((r / 2) % 4) {
    case 1: c.layout = Layout::kPadded16; break;
    case 2: c.layout = Layout::kHeadMajor; break;
    case 3: c.packed_qkv = packable; break;
    default: break;
  }
  c.spiky = c.spiky || (r / 5) % 2 == 1;
  c.return_lse = r % 7 != 3;
  c.dtype = DType::kE4M3;
  c.name += gqa_tag(c) + (c.packed_qkv ? "_packed" : "") +
            (c.layout == Layout::kPadded16 ? "_padded16" : "") +
            (c.layout == Layout::kHeadMajor ? "_headmajor" : "") + (c.spiky ? "_spiky" : "") +
            (f.out_dtype == DType::kFP16 ? "_fp16out" : "_bf16out") +
            descaling_tag(f.descaling) +
            (c.return_lse ? "" : "_nolse");
  f.c = c;
  return f;
}

Case shaped(const Kernel& k, const CaseShape& s) {
  Case c = base_case(k, {"", s.batch, s.seqlen_q, s.seqlen_k});
  c.lens_q = s.lens_q;
  c.lens_k = s.lens_k;
  c.seqused_k = s.used_k;
  c.name = kernel_tag(k) + "_" + s.tag;
  return c;
}

std::vector<Fp8Case> kernel_cases(const Kernel& k) {
  const bool full = tested_in_full(k);
  // docs/testing.md's pairs, seqused_k (0 < used < sk and used = sk), varlen with odd lengths, an
  // empty key sequence, empty and one-row query sequences, and sequences cut by seqused_k.
  const std::vector<CaseShape> shapes = {
      {"q1_k1", 2, 1, 1, {}, {}, {}},
      {"q1_k4096", 1, 1, 4096, {}, {}, {}},
      {"q113_k203", 2, 113, 203, {}, {}, {}},
      {"q128_k217", 1, 128, 217, {}, {}, {}},
      {"q512_k256", 1, 512, 256, {}, {}, {}},
      {"q2048_k1", 1, 2048, 1, {}, {}, {}},
      {"q203_k113_used", 2, 203, 113, {}, {}, {113, 50}},
      {"q1000_k1500", 1, 1000, 1500, {}, {}, {}},
      {"varlen_odd", 0, 0, 0, {177, 366, 479}, {257, 0, 766}, {}},
      {"varlen_empty", 0, 0, 0, {0, 1, 64, 33, 2, 0}, {5, 17, 0, 130, 1, 0}, {}},
      {"varlen_self_used", 0, 0, 0, {177, 0, 128, 1, 257}, {177, 0, 128, 1, 257},
       {100, 0, 128, 1, 200}},
  };
  const std::vector<std::string> shared = {"q1_k4096", "q113_k203", "q512_k256",
                                           "q203_k113_used", "varlen_odd"};
  std::vector<Fp8Case> cases;
  int r = 0;
  for (const CaseShape& s : shapes) {
    if (!full && std::find(shared.begin(), shared.end(), s.tag) == shared.end()) continue;
    for (bool causal : {false, true}) {
      Case c = shaped(k, s);
      c.causal = causal;
      if (causal) c.name += "_causal";
      cases.push_back(rotated(c, r++));
    }
  }

  // Masks and scores: each a window, softcap or scale the descales fold into.
  struct Variant {
    const char* tag;
    CaseShape shape;
    bool causal;
    Window window;
    float softcap, scale;
    bool in_share;  // run at every head dim
  };
  const Variant variants[] = {
      {"window100_20", {"q113_k203", 2, 113, 203, {}, {}, {}}, false, {100, 20}, 0, 0, true},
      {"window300_0", {"q1000_k1500", 1, 1000, 1500, {}, {}, {}}, false, {300, 0}, 0, 0, false},
      {"windowleft64", {"q512_k256", 1, 512, 256, {}, {}, {}}, false, {64, -1}, 0, 0, false},
      {"softcap30", {"q128_k217", 1, 128, 217, {}, {}, {}}, false, {}, 30.0f, 0, true},
      {"softcap30_causal", {"varlen_odd", 0, 0, 0, {177, 366, 479}, {257, 0, 766}, {}}, true, {},
       30.0f, 0, false},
      {"softcap5_scale2", {"q300_k300", 2, 300, 300, {}, {}, {}}, false, {}, 5.0f, 2.0f, false},
  };
  for (const Variant& v : variants) {
    if (!full && !v.in_share) continue;
    Case c = shaped(k, v.shape);
    c.causal = v.causal;
    c.window = v.window;
    c.softcap = v.softcap;
    c.scale = v.scale;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.spiky = true;
    c.name += std::string("_") + v.tag;
    cases.push_back(rotated(c, r++));
  }

  // GQA 4 on decode (one query against 0 … 2999 keys, packed by the launcher) and split-KV: the
  // library's splits on decode, three forced on a fixed, a causal and a varlen problem.
  if (full) {
    Case decode = shaped(k, {"varlen_decode_q1", 0, 0, 0, std::vector<int32_t>(8, 1),
                             {1, 17, 127, 128, 129, 1000, 2999, 0}, {}});
    decode.heads_q = 32;
    decode.heads_kv = 8;
    cases.push_back(rotated(decode, r++));
  }
  struct Split {
    CaseShape shape;
    bool causal;
    bool in_share;
  };
  const Split splits[] = {
      {{"q1_k5000_split3", 2, 1, 5000, {}, {}, {}}, false, true},
      {{"q4_k3000_split3_causal", 1, 4, 3000, {}, {}, {}}, true, false},
      {{"varlen_split3", 0, 0, 0, {3, 1, 0, 130}, {2000, 700, 9, 1500}, {1999, 0, 9, 1300}},
       false, false},
  };
  for (const Split& s : splits) {
    if (!full && !s.in_share) continue;
    Case c = shaped(k, s.shape);
    c.causal = s.causal;
    c.heads_q = 16;
    c.heads_kv = 4;
    Fp8Case f = rotated(c, r++);
    f.splits = 3;
    cases.push_back(f);
  }
  return cases;
}

std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> cases;
  for (const Kernel& k : fp8_kernels()) {
    const std::vector<Fp8Case> more = kernel_cases(k);
    cases.insert(cases.end(), more.begin(), more.end());
  }
  return cases;
}

// Descales per (batch entry, kv head), 1/8 to 2 as the CPU test's, but never within a factor √2
// of 1: a kernel that ignored one would be far from the reference.
struct Descales {
  std::vector<float> q, k, v;  // (batch, heads_kv), dense
};

Descales draw_descales(const Problem& p, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-2.5, 0.5);
  Descales d;
  for (auto* x : {&d.q, &d.k, &d.v})
    for (int64_t e = 0; e < std::max<int64_t>(p.batch, 1) * p.heads_kv; ++e) {
      const double log2 = u(rng);
      x->push_back(float(std::exp2(log2 < 0.0 ? log2 - 0.5 : log2 + 0.5)));
    }
  return d;
}

// A host array copied to device memory of the run (uploaded with its inputs).
template <typename T>
const T* device_copy(DeviceRun& run, const std::vector<T>& a) {
  run.inputs.push_back(std::make_unique<DeviceMirror>(
      std::vector<DeviceMirror::View>{array_view(a)}, sizeof(T)));
  return static_cast<const T*>(run.inputs.back()->device(a.data()));
}

void check_fp8(const Fp8Case& f) {
  FA4_SKIP_WITHOUT_HOPPER();
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(f.c));
  std::mt19937_64 rng = make_rng(f.c.name);
  const std::unique_ptr<CaseData> setup = make_setup(f.c, rng);
  poison_unused_rows(*setup);
  setup->problem.fp8.out_dtype = f.out_dtype;
  const Problem& p = setup->problem;
  const Descales d = draw_descales(p, rng);

  DeviceRun run(*setup);
  if (f.splits > 0) run.overrides.splits = f.splits;
  run.tensors.q_descale = descale_view(device_copy(run, d.q), p, f.descaling);
  run.tensors.k_descale = descale_view(device_copy(run, d.k), p, f.descaling);
  run.tensors.v_descale = descale_view(device_copy(run, d.v), p, f.descaling);
  std::vector<unsigned char> rows;
  run_and_check_writes(run, &rows);
  if (::testing::Test::HasFatalFailure()) return;

  const TensorView q = setup->q.view(), k = setup->k.view(), v = setup->v.view();
  const ref::Descales host{descale_view(d.q.data(), p, f.descaling),
                           descale_view(d.k.data(), p, f.descaling),
                           descale_view(d.v.data(), p, f.descaling)};
  const ref::ForwardResult exact =
      ref::forward(p, q, k, v, ref::Precision::kExact, {}, nullptr, &host);
  const ref::ForwardResult lp =
      ref::forward(p, q, k, v, ref::Precision::kLowPrecision, {}, nullptr, &host);
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const int64_t rows_checked = std::count(rows.begin(), rows.end(), 1) * p.heads_q;

  const DenseShape shape = tensor_shape(run.out.dims());
  const std::vector<double> o = run.out.dense();
  const CheckResult out = check_flash_rule("out vs the rule (P in e4m3)", shape, o, exact.out,
                                           lp.out, rule.multiplier, rule.atol);
  EXPECT_TRUE(out.ok) << out.message;
  EXPECT_EQ(out.compared, rows_checked * p.head_dim_v) << "reference rows missing";
  if (p.return_lse) {
    const CheckResult l = check_bounded("lse vs fp32 + FP8 accumulation bound", lse_shape(p),
                                        run.lse.dense(), exact.lse, fp8_lse_bound(p, exact));
    EXPECT_TRUE(l.ok) << l.message;
    EXPECT_EQ(l.compared, rows_checked) << "reference rows missing";
  }

  // The descales take part: the output is farther from the reference without them than the rule
  // lets it be from the reference with them (where some row sees a key to weigh).
  const bool any_key = std::any_of(exact.lse.begin(), exact.lse.end(),
                                   [](double x) { return std::isfinite(x); });
  if (f.descaling != Descaling::kNone && any_key) {
    double lp_error = 0.0;
    for (size_t e = 0; e < exact.out.size(); ++e)
      if (!std::isnan(exact.out[e]))
        lp_error = std::max(lp_error, std::fabs(lp.out[e] - exact.out[e]));
    const ref::ForwardResult plain = ref::forward(p, q, k, v, ref::Precision::kExact);
    const std::vector<double> allowed(plain.out.size(), rule.multiplier * lp_error + rule.atol);
    EXPECT_FALSE(check_bounded("out vs no descales", shape, o, plain.out, allowed).ok)
        << "the output does not depend on the descales";
  }
}

class Sm90Fp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Sm90Fp8, MatchesReference) { check_fp8(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, Sm90Fp8, ::testing::ValuesIn(fp8_cases()),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) {
                           return info.param.c.name;
                         });
// A build without e4m3 kernels (the default) has no case to run.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Sm90Fp8);

// What the e4m3 kernels do not implement is refused with kNotSupported naming e4m3: the backward
// (forward-only inputs), ALiBi, sinks and a paged KV cache whose pages are not whole 16-key
// pieces (pages of 8 here; pages of 16 and their multiples run: test_sm90_kv_cache.cpp).
// can_implement answers on the host; forward() then leaves the output poisoned.
TEST(Sm90Fp8Refusals, RefusedWithNothingWritten) {
  const std::vector<Kernel> kernels = fp8_kernels();
  if (kernels.empty()) GTEST_SKIP() << "this build has no sm90 e4m3 kernel (FA4_SM90_KERNELS)";
  const Kernel kernel = kernels.front();
  Case c = base_case(kernel, {"", 1, 8, 64});
  c.name = kernel_tag(kernel) + "_refusals";
  c.heads_q = 4;
  c.heads_kv = 2;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  const Problem& base = setup->problem;

  for (const char* what : {"can_implement", "workspace_size"}) {
    SCOPED_TRACE(std::string("backward, ") + what);
    size_t bytes = 0;
    const Status s = std::string(what) == "can_implement"
                         ? can_implement(base, Backend::kSm90, Pass::kBackward)
                         : workspace_size(base, Backend::kSm90, Pass::kBackward, &bytes);
    EXPECT_EQ(s.code, StatusCode::kNotSupported) << s.message;
    EXPECT_NE(s.message.find("e4m3"), std::string::npos) << s.message;
  }

  // The variants, their arrays where `with` says (can_implement reads none of them).
  const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
  const std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f};
  const std::vector<int32_t> pages = {2, 0, 3, 1, 6, 4, 7, 5};
  constexpr int64_t kPageSize = 8;
  struct Arrays {
    const float* slopes;
    const float* sinks;
    const int32_t* pages;
  };
  auto variant = [&](const std::string& what, Problem p, const Arrays& with) {
    if (what == "alibi") p.alibi = {with.slopes, 0, 1};
    if (what == "sinks") p.sinks = with.sinks;
    if (what == "paged kv cache") {
      p.kv_cache.page_table = with.pages;
      p.kv_cache.pages_per_seq = p.kv_cache.page_table_stride = int64_t(pages.size());
      p.kv_cache.num_pages = int64_t(pages.size());
      p.kv_cache.page_size = kPageSize;
      p.kv_cache.cache_batch = 1;
    }
    return p;
  };
  const std::vector<std::string> variants = {"alibi", "sinks", "paged kv cache"};
  for (const std::string& what : variants) {
    SCOPED_TRACE(what);
    const Status s = can_implement(variant(what, base, {slopes.data(), sinks.data(), pages.data()}),
                                   Backend::kSm90, Pass::kForward);
    EXPECT_EQ(s.code, StatusCode::kNotSupported) << to_string(s.code) << ": " << s.message;
    EXPECT_NE(s.message.find("e4m3"), std::string::npos) << s.message;
  }

  FA4_SKIP_WITHOUT_HOPPER();
  DeviceRun run(*setup);
  const Descales d = draw_descales(base, rng);
  run.tensors.q_descale = descale_view(device_copy(run, d.q), base, Descaling::kPerHead);
  run.tensors.k_descale = descale_view(device_copy(run, d.k), base, Descaling::kPerHead);
  run.tensors.v_descale = descale_view(device_copy(run, d.v), base, Descaling::kPerHead);
  const Arrays on_device{device_copy(run, slopes), device_copy(run, sinks),
                         device_copy(run, pages)};
  ASSERT_CUDA(run.upload());
  const ForwardTensors plain = run.tensors;
  for (const std::string& what : variants) {
    SCOPED_TRACE(what);
    // The 64 keys as 8 pages of 8: the page stride in place of the batch stride.
    if (what == "paged kv cache")
      for (TensorView* t : {&run.tensors.k, &run.tensors.v})
        t->batch_stride = kPageSize * t->seq_stride;
    expect_refused(run, variant(what, run.problem, on_device), run.workspace.view(),
                   StatusCode::kNotSupported, "e4m3");
    run.tensors = plain;
  }
}

}  // namespace
}  // namespace fa4::test
