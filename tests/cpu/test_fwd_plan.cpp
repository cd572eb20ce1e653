// The sm90 forward's launch plan (src/sm90/host/fwd_plan.hpp), on the host alone: over many
// problems, devices and overrides, the plan stays within the workspace workspace_size reports (the
// same on every device), uses its tile table's row, numbers and grids its tiles consistently, and
// does what each override forces.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"
#include "sm90/fwd/fwd_tile_shape.hpp"
#include "sm90/fwd/split_kv.hpp"
#include "sm90/fwd/tile_order.hpp"
#include "sm90/host/fwd_plan.hpp"

namespace {

using fa4::Choice;
using fa4::Overrides;
using fa4::Problem;
using namespace fa4::sm90;
using namespace fa4::sm90::fwd_plan;

// Devices of several sizes: H100 PCIe / SXM, H200, small partitions.
const DeviceFacts kDevices[] = {{132, 50 << 20}, {114, 50 << 20}, {8, 50 << 20}, {1, 1 << 20},
                                {78, 40 << 20},  {0, 0}};

// A marker for the arrays the plan never reads (sequence offsets, seqused_k, page tables).
const int32_t kMarker = 0;

Problem random_problem(std::mt19937_64& rng) {
  const FwdTileShape& row = kFwdTileShapes[rng() % std::size(kFwdTileShapes)];
  Problem p;
  p.head_dim_qk = row.head_dim_qk;
  p.head_dim_v = row.head_dim_v;
  p.heads_kv = 1 + int64_t(rng() % 8);
  p.heads_q = p.heads_kv * int64_t(1 + rng() % 8);
  p.batch = int64_t(rng() % 9);
  const bool short_q = rng() % 3 == 0;
  p.seqlen_q = short_q ? int64_t(rng() % 8) : int64_t(rng() % 5000);
  p.seqlen_k = rng() % 4 == 0 ? p.seqlen_q : int64_t(rng() % 20000);
  switch (rng() % 4) {
    case 0: break;
    case 1: p.causal = true; break;
    case 2: p.window = {int64_t(rng() % 300), int64_t(rng() % 3) - 1}; break;
    default: p.causal = true; p.window.left = int64_t(rng() % 500); break;
  }
  if (rng() % 3 == 0) {
    p.varlen.cu_seqlens_q = p.varlen.cu_seqlens_k = &kMarker;
    p.varlen.total_q = p.batch * p.seqlen_q / int64_t(1 + rng() % 3);
    p.varlen.total_k = p.batch * p.seqlen_k / int64_t(1 + rng() % 3);
  } else if (rng() % 4 == 0) {
    p.seqused_k = &kMarker;
  }
  return p;
}

Choice random_choice(std::mt19937_64& rng) { return Choice(int(rng() % 3) - 1); }

Overrides random_overrides(std::mt19937_64& rng) {
  Overrides o;
  if (rng() % 2 == 0) return o;  // half the trials on the library's own choices
  o.persistent = random_choice(rng);
  o.persistent_ctas = rng() % 3 == 0 ? int(1 + rng() % 200) : 0;
  o.zigzag_group = rng() % 4 == 0 ? int(1 + rng() % 6) : 0;
  o.pack_gqa = random_choice(rng);
  o.splits = rng() % 3 == 0 ? int(1 + rng() % 200) : 0;
  o.longest_first = random_choice(rng);
  o.chunked_kv = random_choice(rng);
  o.narrow = random_choice(rng);
  o.unmasked = random_choice(rng);
  return o;
}

// Every plan fits the workspace workspace_size reports (FwdWorkspace::of, device-independent), and
// its numbers agree with each other and with the tile table.
TEST(Sm90ForwardPlan, StaysWithinTheWorkspaceOnEveryDevice) {
  std::mt19937_64 rng(2024);
  int nonempty = 0, ordered = 0, split = 0, chunked = 0, narrow = 0, unmasked = 0, packed = 0,
      persistent = 0, grouped = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const Problem p = random_problem(rng);
    const Overrides o = random_overrides(rng);
    const FwdWorkspace ws = FwdWorkspace::of(p, o);
    ASSERT_EQ(ws.bytes, ws.partials + ws.partials_bytes);
    ASSERT_EQ(ws.partials, ws.order_bytes);
    ASSERT_EQ(ws.bytes % 256, 0u);
    for (const DeviceFacts& device : kDevices) {
      SCOPED_TRACE(testing::Message() << "trial " << trial << ", " << device.sm_count << " SMs");
      const FwdPlan plan = plan_forward(p, device, o);
      EXPECT_EQ(plan.workspace.bytes, ws.bytes);
      EXPECT_EQ(plan.workspace.max_splits, ws.max_splits);
      if (plan.ctas == 0) {
        EXPECT_TRUE(p.batch == 0 || p.seqlen_q == 0 || (p.is_varlen() && p.varlen.total_q == 0));
        continue;
      }
      ++nonempty;
      const FwdTileShape row = fwd_tile_shape(int(p.head_dim_qk), int(p.head_dim_v));
      const bool is_chunked = plan.variant == FwdVariant::kChunked;
      const bool is_narrow = plan.variant == FwdVariant::kNarrow;
      EXPECT_EQ(plan.block_m, is_narrow ? FwdTileShape::kSliceRows : row.block_m());
      const bool is_unmasked = plan.variant == FwdVariant::kUnmasked;
      EXPECT_EQ(plan.block_n, is_chunked    ? row.chunked.block_n
                              : is_unmasked ? row.unmasked.block_n
                                            : row.block_n);
      EXPECT_TRUE(!is_chunked || row.has_chunked());
      EXPECT_TRUE(!is_narrow || row.has_narrow());
      EXPECT_TRUE(!is_unmasked || row.has_unmasked());
      ASSERT_GE(plan.pack_group, 1);
      EXPECT_EQ(p.heads_q % plan.pack_group, 0);
      EXPECT_EQ(plan.tile_heads * plan.pack_group, p.heads_q);
      EXPECT_EQ(plan.m_blocks,
                (p.seqlen_q * plan.pack_group + plan.block_m - 1) / plan.block_m);
      EXPECT_EQ(plan.tiles, int64_t(plan.m_blocks) * plan.tile_heads * p.batch);
      // Split-KV's partials for the plan's splits fit the workspace's.
      ASSERT_GE(plan.splits, 1);
      EXPECT_LE(plan.splits, ws.max_splits);
      EXPECT_LE(split_workspace_bytes(p, plan.splits), ws.partials_bytes);
      // The ordered grid's entries fit the order's workspace.
      if (plan.ordered) {
        EXPECT_GT(ws.order_bytes, 0u);
        EXPECT_LE(int64_t(plan.ordered_entries) * 4, int64_t(ws.order_bytes));
        EXPECT_EQ(plan.entries, plan.ordered_entries * plan.splits);
        EXPECT_EQ(plan.group, 1) << "the order's entries use the plain numbering";
      } else {
        EXPECT_EQ(plan.entries, plan.tiles * plan.splits);
      }
      EXPECT_GE(plan.ctas, 1);
      EXPECT_LE(plan.ctas, plan.entries);
      EXPECT_TRUE(plan.persistent || plan.ctas == plan.entries);
      EXPECT_GE(plan.group, 1);
      EXPECT_LE(plan.group, plan.tile_heads * p.batch);
      ordered += plan.ordered;
      split += plan.splits > 1;
      chunked += is_chunked;
      narrow += is_narrow;
      unmasked += is_unmasked;
      packed += plan.pack_group > 1;
      persistent += plan.persistent && plan.ctas < plan.entries;
      grouped += plan.group > 1;
    }
  }
  // The trials reach every choice.
  EXPECT_GT(nonempty, 10000);
  EXPECT_GT(ordered, 100);
  EXPECT_GT(split, 100);
  EXPECT_GT(chunked, 100);
  EXPECT_GT(narrow, 100);
  EXPECT_GT(unmasked, 100);
  EXPECT_GT(packed, 100);
  EXPECT_GT(persistent, 100);
  EXPECT_GT(grouped, 100);
}

