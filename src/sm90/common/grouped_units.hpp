// GroupedOrder::unit (grouped_order.hpp) with its divisors prepared on the host: every warp of the
// forward numbers every tile it runs with it, and five divisions by run-time values per tile cost
// 1.3 % of the d128 forward's warp samples at 4k.
// cutlass::FastDivmod divides by a multiply-high and a shift.
#pragma once

#include <cutlass/fast_math.h>

#include "common/host_device.hpp"
#include "sm90/common/grouped_order.hpp"

namespace fa4::sm90 {

struct GroupedUnits {
  int first_tiles;               // tiles of the short group, which comes first
  int first;                     // its pairs (0: none)
  int group;
  cutlass::FastDivmod group_tiles;  // group · blocks
  cutlass::FastDivmod group_pairs;  // group
  cutlass::FastDivmod first_pairs;  // first, 1 when there is none
  cutlass::FastDivmod heads;

  static GroupedUnits of(GroupedOrder const& o, int heads_) {
    const int first = o.rows % o.group;
    return {first * o.blocks,
            first,
            o.group,
            cutlass::FastDivmod(o.group * o.blocks),
            cutlass::FastDivmod(o.group),
            cutlass::FastDivmod(first > 0 ? first : 1),
            cutlass::FastDivmod(heads_)};
  }

  // The same unit as GroupedOrder::unit(tile, heads).
  FA4_HD GroupedOrder::Unit unit(int tile) const {
    int row0 = 0, index = tile, block = 0, in_group = 0;
    if (tile >= first_tiles) {
      int g = 0;
      group_tiles.fast_divmod(g, index, tile - first_tiles);
      row0 = first + g * group;
      group_pairs.fast_divmod(block, in_group, index);
    } else {
      first_pairs.fast_divmod(block, in_group, index);
    }
    int batch = 0, head = 0;
    heads.fast_divmod(batch, head, row0 + in_group);
    return GroupedOrder::Unit{block, head, batch};
  }
};

}  // namespace fa4::sm90
