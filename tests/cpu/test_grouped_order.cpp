// The grouped tile order (src/sm90/common/grouped_order.hpp) of the sm90 backward's grid and the forward's
// grid of one CTA per tile: every (tile, head, batch entry) exactly once for any group size, the plain
// order at group 1, tiles in order within a group, the short group first, and the group size rule.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <tuple>

#include "sm90/common/grouped_order.hpp"

namespace {

using fa4::sm90::GroupedOrder;

TEST(Sm90GroupedOrder, EveryUnitOnceInAnyGroupSize) {
  for (int heads_q : {1, 3, 8}) {
    for (int batch : {1, 2, 5}) {
      for (int n_blocks : {1, 7, 64}) {
        const int rows = heads_q * batch;
        for (int group = 1; group <= rows; ++group) {
          const GroupedOrder order{n_blocks, rows, group};
          std::set<std::tuple<int, int, int>> seen;
          for (int tile = 0; tile < n_blocks * rows; ++tile) {
            const auto u = order.unit(tile, heads_q);
            ASSERT_GE(u.block, 0);
            ASSERT_LT(u.block, n_blocks);
            ASSERT_GE(u.head, 0);
            ASSERT_LT(u.head, heads_q);
            ASSERT_GE(u.batch, 0);
            ASSERT_LT(u.batch, batch);
            ASSERT_TRUE(seen.emplace(u.block, u.head, u.batch).second)
                << "tile " << tile << " repeats a unit (group " << group << ")";
          }
          EXPECT_EQ(int(seen.size()), n_blocks * rows);
        }
      }
    }
  }
}

// Clusters of two CTAs (the backward's key-tile pairs): the order numbers pairs of key tiles, a
// cluster's CTAs (consecutive in the grid) take its two key tiles, the CTA's rank picking which;
// every (key tile, head, batch entry) once.
TEST(Sm90GroupedOrder, ClustersTakeAdjacentKeyTilesOfOneUnit) {
  constexpr int kCtas = 2;
  for (int heads_q : {1, 3, 8}) {
    for (int batch : {1, 2, 5}) {
      for (int pairs : {1, 4, 33}) {
        const int rows = heads_q * batch;
        for (int group = 1; group <= rows; ++group) {
          const GroupedOrder order{pairs, rows, group};
          std::set<std::tuple<int, int, int>> seen;
          for (int cta = 0; cta < pairs * kCtas * rows; ++cta) {
            const auto u = order.cluster_unit(cta, heads_q, kCtas);
            ASSERT_GE(u.block, 0);
            ASSERT_LT(u.block, pairs * kCtas);
            EXPECT_EQ(u.block % kCtas, cta % kCtas);
            const auto cluster = order.unit(cta / kCtas, heads_q);
            EXPECT_EQ(u.block / kCtas, cluster.block);
            EXPECT_EQ(u.head, cluster.head);
            EXPECT_EQ(u.batch, cluster.batch);
            ASSERT_TRUE(seen.emplace(u.block, u.head, u.batch).second) << "cta " << cta;
          }
          EXPECT_EQ(int(seen.size()), pairs * kCtas * rows);
        }
      }
    }
  }
}

TEST(Sm90GroupedOrder, GroupOneIsThePlainOrder) {
  const int heads_q = 6, batch = 3, n_blocks = 11;
  const GroupedOrder order{n_blocks, heads_q * batch, 1};
  for (int tile = 0; tile < n_blocks * heads_q * batch; ++tile) {
    const auto u = order.unit(tile, heads_q);
    EXPECT_EQ(u.block, tile % n_blocks);
    EXPECT_EQ(u.head, tile / n_blocks % heads_q);
    EXPECT_EQ(u.batch, tile / n_blocks / heads_q);
  }
}

TEST(Sm90GroupedOrder, KeyTilesAscendWithinAGroupAndTheShortGroupComesFirst) {
  const int heads_q = 8, batch = 2, n_blocks = 5, group = 3;  // 16 pairs: a group of 1, then 5 of 3
  const GroupedOrder order{n_blocks, heads_q * batch, group};
  // The short group: pair 0's key tiles in order.
  for (int tile = 0; tile < n_blocks; ++tile) {
    const auto u = order.unit(tile, heads_q);
    EXPECT_EQ(u.block, tile);
    EXPECT_EQ(u.head * 1 + u.batch * heads_q, 0);
  }
  // Then groups of 3 pairs: key tile n of all three before n + 1, the pairs in order.
  for (int tile = n_blocks; tile < n_blocks * heads_q * batch; ++tile) {
    const int t = tile - n_blocks, g = t / (group * n_blocks), i = t % (group * n_blocks);
    const auto u = order.unit(tile, heads_q);
    EXPECT_EQ(u.block, i / group) << tile;
    EXPECT_EQ(u.batch * heads_q + u.head, 1 + g * group + i % group) << tile;
  }
}

TEST(Sm90GroupedOrder, GroupSize) {
  const int64_t mb = 1 << 20;
  // d256 bf16 at 4k on 132 SMs with 50 MB of L2: 64 key tiles want 5 pairs, the L2 allows 3.
  const int64_t d256 = 2 * 256 * 2 + 4 * 256 + 8;
  EXPECT_EQ(GroupedOrder::group_for(32, 64, 4096, d256, 132, 50 * mb), 3);
  // At 16k one pair's rows exceed half the L2: the plain order.
  EXPECT_EQ(GroupedOrder::group_for(8, 256, 16384, d256, 132, 50 * mb), 1);
  // Short rows: as many pairs as the tail needs (ceil(2 · 132 / 16) = 17), capped by the pairs.
  const int64_t d64 = 2 * 64 * 2 + 4 * 64 + 8;
  EXPECT_EQ(GroupedOrder::group_for(256, 16, 2048, d64, 132, 50 * mb), 17);
  EXPECT_EQ(GroupedOrder::group_for(4, 16, 2048, d64, 132, 50 * mb), 4);
  // Many key tiles: one pair's work already outlasts its longest CTA.
  EXPECT_EQ(GroupedOrder::group_for(64, 512, 256, d64, 132, 50 * mb), 1);
}

// The forward's group: the most pairs within half the L2 among the sizes dividing the pairs.
TEST(Sm90GroupedOrder, DividingGroupSize) {
  const int64_t mb = 1 << 20, d128 = 2 * 128 * 2, d256 = 2 * 256 * 2;  // K + V bytes per key row
  EXPECT_EQ(GroupedOrder::dividing_group_for(32, 4096, d256, 50 * mb), 4);   // cap 6: 4 divides 32
  EXPECT_EQ(GroupedOrder::dividing_group_for(64, 4096, d128, 50 * mb), 8);   // cap 12
  EXPECT_EQ(GroupedOrder::dividing_group_for(8, 16384, d256, 50 * mb), 1);   // 16 MB a pair
  EXPECT_EQ(GroupedOrder::dividing_group_for(16, 512, d128, 50 * mb), 16);   // all fit: all
  EXPECT_EQ(GroupedOrder::dividing_group_for(21, 4096, d128, 50 * mb), 7);   // cap 12: 7 of 1, 3, 7
  EXPECT_EQ(GroupedOrder::dividing_group_for(13, 4096, d128, 50 * mb), 1);   // prime above the cap
  EXPECT_EQ(GroupedOrder::dividing_group_for(5, 0, d128, 50 * mb), 5);       // nothing shared
  for (int64_t rows = 1; rows <= 300; ++rows) {
    const int g = GroupedOrder::dividing_group_for(rows, 4096, d128, 50 * mb);
    ASSERT_GE(g, 1);
    ASSERT_LE(g, rows);
    ASSERT_EQ(rows % g, 0) << rows;
  }
}

}  // namespace
