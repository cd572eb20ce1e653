// Which query row of which head each row of a forward query tile is. Without packing a tile holds
// consecutive positions of one query head. With pack-GQA the G query heads of one kv head share
// the tile (and so each K / V tile the CTA loads): packed row r is position r / G of query head
// kv_head·G + r % G. Heads are innermost, so that a tile spans few positions and a causal tile
// stays near the diagonal; a decode step (one position) fills G rows instead of one.
#pragma once

#include <cstdint>

#include <cute/config.hpp>
#include <cutlass/fast_math.h>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

struct QueryRows {
  cutlass::FastDivmod group;  // G with pack-GQA, else 1

  CUTE_HOST_DEVICE bool packed() const { return group.divisor > 1; }
  // Tile rows a sequence of len_q positions has per tile head (kv head when packed).
  CUTE_HOST_DEVICE int64_t count(int64_t len_q) const { return len_q * group.divisor; }
  // The sequence position of tile row r (r < count; packed counts stay below 2³⁰, as the plan
  // packs: host/fwd_plan.cpp).
  CUTE_HOST_DEVICE int64_t position(int64_t r) const {
    return packed() ? int64_t(group.div(int(r))) : r;
  }

  struct Row {
    int position;
    int head;  // query head
  };
  // Tile row r of tile head `tile_head`.
  CUTE_HOST_DEVICE Row locate(int r, int tile_head) const {
    int position, g;
    group(position, g, r);
    return {position, tile_head * group.divisor + g};
  }
};

}  // namespace fa4::sm90
