// How the sm90 forward loads a paged cache's key tiles (src/sm90/cache/page_tiles.hpp): one TMA box
// per key tile where every page holds whole key tiles, one per 16-key piece where every page holds
// whole pieces (where the kernel's tile row has them; one per 64-key piece where pages and key
// tiles hold those, in the rows with a wide-pieces variant), row by row otherwise; a left pad
// rules out the boxes, since a sequence's tiles then start inside its first page.
#include <gtest/gtest.h>

#include <cstdint>

#include "sm90/cache/page_tiles.hpp"

namespace {

using fa4::Problem;
using fa4::sm90::key_load_of;
using fa4::sm90::KeyLoad;
using fa4::sm90::pages_hold_key_tiles;
using fa4::sm90::wide_key_pieces;

const int32_t kTable[1] = {0};
const int32_t kPads[1] = {0};

Problem paged(int64_t page_size, bool leftpad = false) {
  Problem p;
  p.kv_cache.page_table = kTable;
  p.kv_cache.page_size = page_size;
  if (leftpad) p.kv_cache.leftpad = kPads;
  return p;
}

TEST(Sm90PageTiles, ContiguousCachesLoadWholeTiles) {
  Problem p;
  p.kv_cache.leftpad = kPads;  // a cache, not paged: its rows are contiguous
  EXPECT_TRUE(pages_hold_key_tiles(p, 128));
  EXPECT_EQ(key_load_of(p, 128, true), KeyLoad::kTiles);
  EXPECT_EQ(key_load_of(Problem{}, 64, false), KeyLoad::kTiles);
}

TEST(Sm90PageTiles, PagesOfWholeTilesLoadTiles) {
  for (int64_t block_n : {64, 96, 128})
    for (int64_t tiles : {1, 2, 3}) {
      const Problem p = paged(block_n * tiles);
      EXPECT_EQ(key_load_of(p, block_n, true), KeyLoad::kTiles) << block_n << " " << tiles;
      EXPECT_EQ(key_load_of(p, block_n, false), KeyLoad::kTiles);
    }
}

TEST(Sm90PageTiles, PagesOfWholePiecesLoadPiecesWhereTheKernelHasThem) {
  // vLLM's 16, and every multiple of 16 that does not hold whole tiles of these widths.
  for (int64_t page : {16, 32, 48, 64, 80, 112, 160, 208}) {
    for (int64_t block_n : {64, 96, 128}) {
      const Problem p = paged(page);
      if (page % block_n == 0) continue;
      EXPECT_EQ(key_load_of(p, block_n, true), KeyLoad::kPieces) << page << " " << block_n;
      EXPECT_EQ(key_load_of(p, block_n, false), KeyLoad::kGather) << page << " " << block_n;
    }
  }
}

TEST(Sm90PageTiles, PagesOfWholeWidePiecesLoadWidePiecesWhereTilesHoldThem) {
  // Pages of 64 and 192 under 128-key tiles: 64-key pieces; not pages of 16, 32 or 96, nor
  // 160-key tiles (e4m3's d128 row).
  for (int64_t page : {64, 192, 320}) {
    EXPECT_EQ(key_load_of(paged(page), 128, true), KeyLoad::kPieces) << page;
    EXPECT_TRUE(wide_key_pieces(paged(page), 128)) << page;
    EXPECT_FALSE(wide_key_pieces(paged(page), 160)) << page;
  }
  for (int64_t page : {16, 32, 48, 96, 160})
    EXPECT_FALSE(wide_key_pieces(paged(page), 128)) << page;
}

TEST(Sm90PageTiles, OtherPagesAndLeftPadsGather) {
  // SGLang's page of one key, odd sizes, and sizes that are multiples of 8 but not of 16.
  for (int64_t page : {1, 7, 8, 24, 100, 129})
    EXPECT_EQ(key_load_of(paged(page), 128, true), KeyLoad::kGather) << page;
  // A left pad moves each sequence's first key inside its first page: no whole tiles, no pieces.
  for (int64_t page : {16, 64, 128, 256}) {
    EXPECT_FALSE(pages_hold_key_tiles(paged(page, true), 128)) << page;
    EXPECT_EQ(key_load_of(paged(page, true), 128, true), KeyLoad::kGather) << page;
  }
}

}  // namespace
