// The KV cache (Problem::kv_cache) on the sm90 backend: the cases the CPU backend runs
// (common/kv_cache_cases.hpp: pages, cache rows, left pads, appends, rotary, decode to chunked
// prefill, under every mask), on device copies of the same inputs, checked by the same code
// against the same double reference. The cases whose head dims and dtype this build has a kernel
// for (FA4_SM90_BUILT_KERNELS) run: bf16, fp16 and e4m3 (fp32 has none); e4m3 ones on pages the
// e4m3 kernels do not read check the refusal. Paged cases run again with split-KV forced, and
// with the query heads of a kv head packed into one tile where there is GQA, each on fresh
// inputs: the appends write the cache, so a second call on the same cache would append on top of
// the first. Plus GPU-only shapes: decode (bf16, and e4m3 with quantised appends) and a chunked
// prefill at d128 with 32 / 8 heads and a 3000-key cache, and two of the CPU cases at d128 and
// d256.
// Around each call: outputs and workspace poisoned, every device buffer guarded, the inputs
// (queries, new rows, rotary tables, arrays) compared byte for byte afterwards.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/kv_cache_cases.hpp"
#include "common/numeric.hpp"
#include "common/test_util.hpp"
#include "device_buffer.hpp"
#include "sm90_test_support.hpp"

namespace fa4::test {
namespace {

bool has_kernel(const CacheCase& c) {
  return kernel_listed(built_kernels(), c.dim, c.dim, c.dtype);
}

// The e4m3 kernels read pages only as TMA boxes (whole key tiles or 16-key pieces: their
// producer's third and fourth warps transpose V rather than gather rows): pages of another size,
// or left pads in a paged cache, are refused with nothing written.
bool refused_for_e4m3(const CacheCase& c) {
  return c.dtype == DType::kE4M3 && c.page_size > 0 && (c.page_size % 16 != 0 || c.leftpad);
}

// LSE's allowance on top of the rule, in fp32 ulps of the largest |LSE|: the one the sm90 forward
// tests take, for the same fp32 roundings (docs/testing.md, GPU forward LSE).
constexpr double kLseUlps = 4.0;

// The shapes only the GPU runs: an engine's decode step (one query per sequence, GQA 4, 128-dim
// heads, a long cache) on every page size the kernels tile differently, with and without an
// appended, rotated key; a 200-row chunked prefill; and two CPU cases at the other head dims whose
// key tiles differ (the CPU cases are d64), one of them in pieces where the tile row has them.
std::vector<CacheCase> gpu_only_cases() {
  std::vector<CacheCase> cases;
  CacheCase decode;
  decode.batch = 4;
  decode.heads_q = 32;
  decode.heads_kv = 8;
  decode.dim = 128;
  decode.capacity = 3000;
  for (int64_t page : {int64_t(16), int64_t(64), int64_t(256), int64_t(0)}) {
    CacheCase c = decode;
    c.page_size = page;
    const std::string tag = "decode_d128_gqa4_" +
                            (page > 0 ? "page" + std::to_string(page) : std::string("contiguous"));
    c.name = tag;
    cases.push_back(c);
    c.append = 1;
    c.causal = true;
    c.rotary_dim = 128;
    c.name = tag + "_append1_rotary128_neox";
    cases.push_back(c);
  }
  // The same decode step over an e4m3 cache (pages of 16 and 64), the step's bf16 key and value
  // quantised on write, as engines run FP8 caches.
  for (int64_t page : {int64_t(16), int64_t(64)}) {
    CacheCase c = decode;
    c.dtype = DType::kE4M3;
    c.quantize_appends = true;
    c.page_size = page;
    c.append = 1;
    c.causal = true;
    c.rotary_dim = 128;
    c.name = "decode_d128_gqa4_page" + std::to_string(page) + "_e4m3_append1_rotary128_quantized";
    cases.push_back(c);
  }
  {
    CacheCase c = decode;
    c.page_size = 64;
    c.capacity = 2000;
    c.append = 200;
    c.seqlen_q = 200;
    c.causal = true;
    c.name = "chunk200_d128_gqa4_page64_causal";
    cases.push_back(c);
  }
  for (const CacheCase& base : cache_cases()) {
    if (base.name != "page16_spec3_append3_causal_shared" && base.name != "page128_decode")
      continue;
    for (int64_t dim : {int64_t(96), int64_t(128), int64_t(192), int64_t(256)}) {
      CacheCase c = base;
      c.dim = dim;
      c.name = base.name + "_d" + std::to_string(dim);
      cases.push_back(c);
    }
  }
  return cases;
}

// A case and the launch-plan path it runs on.
struct GpuCacheCase {
  CacheCase c;
  std::string name;  // the test's: c.name and the path's suffix
  int splits = 0;    // > 0: Overrides::splits
  Choice pack_gqa = Choice::kAuto;
};
// GoogleTest prints a parameter by its name, not its bytes.
void PrintTo(const GpuCacheCase& g, std::ostream* os) { *os << g.name; }

std::vector<GpuCacheCase> gpu_cases() {
  std::vector<CacheCase> cases = cache_cases();
  for (CacheCase& c : gpu_only_cases()) cases.push_back(std::move(c));
  // Cases on pages smaller than a key tile run in pieces where pages hold whole 16-key pieces and
  // the kernel's tile row has them (a TMA box per piece: pages of 16 and 64 keys without left
  // pads, every head dim but d256), else gathered (row by row through the page table: d256, pages
  // of 1 and 7 keys, left pads); each runs again where the kernels read a key tile as one TMA box
  // (pages of 256 keys hold whole key tiles at every head dim; cache rows where a left pad rules
  // such pages out), so that the appends, rotary forms, masks and varlen batches see every path.
  const size_t listed = cases.size();
  for (size_t i = 0; i < listed; ++i) {
    if (cases[i].page_size == 0 || cases[i].page_size % 256 == 0) continue;
    CacheCase c = cases[i];
    c.page_size = c.leftpad ? 0 : 256;
    c.name += c.leftpad ? "_as_rows" : "_as_page256";
    cases.push_back(std::move(c));
  }
  std::vector<GpuCacheCase> runs;
  for (const CacheCase& c : cases) {
    if (!has_kernel(c)) continue;
    runs.push_back({c, c.name});
    if (c.page_size == 0) continue;
    runs.push_back({c, c.name + "_split3", 3});
    if (c.heads_q > c.heads_kv) runs.push_back({c, c.name + "_packed", 0, Choice::kOn});
  }
  return runs;
}

// Device copies of a setup's tensors and arrays, each in an allocation of its own with guards,
// and the problem and tensors over them; the checks read the host setup, into which the cache and
// the outputs are downloaded.
struct DeviceCache {
  // What the call reads and must leave as it is: a mirror of one view, which starts at the view's
  // first element (the lowest address it covers, every stride being positive).
  struct Input {
    std::string name;
    const void* host;
    std::unique_ptr<DeviceMirror> mirror;
  };
  Problem problem;  // the setup's, with device arrays
  ForwardTensors tensors;
  std::vector<Input> inputs;
  std::unique_ptr<DeviceMirror> k, v, out, lse;  // written by the call