Problem fixed(int64_t batch, int64_t seqlen, int64_t heads_q, int64_t heads_kv, int64_t dim) {
  Problem p;
  p.batch = batch;
  p.seqlen_q = p.seqlen_k = seqlen;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim_qk = p.head_dim_v = dim;
  return p;
}

Problem varlen(int64_t batch, int64_t longest, int64_t total, int64_t heads) {
  Problem p = fixed(batch, longest, heads, heads, 128);
  p.varlen.cu_seqlens_q = p.varlen.cu_seqlens_k = &kMarker;
  p.varlen.total_q = p.varlen.total_k = total;
  return p;
}

const DeviceFacts kH200{132, 60 << 20};

// A paged cache of `num_pages` pages, table rows `table_stride` entries apart; the page size is
// each check's. The plan reads the sizes only, never the table.
void page(Problem& p, int64_t num_pages, int64_t table_stride) {
  p.kv_cache.page_table = &kMarker;
  p.kv_cache.num_pages = num_pages;
  p.kv_cache.page_table_stride = table_stride;
}

TEST(Sm90ForwardPlan, ScheduleOverrides) {
  const Problem p = fixed(4, 4096, 16, 16, 128);  // 32 · 16 · 4 = 2048 tiles, no mask
  const FwdPlan auto_plan = plan_forward(p, kH200, {});
  EXPECT_TRUE(auto_plan.persistent) << "fixed lengths without a mask balance";
  EXPECT_EQ(auto_plan.ctas, 132);
  Overrides o;
  o.persistent = Choice::kOff;
  EXPECT_FALSE(plan_forward(p, kH200, o).persistent);
  EXPECT_EQ(plan_forward(p, kH200, o).ctas, 2048);
  o.persistent = Choice::kOn;
  o.persistent_ctas = 3;
  EXPECT_EQ(plan_forward(p, kH200, o).ctas, 3);
  o.zigzag_group = 2;
  EXPECT_EQ(plan_forward(p, kH200, o).group, 2);
  o.zigzag_group = 1000;  // at most all (head, batch entry) pairs
  EXPECT_EQ(plan_forward(p, kH200, o).group, 64);
  // A varlen batch never runs persistent by itself.
  EXPECT_FALSE(plan_forward(varlen(4, 4096, 9000, 16), kH200, {}).persistent);
}

