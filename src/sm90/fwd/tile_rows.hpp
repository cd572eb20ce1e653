// Which of a sequence's query rows a forward tile computes, and which of them it stores.
//
// A sequence's `count` query rows (pack-GQA: the rows of all its packed heads) take
// ceil(count / block_m) tiles; where count is not a multiple of block_m one tile holds fewer rows.
// Under a causal diagonal a row's keys grow with its position, so that tile costs least at the top:
// tile m then stores rows [m·block_m − pad, (m + 1)·block_m − pad), pad = −count mod block_m, and
// the last tile ends at the sequence's end. Tile 0 would start above row 0, where no TMA box is to
// start (a store's box there is an illegal instruction): it computes rows
// [0, block_m), overlapping tile 1, and stores only its own rows. Its key tiles are those of the
// rows it stores; the rows past them are computed on whatever keys that gives and dropped (at
// d64 / d192 a consumer warpgroup whose 64 rows are all past them computes nothing:
// FwdKernel::own_key_tiles). Key tiles per causal head, 192-row tiles by 128 keys: 4k 384 → 363
// (−5.5 %), 2k −5 %, 1k −16 %, 16k −1.5 %.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace fa4::sm90 {

struct TileRows {
  int first;  // the tile's row 0: rows [first, first + block_m) are computed
  int end;    // rows [first, end) are stored; empty (first ≥ end) past the sequence's last tile

  FA4_HD bool empty() const { return first >= end; }

  // Whether a box of block_m rows from `first`, clipped at the sequence's end, holds rows another
  // tile stores (tile 0 of a sequence whose short tile comes first): then the rows are stored
  // one by one, up to `end`.
  FA4_HD bool box_overlaps_next(int block_m, int64_t count) const {
    return slice_overlaps_next(0, block_m, count);
  }
  // The same for a box of `rows` rows from first + offset (a consumer warpgroup's slice).
  FA4_HD bool slice_overlaps_next(int offset, int rows, int64_t count) const {
    return end < count && end - first < offset + rows;
  }

  // Tile m_block of a sequence of `count` rows; `short_first`: the short tile at the top (above).
  static FA4_HD TileRows of(int m_block, int block_m, int64_t count, bool short_first) {
    const int64_t pad = short_first ? (block_m - count % block_m) % block_m : 0;
    const int64_t begin = int64_t(m_block) * block_m - pad;
    const int64_t end = begin + block_m < count ? begin + block_m : count;
    return {int(begin > 0 ? begin : 0), int(end)};
  }
};

}  // namespace fa4::sm90
