// The sm90 forward's tile-order workspace (src/sm90/fwd/tile_order.hpp), host side: the workspace
// is sized from the problem's sizes alone, so its bound must hold for every content of the
// sequence arrays, every pack-GQA choice and every query tile height the kernels use. (The plan's
// other choices against the workspace: test_fwd_plan.cpp.)
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "fa4/attention.hpp"
#include "sm90/fwd/tile_order.hpp"

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

}  // namespace
