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

#include "sm90/host/causal_schedule.hpp"
#include "sm90/host/env_switch.hpp"
#include "sm90/common/grouped_order.hpp"
#include "sm90/common/grouped_units.hpp"

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
    // `units` is the same order with its divisors prepared (set_group keeps the two together).
    GroupedOrder grouped;
    GroupedUnits units;
  };

  static Params make(int64_t num_m_blocks, int64_t heads, int64_t batch, bool heavy_last_rows) {
    const GroupedOrder plain{int(num_m_blocks), int(heads * batch), 1};
    return {int(num_m_blocks), int(heads), int(num_m_blocks * heads * batch), heavy_last_rows,
            nullptr, 1, plain, GroupedUnits::of(plain, int(heads))};
  }
  static void set_group(Params& p, int group) {
    p.grouped.group = group;
    p.units = GroupedUnits::of(p.grouped, p.heads);
  }

  // CTAs to launch: one per SM when persistent, else one per tile. FA4_SM90_PERSISTENT_CTAS=n
  // launches n persistent CTAs instead (read once), so that the tests' small problems run many
  // tiles per CTA: the hand-over of the shared buffers from one tile to the next is then tested on
  // every mask and sequence layout, not only on the large problems where it happens by itself.
  static int grid(Params const& p, bool persistent, int sm_count) {
    static const int forced_ctas = env_int("FA4_SM90_PERSISTENT_CTAS");
    const int ctas = forced_ctas > 0 ? forced_ctas : sm_count;
    return persistent && ctas < p.tiles ? ctas : p.tiles;
  }

  // FA4_SM90_SCHEDULE=persistent|per_tile overrides the choice the launcher makes (auto), for
  // measuring one against the other; read once.
  static bool persistent(bool balanced_static_order) {
    static const int forced = env_switch("FA4_SM90_SCHEDULE", "persistent", "per_tile");
    return forced < 0 ? balanced_static_order : forced == 1;
  }
  // The group of the persistent zig-zag's numbering: `chosen` (the causal schedule's, or 1), or
  // FA4_SM90_ZIGZAG_GROUP=g (read once) wherever persistent CTAs run, for the tests: every mask
  // and layout through a grouped zig-zag (at most all pairs; the short group first).
  static int zigzag_group(int chosen, int64_t pairs) {
    static const int forced = env_int("FA4_SM90_ZIGZAG_GROUP");
    return forced <= 0 ? chosen : int(forced < pairs ? forced : pairs);
  }

  // Whether persistent CTAs in the zig-zag get about equal work (within 4 % of the mean) when a
  // query tile costs as many key tiles as it sees under the causal diagonal. The zig-zag balances
  // exactly only when its 2·ctas-tile rounds line up with the tiles per head, or average out over
  // many rounds: at 16k on 132 SMs the busiest CTA had 1.5–1.8× the mean (measured 25–33 %
  // slower than one CTA per tile), while at ≤ 4k it stays within 3 % and persistence gains 4–11 %.
  // O(tiles) integer steps on the host (beyond kMaxTilesChecked, no), once per shape and thread:
  // the last answer is kept for the next call.
  static bool zigzag_balanced(Params const& p, int ctas) {
    constexpr int kMaxTilesChecked = 1 << 14;
    if (p.tiles > kMaxTilesChecked || ctas <= 0) return false;
    struct Last {
      int num_m_blocks = -1, tiles = -1, ctas = -1;
      bool balanced = false;
    };
    static thread_local Last last;
    if (last.num_m_blocks == p.num_m_blocks && last.tiles == p.tiles && last.ctas == ctas)
      return last.balanced;
    int64_t total = 0, busiest = 0;
    for (int c = 0; c < ctas && c < p.tiles; ++c) {
      int64_t load = 0;
      for (int t = c; t < p.tiles; t = zigzag_next(t, c, ctas))
        load += p.num_m_blocks - t % p.num_m_blocks;
      total += load;
      busiest = load > busiest ? load : busiest;
    }
    last = {p.num_m_blocks, p.tiles, ctas, busiest * 100 * int64_t(ctas) <= total * 104};
    return last.balanced;
  }

  // Under the causal diagonal with seqlen_q = seqlen_k, the zig-zag head by head, on a grouped
  // numbering, or one CTA per tile (causal_schedule.hpp). The model walks the tiles a few times
  // (up to about a millisecond at kMaxTilesChecked; beyond, one CTA per tile), once per shape
  // and thread: the answers for the last kKept shapes are kept (a model's layers alternate a few).
  static CausalSchedule causal_schedule(CausalSchedule::Shape const& s) {
    constexpr int64_t kMaxTilesChecked = 1 << 14;
    constexpr int kKept = 8;
    if (int64_t(s.blocks()) * s.pairs > kMaxTilesChecked || s.ctas <= 0) return {false, 1};
    struct Kept {
      CausalSchedule::Shape shape{};
      CausalSchedule schedule{false, 1};
      bool valid = false;
    };
    static thread_local Kept kept[kKept];
    static thread_local int next = 0;
    for (Kept const& k : kept)
      if (k.valid && k.shape == s) return k.schedule;
    kept[next] = {s, CausalSchedule::choose(s), true};
    const CausalSchedule chosen = kept[next].schedule;
    next = (next + 1) % kKept;
    return chosen;
  }

  CUTE_DEVICE static int first() { return int(blockIdx.x); }
  CUTE_DEVICE static int next(int tile) {
    return zigzag_next(tile, int(blockIdx.x), int(gridDim.x));
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
