// The sm90 forward kernel against the double reference (DESIGN.md §4's rule), on device copies of
// the test utilities' inputs: the (sq, sk) pairs of §4, causal or not, GQA 1/4/8, sliding windows,
// softcap, contiguous / head-major / packed-qkv inputs, normal and spiky values; outputs poisoned
// (NaN) before every run, guard bytes around them. Plus: a repeated run (and a CUDA-graph replay)
// must give bitwise-identical results, and problems without a kernel must be refused.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"
#include "device_buffer.hpp"

#ifndef FA4_SM90_BUILT_KERNELS
#error "tests/gpu/CMakeLists.txt passes the built kernel list"
#endif

namespace fa4::test {
namespace {

#define FA4_SKIP_WITHOUT_HOPPER()                                   \
  do {                                                              \
    std::string why_;                                               \
    if (!hopper_present(&why_)) GTEST_SKIP() << "sm90 tests need a Hopper GPU: " << why_; \
  } while (0)

struct Kernel {
  int64_t head_dim;
  DType dtype;
};

// FA4_SM90_BUILT_KERNELS: "128:bf16,64:fp16,..." (cmake/fa4_sm90.cmake's FA4_SM90_KERNELS).
std::vector<Kernel> built_kernels() {
  std::vector<Kernel> kernels;
  std::stringstream list(FA4_SM90_BUILT_KERNELS);
  std::string entry;
  while (std::getline(list, entry, ',')) {
    const size_t colon = entry.find(':');
    if (colon == std::string::npos) continue;
    kernels.push_back({std::stoll(entry.substr(0, colon)),
                       entry.substr(colon + 1) == "fp16" ? DType::kFP16 : DType::kBF16});
  }
  return kernels;
}

struct Shape {
  const char* tag;
  int64_t batch, sq, sk;
};

struct Heads {
  int64_t q, kv;
};
constexpr Heads kGqa[] = {{4, 4}, {8, 2}, {8, 1}};  // ratios 1, 4, 8

Case base_case(const Kernel& k, const Shape& s) {
  Case c;
  c.batch = s.batch;
  c.seqlen_q = s.sq;
  c.seqlen_k = s.sk;
  c.dim_qk = c.dim_v = k.head_dim;
  c.dtype = k.dtype;
  return c;
}

std::string kernel_tag(const Kernel& k) {
  return "d" + std::to_string(k.head_dim) + (k.dtype == DType::kBF16 ? "_bf16" : "_fp16");
}

// The full matrix for the first kernel (head dim 128, bf16, when built); a smaller one for the
// others, which share every piece but the tile sizes.
std::vector<Case> forward_cases() {
  static const Shape kShapes[] = {
      {"q1_k1", 2, 1, 1},         {"q1_k4096", 1, 1, 4096},  {"q113_k203", 2, 113, 203},
      {"q128_k217", 1, 128, 217}, {"q512_k256", 1, 512, 256}, {"q2048_k1", 1, 2048, 1},
      {"q203_k113", 2, 203, 113}, {"q300_k300", 2, 300, 300}, {"q1000_k1500", 1, 1000, 1500},
  };
  std::vector<Case> cases;
  for (const Kernel& k : built_kernels()) {
    const bool full = k.head_dim == 128 && k.dtype == DType::kBF16;
    int rotation = 0;
    for (const Shape& s : kShapes) {
      if (!full && std::string(s.tag) != "q113_k203" && std::string(s.tag) != "q512_k256" &&
          std::string(s.tag) != "q1_k4096" && std::string(s.tag) != "q300_k300")
        continue;
      for (bool causal : {false, true}) {
        Case c = base_case(k, s);
        const int r = rotation++;
        c.causal = causal;
        c.heads_q = kGqa[r % 3].q;
        c.heads_kv = kGqa[r % 3].kv;
        c.spiky = r % 2 == 1;
        if (s.sq == s.sk && r % 3 != 1) {
          c.packed_qkv = true;
        } else {
          c.layout = r % 3 == 2 ? Layout::kHeadMajor : Layout::kContiguous;
        }
        c.name = kernel_tag(k) + "_" + s.tag + (causal ? "_causal" : "") + "_gqa" +
                 std::to_string(c.heads_q / c.heads_kv) + (c.packed_qkv ? "_packed" : "") +
                 (c.layout == Layout::kHeadMajor ? "_headmajor" : "") + (c.spiky ? "_spiky" : "");
        cases.push_back(c);
      }
    }
    // Band and score variants on shapes whose tiles the band cuts in several ways.
    struct Variant {
      const char* tag;
      Shape shape;
      Window window;
      float softcap, scale;
    };
    const Variant variants[] = {
        {"window100_20", {"", 2, 113, 203}, {100, 20}, 0.0f, 0.0f},
        {"window300_0", {"", 1, 1000, 1500}, {300, 0}, 0.0f, 0.0f},
        {"windowleft64", {"", 1, 512, 256}, {64, -1}, 0.0f, 0.0f},
        {"softcap30", {"", 1, 128, 217}, {-1, -1}, 30.0f, 0.0f},
        {"softcap5_scale2", {"", 2, 300, 300}, {-1, -1}, 5.0f, 2.0f},
        {"scale0_5", {"", 2, 113, 203}, {-1, -1}, 0.0f, 0.5f},
    };
    for (const Variant& v : variants) {
      if (!full && std::string(v.tag) != "softcap5_scale2" && std::string(v.tag) != "window100_20")
        continue;
      Case c = base_case(k, v.shape);
      c.window = v.window;
      c.softcap = v.softcap;
      c.scale = v.scale;
      c.heads_q = 8;
      c.heads_kv = 2;
      c.spiky = true;
      c.name = kernel_tag(k) + "_" + v.tag;
      cases.push_back(c);
    }
  }
  return cases;
}

#define ASSERT_CUDA(expr)                                         \
  do {                                                            \
    const std::string err_ = (expr);                              \
    ASSERT_TRUE(err_.empty()) << err_;                            \
  } while (0)

// Device copies of a case's inputs (one allocation for a packed qkv, else one per tensor) and its
// outputs, and the forward call on them.
struct DeviceRun {
  const CaseData& setup;
  HostTensor out;
  HostLse lse;
  std::vector<std::unique_ptr<DeviceMirror>> inputs;
  std::unique_ptr<DeviceMirror> d_out, d_lse;
  ForwardTensors tensors;

