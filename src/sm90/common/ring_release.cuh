// The consumers' release of a TMA ring's stage. CUTLASS's PipelineTmaAsync, in a cluster of one
// CTA, counts one arrival per consumer thread on a stage's empty barrier and has every thread
// arrive (256 arrivals per stage and ring at d128, 384 at d64). The compile-time variant
// FA4_SM90_WARP_ARRIVALS=1 counts consumer warps instead, and each warp's elected lane arrives once
// its lanes are done with the stage (32 times fewer arrivals; FlashAttention-3 arrives once per
// warpgroup). It is off until its A/B against the default has been measured on the device.
#pragma once

#include <cstdint>

#include <cute/arch/util.hpp>
#include <cute/config.hpp>

#ifndef FA4_SM90_WARP_ARRIVALS
#define FA4_SM90_WARP_ARRIVALS 0
#endif

namespace fa4::sm90 {

inline constexpr bool kWarpArrivals = FA4_SM90_WARP_ARRIVALS != 0;

// The empty barrier's arrival count for a ring read by `kConsumerThreads` threads in whole warps:
// the `num_consumers` of the ring's pipeline parameters.
template <int kConsumerThreads>
constexpr uint32_t ring_arrivals() {
  static_assert(kConsumerThreads % 32 == 0, "a ring's consumers are whole warps");
  return kWarpArrivals ? kConsumerThreads / 32 : kConsumerThreads;
}

// `state`'s stage of a ring (its pipeline and the pipeline's shared storage) released by the
// calling thread: with warp arrivals, by the calling warp, which must be converged. __syncwarp
// orders every lane's reads of the stage (the wgmmas have been waited for; generic reads such as
// row statistics) before the elected lane's arrival, whose release semantics publish them to the
// producer; elect.sync predicates the arrival without a branch. Otherwise the pipeline's own
// release, every thread arriving.
template <class Pipeline>
CUTE_DEVICE void release_stage(typename Pipeline::SharedStorage& ring, Pipeline& pipeline,
                               typename Pipeline::PipelineState const& state) {
  if constexpr (kWarpArrivals) {
    __syncwarp();
    const uint32_t barrier = cute::cast_smem_ptr_to_uint(&ring.empty_barrier_[state.index()]);
    asm volatile(
        "{\n"
        ".reg .pred elected;\n"
        "elect.sync _|elected, 0xffffffff;\n"
        "@elected mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "}\n" ::"r"(barrier)
        : "memory");
  } else {
    pipeline.consumer_release(state);
  }
}

}  // namespace fa4::sm90
