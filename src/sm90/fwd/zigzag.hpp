// The persistent CTAs' walk over the forward's tiles (tile_scheduler.cuh), shared with the host's
// model of it (host/causal_schedule.hpp, host/fwd_plan.cpp).
#pragma once

#include "common/host_device.hpp"

namespace fa4::sm90 {

// The zig-zag step of persistent CTA c of g: from the first half of a 2g-tile round to the
// mirrored tile of its second half, from there to the next round's first half. With one CTA per
// tile (g = tiles), past the last tile.
FA4_HD int zigzag_next(int tile, int c, int g) {
  return tile % (2 * g) < g ? tile + 2 * (g - c) - 1 : tile + 2 * c + 1;
}

}  // namespace fa4::sm90
