// The sm90 forward's workspace rules (src/sm90/host/tile_order.hpp, src/sm90/host/split_kv.hpp), host side:
// the workspace is sized from the problem's sizes alone, so these bounds must hold for every
// content of the sequence arrays, every pack-GQA choice and every query tile height the kernels
// use; and the launcher's split choice must stay within what the workspace holds.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "fa4/attention.hpp"
#include "sm90/host/split_kv.hpp"
#include "sm90/host/tile_order.hpp"

namespace {

using fa4::Problem;
using namespace fa4::sm90;

// Query tiles of a varlen batch as the ordering kernel counts them: per tile head, the tiles of
// each sequence's rows (G rows per position when packed).
int64_t tiles_of(const std::vector<int64_t>& lens_q, int64_t group, int64_t block_m) {
  int64_t tiles = 0;
  for (int64_t len : lens_q) tiles += (len * group + block_m - 1) / block_m;
  return tiles;
}

// Every valid batch fits the ordered grid the launcher sizes, and that grid fits the workspace
// workspace_size asks for, whatever the packing (G of heads_q / heads_kv, or 1) and tile height.
TEST(Sm90ForwardWorkspace, TileOrderHoldsEveryTile) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t batch = 1 + int64_t(rng() % 40);
    const int64_t longest = 1 + int64_t(rng() % 3000);
    std::vector<int64_t> lens(static_cast<size_t>(batch));
    int64_t total = 0;
    for (auto& len : lens) {
      len = int64_t(rng() % uint64_t(longest + 1));  // 0 included
      total += len;
    }
    const int64_t heads_kv = 1 + int64_t(rng() % 8);
    const int64_t group = 1 + int64_t(rng() % 9);
    Problem p;
    p.batch = batch;
    p.seqlen_q = longest;
    p.seqlen_k = 1 + int64_t(rng() % 5000);
    p.heads_q = heads_kv * group;
    p.heads_kv = heads_kv;
    p.head_dim_qk = p.head_dim_v = 128;
    int32_t marker = 0;
    p.varlen.cu_seqlens_q = p.varlen.cu_seqlens_k = &marker;  // varlen mode; never read
    p.varlen.total_q = total;
    p.varlen.total_k = p.seqlen_k * batch;
    const size_t bytes = tile_order_workspace_bytes(p);
    ASSERT_GT(bytes, 0u);
    ASSERT_EQ(bytes % 256, 0u);
    for (int64_t block_m : {kMinQueryTileRows, int64_t(192)}) {
      for (bool packed : {false, true}) {
        const int64_t g = packed ? group : 1;
        const int64_t heads = p.heads_q / g;
        const int64_t entries = ordered_tile_entries(batch, longest * g, total * g, heads, block_m);
        EXPECT_GE(entries, heads * tiles_of(lens, g, block_m))
            << "trial " << trial << ", block_m " << block_m << ", packed " << packed;
        EXPECT_LE(entries * int64_t(sizeof(int32_t)), int64_t(bytes))
            << "trial " << trial << ", block_m " << block_m << ", packed " << packed;
      }
    }
  }
}

TEST(Sm90ForwardWorkspace, NoTileOrderForFixedLengthsOrHugeBatches) {
  Problem p;
  p.batch = 4;
  p.seqlen_q = p.seqlen_k = 300;
  p.heads_q = p.heads_kv = 8;
  EXPECT_EQ(tile_order_workspace_bytes(p), 0u);
  int32_t marker = 0;
  p.varlen.cu_seqlens_q = p.varlen.cu_seqlens_k = &marker;
  p.varlen.total_q = p.varlen.total_k = 1200;
  EXPECT_GT(tile_order_workspace_bytes(p), 0u);
  p.batch = kMaxOrderedBatch + 1;
  EXPECT_EQ(tile_order_workspace_bytes(p), 0u);
}

// The launcher's splits: only for problems with keys to share and idle SMs, within the row budget
// and the workspace, never more than fill one wave. (FA4_SM90_SPLITS would force them: the test
// binary runs without it.)
TEST(Sm90ForwardWorkspace, SplitsStayWithinTheirBudget) {
  ASSERT_EQ(forced_splits(), 0) << "run without FA4_SM90_SPLITS";
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
    const int most = max_splits(p);
    ASSERT_GE(most, 1);
    ASSERT_LE(most, kMaxSplits);
    const int64_t rows = p.heads_q * split_query_rows(p);
    if (most > 1) {
      EXPECT_GE(p.seqlen_k, kMinSplitKeys) << "trial " << trial;
      EXPECT_LE(rows * most, kSplitRowBudget) << "trial " << trial;
      EXPECT_LE(p.heads_kv * p.batch * most, kMaxSms) << "trial " << trial;
      EXPECT_GT(split_workspace_bytes(p), 0u);
    } else {
      EXPECT_EQ(split_workspace_bytes(p), 0u) << "trial " << trial;
    }
    for (int sm_count : {78, 114, 132}) {
      for (int64_t tiles : {int64_t(1), int64_t(7), int64_t(64), int64_t(200), int64_t(5000)}) {
        const int64_t key_tiles = (p.seqlen_k + 127) / 128;
        const int s = choose_splits(p, tiles, key_tiles, sm_count);
        ASSERT_GE(s, 1);
        ASSERT_LE(s, most) << "trial " << trial;
        if (s > 1) {
          EXPECT_LE(tiles * s, sm_count) << "one wave at most; trial " << trial;
          EXPECT_GE(key_tiles, s * kMinKeyTilesPerSplit) << "trial " << trial;
          // The launcher's partials for s splits fit the workspace asked for.
          EXPECT_LE(split_workspace_bytes(p, s), split_workspace_bytes(p)) << "trial " << trial;
        }
      }
    }
  }
}

// The decode shapes of bench/gqa_short.py split as docs/sm90_forward.md says.
TEST(Sm90ForwardWorkspace, DecodeSplits) {
  ASSERT_EQ(forced_splits(), 0) << "run without FA4_SM90_SPLITS";
  Problem p;
  p.seqlen_q = 1;
  p.heads_q = 32;
  p.heads_kv = 8;
  p.head_dim_qk = p.head_dim_v = 128;
  struct Shape {
    int64_t batch, seqlen_k;
    int expected;  // on 132 SMs, packed: batch · 8 one-tile kv heads
  } shapes[] = {{1, 262144, 16}, {4, 65536, 4}, {8, 32768, 2}, {64, 4096, 1}};
  for (const Shape& s : shapes) {
    p.batch = s.batch;
    p.seqlen_k = s.seqlen_k;
    EXPECT_EQ(choose_splits(p, s.batch * 8, (s.seqlen_k + 127) / 128, 132), s.expected)
        << "batch " << s.batch;
  }
}

}  // namespace