TEST(Sm90ForwardPlan, PackGqa) {
  Problem decode = fixed(4, 1, 32, 8, 128);
  decode.seqlen_k = 4096;
  EXPECT_EQ(plan_forward(decode, kH200, {}).pack_group, 4) << "one position fills G rows";
  Overrides off;
  off.pack_gqa = Choice::kOff;
  EXPECT_EQ(plan_forward(decode, kH200, off).pack_group, 1);
  const Problem prefill = fixed(1, 4096, 32, 8, 128);
  EXPECT_EQ(plan_forward(prefill, kH200, {}).pack_group, 1) << "full tiles either way";
  Overrides on;
  on.pack_gqa = Choice::kOn;
  EXPECT_EQ(plan_forward(prefill, kH200, on).pack_group, 4);
  EXPECT_EQ(plan_forward(fixed(1, 4096, 8, 8, 128), kH200, on).pack_group, 1) << "no GQA";
}

// When the forward takes the chunked kernel of a head dim: only without a causal or window band
// and from min_keys keys per sequence, the mean over a varlen batch; a forced choice decides
// alone, where the row has a chunked variant.
TEST(Sm90ForwardPlan, ChunkedKvRule) {
  constexpr int64_t kMinKeys = 4096;
  EXPECT_EQ(fwd_tile_shape(256, 256).chunked.min_keys, kMinKeys);
  EXPECT_TRUE(takes_chunked_kv(fixed(4, 4096, 8, 8, 256), false, kMinKeys, Choice::kAuto));
  EXPECT_TRUE(takes_chunked_kv(fixed(1, 16384, 8, 8, 256), false, kMinKeys, Choice::kAuto));
  EXPECT_FALSE(takes_chunked_kv(fixed(4, 4095, 8, 8, 256), false, kMinKeys, Choice::kAuto));
  EXPECT_FALSE(takes_chunked_kv(fixed(32, 512, 8, 8, 256), false, kMinKeys, Choice::kAuto));
  EXPECT_FALSE(takes_chunked_kv(fixed(1, 16384, 8, 8, 256), true, kMinKeys, Choice::kAuto));
  EXPECT_FALSE(takes_chunked_kv(fixed(0, 16384, 8, 8, 256), false, kMinKeys, Choice::kAuto));
  EXPECT_TRUE(takes_chunked_kv(fixed(32, 512, 8, 8, 256), true, kMinKeys, Choice::kOn));
  EXPECT_FALSE(takes_chunked_kv(fixed(1, 16384, 8, 8, 256), false, kMinKeys, Choice::kOff));
  EXPECT_FALSE(takes_chunked_kv(fixed(1, 16384, 8, 8, 128), false, 0, Choice::kOn))
      << "no chunked variant";
  // Varlen: the mean length.
  const int32_t cu[3] = {0, 100, 8292};  // lengths 100 and 8192: mean 4146
  Problem p = fixed(2, 8192, 8, 8, 256);
  p.varlen.cu_seqlens_q = p.varlen.cu_seqlens_k = cu;
  p.varlen.total_q = p.varlen.total_k = 8292;
  EXPECT_TRUE(takes_chunked_kv(p, false, kMinKeys, Choice::kAuto));
  p.varlen.total_k = 8000;  // mean 4000, though the longest has 8192 keys
  EXPECT_FALSE(takes_chunked_kv(p, false, kMinKeys, Choice::kAuto));
  // Through the plan: the variant's tile.
  const FwdPlan plan = plan_forward(fixed(1, 16384, 8, 8, 256), kH200, {});
  EXPECT_EQ(plan.variant, FwdVariant::kChunked);
  EXPECT_EQ(plan.block_n, 128);
  Problem causal = fixed(1, 16384, 8, 8, 256);
  causal.causal = true;
  EXPECT_EQ(plan_forward(causal, kH200, {}).variant, FwdVariant::kMain);
  EXPECT_EQ(plan_forward(causal, kH200, {}).block_n, 64);
}

