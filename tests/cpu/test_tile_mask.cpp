// TileMask::visible_tiles (src/sm90/common/tile_mask.cuh): the forward skips the mask on the key tiles of that
// range, so it must hold exactly the tiles whose every key every row of the span sees. Checked
// against the band row by row (BandMask::key_range) for every key tile, over causal and windowed
// bands, query and key lengths on either side of each other and of the tile size, and the spans
// the kernel makes (TileRows, pack-GQA) as well as arbitrary ones, rows past the end included.
// And the backward's QueryOrder (src/sm90/bwd/bwd_mask.cuh): each key tile's walk over its query tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "sm90/bwd/bwd_mask.cuh"
#include "sm90/common/tile_mask.cuh"

namespace {

using fa4::BandMask;
using fa4::sm90::KeyTiles;
using fa4::sm90::QueryRows;
using fa4::sm90::TileMask;
using fa4::sm90::TileRows;

// Whether every position of [first, last] sees every key of tile n.
template <int kBlockN>
bool whole_tile_seen(BandMask const& band, int64_t first, int64_t last, int n) {
  const int64_t n0 = int64_t(n) * kBlockN;
  for (int64_t i = first; i <= last; ++i) {
    int64_t lo, hi;
    band.key_range(i, &lo, &hi);
    if (lo > n0 || hi < n0 + kBlockN) return false;
  }
  return true;
}

template <int kBlockN>
void expect_exact(TileMask<kBlockN> const& mask, typename TileMask<kBlockN>::Span span) {
  const BandMask& b = mask.band;
  const KeyTiles visible = mask.visible_tiles(span);
  const KeyTiles keys = mask.key_tiles(span);
  const int tiles = int((b.seqlen_k + kBlockN - 1) / kBlockN);
  for (int n = -2; n < tiles + 2; ++n) {
    const bool in_range = n >= visible.begin && n < visible.end;
    ASSERT_EQ(in_range, whole_tile_seen<kBlockN>(b, span.first, span.last, n))
        << "key tile " << n << " of " << tiles << ", visible [" << visible.begin << ", "
        << visible.end << "), rows [" << span.first << ", " << span.last << "], seqlen_q "
        << b.seqlen_q << " seqlen_k " << b.seqlen_k << " left " << b.left << " right " << b.right
        << " block_n " << kBlockN;
    // The kernel only visits the tile's key tiles.
    if (in_range) {
      ASSERT_TRUE(n >= keys.begin && n < keys.end) << "key tile " << n;
    }
  }
}

template <int kBlockN>
void check_band(int64_t sq, int64_t sk, bool causal, int64_t left, int64_t right) {
  // Folded as the launcher does, then per sequence as find_work does.
  const BandMask launch = BandMask::make(sq, sk, causal, left, right);
  const BandMask band = BandMask::make(sq, sk, false, launch.left, launch.right);

  // The spans of the kernel's query tiles, with and without pack-GQA.
  for (int group : {1, 3, 8}) {
    const TileMask<kBlockN> mask{band, QueryRows{cutlass::FastDivmod(group)}};
    const int64_t count = mask.rows.count(sq);
    for (int block_m : {64, 128, 192}) {
      for (bool short_first : {false, true}) {
        for (int m = 0; int64_t(m) * block_m < count + block_m; ++m) {
          const TileRows rows = TileRows::of(m, block_m, count, short_first);
          if (rows.empty()) continue;
          expect_exact(mask, mask.span(rows));
        }
      }
    }
  }

  // Any span: one row, many, and rows past the sequence's end.
  const TileMask<kBlockN> mask{band};
  for (int64_t first = 0; first < sq + 3; first += first < 4 ? 1 : 37) {
    for (int64_t rows : {1, 2, 64, 129, 300}) {
      expect_exact(mask, {first, first + rows - 1});
    }
  }
}

template <int kBlockN>
void check_all() {
  const std::vector<int64_t> lengths = {1, 7, 63, 64, 65, 128, 177, 300, 513};
  for (int64_t sq : lengths) {
    for (int64_t sk : {int64_t(0), int64_t(1), int64_t(kBlockN - 1), int64_t(kBlockN),
                       int64_t(kBlockN + 1), int64_t(3 * kBlockN), int64_t(130), int64_t(257),
                       int64_t(700)}) {
      for (bool causal : {false, true}) {
        for (int64_t left : {-1, 0, 1, 5, 64, 127, 200, 5000}) {
          for (int64_t right : {-1, 0, 1, 17, 128, 5000}) {
            if (causal && right > 0) continue;  // folded to 0
            check_band<kBlockN>(sq, sk, causal, left, right);
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(Sm90TileMask, VisibleTilesExact64) { check_all<64>(); }
TEST(Sm90TileMask, VisibleTilesExact96) { check_all<96>(); }
TEST(Sm90TileMask, VisibleTilesExact128) { check_all<128>(); }
TEST(Sm90TileMask, VisibleTilesExact176) { check_all<176>(); }

// Every key tile visits each of its query tiles once, in steps that wrap once, starting where
// make() puts it: the first tile without rotation; with it, n_block / blocks of the way along,
// so that key tiles with the same range start at different tiles where there are as many tiles.
// Without rotation compiled in, the walk is the plain one whatever make() is asked.
TEST(Sm90QueryOrder, PlainWithoutRotation) {
  using Plain = fa4::sm90::QueryOrder<false>;
  const fa4::sm90::QueryTiles tiles{3, 10};
  const Plain order = Plain::make(tiles, 5, 8, true);
  EXPECT_EQ(order.shift, 0);
  for (int step = tiles.begin; step < tiles.end; ++step) EXPECT_EQ(order.tile(step), step);
}

TEST(Sm90QueryOrder, EachTileOnceFromItsStart) {
  using QueryOrder = fa4::sm90::QueryOrder<true>;
  using fa4::sm90::QueryTiles;
  for (int begin : {0, 1, 5}) {
    for (int count : {0, 1, 2, 3, 7, 64, 65}) {
      const QueryTiles tiles{begin, begin + count};
      for (int blocks : {1, 2, 3, 64, 100}) {
        std::vector<int> starts;
        for (int n = 0; n < blocks; ++n) {
          for (bool rotate : {false, true}) {
            const QueryOrder order = QueryOrder::make(tiles, n, blocks, rotate);
            ASSERT_GE(order.shift, 0);
            ASSERT_LT(order.shift, count > 0 ? count : 1);
            EXPECT_EQ(order.shift, rotate && count > 1 ? n * count / blocks : 0);
            std::vector<int> seen(count, 0);
            for (int step = tiles.begin; step < tiles.end; ++step) {
              const int m = order.tile(step);
              ASSERT_TRUE(tiles.contains(m)) << m;
              ++seen[m - begin];
              // One wrap: from the last tile to the first, else the next tile.
              if (step > tiles.begin) {
                const int before = order.tile(step - 1);
                EXPECT_EQ(m, before + 1 == tiles.end ? tiles.begin : before + 1);
              }
            }
            EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), count);
            if (count > 0) EXPECT_EQ(order.tile(tiles.begin), begin + order.shift);
            if (rotate) starts.push_back(order.shift);
          }
        }
        // Distinct starts for the first min(count, blocks) tiles' worth of key tiles.
        std::sort(starts.begin(), starts.end());
        const int distinct =
            int(std::unique(starts.begin(), starts.end()) - starts.begin());
        EXPECT_EQ(distinct, count < 2 ? 1 : std::min(count, blocks)) << count << " " << blocks;
      }
    }
  }
}

// Key-tile pairs walk the hull of their two ranges (bwd_pair.cuh): every tile either key tile
// sees, nothing before the first or after the last, and one side's range when the other is empty.
TEST(Sm90QueryTileHull, BothRangesAndNothingBeyond) {
  using fa4::sm90::QueryTiles;
  const QueryTiles ranges[] = {{}, {0, 0}, {3, 3}, {0, 1}, {0, 5}, {2, 7}, {4, 9}, {7, 8}, {9, 12}};
  for (const QueryTiles& a : ranges) {
    for (const QueryTiles& b : ranges) {
      const QueryTiles h = fa4::sm90::query_tile_hull(a, b);
      if (a.empty() && b.empty()) {
        EXPECT_TRUE(h.empty());
        continue;
      }
      for (const QueryTiles& r : {a, b})
        for (int m = r.begin; m < r.end; ++m) EXPECT_TRUE(h.contains(m)) << m;
      const int lo = a.empty() ? b.begin : b.empty() ? a.begin : std::min(a.begin, b.begin);
      const int hi = a.empty() ? b.end : b.empty() ? a.end : std::max(a.end, b.end);
      EXPECT_EQ(h.begin, lo);
      EXPECT_EQ(h.end, hi);
    }
  }
}

// Adjacent key tiles' ranges under a causal band overlap or touch, so that the hull adds no
// tile neither sees (checked against the mask's own ranges at 64-key, 64-query tiles).
TEST(Sm90QueryTileHull, AdjacentKeyTilesLeaveNoGapUnderCausal) {
  using Mask = fa4::sm90::KeyTileMask<64, 64>;
  for (int64_t sq : {1, 63, 64, 300, 1000}) {
    for (int64_t sk : {2, 128, 256, 600, 1024}) {
      const Mask mask{fa4::BandMask::make(sq, sk, true, -1, -1)};
      const int blocks = int((sk + 63) / 64);
      for (int n = 0; n + 1 < blocks; n += 2) {
        const auto a = mask.query_tiles(n), b = mask.query_tiles(n + 1);
        if (a.empty() || b.empty()) continue;
        EXPECT_LE(b.begin, a.end) << sq << " " << sk << " " << n;
      }
    }
  }
}

}  // namespace
