// Takes turns between the consumer warpgroups (two or three; one alone has nobody to wait for) when
// issuing their GEMMs, so that one warpgroup's softmax runs while another's wgmma occupy the tensor
// cores (FA3's ping-pong, round robin with three). Each warpgroup waits on its own named barrier,
// which the previous warpgroup arrives at after issuing; the first warpgroup starts by arriving at
// its own barrier. All take the same number of turns per tile, so the order carries over from one
// tile to the next.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/named_barriers.cuh"

namespace fa4::sm90 {

template <int kWarpgroups>
class WarpgroupTurns {
  // One warpgroup (the narrow variant) takes every turn itself: the turns are no-ops.
  static_assert(kWarpgroups >= 1 && kWarpgroups <= 3, "one named barrier per warpgroup below");

 public:
  static constexpr uint32_t kThreads = 2 * 128;  // the waiting warpgroup + the arriving one

  CUTE_DEVICE explicit WarpgroupTurns(int consumer_warpgroup) : wg_(consumer_warpgroup) {}

  CUTE_DEVICE void start() const {
    if constexpr (kWarpgroups > 1)
      if (wg_ == 0) cutlass::arch::NamedBarrier::arrive(kThreads, barrier(0));
  }
  CUTE_DEVICE void wait() const {
    if constexpr (kWarpgroups > 1) cutlass::arch::NamedBarrier::sync(kThreads, barrier(wg_));
  }
  CUTE_DEVICE void pass() const {
    if constexpr (kWarpgroups > 1)
      cutlass::arch::NamedBarrier::arrive(kThreads, barrier((wg_ + 1) % kWarpgroups));
  }
  // Turns go on across tiles. Warpgroup 0's barrier ends with one arrival more than it waited for
  // (start's, or the last warpgroup's last pass): consume it, so that no arrival is left pending
  // when the CTA exits.
  CUTE_DEVICE void finish() const {
    if constexpr (kWarpgroups > 1)
      if (wg_ == 0) wait();
  }

 private:
  CUTE_DEVICE static uint32_t barrier(int wg) {
    return uint32_t(wg == 0 ? ConsumerBarrier::kTurn0
                    : wg == 1 ? ConsumerBarrier::kTurn1 : ConsumerBarrier::kTurn2);
  }
  int wg_;
};

}  // namespace fa4::sm90
