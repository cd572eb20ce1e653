// GroupedUnits (src/sm90/common/grouped_units.hpp): the forward's tile numbering with its divisors
// prepared on the host gives GroupedOrder::unit's (head, batch entry, tile) for every tile, group
// size and shape tried, including counts near 2^31 / blocks where a multiply-high could round.
#include <gtest/gtest.h>

#include <cstdint>

#include "sm90/common/grouped_units.hpp"

namespace {

using fa4::sm90::GroupedOrder;
using fa4::sm90::GroupedUnits;

void expect_same(GroupedOrder const& order, int heads, int tile) {
  const GroupedUnits fast = GroupedUnits::of(order, heads);
  const auto want = order.unit(tile, heads);
  const auto got = fast.unit(tile);
  ASSERT_EQ(got.block, want.block) << "tile " << tile << " group " << order.group;
  ASSERT_EQ(got.head, want.head) << "tile " << tile << " group " << order.group;
  ASSERT_EQ(got.batch, want.batch) << "tile " << tile << " group " << order.group;
}

TEST(Sm90GroupedUnits, SameUnitsAsGroupedOrder) {
  for (int heads : {1, 3, 8, 16, 64}) {
    for (int batch : {1, 2, 5, 7}) {
      for (int blocks : {1, 7, 32, 129}) {
        const int rows = heads * batch;
        for (int group = 1; group <= rows; group += (group < 8 ? 1 : 5)) {
          const GroupedOrder order{blocks, rows, group};
          for (int tile = 0; tile < blocks * rows; ++tile) expect_same(order, heads, tile);
        }
      }
    }
  }
}

TEST(Sm90GroupedUnits, LargeTileCounts) {
  // 2^30 tiles at most (backend.cpp): the last tiles of such grids.
  for (int blocks : {1, 128, 1000}) {
    for (int heads : {1, 32, 96}) {
      const int rows = int((int64_t(1) << 30) / blocks / heads) * heads;
      for (int group : {1, 3, 8}) {
        const GroupedOrder order{blocks, rows, group};
        const int tiles = blocks * rows;
        for (int tile = tiles - 4096; tile < tiles; ++tile) expect_same(order, heads, tile);
        for (int tile = 0; tile < tiles; tile += 9973 * 13) expect_same(order, heads, tile);
      }
    }
  }
}

}  // namespace
