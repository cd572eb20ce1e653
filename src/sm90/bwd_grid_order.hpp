// Which (key tile, query head, batch entry) each CTA of the backward's main kernel works on.
// The hardware starts CTAs in grid order as SMs free up, so the order decides the last wave.
// With a causal mask a key tile's work shrinks with its index (key tile n sees the query tiles
// from n on), and one head after another puts each head's longest CTA (key tile 0) late in the
// run whenever a new head starts: the last head's leaves its SM busy long after the others are
// done (a list-scheduling model of d256 at 4k: 5.6 % over the average load). Taking the key
// tiles of a few heads together, longest first, ends the run with short CTAs (0.1 % in the same
// model), while the CTAs in flight still share the Q / dO / dQ rows of a few heads in L2.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace fa4::sm90 {

struct BwdGridOrder {
  int n_blocks;  // key tiles per (head, batch entry)
  int rows;      // (head, batch entry) pairs: heads_q · batch, numbered batch-major
  int group;     // pairs whose key tiles run together; 1: one pair after another

  struct Unit {
    int n_block, head, batch;
  };

  // CTA `tile` in [0, n_blocks · rows): groups of `group` pairs, the short group (rows % group)
  // first, so that the run ends with a whole group; in a group, key tile n of every pair before
  // key tile n + 1. group 1 is the plain order: tile = (batch · heads_q + head) · n_blocks + n.
  FA4_HD Unit unit(int tile, int heads_q) const {
    const int first = rows % group;  // the short group's pairs (0: none)
    const int first_tiles = first * n_blocks;
    int row0 = 0, size = first, index = tile;
    if (tile >= first_tiles) {
      const int t = tile - first_tiles;
      const int g = t / (group * n_blocks);
      row0 = first + g * group;
      size = group;
      index = t - g * group * n_blocks;
    }
    const int row = row0 + index % size;
    return Unit{index / size, row % heads_q, row / heads_q};
  }

  // The pairs per group: enough for a group's work per SM to outlast its longest CTA (key tile
  // 0, n_blocks steps; a group of g pairs is g · n_blocks² / 2 steps over sm_count SMs, so
  // g ≥ 2 · sm_count / n_blocks), and no more than keep their query-side rows (Q, dO, the dQ
  // accumulator and the two stats: query_rows · bytes_per_row per pair) within half the L2. At
  // least 1, at most all.
  static int group_for(int64_t rows, int64_t n_blocks, int64_t query_rows, int64_t bytes_per_row,
                       int64_t sm_count, int64_t l2_bytes) {
    int64_t g = (2 * sm_count + n_blocks - 1) / n_blocks;
    const int64_t per_pair = query_rows * bytes_per_row;
    if (per_pair > 0 && g > l2_bytes / 2 / per_pair) g = l2_bytes / 2 / per_pair;
    if (g > rows) g = rows;
    return g < 1 ? 1 : int(g);
  }
};

}  // namespace fa4::sm90
