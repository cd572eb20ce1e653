// Which (query tile, head, batch) tiles a CTA computes, in a 1-D grid (no 65535 limit on heads or
// batch). Consecutive tiles share a head so its K and V stay in L2.
//
// Each CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ... With one CTA per tile that is one
// tile each and the hardware hands out CTAs as SMs free up, which balances tiles of unequal cost
// (causal, windows, varlen). With one CTA per SM (persistent) a CTA pays the CTA start-up once and
// loads the next tile's first K tile during this tile's epilogue (its Q waits for O to leave the
// shared buffer); tiles of equal cost (no mask, fixed lengths) lose nothing to the static order. With a mask that makes later rows see more keys
// (causal), the heaviest query tiles come first so the short ones fill the tail.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <cute/config.hpp>

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
  };

  static Params make(int64_t num_m_blocks, int64_t heads, int64_t batch, bool heavy_last_rows) {
    return {int(num_m_blocks), int(heads), int(num_m_blocks * heads * batch), heavy_last_rows};
  }

  // CTAs to launch: one per SM when persistent, else one per tile.
  static int grid(Params const& p, bool persistent, int sm_count) {
    return persistent && sm_count < p.tiles ? sm_count : p.tiles;
  }

  // FA4_SM90_SCHEDULE=persistent|per_tile overrides the choice the launcher makes (auto), for
  // measuring one against the other; read once.
  static bool persistent(bool equal_cost_tiles) {
    static const int forced = [] {
      const char* v = std::getenv("FA4_SM90_SCHEDULE");
      if (v == nullptr) return -1;
      if (std::strcmp(v, "persistent") == 0) return 1;
      if (std::strcmp(v, "per_tile") == 0) return 0;
      return -1;
    }();
    return forced < 0 ? equal_cost_tiles : forced == 1;
  }

  CUTE_DEVICE static int first() { return int(blockIdx.x); }
  CUTE_DEVICE static int next(int tile) { return tile + int(gridDim.x); }
  CUTE_DEVICE static bool valid(Params const& p, int tile) { return tile < p.tiles; }

  CUTE_DEVICE static TileCoord coord(Params const& p, int tile) {
    const int m = tile % p.num_m_blocks;
    const int head_batch = tile / p.num_m_blocks;
    return {p.heavy_last_rows ? p.num_m_blocks - 1 - m : m, head_batch % p.heads,
            head_batch / p.heads};
  }
};

}  // namespace fa4::sm90
