// Takes turns between the two consumer warpgroups when issuing their GEMMs, so that one
// warpgroup's softmax runs while the other's wgmma occupy the tensor cores (FA3's ping-pong).
// Each warpgroup waits on its own named barrier, which the other warpgroup arrives at after
// issuing; the first warpgroup starts by arriving at its own barrier.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/named_barriers.cuh"

namespace fa4::sm90 {

class WarpgroupTurns {
 public:
  static constexpr uint32_t kThreads = 2 * 128;  // the waiting warpgroup + the arriving one

  CUTE_DEVICE explicit WarpgroupTurns(int consumer_warpgroup) : wg_(consumer_warpgroup) {}

  CUTE_DEVICE void start() const {
    if (wg_ == 0) cutlass::arch::NamedBarrier::arrive(kThreads, barrier(0));
  }
  CUTE_DEVICE void wait() const { cutlass::arch::NamedBarrier::sync(kThreads, barrier(wg_)); }
  // After its last turn the second warpgroup does not pass on: nobody would wait for it, and an
  // arrival nobody consumes would be left pending at exit.
  CUTE_DEVICE void pass(bool last = false) const {
    if (last && wg_ == 1) return;
    cutlass::arch::NamedBarrier::arrive(kThreads, barrier(1 - wg_));
  }

 private:
  CUTE_DEVICE static uint32_t barrier(int wg) {
    return uint32_t(wg == 0 ? ConsumerBarrier::kTurn0 : ConsumerBarrier::kTurn1);
  }
  int wg_;
};

}  // namespace fa4::sm90
