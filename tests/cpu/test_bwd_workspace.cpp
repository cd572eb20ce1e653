// The sm90 backward's stat-row layout (src/sm90/bwd/bwd_workspace.hpp), host side: the main kernel reads
// a query tile's LSE and D with no bounds check, so every tile it reads must lie in its sequence's
// rows or in that sequence's pad, and no pad may reach into the next sequence's rows. And the dQ
// accumulator's column order: a permutation within each swizzle atom under which the staging's
// 8-byte stores are free of bank conflicts. And the stats' order within 16-row blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "sm90/bwd/bwd_workspace.hpp"

namespace {

using fa4::sm90::bwd_block_m;
using fa4::sm90::dq_accum_flip;
using fa4::sm90::bwd_padded_stat_rows;
using fa4::sm90::bwd_stat_row;
using fa4::sm90::bwd_stat_rows;
using fa4::sm90::bwd_stat_slot;
using fa4::sm90::kBwdStatAlign;

// Sequence b's rows start at starts[b] and number lens[b] (packed query rows).
void expect_disjoint_padded_regions(const std::vector<int64_t>& starts,
                                    const std::vector<int64_t>& lens) {
  const int64_t batch = int64_t(starts.size());
  const int64_t rows = batch == 0 ? 0 : starts.back() + lens.back();
  const int64_t total = bwd_stat_rows(rows, batch);
  EXPECT_EQ(total % kBwdStatAlign, 0) << "each head's stat rows must start aligned";
  int64_t end_of_previous = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = bwd_stat_row(starts[b], b);
    const int64_t padded = bwd_padded_stat_rows(lens[b]);
    ASSERT_EQ(first % kBwdStatAlign, 0) << "sequence " << b;
    ASSERT_GE(padded, lens[b]);
    ASSERT_LT(padded, lens[b] + kBwdStatAlign);
    ASSERT_GE(first, end_of_previous) << "sequence " << b << " starts inside the previous pad";
    // Every tile the main kernel reads, at every head dim's tile height, stays in [first, end).
    for (int hdim : {64, 96, 128, 192, 256}) {
      const int block_m = bwd_block_m(hdim);
      ASSERT_EQ(kBwdStatAlign % block_m, 0);
      const int64_t tiles = (lens[b] + block_m - 1) / block_m;
      ASSERT_LE(tiles * block_m, padded) << "hdim " << hdim << ", sequence " << b;
    }
    end_of_previous = first + padded;
  }
  EXPECT_LE(end_of_previous, total);
}

TEST(BwdWorkspace, FixedLengthSequencesAndTheirPadsAreDisjoint) {
  for (int64_t seqlen : {1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4096}) {
    for (int64_t batch : {1, 2, 3, 7}) {
      std::vector<int64_t> starts, lens;
      for (int64_t b = 0; b < batch; ++b) {
        starts.push_back(b * seqlen);
        lens.push_back(seqlen);
      }
      SCOPED_TRACE("seqlen " + std::to_string(seqlen) + ", batch " + std::to_string(batch));
      expect_disjoint_padded_regions(starts, lens);
    }
  }
}

