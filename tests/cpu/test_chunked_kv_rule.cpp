// When the forward takes the chunked kernel of a head dim (src/sm90/host/chunked_kv_rule.hpp): only
// without a causal or window band and from min_keys keys per sequence, the mean over a varlen
// batch; FA4_SM90_CHUNKED_KV's value decides alone when set.
#include <gtest/gtest.h>

#include <cstdint>

#include "sm90/host/chunked_kv_rule.hpp"

namespace {

using fa4::sm90::takes_chunked_kv;

constexpr int64_t kMinKeys = 4096;
constexpr int kRule = -1;

fa4::Problem fixed(int64_t batch, int64_t seqlen_k) {
  fa4::Problem p;
  p.batch = batch;
  p.seqlen_q = seqlen_k;
  p.seqlen_k = seqlen_k;
  p.heads_q = p.heads_kv = 8;
  p.head_dim_qk = p.head_dim_v = 256;
  return p;
}

TEST(Sm90ChunkedKvRule, LongSequencesWithoutABand) {
  EXPECT_TRUE(takes_chunked_kv(fixed(4, 4096), false, kMinKeys, kRule));
  EXPECT_TRUE(takes_chunked_kv(fixed(1, 16384), false, kMinKeys, kRule));
  EXPECT_FALSE(takes_chunked_kv(fixed(4, 4095), false, kMinKeys, kRule));
  EXPECT_FALSE(takes_chunked_kv(fixed(32, 512), false, kMinKeys, kRule));
  // A causal or window band: never by the rule, at any length.
  EXPECT_FALSE(takes_chunked_kv(fixed(1, 16384), true, kMinKeys, kRule));
  // Nothing to run.
  EXPECT_FALSE(takes_chunked_kv(fixed(0, 16384), false, kMinKeys, kRule));
}

TEST(Sm90ChunkedKvRule, VarlenTakesTheMeanLength) {
  const int32_t cu[3] = {0, 100, 8292};  // lengths 100 and 8192: mean 4146
  fa4::Problem p = fixed(2, 8192);
  p.varlen.cu_seqlens_q = p.varlen.cu_seqlens_k = cu;
  p.varlen.total_q = p.varlen.total_k = 8292;
  EXPECT_TRUE(takes_chunked_kv(p, false, kMinKeys, kRule));
  p.varlen.total_k = 8000;  // mean 4000, though the longest has 8192 keys
  EXPECT_FALSE(takes_chunked_kv(p, false, kMinKeys, kRule));
}

TEST(Sm90ChunkedKvRule, TheSwitchDecidesAlone) {
  EXPECT_TRUE(takes_chunked_kv(fixed(32, 512), true, kMinKeys, 1));
  EXPECT_FALSE(takes_chunked_kv(fixed(1, 16384), false, kMinKeys, 0));
}

}  // namespace