// When the forward takes the narrow kernel (d128's row has one): a tile's rows within one slice and
// main-kernel tiles for half the SMs at most; forced, wherever the row has it.
TEST(Sm90ForwardPlan, NarrowRule) {
  EXPECT_TRUE(fwd_tile_shape(128, 128).has_narrow());
  EXPECT_FALSE(fwd_tile_shape(64, 64).has_narrow());
  EXPECT_FALSE(fwd_tile_shape(128, 128, true).has_narrow()) << "e4m3 has no variants";
  EXPECT_TRUE(takes_narrow(true, 64, 66, 132, true, Choice::kAuto));
  EXPECT_FALSE(takes_narrow(true, 65, 1, 132, true, Choice::kAuto));
  EXPECT_FALSE(takes_narrow(true, 4, 67, 132, true, Choice::kAuto));
  EXPECT_FALSE(takes_narrow(true, 4, 1, 132, false, Choice::kAuto)) << "keys in pieces";
  EXPECT_FALSE(takes_narrow(false, 4, 1, 132, true, Choice::kOn));
  EXPECT_TRUE(takes_narrow(true, 4096, 5000, 132, false, Choice::kOn));
  EXPECT_FALSE(takes_narrow(true, 4, 1, 132, true, Choice::kOff));
  // Decode, GQA 32/8 at 8k: 4 packed rows; 4 sequences are 32 tiles (narrow, split), 16 are 128
  // (main).
  Problem decode = fixed(4, 1, 32, 8, 128);
  decode.seqlen_k = 8192;
  FwdPlan plan = plan_forward(decode, kH200, {});
  EXPECT_EQ(plan.variant, FwdVariant::kNarrow);
  EXPECT_EQ(plan.block_m, 64);
  EXPECT_EQ(plan.block_n, 128);
  EXPECT_EQ(plan.tiles, 32);
  EXPECT_GT(plan.splits, 1);
  decode.batch = 16;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kMain);
  // Pages of 16 keys load in pieces: main; of 256, as whole tiles: narrow.
  decode.batch = 4;
  page(decode, 4 * 512, 512);
  decode.kv_cache.page_size = 16;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kMain);
  decode.kv_cache.page_size = 256;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kNarrow);
  decode.kv_cache = {};
  // Speculative decode, 16 positions × 4 heads fill one slice; 17 do not.
  decode.batch = 1;
  decode.seqlen_q = 16;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kNarrow);
  decode.seqlen_q = 17;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kMain);
  // Forced onto a prefill: 64-row tiles, twice the main kernel's.
  Overrides on;
  on.narrow = Choice::kOn;
  const Problem prefill = fixed(1, 4096, 16, 16, 128);
  plan = plan_forward(prefill, kH200, on);
  EXPECT_EQ(plan.variant, FwdVariant::kNarrow);
  EXPECT_EQ(plan.m_blocks, 64);
  EXPECT_EQ(plan_forward(prefill, kH200, {}).m_blocks, 32);
  // Rows without one: d256 stays chunked, e4m3 d128 decode main.
  EXPECT_EQ(plan_forward(fixed(1, 16384, 8, 8, 256), kH200, on).variant, FwdVariant::kChunked);
  Problem fp8 = fixed(1, 1, 32, 8, 128);
  fp8.seqlen_k = 8192;
  fp8.dtype = fa4::DType::kE4M3;
  EXPECT_EQ(plan_forward(fp8, kH200, on).variant, FwdVariant::kMain);
}

