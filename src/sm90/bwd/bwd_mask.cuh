// The band mask (causal / sliding window, bottom-right aligned) seen from a key tile, for the
// backward's transposed scores Sᵀ (rows = keys, columns = queries). The rule is BandMask's
// (common/mask.hpp), the one the forward and the CPU backend use.
//
// Query rows past the sequence's end need no mask: their Q / dO rows load as zeros and their LSE
// is +inf, so their probabilities and dS are 0. Keys past it do: their K rows load as zeros, so
// their scores are 0 and their probabilities exp(−LSE), which overflows to inf for a row of very
// negative LSE (−11 suffices in fp16 once dS is rounded), and inf · a zero K row is NaN in dQ. So
// the last key tile of a sequence, when partial, is always masked.
#pragma once

#include <cstdint>
#include <climits>

#include <cute/tensor.hpp>

#include "common/mask.hpp"
#include "sm90/common/tile_mask.cuh"

namespace fa4::sm90 {

// Query tiles that see a key tile; empty when no query sees any of its keys.
using QueryTiles = TileRange;

// The order in which a key tile visits its query tiles: step i of [begin, end) takes tile
// begin + (i − begin + shift) mod count. Without a band every key tile sees every query tile, and
// a (head, batch entry)'s key tiles, which start together, would add their dQ into the same tile
// at the same time; each starting at its own tile spreads those adds over the accumulator. The
// steps, not the tiles, keep the rings' and stages' parities (a wrap would repeat one).
// kRotates false: the plain walk, tile = step, compiled as such (a runtime shift of 0 cost the
// d128 kernel 44 bytes of spills).
template <bool kRotates>
struct QueryOrder {
  QueryTiles tiles;
  int shift = 0;  // in [0, count); 0 without kRotates

  // Key tile n_block of `blocks` (n_block < blocks) starts n_block / blocks of the way along the
  // tiles; without `rotate`, at the first.
  CUTE_HOST_DEVICE static QueryOrder make(QueryTiles tiles, int n_block, int blocks, bool rotate) {
    if constexpr (kRotates) {
      const int count = tiles.count();
      return {tiles, rotate && count > 1 ? int(int64_t(n_block) * count / blocks) : 0};
    } else {
      return {tiles, 0};
    }
  }
  CUTE_HOST_DEVICE int tile(int step) const {
    if constexpr (kRotates) {
      const int t = step + shift;
      return t < tiles.end ? t : t - tiles.count();
    } else {
      return step;
    }
  }
};

// The query tiles that either of two key tiles sees (key-tile pairs walk them together,
// bwd_pair.cuh). A band's ranges move monotonically with the key tile: under a causal band
// adjacent key tiles' ranges overlap or touch; a narrow window can leave a gap between them. The
// hull's tiles in such a gap are masked whole, as are those outside a key tile's own range.
CUTE_HOST_DEVICE QueryTiles query_tile_hull(QueryTiles a, QueryTiles b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  return {a.begin < b.begin ? a.begin : b.begin, a.end > b.end ? a.end : b.end};
}

template <int kBlockN, int kBlockM>
struct KeyTileMask {
  BandMask band;  // this sequence's lengths

  CUTE_DEVICE int64_t first_key(int n_block) const { return int64_t(n_block) * kBlockN; }
  CUTE_DEVICE int64_t last_key(int n_block) const {
    const int64_t end = first_key(n_block) + kBlockN;
    return (end < band.seqlen_k ? end : band.seqlen_k) - 1;
  }

  // The last key tile that query tile m sees: the one holding the last key its last row sees
  // (the key tiles that see m are contiguous and end there).
  CUTE_DEVICE int last_tile(int m) const {
    const int64_t last_row = cute::min(int64_t(m) * kBlockM + kBlockM, band.seqlen_q) - 1;
    const int64_t last_key = cute::min(band.key_end(last_row), band.seqlen_k) - 1;
    return int(last_key / kBlockN);
  }

