// The premise of AccumulatorStore (src/sm90/common/wgmma.cuh), which the narrow backward kernel relies on
// without a check of its own: every thread's stmatrix stores lie at thread 0's offsets from its
// first, for the shared-memory tile it stores dS into. Layout algebra only: it runs on the host,
// with or without a GPU. (The wide kernel's P and dS tiles break the premise: it stores them with
// store_accumulator.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "sm90/bwd/bwd_config.cuh"
#include "sm90/common/wgmma.cuh"

namespace fa4::sm90 {
namespace {

template <class Config, class StoreOp, class TileLayout>
void expect_offsets_shared(TileLayout layout, const std::string& what) {
  using Element = typename Config::Element;
  using Store = AccumulatorStore<StoreOp, typename Config::TiledMmaSdP, Element>;
  // Where the tile would be: only addresses are formed. 1024-byte aligned, as the kernels' shared
  // memory is (the swizzle acts on address bits).
  const size_t bytes = (size_t(cosize(layout)) * sizeof(Element) + 1023) / 1024 * 1024;
  std::unique_ptr<void, decltype(&std::free)> tile(std::aligned_alloc(1024, bytes), &std::free);
  ASSERT_NE(tile, nullptr);
  for (int thread = 0; thread < Config::kMmaThreads; ++thread)
    ASSERT_TRUE(Store::offsets_shared(thread, static_cast<Element*>(tile.get()), layout))
        << what << ": thread " << thread;
}

// The narrow kernel (d ≤ 128) stores dS transposed, one stage of two at a time.
template <int kHeadDim>
void narrow() {
  using Config = BwdConfig<kHeadDim, cutlass::bfloat16_t>;
  expect_offsets_shared<Config, SM90_U16x8_STSM_T>(typename Config::SmemLayoutDst{}(_, _, 0),
                                                   "d" + std::to_string(kHeadDim) + " dS");
}

TEST(AccumulatorStore, EveryThreadStoresAtThreadZerosOffsets) {
  narrow<64>();
  narrow<96>();
  narrow<128>();
}

}  // namespace
}  // namespace fa4::sm90
