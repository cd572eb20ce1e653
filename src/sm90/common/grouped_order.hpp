// Tiles of many (head, batch entry) pairs in an order that ends a run on short work while the CTAs
// in flight share the rows of a few heads in L2. Along each pair's sequence the tiles' work grows
// or shrinks under a causal mask (the backward's key tile n sees the query tiles from n on; the
// forward's query tile m the key tiles up to m). One pair after another, each new pair's longest
// tile comes late whenever it starts, and the last pair's keeps its SM busy long after the others
// are done (a list-scheduling model of the d256 backward at 4k: 5.6 % over the average load; of
// the d256 forward at causal 8k, one CTA per tile: 11.7 %, bench/schedule_model.py). Taking the
// tiles of a few pairs together, position by position, ends the run with short tiles (0.1 % and
// 0.8 % in the same models). Used by the backward's grid (bwd_launch.cuh) and the forward's grid
// of one CTA per tile (tile_scheduler.cuh, fwd_launch.cuh).
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace fa4::sm90 {

struct GroupedOrder {
  int blocks;  // tiles per (head, batch entry): key tiles (backward), query tiles (forward)
  int rows;    // (head, batch entry) pairs: heads_q · batch, numbered batch-major
  int group;   // pairs whose tiles run together; 1: one pair after another

  struct Unit {
    int block, head, batch;
  };

  // Tile `tile` in [0, blocks · rows): groups of `group` pairs, the short group (rows % group)
  // first, so that the run ends with a whole group; in a group, tile n of every pair before tile
  // n + 1. group 1 is the plain order: tile = (batch · heads + head) · blocks + n.
  FA4_HD Unit unit(int tile, int heads) const {
    const int first = rows % group;  // the short group's pairs (0: none)
    const int first_tiles = first * blocks;
    int row0 = 0, size = first, index = tile;
    if (tile >= first_tiles) {
      const int t = tile - first_tiles;
      const int g = t / (group * blocks);
      row0 = first + g * group;
      size = group;
      index = t - g * group * blocks;
    }
    const int row = row0 + index % size;
    return Unit{index / size, row % heads, row / heads};
  }

  // CTA `cta` of a grid of clusters of `ctas` CTAs that share a unit (the backward's key-tile
  // pairs: the order numbers pairs of key tiles): its cluster's unit, the CTAs taking its
  // consecutive tiles (block · ctas + the CTA's rank, the cluster being consecutive CTAs).
  FA4_HD Unit cluster_unit(int cta, int heads, int ctas) const {
    Unit u = unit(cta / ctas, heads);
    u.block = u.block * ctas + cta % ctas;
    return u;
  }

  // The pairs per group: enough for a group's work per SM to outlast its longest tile (`blocks`
  // steps; a group of g pairs is g · blocks² / 2 steps over sm_count SMs, so
  // g ≥ 2 · sm_count / blocks), and no more than keep the rows they share within half the L2
  // (shared_rows · bytes_per_row per pair: the backward's query side, Q, dO, the dQ accumulator and
  // the two stats; the forward's K and V). At least 1, at most all.
  static int group_for(int64_t rows, int64_t blocks, int64_t shared_rows, int64_t bytes_per_row,
                       int64_t sm_count, int64_t l2_bytes) {
    int64_t g = (2 * sm_count + blocks - 1) / blocks;
    const int64_t fit = l2_pairs(rows, shared_rows, bytes_per_row, l2_bytes);
    if (g > fit) g = fit;
    if (g > rows) g = rows;
    return g < 1 ? 1 : int(g);
  }

  // The forward's grid of one CTA per tile, which the hardware hands out greedily in this order:
  // the most pairs whose shared rows (K and V) fit in half the L2, among the sizes that divide the
  // pairs evenly. A short group ahead of the others leaves the greedy hand-out an uneven end: in
  // the model (bench/schedule_model.py), d256 causal 4k (32 pairs of 32 query tiles, 132 SMs) in
  // groups of 4 or 8 pairs ends within 0.0 % of the mean, in groups of 6 at 3.7 %. Groups as large
  // as half the L2 holds keep every causal row of the benchmark within 3.1 % of the mean, where
  // the head-by-head numbering is up to 14.5 % off (d256 2k).
  static int dividing_group_for(int64_t rows, int64_t shared_rows, int64_t bytes_per_row,
                                int64_t l2_bytes) {
    int64_t cap = l2_pairs(rows, shared_rows, bytes_per_row, l2_bytes);
    if (cap > rows) cap = rows;
    int g = 1;
    for (int64_t d = 2; d <= cap; ++d)
      if (rows % d == 0) g = int(d);
    return g;
  }

  // The pairs whose shared rows fit in half the L2 (all of them when they share nothing).
  static int64_t l2_pairs(int64_t rows, int64_t shared_rows, int64_t bytes_per_row,
                          int64_t l2_bytes) {
    const int64_t per_pair = shared_rows * bytes_per_row;
    return per_pair > 0 ? l2_bytes / 2 / per_pair : rows;
  }
};

}  // namespace fa4::sm90