TEST(BwdWorkspace, VarlenSequencesAndTheirPadsAreDisjoint) {
  std::mt19937_64 rng(20261129);
  // Lengths near the alignment's multiples, zeros and ones are where an off-by-one would show.
  const std::vector<int64_t> picks = {0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 383};
  for (int trial = 0; trial < 2000; ++trial) {
    const int batch = 1 + int(rng() % 12);
    std::vector<int64_t> starts, lens;
    int64_t at = 0;
    for (int b = 0; b < batch; ++b) {
      const int64_t len = trial % 2 == 0 ? picks[rng() % picks.size()] : int64_t(rng() % 700);
      starts.push_back(at);
      lens.push_back(len);
      at += len;
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    expect_disjoint_padded_regions(starts, lens);
    if (HasFatalFailure()) return;
  }
}

// The staging's bank pattern, modelled: wgmma's accumulator gives lane l of a warp rows ≡ l / 4
// (mod 8) and the column pair 2 (l mod 4) of each 8-column block; a warp's 8-byte store is served
// per half-warp, and a half-warp's store takes as many wavefronts as the most 4-byte words any one
// bank receives. The tile's swizzle (TMA / GMMA 128- or 64-byte atom of floats) maps 16-byte chunk c
// of row r to c ^ (r mod 8) in 128-byte rows, to c ^ (r / 2 mod 4) in 64-byte rows.
int half_warp_wavefronts(int atom, int block, int half, bool flipped) {
  std::vector<std::set<int>> words(32);
  for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
    const int r = lane / 4, c = 8 * block + 2 * (lane % 4);
    const int col = flipped ? c ^ dq_accum_flip(r, atom) : c;
    int byte = (r * atom + col) * 4;
    const int bits = atom == 32 ? 3 : 2;
    byte ^= ((byte >> 7) & ((1 << bits) - 1)) << 4;
    for (int w : {byte / 4, byte / 4 + 1}) words[w % 32].insert(w);
  }
  size_t most = 0;
  for (auto const& bank : words) most = std::max(most, bank.size());
  return int(most);
}

TEST(Sm90BackwardWorkspace, DqAccumOrderIsConflictFree) {
  for (int atom : {32, 16}) {
    for (int64_t row = 0; row < 64; ++row) {
      // A permutation of the atom's 8-column blocks, the same for rows 8 apart.
      std::set<int> blocks;
      for (int c = 0; c < atom; c += 8) {
        const int to = c ^ dq_accum_flip(row, atom);
        EXPECT_TRUE(to >= 0 && to < atom && to % 8 == 0) << atom << " " << row << " " << c;
        blocks.insert(to);
      }
      EXPECT_EQ(int(blocks.size()), atom / 8) << atom << " " << row;
      EXPECT_EQ(dq_accum_flip(row, atom), dq_accum_flip(row + 8, atom));
    }
    for (int block = 0; block < atom / 8; ++block) {
      for (int half = 0; half < 2; ++half) {
        // 16 lanes × 8 bytes: one wavefront is the least, and the flip reaches it ...
        EXPECT_EQ(half_warp_wavefronts(atom, block, half, true), 1) << atom << " " << block;
        // ... where the natural order takes two (the conflict the flip is there for).
        EXPECT_EQ(half_warp_wavefronts(atom, block, half, false), 2) << atom << " " << block;
      }
    }
  }
  EXPECT_EQ(dq_accum_flip(5, 0), 0);  // natural order
}

// Stat rows are stored in 16-row blocks in the narrow kernel's column order: a permutation of each
// block (so a tile of whole blocks holds its own rows), with a thread's columns 2q, 2q + 1, 2q + 8,
// 2q + 9 at 4q … 4q + 3 (one 16-byte load), and each quarter-warp's four loads contiguous.
TEST(BwdWorkspace, StatSlotsPermuteEachBlockIntoQuads) {
  for (int64_t block : {int64_t(0), int64_t(16), int64_t(4096), (int64_t(1) << 33) + 48}) {
    std::set<int64_t> slots;
    for (int64_t r = block; r < block + 16; ++r) {
      const int64_t slot = bwd_stat_slot(r);
      ASSERT_GE(slot, block);
      ASSERT_LT(slot, block + 16);
      slots.insert(slot);
    }
    EXPECT_EQ(slots.size(), 16u) << "block " << block;
    for (int q = 0; q < 4; ++q) {
      const int64_t first = block + 2 * q;
      EXPECT_EQ(bwd_stat_slot(first), block + 4 * q);
      EXPECT_EQ(bwd_stat_slot(first + 1), block + 4 * q + 1);
      EXPECT_EQ(bwd_stat_slot(first + 8), block + 4 * q + 2);
      EXPECT_EQ(bwd_stat_slot(first + 9), block + 4 * q + 3);
    }
  }
  EXPECT_EQ(bwd_stat_slot(int32_t(18)), 20);  // the kernels' 32-bit form
}

}  // namespace