  explicit DeviceRun(const CaseData& s)
      : setup(s),
        out(s.problem.dtype, query_dims(s.problem, s.problem.heads_q, s.problem.head_dim_v),
            s.layout == Layout::kHeadMajor ? Layout::kHeadMajor : Layout::kContiguous),
        lse(make_lse(s.problem, /*padded=*/false)) {
    const size_t elem = dtype_size(s.problem.dtype);
    const DeviceMirror* q_mirror;
    const DeviceMirror* k_mirror;
    const DeviceMirror* v_mirror;
    if (s.packed) {
      inputs.push_back(std::make_unique<DeviceMirror>(
          std::vector<DeviceMirror::View>{mirror_view(s.q), mirror_view(s.k), mirror_view(s.v)},
          elem));
      q_mirror = k_mirror = v_mirror = inputs[0].get();
    } else {
      for (const HostTensor* t : {&s.q, &s.k, &s.v})
        inputs.push_back(std::make_unique<DeviceMirror>(
            std::vector<DeviceMirror::View>{mirror_view(*t)}, elem));
      q_mirror = inputs[0].get();
      k_mirror = inputs[1].get();
      v_mirror = inputs[2].get();
    }
    d_out = std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{mirror_view(out)}, elem);
    d_lse = std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{mirror_view(lse)}, 4);
    tensors.q = q_mirror->device_view(s.q.view());
    tensors.k = k_mirror->device_view(s.k.view());
    tensors.v = v_mirror->device_view(s.v.view());
    tensors.out = d_out->device_view(out.view());
    if (s.problem.return_lse) tensors.lse = d_lse->device_view(lse.view());
  }

  std::string upload() {
    for (auto& m : inputs) {
      const std::string e = m->upload();
      if (!e.empty()) return e;
    }
    return device_sync();
  }

  // The copies and memsets run on the legacy stream, the kernel on a non-blocking one: without a
  // device-wide wait, a pageable upload or the poison could land after the kernel has started.
  static std::string device_sync() {
    const cudaError_t err = cudaDeviceSynchronize();
    return err == cudaSuccess ? "" : std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(err);
  }

  // Poisons the outputs, runs the forward on `stream` (directly, or captured in a CUDA graph and
  // replayed), waits, and downloads the outputs into `out` / `lse`.
  std::string run(cudaStream_t stream, bool graph, Status* status) {
    std::string e = d_out->poison();
    if (e.empty()) e = d_lse->poison();
    if (e.empty()) e = device_sync();
    if (!e.empty()) return e;
    if (graph) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        return "cudaStreamBeginCapture failed";
      *status = forward(setup.problem, tensors, {}, stream, Backend::kSm90);
      if (cudaStreamEndCapture(stream, &g) != cudaSuccess) return "cudaStreamEndCapture failed";
      if (cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) return "cudaGraphInstantiate failed";
      const cudaError_t launched = cudaGraphLaunch(exec, stream);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
      if (launched != cudaSuccess) return "cudaGraphLaunch failed";
    } else {
      *status = forward(setup.problem, tensors, {}, stream, Backend::kSm90);
    }
    const cudaError_t err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return std::string("kernel: ") + cudaGetErrorString(err);
    e = d_out->download(nullptr);
    if (e.empty()) e = d_lse->download(nullptr);
    return e;
  }
};

