// The KV cache (Problem::kv_cache) on the CPU backend: the cases of common/kv_cache_cases.hpp
// (pages, cache rows, left pads, appends, rotary, decode to chunked prefill, under every mask),
// each checked there for its appends and its attention against the double reference; plus bad
// input refused with nothing written, and what the library does not compute with a cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/kv_cache_cases.hpp"
#include "common/test_util.hpp"
#include "fa4/attention.hpp"

namespace fa4::test {
namespace {

void check_cache_case(const CacheCase& c) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
  size_t bytes = 1;
  ASSERT_TRUE(workspace_size(s->p, Backend::kCpu, Pass::kForward, &bytes).ok());
  HostWorkspace ws(bytes);
  const Status st = forward(s->p, tensors_of(*s), ws.view(), nullptr, Backend::kCpu);
  ASSERT_TRUE(st.ok()) << st.message;
  for (const CheckResult& r : check_appends(*s)) EXPECT_TRUE(r.ok) << r.message;
  for (const CheckResult& r : check_attention(*s)) EXPECT_TRUE(r.ok) << r.message;
}

class CpuKvCache : public ::testing::TestWithParam<CacheCase> {};

TEST_P(CpuKvCache, MatchesReference) { check_cache_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CpuKvCache, ::testing::ValuesIn(cache_cases()),
                         [](const ::testing::TestParamInfo<CacheCase>& info) {
                           return info.param.name;
                         });

// The page-table entry of sequence b's first appended row.
int32_t& appended_page(CacheSetup& s, int64_t b) {
  const KvCache& kc = s.p.kv_cache;
  return s.page_table[size_t(s.batch_idx[size_t(b)] * kc.page_table_stride +
                             s.cache_len[size_t(b)] / kc.page_size)];
}

// Bad input: a clear kInvalidArgument naming what is wrong, and nothing written — neither the
// output nor the cache.
TEST(CpuKvCache, RefusesBadInputWritingNothing) {
  CacheCase c;
  c.name = "refusals";
  c.page_size = 16;
  c.append = 3;
  c.seqlen_q = 3;
  c.causal = true;
  c.rotary_dim = 32;
  c.batch_idx = true;
  c.leftpad = true;
  std::mt19937_64 rng = make_rng(c.name);
  struct Refusal {
    const char* what;
    const char* named;  // in the message
    void (*spoil)(CacheSetup&);
  } refusals[] = {
      // (The pages the appends write: entries of pages no key is read from are never read.)
      {"a page out of range", "page_table",
       [](CacheSetup& s) { appended_page(s, 1) = int32_t(s.p.kv_cache.num_pages); }},
      {"a negative page", "page_table", [](CacheSetup& s) { appended_page(s, 2) = -1; }},
      {"an append past the capacity", "capacity",
       [](CacheSetup& s) { s.cache_len[1] = int32_t(s.p.seqlen_k - 1); }},
      {"a cache row out of range", "batch_idx",
       [](CacheSetup& s) { s.batch_idx[0] = int32_t(s.cache_rows); }},
      {"a left pad past the cache length", "leftpad",
       [](CacheSetup& s) { s.leftpad[2] = s.cache_len[2] + 1; }},
      {"an odd rotary dim", "rotary_dim", [](CacheSetup& s) { s.p.kv_cache.rotary_dim = 31; }},
      {"a rotary dim past the head dim", "rotary_dim",
       [](CacheSetup& s) { s.p.kv_cache.rotary_dim = 66; }},
      {"rotary positions past the tables", "rotary",
       [](CacheSetup& s) { s.p.kv_cache.rotary_seqlen = 2; }},
      {"rotary without appends", "rotary_dim", [](CacheSetup& s) { s.p.kv_cache.seqlen_new = 0; }},
      {"packed keys with a cache", "cu_seqlens_k",
       [](CacheSetup& s) { s.p.varlen.cu_seqlens_k = s.cache_len.data(); }},
      {"a page table row shorter than its pages", "page_table_stride",
       [](CacheSetup& s) { s.p.kv_cache.page_table_stride = s.p.kv_cache.pages_per_seq - 1; }},
      {"a capacity other than the pages'", "seqlen_k", [](CacheSetup& s) { s.p.seqlen_k += 1; }},
      {"page sizes without a page table", "page_table",
       [](CacheSetup& s) { s.p.kv_cache.page_table = nullptr; }},
      {"no k_new", "k_new.data", nullptr},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.what);
    const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
    if (r.spoil != nullptr) r.spoil(*s);
    ForwardTensors t = tensors_of(*s);
    if (r.spoil == nullptr) t.k_new.data = nullptr;
    const Status st = forward(s->p, t, {}, nullptr, Backend::kCpu);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << st.message;
    EXPECT_NE(st.message.find(r.named), std::string::npos) << st.message;
    const std::vector<double> k_after = s->k.dense(), v_after = s->v.dense();
    EXPECT_TRUE(k_after == s->k_initial) << "the k cache was written";
    EXPECT_TRUE(v_after == s->v_initial) << "the v cache was written";
    for (int64_t i = 0; i < s->out.size(); ++i)
      ASSERT_TRUE(s->out.is_poison(i)) << "out was written at " << i;
  }
}

// The backward does not take a cache, on either backend, and says so. The sm90 forward takes one,
// on pages of any size (16 keys here: gathered rows): a build without CUDA answers
// kBackendUnavailable, as for any problem (Sm90KvCache runs the cases on the GPU).
TEST(CpuKvCache, UnsupportedPassesAndBackends) {
  CacheCase c;
  c.name = "unsupported";
  c.page_size = 16;
  c.dim = 128;
  c.append = 1;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
  for (Backend backend : {Backend::kCpu, Backend::kSm90}) {
    const Status st = can_implement(s->p, backend, Pass::kBackward);
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
    EXPECT_NE(st.message.find("forward-only"), std::string::npos) << st.message;
  }
  // The sm90 forward takes every cache layout; a build may lack the head dim's kernel.
  const Status st = can_implement(s->p, Backend::kSm90, Pass::kForward);
  const bool no_kernel = st.code == StatusCode::kNotSupported &&
                         st.message.find("no forward kernel") != std::string::npos;
  EXPECT_TRUE(st.ok() || st.code == StatusCode::kBackendUnavailable || no_kernel)
      << to_string(st.code) << ": " << st.message;
  EXPECT_TRUE(can_implement(s->p, Backend::kCpu, Pass::kForward).ok());
}

// num_splits is a count: 0 the library's choice, 1 none, n at most n; negative is refused.
TEST(CpuKvCache, NumSplitsIsValidated) {
  Problem p;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = 16;
  p.heads_q = p.heads_kv = 1;
  p.head_dim_qk = p.head_dim_v = 64;
  p.num_splits = -1;
  const Status st = can_implement(p, Backend::kCpu, Pass::kForward);
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("num_splits"), std::string::npos) << st.message;
  p.num_splits = 3;
  EXPECT_TRUE(can_implement(p, Backend::kCpu, Pass::kForward).ok());
}

}  // namespace
}  // namespace fa4::test
