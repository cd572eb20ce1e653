// The forward's query rows per tile (src/sm90/fwd/tile_rows.hpp): every row of a sequence stored by
// exactly one tile, boxes that never start above row 0, the plain tiling without the short tile
// first, and what the short tile first saves under a causal diagonal.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "sm90/fwd/tile_rows.hpp"

namespace {

using fa4::sm90::TileRows;

int tiles_for(int64_t count, int block_m) { return int((count + block_m - 1) / block_m); }

TEST(Sm90TileRows, EveryRowStoredOnceAndEveryBoxInsideTheSequence) {
  for (int block_m : {64, 128, 192}) {
    for (bool short_first : {false, true}) {
      for (int64_t count = 0; count <= 5 * block_m + 7; ++count) {
        std::vector<int> stored(size_t(count), 0);
        const int tiles = tiles_for(count, block_m);
        for (int m = 0; m < tiles + 2; ++m) {
          const TileRows t = TileRows::of(m, block_m, count, short_first);
          if (m >= tiles) {
            EXPECT_TRUE(t.empty()) << "tile " << m << " past the last of " << count << " rows";
            continue;
          }
          ASSERT_FALSE(t.empty()) << "tile " << m << " of " << count << " rows";
          EXPECT_GE(t.first, 0);  // no box starts above row 0
          EXPECT_LE(t.end, count);
          EXPECT_LE(t.end - t.first, block_m);  // the rows it stores lie in its box
          for (int r = t.first; r < t.end; ++r) ++stored[size_t(r)];
        }
        for (int64_t r = 0; r < count; ++r)
          ASSERT_EQ(stored[size_t(r)], 1) << "row " << r << " of " << count << ", block "
                                          << block_m << (short_first ? ", short first" : "");
      }
    }
  }
}

TEST(Sm90TileRows, WithoutTheShortTileFirstTheTilingIsPlain) {
  for (int64_t count : {1, 191, 192, 193, 4096}) {
    for (int m = 0; m < tiles_for(count, 192); ++m) {
      const TileRows t = TileRows::of(m, 192, count, false);
      EXPECT_EQ(t.first, m * 192);
      EXPECT_EQ(t.end, count < (m + 1) * 192 ? count : (m + 1) * 192);
      EXPECT_FALSE(t.box_overlaps_next(192, count));
    }
  }
}

TEST(Sm90TileRows, TheShortTileComesFirstAndOnlyItsBoxOverlaps) {
  const int block_m = 192;
  const int64_t count = 4096;  // 21⅓ tiles: the short one holds 64 rows
  const int tiles = tiles_for(count, block_m);
  const TileRows first = TileRows::of(0, block_m, count, true);
  EXPECT_EQ(first.first, 0);
  EXPECT_EQ(first.end, 64);
  EXPECT_TRUE(first.box_overlaps_next(block_m, count));
  for (int m = 1; m < tiles; ++m) {
    const TileRows t = TileRows::of(m, block_m, count, true);
    EXPECT_EQ(t.end - t.first, block_m);
    EXPECT_FALSE(t.box_overlaps_next(block_m, count));
  }
  EXPECT_EQ(TileRows::of(tiles - 1, block_m, count, true).end, count);
  // One tile that the sequence only partly fills holds no other tile's rows.
  const TileRows single = TileRows::of(0, block_m, 100, true);
  EXPECT_EQ(single.first, 0);
  EXPECT_EQ(single.end, 100);
  EXPECT_FALSE(single.box_overlaps_next(block_m, 100));
}

// A warpgroup's 64-row slice of a tile's box: only a slice that reaches past the stored rows of a
// sequence's short first tile overlaps the next tile.
TEST(Sm90TileRows, OnlyTheSlicesPastTheShortTileOverlap) {
  const int block_m = 128;
  for (int64_t count : {int64_t(4096 - 32), int64_t(4096 - 64), int64_t(4096 - 96)}) {
    const TileRows first = TileRows::of(0, block_m, count, true);
    const int stored = first.end - first.first;  // 96, 64 or 32 rows
    EXPECT_EQ(first.slice_overlaps_next(0, 64, count), stored < 64) << count;
    EXPECT_TRUE(first.slice_overlaps_next(64, 64, count)) << count;
    const TileRows second = TileRows::of(1, block_m, count, true);
    EXPECT_FALSE(second.slice_overlaps_next(0, 64, count)) << count;
    EXPECT_FALSE(second.slice_overlaps_next(64, 64, count)) << count;
  }
  // The last tile of a sequence without a short first tile: its slices end at the sequence's end.
  const TileRows last = TileRows::of(1, block_m, 200, false);
  EXPECT_FALSE(last.slice_overlaps_next(0, 64, 200));
  EXPECT_FALSE(last.slice_overlaps_next(64, 64, 200));
}

// Key tiles of a causal head with seqlen_q = seqlen_k: a tile needs the keys up to its last
// stored row.
int causal_key_tiles(int64_t count, int block_m, int block_n, bool short_first) {
  int total = 0;
  for (int m = 0; m < tiles_for(count, block_m); ++m) {
    const TileRows t = TileRows::of(m, block_m, count, short_first);
    total += int((t.end + block_n - 1) / block_n);
  }
  return total;
}

TEST(Sm90TileRows, TheShortTileFirstNeverCostsMoreUnderACausalDiagonal) {
  for (int64_t count = 1; count <= 2048; ++count)
    ASSERT_LE(causal_key_tiles(count, 192, 128, true), causal_key_tiles(count, 192, 128, false))
        << count;
  EXPECT_EQ(causal_key_tiles(4096, 192, 128, false), 384);
  EXPECT_EQ(causal_key_tiles(4096, 192, 128, true), 363);
}

}  // namespace