class Stream {
 public:
  Stream() { cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

void check_forward(const Case& c, const std::vector<ref::RowSample>& sample = {}) {
  FA4_SKIP_WITHOUT_HOPPER();
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  const Problem& p = setup->problem;
  const Status can = can_implement(p, Backend::kSm90, Pass::kForward);
  ASSERT_TRUE(can.ok()) << to_string(can.code) << ": " << can.message;

  DeviceRun run(*setup);
  ASSERT_CUDA(run.upload());
  Stream stream;
  Status status;
  ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, &status));
  ASSERT_TRUE(status.ok()) << to_string(status.code) << ": " << status.message;

  const std::vector<unsigned char> rows = rows_in_sequences(p, /*keys=*/false);
  const CheckResult written = check_written("out", run.out, rows);
  EXPECT_TRUE(written.ok) << written.message;
  const CheckResult lse_written = check_written("lse", run.lse, rows);
  EXPECT_TRUE(lse_written.ok) << lse_written.message;
  bool intact = false;
  ASSERT_CUDA(run.d_out->guards_intact(&intact));
  EXPECT_TRUE(intact) << "out: bytes around the tensor were written";
  ASSERT_CUDA(run.d_lse->guards_intact(&intact));
  EXPECT_TRUE(intact) << "lse: bytes around the tensor were written";

  const TensorView q = setup->q.view(), k = setup->k.view(), v = setup->v.view();
  const ref::ForwardResult exact = ref::forward(p, q, k, v, ref::Precision::kExact, sample);
  const ref::ForwardResult lp = ref::forward(p, q, k, v, ref::Precision::kLowPrecision, sample);
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const int64_t rows_checked =
      sample.empty() ? p.batch * p.seqlen_q * p.heads_q : int64_t(sample.size());

  const CheckResult o = check_flash_rule("out", tensor_shape(run.out.dims()), run.out.dense(),
                                         exact.out, lp.out, rule.multiplier, rule.atol);
  EXPECT_TRUE(o.ok) << o.message;
  EXPECT_EQ(o.compared, rows_checked * p.head_dim_v) << "reference rows missing";
  // LSE ≈ the row's largest scaled score, which spiky inputs push to |LSE| ≈ 100, where the rule's
  // atol (1e-5) is about one fp32 ulp. The kernel reaches LSE through a few fp32 roundings the lp
  // reference does not share (tensor-core accumulation of the scores, the scale FFMA, the log2 →
  // ln conversion, the final add), each up to half an ulp of |LSE|: allow kLseUlps ulps of the
  // largest |LSE| on top of the rule.
  constexpr double kLseUlps = 4.0;
  double max_lse = 0.0;
  for (double x : exact.lse)
    if (std::isfinite(x)) max_lse = std::max(max_lse, std::fabs(x));
  const double lse_atol = rule.atol + kLseUlps * std::numeric_limits<float>::epsilon() * max_lse;
  const CheckResult l = check_flash_rule("lse", lse_shape(p), run.lse.dense(), exact.lse, lp.lse,
                                         rule.multiplier, lse_atol);
  EXPECT_TRUE(l.ok) << l.message;
  EXPECT_EQ(l.compared, rows_checked) << "reference rows missing";
}

class Sm90Forward : public ::testing::TestWithParam<Case> {};

