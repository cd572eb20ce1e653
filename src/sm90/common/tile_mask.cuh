// The band mask (causal / sliding window, bottom-right aligned, and the end of the keys) applied to
// one (query tile, key tile) pair of scores. The rule itself is BandMask from common/mask.hpp, the
// one the CPU backend uses; this piece only decides which tiles need it and writes the −inf.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "common/mask.hpp"
#include "sm90/fwd/query_rows.cuh"
#include "sm90/fwd/tile_rows.hpp"

namespace fa4::sm90 {

// Tiles [begin, end) of one side of the score matrix (key tiles or query tiles).
struct TileRange {
  int begin = 0;
  int end = 0;
  CUTE_HOST_DEVICE bool empty() const { return end <= begin; }
  CUTE_HOST_DEVICE int count() const { return end - begin; }
  CUTE_HOST_DEVICE bool contains(int tile) const { return tile >= begin && tile < end; }
};
// Key tiles a query tile has to visit; empty when no row of the tile sees a key.
using KeyTiles = TileRange;

// Sets scores(i, j) to −inf unless column col0 + j' lies in [lo[i], hi[i]), where j' is column j's
// offset from the thread's first column. `coords` is the (rows, cols) view of the tile's identity
// tensor as this thread holds it. Columns are compared relative to the thread's first one: the
// offsets are then compile-time constants, where absolute columns would be hoisted out of the
// tile loop as one register each.
template <class Scores, class Coords>
CUTE_DEVICE void mask_outside_columns(Scores& scores, Coords const& coords, int const* lo,
                                      int const* hi, int col0) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size<0>(scores); ++i) {
    const int col_lo = lo[i] - col0;
    const int col_hi = hi[i] - col0;
    CUTE_UNROLL
    for (int j = 0; j < cute::size<1>(scores); ++j) {
      const int col = cute::get<1>(coords(0, j)) - cute::get<1>(coords(0, 0));
      if (col < col_lo || col >= col_hi) scores(i, j) = -INFINITY;
    }
  }
}

template <int kBlockN>
struct TileMask {
  BandMask band;     // seqlen_k is the number of keys used (seqused_k applied)
  QueryRows rows{};  // tile row → query position (pack-GQA); identity by default

  // The positions of the first and the last row a tile stores (rows past them are computed but
  // never stored: padding past the sequence's end, or the next tile's rows: TileRows); rows hold
  // non-decreasing positions. Made once per tile.
  struct Span {
    int64_t first, last;
  };
  CUTE_HOST_DEVICE Span span(TileRows tile) const {
    return {rows.position(tile.first), rows.position(tile.end - 1)};
  }

  // Rows see keys in windows that only move right as the row grows, so the tile's keys lie in
  // [begin(first row), end(last row)).
  CUTE_HOST_DEVICE KeyTiles key_tiles(Span tile) const {
    int64_t lo = band.key_begin(tile.first);
    int64_t hi = band.key_end(tile.last);
    lo = lo < 0 ? 0 : lo;
    hi = hi > band.seqlen_k ? band.seqlen_k : hi;
    if (hi <= lo) return {};
    return {int(lo / kBlockN), int((hi + kBlockN - 1) / kBlockN)};
  }

  // The key tiles every stored row sees whole, so that they need no mask: a contiguous range
  // (the last row's left side bounds it below; the first row's right side and the end of the keys
  // above), computed once per query tile so that the tile loop compares two ints rather than
  // evaluating the band in 64 bits per key tile.
  CUTE_HOST_DEVICE KeyTiles visible_tiles(Span tile) const {
    // key_begin(last) ≤ n·B  ⇔  n ≥ ceil(key_begin(last) / B); n ≥ 0 covers a bound ≤ 0.
    const int64_t lo = band.key_begin(tile.last);
    const int64_t begin = lo <= 0 ? 0 : (lo + kBlockN - 1) / kBlockN;
    // n·B + B ≤ min(key_end(first), seqlen_k)  ⇔  n < floor(hi / B); a bound < B truncates to
    // end ≤ 0 ≤ begin: no tile.
    const int64_t hi = cute::min(band.key_end(tile.first), band.seqlen_k);
    const int64_t end = hi / kBlockN;
    if (end <= begin) return {};
    return {int(begin), int(end)};  // 0 ≤ begin < end ≤ seqlen_k / B: both fit an int
  }

  // Keys [lo, hi) of each of the thread's rows, clamped to [0, seqlen_k] (lo ≥ hi: no key). They do
  // not depend on the key tile, so they are computed once per query tile, in 32 bits.
  template <int kRows>
  struct RowKeys {
    int lo[kRows];
    int hi[kRows];
  };

  // `coords`: the (rows, cols) view of the score tile's identity tensor as this thread holds it;
  // `first_row`: the tile's row 0 in its sequence (TileRows::first).
  template <class Coords>
  CUTE_DEVICE auto row_keys(Coords const& coords, int64_t first_row) const {
    constexpr int kRows = decltype(cute::size<0>(coords))::value;
    RowKeys<kRows> keys;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      int64_t lo, hi;
      band.key_range(rows.position(first_row + cute::get<0>(coords(i, 0))), &lo, &hi);
      // Clamping to [0, seqlen_k] keeps lo ≥ hi for a row that sees no key.
      keys.lo[i] = int(cute::min(lo, band.seqlen_k));
      keys.hi[i] = int(cute::max(hi, int64_t(0)));
    }
    return keys;
  }

  // Sets the scores of keys a row may not see to −inf. `scores` is a (rows, cols) fragment view,
  // `coords` the same view of the tile's identity tensor.
  template <class Scores, class Coords, class Keys>
  CUTE_DEVICE void apply(Scores& scores, Coords const& coords, Keys const& keys,
                         int n_block) const {
    mask_outside_columns(scores, coords, keys.lo, keys.hi,
                         n_block * kBlockN + cute::get<1>(coords(0, 0)));
  }
};

}  // namespace fa4::sm90
