// Which (query tile, head, batch) tiles a CTA computes, in a 1-D grid (no 65535 limit on heads or
// batch). Consecutive tiles share a head so its K and V stay in L2.
//
// With one CTA per tile each CTA computes one tile and the hardware hands out CTAs as SMs free
// up, which balances tiles of unequal cost (windows, varlen). With one CTA per SM (persistent) a
// CTA pays the CTA start-up once and loads the next tile's first K tile during this tile's
// epilogue (its Q waits for O to leave the shared buffer). Persistent CTAs walk the tiles in a
// zig-zag: CTA c of G takes c, 2G−1−c, 2G+c, 4G−1−c, ... With a causal mask the heaviest query
// tiles of each head come first and a CTA's pairs then sum to about the same cost (with G a
// multiple of the tiles per head, exactly), where a plain stride G would give some CTAs only the
// heaviest tiles; without a mask the order changes nothing.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

#include "sm90/common/grouped_order.hpp"
#include "sm90/common/grouped_units.hpp"
#include "sm90/fwd/zigzag.hpp"

namespace fa4::sm90 {

struct TileCoord {
  int m_block;
  int head;   // query head
  int batch;
};

struct TileScheduler {
  struct Params {
    int num_m_blocks;
    int heads;
    int tiles;             // num_m_blocks · heads · batch
    bool heavy_last_rows;  // later query tiles see more keys: issue them first
    // Null: grid entry t / splits is tile t / splits. Else the tile of each entry / splits,
    // negative past the last one: a varlen batch's tiles longest-first (tile_order.cuh).
    int32_t* order;
    // Each tile's keys shared out among this many CTAs (split_kv.cuh): entry t is split
    // t % splits of its tile. `tiles` counts entries.
    int splits;
    // Tile index → (query tile, head, batch entry): groups of `grouped.group` (head, batch entry)
    // pairs, query tile by query tile (coord). Group 1, the plain head-by-head numbering, for
    // `order`, whose entries use it, and for the persistent CTAs' zig-zag but where the causal
    // schedule numbers it in groups (causal_schedule.hpp).
    // `units` is the same order with its divisors prepared (the launcher makes both from the plan).
    GroupedOrder grouped;
    GroupedUnits units;
  };

  CUTE_DEVICE static int first() { return int(blockIdx.x); }
  // The CTA's index and the grid's size are read afresh at each step (volatile): held across the
  // tile loop instead, they are three more live registers in the producer's gathering warps,
  // which have 24 and then spill.
  CUTE_DEVICE static int next(int tile) {
    uint32_t c, g;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(c));
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(g));
    return zigzag_next(tile, int(c), int(g));
  }
  CUTE_DEVICE static bool valid(Params const& p, int entry) { return entry < p.tiles; }
  // The tile of grid entry `entry`; negative: none (the ordered grid's unused entries).
  CUTE_DEVICE static int tile_at(Params const& p, int entry) {
    const int unsplit = p.splits > 1 ? entry / p.splits : entry;
    return p.order == nullptr ? unsplit : p.order[unsplit];
  }
  CUTE_DEVICE static int split_at(Params const& p, int entry) {
    return p.splits > 1 ? entry % p.splits : 0;
  }

  CUTE_DEVICE static TileCoord coord(Params const& p, int tile) {
    const GroupedOrder::Unit u = p.units.unit(tile);
    return {p.heavy_last_rows ? p.num_m_blocks - 1 - u.block : u.block, u.head, u.batch};
  }
};

}  // namespace fa4::sm90
