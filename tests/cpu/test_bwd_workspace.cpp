// The sm90 backward's stat-row layout (src/sm90/bwd_workspace.hpp), host side: the main kernel reads
// a query tile's LSE and D with no bounds check, so every tile it reads must lie in its sequence's
// rows or in that sequence's pad, and no pad may reach into the next sequence's rows.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "sm90/bwd_workspace.hpp"

namespace {

using fa4::sm90::bwd_block_m;
using fa4::sm90::bwd_padded_stat_rows;
using fa4::sm90::bwd_stat_row;
using fa4::sm90::bwd_stat_rows;
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

}  // namespace