  // Keys see queries in windows that only move down as the key grows, so the tile's queries lie
  // in [query_begin(first key), query_end(last key)).
  CUTE_DEVICE QueryTiles query_tiles(int n_block) const {
    int64_t lo = band.query_begin(first_key(n_block));
    int64_t hi = band.query_end(last_key(n_block));
    lo = lo < 0 ? 0 : lo;
    hi = hi > band.seqlen_q ? band.seqlen_q : hi;
    if (hi <= lo) return {};
    return {int(lo / kBlockM), int((hi + kBlockM - 1) / kBlockM)};
  }

  // The query tiles whose every (query, key) pair with this key tile is inside the band: a
  // contiguous range (the right side of the band bounds it below, the left side above), computed
  // once so that the tile loop holds two integers rather than the band.
  CUTE_DEVICE QueryTiles unmasked_tiles(int n_block) const {
    const int64_t n0 = first_key(n_block);
    const int64_t shift = band.seqlen_k - band.seqlen_q;
    QueryTiles t{0, INT32_MAX};
    if (n0 + kBlockN > band.seqlen_k) return {};  // partial: the keys past the end need the mask
    if (band.right >= 0) {
      // key_end(m0) ≥ n0 + kBlockN  ⇔  m0 ≥ n0 + kBlockN − 1 − shift − right
      const int64_t first = n0 + kBlockN - 1 - shift - band.right;
      t.begin = first <= 0 ? 0 : int((first + kBlockM - 1) / kBlockM);
    }
    if (band.left >= 0) {
      // key_begin(last row) ≤ n0  ⇔  last row ≤ n0 − shift + left, the last row being
      // min(m0 + kBlockM, seqlen_q) − 1
      const int64_t last = n0 - shift + band.left;
      if (last < band.seqlen_q - 1) {
        const int64_t m_max = last + 1 - kBlockM;  // m0 ≤ m_max
        t.end = m_max < 0 ? 0 : int(m_max / kBlockM) + 1;
      }
    }
    return t;
  }

  // Queries [lo, hi) that see the thread's first key; its other keys' bounds are these moved by
  // their (compile-time) row offsets. Three integers held through the tile loop, not two per row.
  // Clamped into [−kBlockN, seqlen_q], which keeps every comparison with a query in
  // [0, seqlen_q) as it was; an unbounded side becomes a bound no query crosses. `keys`: how many
  // of the thread's keys, from its first, exist (≤ 0: none).
  struct RowQueries {
    int lo, hi, keys;
  };
  template <class Coords>
  CUTE_DEVICE RowQueries row_queries(Coords const& coords, int n_block) const {
    const int64_t key = first_key(n_block) + cute::get<0>(coords(0, 0));
    const int64_t lowest = -kBlockN;
    auto clamp = [&](int64_t x) { return int(cute::max(cute::min(x, band.seqlen_q), lowest)); };
    return {band.right < 0 ? int(lowest) : clamp(band.query_begin(key)),
            band.left < 0 ? int(band.seqlen_q) : clamp(band.query_end(key)),
            int(cute::max(cute::min(band.seqlen_k - key, int64_t(kBlockN)), int64_t(0)))};
  }

  template <class Scores, class Coords>
  CUTE_DEVICE static void apply(Scores& scores, Coords const& coords, RowQueries queries,
                                int m_block) {
    constexpr int kRows = decltype(cute::size<0>(coords))::value;
    int lo[kRows], hi[kRows];
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int below = cute::get<0>(coords(i, 0)) - cute::get<0>(coords(0, 0));
      // A key past the sequence's end is seen by no query.
      lo[i] = below < queries.keys ? queries.lo + below : INT_MAX;
      hi[i] = queries.hi + below;
    }
    mask_outside_columns(scores, coords, lo, hi, m_block * kBlockM + cute::get<1>(coords(0, 0)));
  }
};

}  // namespace fa4::sm90