// When the forward takes the unmasked kernel (d128's row has one): keys that load as whole tiles
// of its width; then, forced, always; else only where nothing but the sequence end cuts a key
// tile, without ALiBi, with query rows that fill a tile and min_keys keys per sequence (the mean
// over a varlen batch).
TEST(Sm90ForwardPlan, UnmaskedRule) {
  const FwdTileShape row = fwd_tile_shape(128, 128);
  ASSERT_TRUE(row.has_unmasked());
  EXPECT_EQ(row.unmasked.block_n % 16, 0) << "P is the A operand of k16 wgmmas";
  EXPECT_FALSE(fwd_tile_shape(64, 64).has_unmasked());
  EXPECT_FALSE(fwd_tile_shape(128, 128, true).has_unmasked()) << "e4m3 has no variants";
  const int64_t min_keys = row.unmasked.min_keys;
  const Problem at = fixed(2, min_keys, 16, 16, 128);
  EXPECT_TRUE(takes_unmasked(at, row, false, 128, Choice::kAuto));
  EXPECT_FALSE(takes_unmasked(at, row, true, 128, Choice::kAuto)) << "banded";
  EXPECT_FALSE(takes_unmasked(at, row, false, 127, Choice::kAuto)) << "rows short of a tile";
  Problem fewer = at;
  fewer.seqlen_k = min_keys - 1;
  EXPECT_FALSE(takes_unmasked(fewer, row, false, 128, Choice::kAuto));
  EXPECT_TRUE(takes_unmasked(fewer, row, true, 1, Choice::kOn));
  EXPECT_FALSE(takes_unmasked(at, row, false, 128, Choice::kOff));
  EXPECT_FALSE(takes_unmasked(at, fwd_tile_shape(64, 64), false, 192, Choice::kOn));
  Problem alibi = at;
  const float slopes[16] = {};
  alibi.alibi.data = slopes;
  EXPECT_FALSE(takes_unmasked(alibi, row, false, 128, Choice::kAuto));
  EXPECT_TRUE(takes_unmasked(alibi, row, false, 128, Choice::kOn));
  // Varlen: the mean length.
  Problem v = varlen(2, 2 * min_keys, min_keys * 2, 16);
  EXPECT_TRUE(takes_unmasked(v, row, false, 2 * min_keys, Choice::kAuto));
  v.varlen.total_k = min_keys * 2 - 2;
  EXPECT_FALSE(takes_unmasked(v, row, false, 2 * min_keys, Choice::kAuto));
  // Pages: whole tiles of its width only, forced or not.
  Problem paged = at;
  page(paged, 64, 32);
  for (int64_t page : {row.unmasked.block_n, 2 * row.unmasked.block_n}) {
    paged.kv_cache.page_size = page;
    EXPECT_TRUE(takes_unmasked(paged, row, false, 128, Choice::kAuto)) << page;
  }
  for (int64_t page : {16, 64, 128, 256}) {
    paged.kv_cache.page_size = page;
    EXPECT_FALSE(takes_unmasked(paged, row, false, 128, Choice::kOn)) << page;
  }
  // Through the plan: the variant's tile where it applies, the main kernel's elsewhere.
  FwdPlan plan = plan_forward(fixed(1, 16384, 16, 16, 128), kH200, {});
  EXPECT_EQ(plan.variant, FwdVariant::kUnmasked);
  EXPECT_EQ(plan.block_m, 128);
  EXPECT_EQ(plan.block_n, row.unmasked.block_n);
  Problem causal = fixed(1, 16384, 16, 16, 128);
  causal.causal = true;
  plan = plan_forward(causal, kH200, {});
  EXPECT_EQ(plan.variant, FwdVariant::kMain);
  EXPECT_EQ(plan.block_n, 128);
  Problem window = fixed(1, 16384, 16, 16, 128);
  window.window = {1024, -1};
  EXPECT_EQ(plan_forward(window, kH200, {}).variant, FwdVariant::kMain);
  EXPECT_EQ(plan_forward(fixed(8, 1024, 16, 16, 128), kH200, {}).variant, FwdVariant::kMain);
  // Decode of few sequences keeps the narrow kernel, of many the main one.
  Problem decode = fixed(4, 1, 32, 8, 128);
  decode.seqlen_k = 16384;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kNarrow);
  decode.batch = 64;
  EXPECT_EQ(plan_forward(decode, kH200, {}).variant, FwdVariant::kMain);
  // Forced onto a causal problem: the variant's tile under the diagonal's mask.
  Overrides on;
  on.unmasked = Choice::kOn;
  plan = plan_forward(causal, kH200, on);
  EXPECT_EQ(plan.variant, FwdVariant::kUnmasked);
  EXPECT_EQ(plan.block_n, row.unmasked.block_n);
  Overrides off;
  off.unmasked = Choice::kOff;
  EXPECT_EQ(plan_forward(fixed(1, 16384, 16, 16, 128), kH200, off).variant, FwdVariant::kMain);
}

