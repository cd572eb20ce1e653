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
// (queries, new rows, rotary tables, arrays) compared byte for byte afterwards. Bad entries in
// device memory (pages, cache lengths, cache rows, left pads) skip their sequence alone: nothing of
// it written, every other sequence bitwise as a clean call leaves it.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iostream>
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
// An engine's decode step: 4 sequences of one query, 32 / 8 heads of 128 dims, 3000-key caches.
CacheCase decode_case() {
  CacheCase decode;
  decode.batch = 4;
  decode.heads_q = 32;
  decode.heads_kv = 8;
  decode.dim = 128;
  decode.capacity = 3000;
  return decode;
}

std::vector<CacheCase> gpu_only_cases() {
  std::vector<CacheCase> cases;
  const CacheCase decode = decode_case();
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

// The forward on d's device copies with a poisoned workspace of `bytes`, its status in *st; then the
// workspace's guards, every device buffer's guards and the inputs checked, and its writes
// downloaded.
void run_forward(DeviceCache& d, size_t bytes, const Overrides& overrides, Status* st) {
  DeviceWorkspace ws;
  ASSERT_CUDA(ws.allocate(bytes));  // poisoned: 0xFF
  ASSERT_CUDA(d.upload());
  *st = forward(d.problem, d.tensors, ws.view(), nullptr, Backend::kSm90, overrides);
  ASSERT_CUDA(DeviceRun::device_sync());
  bool intact = false;
  ASSERT_CUDA(ws.guards_intact(&intact));
  EXPECT_TRUE(intact) << "workspace: bytes around it were written";
  std::string written;
  ASSERT_CUDA(d.untouched(&written));
  EXPECT_TRUE(written.empty()) << written;
  ASSERT_CUDA(d.download());
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
  Status st;
  run_forward(d, bytes, overrides, &st);
  if (::testing::Test::HasFatalFailure()) return;
  if (refused(st)) GTEST_SKIP() << st.message;
  ASSERT_TRUE(st.ok()) << to_string(st.code) << ": " << st.message;
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

// Bad entries the host cannot see (they live in device memory): a sequence whose entries are
// inconsistent is neither appended to nor computed, nothing of it written (the prepare kernel
// finds it out and marks it for the attention and the combine); every other sequence of the call
// is computed as if the bad one were sound. An engine's decode step (the GPU-only decode shape,
// cache rows picked by batch_idx so that a row can be out of range) on pages
// in pieces, pages of whole key tiles, a contiguous cache with and without left pads, gathered rows
// past left pads, and with an appended, rotated key (the prepare kernel's appends): each run
// unsplit (the attention reads the marks), split as the library likes and split three ways (the
// combine reads them too); clean first, then once per bad entry on a fresh copy of the same
// inputs.
std::vector<CacheCase> bad_entry_cases() {
  CacheCase decode = decode_case();
  decode.batch_idx = true;
  std::vector<CacheCase> cases;
  for (int64_t page : {int64_t(16), int64_t(256), int64_t(0)}) {
    CacheCase c = decode;
    c.page_size = page;
    c.name = "decode_" + (page > 0 ? "page" + std::to_string(page) : std::string("contiguous"));
    cases.push_back(c);
  }
  CacheCase c = decode;
  c.page_size = 16;
  c.leftpad = true;
  c.name = "decode_page16_leftpad";  // gathered rows
  cases.push_back(c);
  c.page_size = 0;
  c.name = "decode_contiguous_leftpad";  // whole key tiles past the pads
  cases.push_back(c);
  c = decode;
  c.page_size = 16;
  c.append = 1;
  c.causal = true;
  c.rotary_dim = 128;
  c.name = "decode_page16_append1_rotary128";
  cases.push_back(c);
  return cases;
}

// The keys sequence b's attention reads: from its left pad to its last appended row.
int64_t first_key(const CacheSetup& s, int64_t b) {
  return s.p.kv_cache.leftpad != nullptr ? s.leftpad[size_t(b)] : 0;
}
int64_t end_key(const CacheSetup& s, int64_t b) {
  return s.cache_len[size_t(b)] + s.new_rows[size_t(b)];
}

// The page-table entry of a page in the middle of those sequence b reads (neither its first nor
// its last, so that a split which does not read it sees the sequence rejected all the same); null
// where b reads fewer than three pages.
int32_t* middle_page(CacheSetup& s, int64_t b) {
  const KvCache& kc = s.p.kv_cache;
  if (end_key(s, b) == 0) return nullptr;
  const int64_t first = first_key(s, b) / kc.page_size, last = (end_key(s, b) - 1) / kc.page_size;
  if (last - first < 2) return nullptr;
  return &s.page_table[size_t(s.batch_idx[size_t(b)] * kc.page_table_stride + (first + last) / 2)];
}

struct BadEntry {
  const char* what;
  bool paged_only, leftpad_only;
  // Spoils sequence b's entry; false where this draw has no such entry.
  bool (*spoil)(CacheSetup&, int64_t b);
};
const BadEntry kBadEntries[] = {
    {"a page read out of range", true, false,
     [](CacheSetup& s, int64_t b) {
       int32_t* page = middle_page(s, b);
       if (page != nullptr) *page = int32_t(s.p.kv_cache.num_pages);
       return page != nullptr;
     }},
    {"a negative page read", true, false,
     [](CacheSetup& s, int64_t b) {
       int32_t* page = middle_page(s, b);
       if (page != nullptr) *page = -1;
       return page != nullptr;
     }},
    {"a cache length past the capacity", false, false,
     [](CacheSetup& s, int64_t b) {
       s.cache_len[size_t(b)] = int32_t(s.p.seqlen_k + 5);
       return true;
     }},
    // Far out of range: a kernel that took these entries unchecked would read outside the page
    // table or the cache (the TMA views' bounds do not cover every coordinate they reach).
    {"a cache length far past the capacity", false, false,
     [](CacheSetup& s, int64_t b) {
       s.cache_len[size_t(b)] = int32_t(1) << 28;
       return true;
     }},
    {"a cache row out of range", false, false,
     [](CacheSetup& s, int64_t b) {
       s.batch_idx[size_t(b)] = int32_t(s.cache_rows);
       return true;
     }},
    {"a cache row far out of range", false, false,
     [](CacheSetup& s, int64_t b) {
       s.batch_idx[size_t(b)] = int32_t(1) << 24;
       return true;
     }},
    {"a left pad past the cache length", false, true,
     [](CacheSetup& s, int64_t b) {
       s.leftpad[size_t(b)] = s.cache_len[size_t(b)] + 1;
       return true;
     }},
    {"a negative left pad", false, true,
     [](CacheSetup& s, int64_t b) {
       s.leftpad[size_t(b)] = -100;
       return true;
     }},
};

// Elements of sequence b (fixed-length rows): out's dense [b][row][head][dim] and LSE's dense
// [b][head][row], each read through the host tensor's own strides.
int64_t out_per_sequence(const CacheSetup& s) { return s.out.size() / s.out.dims().batch; }
int64_t lse_per_sequence(const CacheSetup& s) { return s.lse.size() / s.lse.batch(); }

// Sequence b's output rows (every head, every dim) and LSE entries still poisoned.
void expect_sequence_unwritten(const CacheSetup& s, int64_t b) {
  const int64_t n = out_per_sequence(s), m = lse_per_sequence(s);
  for (int64_t i = b * n; i < (b + 1) * n; ++i)
    ASSERT_TRUE(s.out.is_poison(i)) << "out of the bad sequence " << b << " written at " << i;
  for (int64_t i = b * m; i < (b + 1) * m; ++i)
    ASSERT_TRUE(s.lse.is_poison(i)) << "lse of the bad sequence " << b << " written at " << i;
}

// Every sequence but `bad` bitwise as the clean call left it: the plan depends on shapes and
// overrides only, and the forward is deterministic for a plan.
void expect_others_as_clean(const CacheSetup& s, const CacheSetup& clean, int64_t bad) {
  const int64_t n = out_per_sequence(s), m = lse_per_sequence(s);
  for (int64_t b = 0; b < s.p.batch; ++b) {
    if (b == bad) continue;
    int64_t differ = 0, first = -1;
    for (int64_t i = b * n; i < (b + 1) * n; ++i)
      if (s.out.bits(i) != clean.out.bits(i) && differ++ == 0) first = i;
    EXPECT_EQ(differ, 0) << "out of sequence " << b << " differs from the clean call's in "
                         << differ << " elements, the first at " << first;
    differ = 0;
    for (int64_t i = b * m; i < (b + 1) * m; ++i) {
      const double x = s.lse.get(i), y = clean.lse.get(i);
      if (std::memcmp(&x, &y, sizeof x) != 0 && differ++ == 0) first = i;
    }
    EXPECT_EQ(differ, 0) << "lse of sequence " << b << " differs from the clean call's in "
                         << differ << " entries, the first at " << first;
  }
}

// The cache the spoiled call left: the clean call's, but for the rows the clean call appended to
// sequence `bad` (placed by the clean arrays), which hold what was drawn.
void expect_cache_as_clean_but(const CacheSetup& s, const CacheSetup& clean, int64_t bad) {
  std::vector<int64_t> as_drawn;
  for (int64_t j = 0; j < clean.new_rows[size_t(bad)]; ++j)
    for (int64_t h = 0; h < clean.p.heads_kv; ++h)
      for (int64_t c = 0; c < clean.p.head_dim_qk; ++c)
        as_drawn.push_back(cache_index(clean, bad, clean.cache_len[size_t(bad)] + j, h, c));
  std::sort(as_drawn.begin(), as_drawn.end());
  const struct {
    const char* name;
    const HostTensor &got, &want;
    const std::vector<double>& initial;
  } caches[] = {{"k", s.k, clean.k, s.k_initial}, {"v", s.v, clean.v, s.v_initial}};
  for (const auto& t : caches) {
    int64_t differ = 0, first = -1;
    size_t next = 0;
    for (int64_t e = 0; e < t.got.size(); ++e) {
      const bool kept = next < as_drawn.size() && as_drawn[next] == e;
      next += kept ? 1 : 0;
      const bool ok = kept ? t.got.get(e) == t.initial[size_t(e)] : t.got.bits(e) == t.want.bits(e);
      if (!ok && differ++ == 0) first = e;
    }
    EXPECT_EQ(differ, 0) << "the " << t.name << " cache differs in " << differ
                         << " elements (the bad sequence's appended rows as drawn, every other "
                            "as the clean call left it), the first at "
                         << first;
  }
}

class Sm90KvCacheBadEntries : public ::testing::TestWithParam<CacheCase> {};

TEST_P(Sm90KvCacheBadEntries, SkipsOnlyTheBadSequence) {
  const CacheCase& c = GetParam();
  if (!has_kernel(c)) GTEST_SKIP() << "no d128 bf16 forward kernel in this build";
  FA4_SKIP_WITHOUT_HOPPER();
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  auto setup = [&] {
    std::mt19937_64 rng = make_rng(c.name);
    return make_cache_setup(c, rng);
  };
  // The forward on a setup's device copies, its writes downloaded: ok (the host sees no device
  // entry), the workspace's guards and every device buffer's guards and inputs intact.
  auto run = [](CacheSetup& s, const Overrides& overrides) {
    DeviceCache d(s);
    size_t bytes = 0;
    const Status sized =
        workspace_size(d.problem, Backend::kSm90, Pass::kForward, overrides, &bytes);
    ASSERT_TRUE(sized.ok()) << to_string(sized.code) << ": " << sized.message;
    Status st;
    run_forward(d, bytes, overrides, &st);
    ASSERT_TRUE(st.ok()) << to_string(st.code) << ": " << st.message;
  };

  const struct {
    const char* name;
    int splits;  // 0: the library's choice
  } plans[] = {{"unsplit", 1}, {"splits left to the library", 0}, {"split three ways", 3}};
  for (const auto& plan : plans) {
    SCOPED_TRACE(plan.name);
    Overrides overrides = test_overrides();
    if (plan.splits > 0) overrides.splits = plan.splits;
    const std::unique_ptr<CacheSetup> clean = setup();
    run(*clean, overrides);
    if (HasFatalFailure()) return;
    for (const CheckResult& r : check_appends(*clean)) EXPECT_TRUE(r.ok) << r.message;
    for (const CheckResult& r : check_attention(*clean, kLseUlps)) EXPECT_TRUE(r.ok) << r.message;
    // The bad sequence: past the first (whose cache is empty), the one that reads the most keys,
    // so that it has a middle page (the same in every setup: they are drawn alike).
    int64_t bad = 1;
    for (int64_t b = 2; b < c.batch; ++b)
      if (end_key(*clean, b) - first_key(*clean, b) > end_key(*clean, bad) - first_key(*clean, bad))
        bad = b;
    for (const BadEntry& e : kBadEntries) {
      if ((e.paged_only && c.page_size == 0) || (e.leftpad_only && !c.leftpad)) continue;
      SCOPED_TRACE(std::string(e.what) + " in sequence " + std::to_string(bad));
      const std::unique_ptr<CacheSetup> s = setup();
      if (!e.spoil(*s, bad)) {
        std::cout << "[          ] " << c.name << ": sequence " << bad
                  << " reads fewer than three pages: not spoiled by " << e.what << "\n";
        continue;
      }
      run(*s, overrides);
      if (HasFatalFailure()) return;
      expect_sequence_unwritten(*s, bad);
      if (HasFatalFailure()) return;
      expect_others_as_clean(*s, *clean, bad);
      if (c.append > 0) expect_cache_as_clean_but(*s, *clean, bad);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Sm90KvCacheBadEntries, ::testing::ValuesIn(bad_entry_cases()),
                         [](const ::testing::TestParamInfo<CacheCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace fa4::test
