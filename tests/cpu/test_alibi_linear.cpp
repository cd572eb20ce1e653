// ALiBi's linear form (src/sm90/fwd/alibi_linear.hpp) against the bias itself, on every thread's
// scores of the forward's query tile as the kernel partitions them (two consumer warpgroups of
// m64 wgmmas, 128 and 96 keys): where apply_alibi_linear returns, each score plus its row's shift
// must equal the score plus −slope·|center − key| up to fp32 rounding, on every key up to the
// sequence's last, on tiles left and right of the rows' diagonals and on the diagonal's own tiles.
// The four threads of a row hold different shifts, which the softmax adds before reducing across
// them: checked too, so that a shift taken as the row's would fail here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/common/rowcol.hpp"
#include "sm90/fwd/alibi_linear.hpp"

namespace {

using namespace cute;
using fa4::sm90::AlibiRows;
using fa4::sm90::apply_alibi_linear;
using fa4::sm90::rowcol_view;

struct Counts {
  int linear_tiles = 0;  // thread-tiles that took the linear form (a non-zero shift)
  int rows_with_distinct_shifts = 0;  // rows whose quad held more than one shift
};

// Key tile n_block of a query tile whose row r has diagonal key center0 + r; every thread of the
// two warpgroups, scores drawn at random; keys past last_key are not compared (the mask's).
template <int kBlockN>
void check_tile(int n_block, int center0, int last_key, std::mt19937& rng, Counts& counts) {
  using BlockM = _128;
  using BlockN = Int<kBlockN>;
  auto mma = make_tiled_mma(
      GMMA::ss_op_selector<cutlass::bfloat16_t, cutlass::bfloat16_t, float,
                           Shape<_64, BlockN, _128>>(),
      Layout<Shape<_2, _1, _1>>{});
  std::uniform_real_distribution<float> score(-8.0f, 8.0f);
  std::uniform_real_distribution<float> slope(0.001f, 1.5f);
  // Slopes by row, so that the four threads of a row agree (as the kernel's rows do).
  float slopes[BlockM::value];
  for (float& s : slopes) s = slope(rng);
  // Each row's shifts, per quad (row → set of shifts), to see them differ.
  std::set<float> shifts[BlockM::value];
  for (int thread = 0; thread < 256; ++thread) {
    auto coords = rowcol_view(
        mma.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<BlockM, BlockN>{})));
    constexpr int kRows = decltype(size<0>(coords))::value;
    static_assert(kRows == 2, "an m64 accumulator: two rows per thread");
    Tensor scores = make_tensor<float>(shape(coords));
    Tensor given = make_tensor<float>(shape(coords));
    for (int i = 0; i < size<0>(coords); ++i)
      for (int j = 0; j < size<1>(coords); ++j) given(i, j) = scores(i, j) = score(rng);
    AlibiRows<kRows> rows;
    for (int i = 0; i < kRows; ++i) {
      const int r = get<0>(coords(i, 0));
      rows.slope[i] = slopes[r];
      rows.center[i] = center0 + r;
    }
    const auto shift = apply_alibi_linear<kBlockN>(scores, coords, rows, n_block, last_key);
    bool linear = false;
    for (int i = 0; i < kRows; ++i) {
      linear |= shift.c[i] != 0.0f;
      shifts[get<0>(coords(i, 0))].insert(shift.c[i]);
      for (int j = 0; j < size<1>(coords); ++j) {
        const int key = n_block * kBlockN + get<1>(coords(i, j));
        if (key > last_key) continue;
        const double bias = -double(rows.slope[i]) * std::abs(double(rows.center[i] - key));
        const double want = double(given(i, j)) + bias;
        const double got = double(scores(i, j)) + double(shift.c[i]);
        // A few fp32 roundings of values up to |score| + |bias| (the linear form: the product
        // and the FFMA of the offset, the shift's product; the diagonal's: the distance and the
        // FFMA).
        const double tol = 4.0 * std::ldexp(1.0, -24) *
                           (std::abs(double(given(i, j))) + std::abs(bias) +
                            std::abs(double(shift.c[i])) + 1.0);
        ASSERT_NEAR(got, want, tol) << "thread " << thread << " row " << get<0>(coords(i, j))
                                    << " key " << key << " tile " << n_block << " center "
                                    << rows.center[i] << " shift " << shift.c[i];
      }
    }
    counts.linear_tiles += linear ? 1 : 0;
  }
  for (const auto& s : shifts) counts.rows_with_distinct_shifts += s.size() > 1 ? 1 : 0;
}

template <int kBlockN>
void check_all(uint32_t seed) {
  std::mt19937 rng(seed);
  Counts counts;
  // Query tiles whose diagonals lie far right of the key tile (a causal row's earlier keys), far
  // left (a bidirectional row's later keys), and across it; decode-like tiles whose last key cuts
  // the key tile; long sequences (keys near 2^20).
  for (int center0 : {-300, -127, -1, 0, 5, 64, kBlockN - 1, kBlockN, 1000, (1 << 20) - 77})
    for (int n_block : {0, 1, 3, 7})
      for (int last_key : {1 << 30, (n_block + 1) * kBlockN - 1, n_block * kBlockN + 17})
        check_tile<kBlockN>(n_block, center0, last_key, rng, counts);
  EXPECT_GT(counts.linear_tiles, 1000) << "the linear form was hardly reached";
  EXPECT_GT(counts.rows_with_distinct_shifts, 100)
      << "the threads of a row should hold different shifts (their first keys differ)";
}

TEST(Sm90AlibiLinear, MatchesTheBiasOnEveryThreadOf128KeyTiles) { check_all<128>(1); }
TEST(Sm90AlibiLinear, MatchesTheBiasOnEveryThreadOf96KeyTiles) { check_all<96>(2); }

}  // namespace