// When the forward takes the wide-pieces twin (d128's row has one): where the main kernel would
// load 16-key pieces from pages that hold whole 64-key pieces.
TEST(Sm90ForwardPlan, WidePiecesRule) {
  EXPECT_TRUE(fwd_tile_shape(128, 128).has_wide_pieces());
  EXPECT_FALSE(fwd_tile_shape(64, 64).has_wide_pieces());
  EXPECT_FALSE(fwd_tile_shape(128, 128, true).has_wide_pieces()) << "e4m3 has no variants";
  // Chunked prefill, 512 queries of 4 sequences against 8k keys, GQA 32/8.
  Problem prefill = fixed(4, 512, 32, 8, 128);
  prefill.seqlen_k = 8192;
  prefill.causal = true;
  page(prefill, 4 * 8192 / 16, 8192 / 16);
  for (int64_t page : {64, 192, 320}) {
    prefill.kv_cache.page_size = page;
    const FwdPlan plan = plan_forward(prefill, kH200, {});
    EXPECT_EQ(plan.variant, FwdVariant::kWidePieces) << page;
    EXPECT_EQ(plan.block_m, 128);
    EXPECT_EQ(plan.block_n, 128);
  }
  for (int64_t page : {16, 32, 96, 128, 256}) {
    prefill.kv_cache.page_size = page;
    EXPECT_EQ(plan_forward(prefill, kH200, {}).variant, FwdVariant::kMain) << page;
  }
  // ALiBi keeps its own kernel (the main kernel's ALiBi twin).
  const float slopes[32] = {};
  prefill.kv_cache.page_size = 64;
  prefill.alibi.data = slopes;
  EXPECT_EQ(plan_forward(prefill, kH200, {}).variant, FwdVariant::kMain);
  prefill.alibi.data = nullptr;
  // A left pad: rows gathered, main kernel.
  const int32_t pads[4] = {};
  prefill.kv_cache.page_size = 64;
  prefill.kv_cache.leftpad = pads;
  EXPECT_EQ(plan_forward(prefill, kH200, {}).variant, FwdVariant::kMain);
  prefill.kv_cache.leftpad = nullptr;
  // Forced narrow keeps the narrow kernel's 16-key pieces.
  Overrides on;
  on.narrow = Choice::kOn;
  EXPECT_EQ(plan_forward(prefill, kH200, on).variant, FwdVariant::kNarrow);
  // Other head dims and e4m3 keep their main kernel.
  Problem d64 = prefill;
  d64.head_dim_qk = d64.head_dim_v = 64;
  EXPECT_EQ(plan_forward(d64, kH200, {}).variant, FwdVariant::kMain);
  Problem fp8 = prefill;
  fp8.dtype = fa4::DType::kE4M3;
  EXPECT_EQ(plan_forward(fp8, kH200, {}).variant, FwdVariant::kMain);
}

TEST(Sm90ForwardPlan, TileOrder) {
  // 300 one-tile sequences × 16 heads: more tiles than SMs, ordered by the plan's own rule.
  const Problem many = varlen(300, 100, 300 * 60, 16);
  EXPECT_TRUE(plan_forward(many, kH200, {}).ordered);
  const Problem few = varlen(4, 100, 200, 16);  // 64 tiles: one wave
  EXPECT_FALSE(plan_forward(few, kH200, {}).ordered);
  EXPECT_TRUE(plan_forward(few, {8, 50 << 20}, {}).ordered) << "more tiles than 8 SMs";
  Overrides on;
  on.longest_first = Choice::kOn;
  EXPECT_TRUE(plan_forward(few, kH200, on).ordered);
  Overrides off;
  off.longest_first = Choice::kOff;
  EXPECT_FALSE(plan_forward(many, kH200, off).ordered);
  EXPECT_EQ(FwdWorkspace::of(many, off).order_bytes, 0u) << "nothing reserved for no order";
  EXPECT_EQ(FwdWorkspace::of(many, {}).order_bytes, tile_order_workspace_bytes(many));
  EXPECT_FALSE(plan_forward(fixed(4, 4096, 16, 16, 128), kH200, on).ordered) << "fixed lengths";
}