  explicit DeviceCache(const CacheSetup& s) : problem(s.p) {
    // e4m3 problems: O, the rotary tables and appends quantised on write are 16-bit.
    auto elem = [](const HostTensor& t) { return dtype_size(t.dtype()); };
    auto mirror = [](const DeviceMirror::View& view, size_t bytes) {
      return std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{view}, bytes);
    };
    auto input = [&](const char* name, const DeviceMirror::View& view,
                     size_t bytes) -> const DeviceMirror& {
      inputs.push_back({name, view.data, mirror(view, bytes)});
      return *inputs.back().mirror;
    };
    auto device_array = [&](const char* name, const std::vector<int32_t>& a) {
      return static_cast<const int32_t*>(
          input(name, array_view(a), sizeof(int32_t)).device(a.data()));
    };
    // The GPU backend reads every array the problem points at in device memory.
    const KvCache& kc = s.p.kv_cache;
    KvCache& dkc = problem.kv_cache;
    if (kc.page_table != nullptr) dkc.page_table = device_array("page_table", s.page_table);
    if (kc.batch_idx != nullptr) dkc.batch_idx = device_array("batch_idx", s.batch_idx);
    if (kc.leftpad != nullptr) dkc.leftpad = device_array("leftpad", s.leftpad);
    if (kc.cu_seqlens_new != nullptr)
      dkc.cu_seqlens_new = device_array("cu_seqlens_new", s.cu_new);
    if (s.p.seqused_k != nullptr) problem.seqused_k = device_array("seqused_k", s.cache_len);
    if (s.p.varlen.cu_seqlens_q != nullptr)
      problem.varlen.cu_seqlens_q = device_array("cu_seqlens_q", s.cu_q);
    auto device_floats = [&](const char* name, const std::vector<float>& a) {
      return static_cast<const float*>(input(name, array_view(a), sizeof(float)).device(a.data()));
    };
    if (s.p.sinks != nullptr) problem.sinks = device_floats("sinks", s.sinks);
    if (s.p.alibi.data != nullptr) problem.alibi.data = device_floats("alibi", s.alibi_slopes);

