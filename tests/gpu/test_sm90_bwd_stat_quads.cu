// The premise of stat_quad (src/sm90/bwd/bwd_scores.cuh), which the narrow backward kernel relies
// on without a check of its own: in its Sᵀ accumulator, each thread's query columns j = 4k … 4k + 3
// are c, c + 1, c + 8, c + 9 with c = (its first column) + 16·k, and its first column is
// 2·(thread mod 4). Those are the columns bwd_stat_slot stores as one quad. Layout algebra only: it
// runs on the host, with or without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "sm90/bwd/bwd_config.cuh"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/rowcol.hpp"

namespace fa4::sm90 {
namespace {

template <int kHeadDim>
void narrow() {
  using Config = BwdConfig<kHeadDim, cutlass::bfloat16_t>;
  using BlockN = Int<Config::kBlockN>;
  using BlockM = Int<Config::kBlockM>;
  typename Config::TiledMmaSdP mma;
  const std::string what = "d" + std::to_string(kHeadDim);
  for (int thread = 0; thread < Config::kMmaThreads; ++thread) {
    const auto coords = rowcol_view(
        mma.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<BlockN, BlockM>{})));
    const int first = get<1>(coords(0, 0));
    ASSERT_EQ(first, 2 * (thread % 4)) << what << ": thread " << thread;
    const int columns = int(size<1>(coords));
    ASSERT_EQ(columns % 4, 0) << what;
    ASSERT_EQ(columns * 4, Config::kBlockM) << what << ": every query column, in quads";
    for (int j = 0; j < columns; ++j) {
      const int c = get<1>(coords(0, j));
      constexpr int kInQuad[4] = {0, 1, 8, 9};
      ASSERT_EQ(c, first + 16 * (j / 4) + kInQuad[j % 4]) << what << ": thread " << thread;
      ASSERT_EQ(bwd_stat_slot(c), bwd_stat_slot(first) + 16 * (j / 4) + j % 4)
          << what << ": thread " << thread << ", column " << c;
    }
  }
}

TEST(BwdStatQuads, EachThreadsQueryColumnsAreTheStoredQuads) {
  narrow<64>();
  narrow<96>();
  narrow<128>();
}

}  // namespace
}  // namespace fa4::sm90