// The plan's splits: only for problems with keys to share and idle SMs, within the row budget and
// the workspace, never more than fill one wave.
TEST(Sm90ForwardPlan, SplitsStayWithinTheirBudget) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 5000; ++trial) {
    Problem p;
    p.batch = 1 + int64_t(rng() % 64);
    p.seqlen_q = 1 + int64_t(rng() % (rng() % 2 ? 8 : 600));
    p.seqlen_k = 1 + int64_t(rng() % 70000);
    p.heads_kv = 1 + int64_t(rng() % 16);
    p.heads_q = p.heads_kv * (1 + int64_t(rng() % 8));
    p.head_dim_qk = 128;
    p.head_dim_v = 64 * (1 + int64_t(rng() % 4));
    const int most = max_splits(p, {});
    ASSERT_GE(most, 1);
    ASSERT_LE(most, kMaxSplits);
    const int64_t rows = p.heads_q * split_query_rows(p);
    if (most > 1) {
      EXPECT_GE(p.seqlen_k, kMinSplitKeys) << "trial " << trial;
      EXPECT_LE(rows * most, kSplitRowBudget) << "trial " << trial;
      EXPECT_LE(p.heads_kv * p.batch * most, kMaxSms) << "trial " << trial;
      EXPECT_GT(FwdWorkspace::of(p, {}).partials_bytes, 0u);
    } else {
      EXPECT_EQ(FwdWorkspace::of(p, {}).partials_bytes, 0u) << "trial " << trial;
    }
    for (int sm_count : {78, 114, 132}) {
      for (int64_t tiles : {int64_t(1), int64_t(7), int64_t(64), int64_t(200), int64_t(5000)}) {
        const int64_t key_tiles = (p.seqlen_k + 127) / 128;
        const int s = choose_splits(p, tiles, key_tiles, sm_count, most, false);
        ASSERT_GE(s, 1);
        ASSERT_LE(s, most) << "trial " << trial;
        if (s > 1) {
          EXPECT_LE(tiles * s, sm_count) << "one wave at most; trial " << trial;
          EXPECT_GE(key_tiles, s * kMinKeyTilesPerSplit) << "trial " << trial;
        }
      }
    }
  }
}

// Forced, as many splits as asked for within the row budget, on problems of any length.
TEST(Sm90ForwardPlan, ForcedSplits) {
  Problem p = fixed(2, 300, 8, 8, 128);
  Overrides o;
  o.splits = 3;
  EXPECT_EQ(max_splits(p, o), 3);
  const FwdPlan plan = plan_forward(p, kH200, o);
  EXPECT_EQ(plan.splits, 3);
  EXPECT_EQ(plan.entries, plan.tiles * 3);
  EXPECT_GE(FwdWorkspace::of(p, o).partials_bytes, split_workspace_bytes(p, 3));
  EXPECT_EQ(FwdWorkspace::of(p, {}).bytes, 0u) << "unforced, 300 keys never split";
  o.splits = 1;
  EXPECT_EQ(plan_forward(p, kH200, o).splits, 1);
  EXPECT_EQ(FwdWorkspace::of(p, o).bytes, 0u);
  // Beyond the row budget: as many as it holds.
  Problem big = fixed(8, 4096, 16, 16, 128);
  o.splits = 100;
  EXPECT_EQ(max_splits(big, o), 1) << "2^19 rows leave no room for a second split";
}

// The problem's num_splits bounds the splits (1: none) and with them the workspace.
TEST(Sm90ForwardPlan, NumSplitsBoundsTheSplits) {
  Problem p = fixed(1, 1, 32, 8, 128);
  p.seqlen_k = 262144;
  ASSERT_EQ(plan_forward(p, kH200, {}).splits, 16);
  p.num_splits = 5;
  EXPECT_EQ(plan_forward(p, kH200, {}).splits, 5);
  EXPECT_EQ(FwdWorkspace::of(p, {}).max_splits, 5);
  p.num_splits = 1;
  EXPECT_EQ(plan_forward(p, kH200, {}).splits, 1);
  EXPECT_EQ(FwdWorkspace::of(p, {}).bytes, 0u);
  p.num_splits = 1000;  // a bound, not a demand
  EXPECT_EQ(plan_forward(p, kH200, {}).splits, 16);
  Overrides forced;
  forced.splits = 8;
  p.num_splits = 3;
  EXPECT_EQ(plan_forward(p, kH200, forced).splits, 3) << "forced within the caller's bound";
}