    const ForwardTensors host = tensors_of(s);
    tensors.q = input("q", mirror_view(s.q), elem(s.q)).device_view(host.q);
    k = mirror(mirror_view(s.k), elem(s.k));
    v = mirror(mirror_view(s.v), elem(s.v));
    out = mirror(mirror_view(s.out), elem(s.out));
    lse = mirror(mirror_view(s.lse), sizeof(float));
    tensors.k = k->device_view(host.k);
    tensors.v = v->device_view(host.v);
    tensors.out = out->device_view(host.out);
    tensors.lse = lse->device_view(host.lse);
    if (kc.appends()) {
      tensors.k_new =
          input("k_new", mirror_view(s.k_new), elem(s.k_new)).device_view(host.k_new);
      tensors.v_new =
          input("v_new", mirror_view(s.v_new), elem(s.v_new)).device_view(host.v_new);
    }
    if (kc.rotary_dim > 0) {
      tensors.rotary = host.rotary;
      tensors.rotary.cos =
          input("rotary cos", mirror_view(s.cos), elem(s.cos)).device(host.rotary.cos);
      tensors.rotary.sin =
          input("rotary sin", mirror_view(s.sin), elem(s.sin)).device(host.rotary.sin);
    }
    auto descale = [&](const char* name, const std::vector<float>& a, DescaleView view) {
      if (view.data != nullptr) view.data = device_floats(name, a);
      return view;
    };
    tensors.q_descale = descale("q_descale", s.q_descale, host.q_descale);
    tensors.k_descale = descale("k_descale", s.k_descale, host.k_descale);
    tensors.v_descale = descale("v_descale", s.v_descale, host.v_descale);
  }

  // Every buffer by name.
  std::vector<std::pair<std::string, DeviceMirror*>> all() {
    std::vector<std::pair<std::string, DeviceMirror*>> m = {
        {"k", k.get()}, {"v", v.get()}, {"out", out.get()}, {"lse", lse.get()}};
    for (Input& i : inputs) m.push_back({i.name, i.mirror.get()});
    return m;
  }

  // Every byte of every buffer, guards included, to 0xFF; then the host contents over it (the
  // outputs' being the host tensors' poison, which the caller sets). The copies run on the legacy
  // stream: the device-wide wait keeps a pageable upload from landing after the kernel starts.
  std::string upload() {
    for (auto& [name, m] : all()) {
      std::string e = m->poison();
      if (e.empty()) e = m->upload();
      if (!e.empty()) return name + ": " + e;
    }
    return DeviceRun::device_sync();
  }

  // The cache and the outputs back into the host setup's tensors.
  std::string download() {
    for (DeviceMirror* m : {k.get(), v.get(), out.get(), lse.get()}) {
      const std::string e = m->download(nullptr);
      if (!e.empty()) return e;
    }
    return "";
  }

  // What the call changed that it must not have: guard bytes of any buffer, any byte of an
  // input. Sets *what to a list of them ("" when none); returns "" or the CUDA error.
  std::string untouched(std::string* what) {
    what->clear();
    for (auto& [name, m] : all()) {
      bool intact = false;
      const std::string e = m->guards_intact(&intact);
      if (!e.empty()) return name + ": " + e;
      if (!intact) *what += name + ": bytes around it were written; ";
    }
    for (Input& i : inputs) {
      std::vector<unsigned char> now(i.mirror->bytes());
      const std::string e = i.mirror->download(now.data());
      if (!e.empty()) return i.name + ": " + e;
      if (!now.empty() && std::memcmp(now.data(), i.host, now.size()) != 0)
        *what += i.name + " was written; ";
    }
    return "";
  }
};

// After a refused call: no byte of any buffer written, the caches as they were, the outputs still
// poisoned.
void expect_nothing_written(DeviceCache& d, CacheSetup& s) {
  std::string written;
  ASSERT_CUDA(d.untouched(&written));
  EXPECT_TRUE(written.empty()) << written;
  ASSERT_CUDA(d.download());
  const std::vector<double> k_after = s.k.dense(), v_after = s.v.dense();
  EXPECT_TRUE(k_after == s.k_initial) << "the k cache was written";
  EXPECT_TRUE(v_after == s.v_initial) << "the v cache was written";
  for (int64_t i = 0; i < s.out.size(); ++i)
    ASSERT_TRUE(s.out.is_poison(i)) << "out was written at " << i;
  for (int64_t i = 0; i < s.lse.size(); ++i)
    ASSERT_TRUE(s.lse.is_poison(i)) << "lse was written at " << i;
}

void check_gpu_case(const GpuCacheCase& g) {
  FA4_SKIP_WITHOUT_HOPPER();
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(g.c));
  // Seeded by the case's own name: with the same FA4_TEST_SEED, the CPU test's inputs.
  std::mt19937_64 rng = make_rng(g.c.name);
  const std::unique_ptr<CacheSetup> s = make_cache_setup(g.c, rng);
  DeviceCache d(*s);
  Overrides overrides = test_overrides();
  if (g.splits > 0) overrides.splits = g.splits;
  if (g.pack_gqa != Choice::kAuto) overrides.pack_gqa = g.pack_gqa;