TEST_P(Sm90Forward, MatchesReference) { check_forward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, Sm90Forward, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// A long causal sequence (33 query tiles, 33 key tiles): every tile of the band, many rescales with
// spiky inputs. The reference checks rows at the start, at tile boundaries, at the end, at random.
TEST(Sm90ForwardLong, Seq4224CausalSampledRows) {
  for (const Kernel& k : built_kernels()) {
    for (bool causal : {true, false}) {
      Case c = base_case(k, {"", 1, 4224, 4224});
      c.name = kernel_tag(k) + "_long_q4224_k4224" + (causal ? "_causal" : "");
      c.heads_q = 8;
      c.heads_kv = 1;
      c.causal = causal;
      c.spiky = true;
      std::mt19937_64 rng = make_rng(c.name + "/rows");
      std::uniform_int_distribution<int64_t> any_row(0, c.seqlen_q - 1);
      std::vector<ref::RowSample> sample;
      for (int64_t h = 0; h < c.heads_q; h += 3) {
        std::vector<int64_t> picked = {0, 1, 63, 64, 127, 128, 129, 2111, 2112, 4095, 4096, 4223};
        for (int n = 0; n < 8; ++n) picked.push_back(any_row(rng));
        std::sort(picked.begin(), picked.end());
        picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
        for (int64_t row : picked) sample.push_back({0, h, row});
      }
      SCOPED_TRACE(c.name);
      check_forward(c, sample);
    }
  }
}

// The same inputs must give the same bits: twice directly, and once replayed from a CUDA graph
// (the launch captures without allocating or synchronizing). A difference means a race.
TEST(Sm90Forward, RepeatedRunsAreBitwiseIdentical) {
  FA4_SKIP_WITHOUT_HOPPER();
  for (const Kernel& k : built_kernels()) {
    Case c = base_case(k, {"", 2, 1000, 1500});
    c.name = kernel_tag(k) + "_repeat";
    c.causal = true;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.spiky = true;
    SCOPED_TRACE(seed_note());
    SCOPED_TRACE(describe(c));
    std::mt19937_64 rng = make_rng(c.name);
    const std::unique_ptr<CaseData> setup = make_setup(c, rng);
    DeviceRun run(*setup);
    ASSERT_CUDA(run.upload());
    Stream stream;
    std::vector<uint64_t> first_out;
    std::vector<double> first_lse;  // fp32 values widened exactly: equal bits ⇔ equal doubles' bits
    for (int attempt = 0; attempt < 3; ++attempt) {
      Status status;
      ASSERT_CUDA(run.run(stream.get(), /*graph=*/attempt == 2, &status));
      ASSERT_TRUE(status.ok()) << status.message;
      std::vector<uint64_t> out_bits(size_t(run.out.size()));
      for (int64_t i = 0; i < run.out.size(); ++i) out_bits[size_t(i)] = run.out.bits(i);
      const std::vector<double> lse = run.lse.dense();
      if (attempt == 0) {
        first_out = out_bits;
        first_lse = lse;
        continue;
      }
      const char* how = attempt == 2 ? " (CUDA graph replay)" : "";
      EXPECT_TRUE(out_bits == first_out) << "out differs on run " << attempt + 1 << how;
      EXPECT_EQ(std::memcmp(lse.data(), first_lse.data(), lse.size() * sizeof(double)), 0)
          << "lse differs on run " << attempt + 1 << how;
    }
  }
}

// Problems without a kernel get kNotSupported with a reason, never a wrong answer. These are
// host-side answers: they hold with or without a GPU.
TEST(Sm90Forward, RefusesWhatItDoesNotImplement) {
  ASSERT_FALSE(built_kernels().empty()) << "FA4_SM90_KERNELS built no forward kernel";
  const Kernel k = built_kernels().front();
  Problem base;
  base.batch = 1;
  base.seqlen_q = base.seqlen_k = 64;
  base.heads_q = base.heads_kv = 2;
  base.head_dim_qk = base.head_dim_v = k.head_dim;
  base.dtype = k.dtype;

  const Status ok = can_implement(base, Backend::kSm90, Pass::kForward);
  EXPECT_TRUE(ok.ok() || ok.code == StatusCode::kBackendUnavailable) << ok.message;

  int32_t cu[2] = {0, 64};
  int32_t used[1] = {32};
  struct Refusal {
    const char* what;
    Problem p;
  };
  std::vector<Refusal> refusals;
  refusals.push_back({"varlen", base});
  refusals.back().p.varlen = {cu, cu, 64, 64};
  refusals.push_back({"seqused_k", base});
  refusals.back().p.seqused_k = used;
  refusals.push_back({"head dim 96", base});
  refusals.back().p.head_dim_qk = refusals.back().p.head_dim_v = 96;
  refusals.push_back({"head_dim_v != head_dim_qk", base});
  refusals.back().p.head_dim_v = k.head_dim / 2;
  refusals.push_back({"fp32", base});
  refusals.back().p.dtype = DType::kFP32;
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.what);
    const Status s = can_implement(r.p, Backend::kSm90, Pass::kForward);
    EXPECT_EQ(s.code, StatusCode::kNotSupported) << to_string(s.code) << ": " << s.message;
    EXPECT_FALSE(s.message.empty());
  }
  const Status bwd = can_implement(base, Backend::kSm90, Pass::kBackward);
  EXPECT_EQ(bwd.code, StatusCode::kNotSupported) << bwd.message;
}

// Host pointers handed to the GPU backend are refused before any launch.
TEST(Sm90Forward, RefusesHostMemory) {
  FA4_SKIP_WITHOUT_HOPPER();
  const Kernel k = built_kernels().front();
  Case c = base_case(k, {"", 1, 64, 64});
  c.name = "host_memory";
  c.heads_q = c.heads_kv = 2;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  HostTensor out(c.dtype, query_dims(setup->problem, 2, k.head_dim));
  HostLse lse = make_lse(setup->problem, false);
  ForwardTensors t;
  t.q = setup->q.view();
  t.k = setup->k.view();
  t.v = setup->v.view();
  t.out = out.view();
  t.lse = lse.view();
  const Status s = forward(setup->problem, t, {}, nullptr, Backend::kSm90);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
}

}  // namespace
}  // namespace fa4::test