// The decode shapes of bench/gqa_short.py split as docs/sm90_forward.md says.
TEST(Sm90ForwardPlan, DecodeSplits) {
  struct Shape {
    int64_t batch, seqlen_k;
    int expected;  // on 132 SMs, packed: batch · 8 one-tile kv heads
  } shapes[] = {{1, 262144, 16}, {4, 65536, 4}, {8, 32768, 2}, {64, 4096, 1},
                // 8 key tiles: a split each (one key tile per split is the floor)
                {1, 1024, 8}};
  for (const Shape& s : shapes) {
    Problem p = fixed(s.batch, 1, 32, 8, 128);
    p.seqlen_k = s.seqlen_k;
    EXPECT_EQ(choose_splits(p, s.batch * 8, (s.seqlen_k + 127) / 128, 132, max_splits(p, {}),
                            false),
              s.expected)
        << "batch " << s.batch;
    const FwdPlan plan = plan_forward(p, {132, 60 << 20}, {});
    EXPECT_EQ(plan.pack_group, 4);
    EXPECT_EQ(plan.splits, s.expected) << "batch " << s.batch;
  }
}

// The plan's limits: the ordered batch's size, the packed rows' 2^30, the splits' row cap and
// kMaxSplits, forced splits without keys, and the workspace's layout without an order.
TEST(Sm90ForwardPlan, Boundaries) {
  Overrides order;
  order.longest_first = Choice::kOn;
  const Problem huge = varlen(kMaxOrderedBatch + 1, 100, (kMaxOrderedBatch + 1) * 50, 2);
  EXPECT_EQ(FwdWorkspace::of(huge, order).order_bytes, 0u);
  EXPECT_FALSE(plan_forward(huge, kH200, order).ordered) << "too many sequences to sort";
  EXPECT_TRUE(plan_forward(varlen(kMaxOrderedBatch, 100, kMaxOrderedBatch * 50, 2), kH200, order)
                  .ordered);

  Overrides pack;
  pack.pack_gqa = Choice::kOn;
  Problem tall = fixed(1, (int64_t(1) << 27), 64, 8, 128);  // 2^30 packed rows
  EXPECT_EQ(pack_group(tall, 128, Choice::kOn), 1);
  tall.seqlen_q = tall.seqlen_k = (int64_t(1) << 27) - 1;
  EXPECT_EQ(pack_group(tall, 128, Choice::kOn), 8);

  Overrides many;
  many.splits = 1000;
  const Problem decode = [] {
    Problem p = fixed(1, 1, 8, 8, 128);
    p.seqlen_k = 100000;
    return p;
  }();
  EXPECT_EQ(max_splits(decode, many), kMaxSplits) << "8 rows: the budget allows more";
  EXPECT_EQ(plan_forward(decode, kH200, many).splits, kMaxSplits);
  Problem no_keys = decode;
  no_keys.seqlen_k = 0;
  Overrides three;
  three.splits = 3;
  EXPECT_EQ(plan_forward(no_keys, kH200, three).splits, 1);
  EXPECT_EQ(FwdWorkspace::of(no_keys, three).bytes, 0u);

  Overrides no_order = three;
  no_order.longest_first = Choice::kOff;
  const Problem batch = varlen(4, 300, 900, 8);
  EXPECT_EQ(FwdWorkspace::of(batch, no_order).partials, 0u) << "the partials come first";
  EXPECT_GT(FwdWorkspace::of(batch, three).partials, 0u) << "after the order";

  // A forced zig-zag group only where persistent CTAs walk the zig-zag.
  Overrides zigzag;
  zigzag.zigzag_group = 2;
  zigzag.persistent = Choice::kOff;
  EXPECT_EQ(plan_forward(fixed(4, 4096, 16, 16, 128), kH200, zigzag).group, 1);
}

// The causal schedule's choices reach the plan: one CTA per tile numbered in groups where the
// grid exceeds the SMs, the model's zig-zag elsewhere.
TEST(Sm90ForwardPlan, CausalGrids) {
  Problem p = fixed(1, 8192, 8, 8, 256);
  p.causal = true;
  const FwdPlan plan = plan_forward(p, kH200, {});
  ASSERT_EQ(plan.tiles, 64 * 8);
  EXPECT_TRUE(plan.heavy_last_rows);
  // One CTA per tile forced on a causal grid larger than the device: numbered in groups.
  Overrides per_tile;
  per_tile.persistent = Choice::kOff;
  const FwdPlan forced = plan_forward(p, kH200, per_tile);
  EXPECT_EQ(forced.ctas, forced.tiles);
  EXPECT_GT(forced.group, 1) << "one CTA per tile under a diagonal: numbered in groups";
  // Without a mask the numbering stays head by head.
  Problem plain = p;
  plain.causal = false;
  EXPECT_EQ(plan_forward(plain, kH200, per_tile).group, 1);
}

}  // namespace