  // Unsupported must not pass silently: only a build without the kernel skips (the case list
  // follows FA4_SM90_BUILT_KERNELS, so that means the list and the library disagree on it).
  auto refused = [](const Status& st) {
    return st.code == StatusCode::kNotSupported &&
           st.message.find("no forward kernel for head dims") != std::string::npos;
  };
  size_t bytes = 0;
  const Status sized = workspace_size(d.problem, Backend::kSm90, Pass::kForward, overrides, &bytes);
  if (refused(sized)) GTEST_SKIP() << sized.message;
  if (refused_for_e4m3(g.c)) {
    EXPECT_EQ(sized.code, StatusCode::kNotSupported)
        << to_string(sized.code) << ": " << sized.message;
    ASSERT_CUDA(d.upload());
    const Status st = forward(d.problem, d.tensors, {}, nullptr, Backend::kSm90, overrides);
    ASSERT_CUDA(DeviceRun::device_sync());
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << to_string(st.code) << ": " << st.message;
    expect_nothing_written(d, *s);
    return;
  }
  ASSERT_TRUE(sized.ok()) << to_string(sized.code) << ": " << sized.message;
  DeviceWorkspace ws;
  ASSERT_CUDA(ws.allocate(bytes));  // poisoned: 0xFF
  ASSERT_CUDA(d.upload());
  const Status st = forward(d.problem, d.tensors, ws.view(), nullptr, Backend::kSm90, overrides);
  ASSERT_CUDA(DeviceRun::device_sync());
  if (refused(st)) GTEST_SKIP() << st.message;
  ASSERT_TRUE(st.ok()) << to_string(st.code) << ": " << st.message;

  bool intact = false;
  ASSERT_CUDA(ws.guards_intact(&intact));
  EXPECT_TRUE(intact) << "workspace: bytes around it were written";
  std::string written;
  ASSERT_CUDA(d.untouched(&written));
  EXPECT_TRUE(written.empty()) << written;
  ASSERT_CUDA(d.download());
  for (const CheckResult& r : check_appends(*s)) EXPECT_TRUE(r.ok) << r.message;
  for (const CheckResult& r : check_attention(*s, kLseUlps, /*fp8_mma=*/true)) EXPECT_TRUE(r.ok) << r.message;
}

class Sm90KvCache : public ::testing::TestWithParam<GpuCacheCase> {};

TEST_P(Sm90KvCache, MatchesReference) { check_gpu_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, Sm90KvCache, ::testing::ValuesIn(gpu_cases()),
                         [](const ::testing::TestParamInfo<GpuCacheCase>& info) {
                           return info.param.name;
                         });
// A build without any of the cases' kernels has no case to run.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Sm90KvCache);

// Bad input the host can see (an odd rotary dim) is refused before any launch: kInvalidArgument
// naming the field, the outputs still poisoned and the cache unchanged. (Bad page-table entries,
// cache rows and pads live in device memory, which the host does not read.)
TEST(Sm90KvCacheRefusal, OddRotaryDimWritesNothing) {
  FA4_SKIP_WITHOUT_HOPPER();
  CacheCase c;
  c.name = "refuse_odd_rotary";
  c.page_size = 16;
  c.append = 3;
  c.seqlen_q = 3;
  c.causal = true;
  c.rotary_dim = 32;
  bool found = false;
  for (const Kernel& k : built_16bit_kernels())
    if (k.dim_qk == k.dim_v && k.dim_qk >= c.rotary_dim) {
      c.dim = k.dim_qk;
      c.dtype = k.dtype;
      found = true;
      break;
    }
  if (!found) GTEST_SKIP() << "no built kernel has equal qk and v head dims";
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
  DeviceCache d(*s);
  ASSERT_CUDA(d.upload());
  Problem p = d.problem;
  p.kv_cache.rotary_dim = 31;
  const Status st = forward(p, d.tensors, {}, nullptr, Backend::kSm90, test_overrides());
  ASSERT_CUDA(DeviceRun::device_sync());
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << to_string(st.code) << ": " << st.message;
  EXPECT_NE(st.message.find("rotary_dim"), std::string::npos) << st.message;
  expect_nothing_written(d, *s);
}

}  // namespace
}  // namespace fa4::test
