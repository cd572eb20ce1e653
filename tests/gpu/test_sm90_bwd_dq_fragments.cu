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

template <class Config>
void check(const std::string& what) {
  using Reduce = BwdDqReduce<Config>;
  const DqFragments order = Reduce::fragments();
  ASSERT_TRUE(order.enabled()) << what;
  typename Config::TiledMmaQ mma;
  std::vector<int> hits(size_t(Config::kBlockM) * Config::kDqDim, 0);
  for (int thread = 0; thread < Config::kMmaThreads; ++thread) {
    const auto coords = mma.get_thread_slice(thread).partition_C(
        make_identity_tensor(Shape<Int<Config::kBlockM>, Int<Config::kDqDim>>{}));
    ASSERT_EQ(int(size(coords)) * 128, Reduce::kPartFloats) << what;
    for (int v = 0; v < int(size(coords)); ++v) {
      const int r = get<0>(coords(v)), c = get<1>(coords(v));
      const int staged = Reduce::staged_at(thread, v);  // where BwdDqFragments::stage puts it
      ASSERT_EQ(order.offset(r, c), staged)
          << what << ": thread " << thread << ", value " << v << " at (" << r << ", " << c << ")";
      ++hits[size_t(staged)];
    }
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << what << ": float " << i;
}

template <int kHeadDim>
void fragments() {
  using Config = BwdConfig<kHeadDim, cutlass::bfloat16_t>;
  // d64 built with FA4_SM90_BWD_DQ_ROWS=0 (128-row parts) stages by rows.
  if constexpr (Config::kDqFragments) check<Config>("d" + std::to_string(kHeadDim));
}

TEST(BwdDqFragments, StagedWhereTheFinishKernelReads) {
  fragments<64>();
  fragments<96>();
  fragments<128>();
}

}  // namespace
}  // namespace fa4::sm90
