// Under a causal diagonal with seqlen_q = seqlen_k a query tile's work grows with its position,
// and the forward's plan (fwd_plan.cpp) chooses between persistent CTAs walking the zig-zag
// (tile_scheduler.cuh) and one CTA per tile, which the hardware hands to SMs as they free up. The
// choice compares a model of each one's busiest SM (bench/schedule_model.py's list scheduling,
// with zig-zags on grouped numberings and a fixed cost per tile of each schedule's own): a tile
// costs the key tiles it sees plus a fixed part, half a key tile
// on a persistent CTA, which loads the next tile's first K and Q under this one, and 1.8 on a CTA
// of its own (its start, its first loads and its epilogue alone on the SM). 1.8 is the median of
// per-row fits: for each causal row of the benchmark (d64–d256, 512–4k), the fixed part at which
// the model's time of the zig-zag over one CTA per tile equals the measured one (range 1.3–2.9).
//
// The zig-zag's balance depends on the tiles' numbering. Head by head, its mirrored pairs have
// equal work only where its rounds line up with the query tiles per head (d64 512: three tiles of
// 1, 3 and 4 key tiles per head, the busiest CTA 14 % over the mean). In groups of pairs, query
// tile by query tile (GroupedOrder), it pairs tiles of equal work, but the CTAs in flight then
// read the K and V of as many pairs: only groups whose K and V fit in half the L2 are tried.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/host_device.hpp"
#include "sm90/common/grouped_order.hpp"
#include "sm90/fwd/tile_rows.hpp"
#include "sm90/fwd/zigzag.hpp"

namespace fa4::sm90 {

struct CausalSchedule {
  bool persistent;
  // The numbering's group (GroupedOrder::group): of the zig-zag, or, for one CTA per tile, the
  // group the plan numbers that grid in (GroupedOrder::dividing_group_for).
  int group;

  // Fixed work per tile, in key tiles (above).
  static constexpr double kFixedPersistent = 0.5;
  static constexpr double kFixedPerTile = 1.8;
  // The zig-zag head by head is kept where its busiest CTA is within 4 % of the mean; else it is
  // tried on the largest few groups that fit (each try walks every tile once).
  static constexpr double kBalanced = 1.04;
  static constexpr int kGroupsTried = 4;

  struct Shape {
    int seqlen;  // of queries and keys; the causal diagonal bottom-right, no window
    int block_m, block_n;
    int pairs;      // (head, batch entry) pairs
    int ctas;       // persistent CTAs: one per SM
    int max_group;  // pairs whose K and V fit in half the L2 (GroupedOrder::l2_pairs)
    int blocks() const { return (seqlen + block_m - 1) / block_m; }
    bool operator==(Shape const& o) const {
      return seqlen == o.seqlen && block_m == o.block_m && block_n == o.block_n &&
             pairs == o.pairs && ctas == o.ctas && max_group == o.max_group;
    }
  };

  // The key tiles of query tile m (from the top) under the diagonal: those up to its last stored
  // row, the short tile first (tile_rows.hpp).
  static int key_tiles(Shape const& s, int m) {
    return (TileRows::of(m, s.block_m, s.seqlen, true).end + s.block_n - 1) / s.block_n;
  }

  // Head by head where that balances; else the zig-zag on the numbering that leaves its busiest
  // CTA the least work, where that is less than the busiest SM's with one CTA per tile, numbered
  // as the plan numbers that grid (the largest group that divides the pairs and fits:
  // GroupedOrder::dividing_group_for); else one CTA per tile.
  static CausalSchedule choose(Shape const& s) {
    if (s.ctas <= 0 || s.pairs <= 0 || s.seqlen <= 0) return {false, 1};
    const Model model(s);
    double least = model.zigzag_busiest(1);
    if (least <= kBalanced * model.total(kFixedPersistent) / s.ctas) return {true, 1};
    CausalSchedule best{true, 1};
    int per_tile_group = 1, tried = 0;
    for (int g = std::min(s.max_group, s.pairs); g >= 2 && tried < kGroupsTried; --g) {
      if (s.pairs % g != 0) continue;
      if (per_tile_group == 1) per_tile_group = g;
      ++tried;
      const double work = model.zigzag_busiest(g);
      if (work < least) {
        least = work;
        best.group = g;
      }
    }
    // One CTA per tile: its busiest SM has at least the mean and, handed out greedily, at most
    // the mean plus the heaviest tile; the hand-out is walked only where that does not decide.
    const double per_tile_mean = model.total(kFixedPerTile) / s.ctas;
    if (least < per_tile_mean) return best;
    if (per_tile_mean + model.keys.back() + kFixedPerTile <= least ||
        model.greedy_busiest(per_tile_group) <= least)
      return {false, per_tile_group};
    return best;
  }

  // The loads of a shape's tiles (each query tile's key tiles computed once).
  struct Model {
    Shape s;
    std::vector<int> keys;  // per query tile from the top

    explicit Model(Shape const& shape) : s(shape), keys(shape.blocks()) {
      for (int m = 0; m < s.blocks(); ++m) keys[m] = key_tiles(s, m);
    }
    // Tile `tile` numbered in groups of `group`, a divisor of the pairs (no short group: then
    // GroupedOrder::unit's block is the position in the group's tiles over the group): block 0
    // is a pair's last query tile, the heaviest (tile_scheduler.cuh).
    double cost(int group, int tile, double fixed) const {
      const int block = tile % (group * s.blocks()) / group;
      return keys[s.blocks() - 1 - block] + fixed;
    }
    double total(double fixed) const {
      double sum = 0;
      for (int k : keys) sum += k + fixed;
      return sum * s.pairs;
    }
    // The busiest persistent CTA's work in the zig-zag.
    double zigzag_busiest(int group) const {
      const int tiles = s.blocks() * s.pairs;
      double busiest = 0;
      for (int c = 0; c < s.ctas && c < tiles; ++c) {
        double load = 0;
        for (int t = c; t < tiles; t = zigzag_next(t, c, s.ctas))
          load += cost(group, t, kFixedPersistent);
        busiest = std::max(busiest, load);
      }
      return busiest;
    }
    // The busiest SM's work with one CTA per tile, each to whichever SM is free first: a min-heap
    // of the SMs' free times whose top takes each tile in turn (one sift-down per tile).
    double greedy_busiest(int group) const {
      std::vector<double> free_at(s.ctas, 0.0);
      const size_t n = free_at.size();
      double busiest = 0;
      for (int t = 0; t < s.blocks() * s.pairs; ++t) {
        const double end = free_at[0] + cost(group, t, kFixedPerTile);
        busiest = std::max(busiest, end);
        size_t i = 0;
        for (size_t child = 1; child < n; child = 2 * i + 1) {
          if (child + 1 < n && free_at[child + 1] < free_at[child]) ++child;
          if (free_at[child] >= end) break;
          free_at[i] = free_at[child];
          i = child;
        }
        free_at[i] = end;
      }
      return busiest;
    }
  };
};

}  // namespace fa4::sm90
