// Which (query tile, head, batch) a CTA computes. One CTA per tile, laid out in a 1-D grid (no
// 65535 limit on heads or batch): consecutive CTAs share a head so its K and V stay in L2. With a
// mask that makes later rows see more keys (causal), the heaviest query tiles are issued first so
// the short ones fill the tail. A persistent scheduler will replace this behind the same coord().
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace fa4::sm90 {

struct TileCoord {
  int m_block;
  int head;   // query head
  int batch;
};

struct StaticTileScheduler {
  struct Params {
    int num_m_blocks;
    int heads;
    bool heavy_last_rows;  // later query tiles see more keys: issue them first
  };

  static int64_t num_tiles(Params const& p, int64_t batch) {
    return int64_t(p.num_m_blocks) * p.heads * batch;
  }

  CUTE_DEVICE static TileCoord coord(Params const& p) {
    const int tile = int(blockIdx.x);
    const int m = tile % p.num_m_blocks;
    const int head_batch = tile / p.num_m_blocks;
    return {p.heavy_last_rows ? p.num_m_blocks - 1 - m : m, head_batch % p.heads,
            head_batch / p.heads};
  }
};

}  // namespace fa4::sm90
