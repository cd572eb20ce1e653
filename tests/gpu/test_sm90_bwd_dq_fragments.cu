// The fragment order of dQ's accumulator (DqFragments, src/sm90/bwd/bwd_workspace.hpp), which the
// dQ finish kernel reads back without a check of its own: for every config that stages dQ in that
// order (BwdDqFragments), value v of MMA thread t of the tiled dQ wgmma, at (row, column) of the
// query tile, is staged at the float the order gives that (row, column), and the tile's values
// fill its block exactly once. Layout algebra only: it runs on the host, with or without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sm90/bwd/bwd_config.cuh"
#include "sm90/bwd/bwd_dq_reduce.cuh"

namespace fa4::sm90 {
namespace {

template <int kHeadDim>
void fragments() {
  using Config = BwdConfig<kHeadDim, cutlass::bfloat16_t>;
  static_assert(Config::kDqFragments);
  using Reduce = BwdDqReduce<Config>;
  const DqFragments order = Reduce::fragments();
  const std::string what = "d" + std::to_string(kHeadDim);
  ASSERT_TRUE(order.enabled()) << what;
  typename Config::TiledMmaQ mma;
  std::vector<int> hits(size_t(Config::kBlockM) * Config::kDqDim, 0);
  for (int thread = 0; thread < Config::kMmaThreads; ++thread) {
    const auto coords = mma.get_thread_slice(thread).partition_C(
        make_identity_tensor(Shape<Int<Config::kBlockM>, Int<Config::kDqDim>>{}));
    ASSERT_EQ(int(size(coords)) * 128, Reduce::kPartFloats) << what;
    for (int v = 0; v < int(size(coords)); ++v) {
      const int r = get<0>(coords(v)), c = get<1>(coords(v));
      // Where BwdDqFragments::stage puts the value.
      const int staged = thread / 128 * Reduce::kPartFloats + v / 4 * 512 + 4 * (thread % 128) + v % 4;
      ASSERT_EQ(order.offset(r, c), staged)
          << what << ": thread " << thread << ", value " << v << " at (" << r << ", " << c << ")";
      ++hits[size_t(staged)];
    }
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << what << ": float " << i;
}

TEST(BwdDqFragments, StagedWhereTheFinishKernelReads) {
  fragments<64>();
  fragments<96>();
  fragments<128>();
}

}  // namespace
}  // namespace fa4::sm90
