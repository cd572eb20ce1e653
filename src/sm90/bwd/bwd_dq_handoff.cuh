// How the MMA warpgroups hand their staged dQ parts to the writer warp, and how that warp walks
// the query tiles issuing one reduce-add per part (the order and deterministic turns alike for
// both ways of staging, bwd_dq_reduce.cuh): each warpgroup stages its part of a tile in shared
// memory and hands it to a writer warp of the producer warpgroup, which issues the reduction (in
// deterministic mode after waiting for its turn), so that the MMA warpgroups wait neither on the
// TMA unit nor on other CTAs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/bwd/bwd_turns.cuh"
#include "sm90/common/named_barriers.cuh"

namespace fa4::sm90 {

struct BwdDqHandoff {
  // A warpgroup's part is full (its 128 threads arrive, the writer warp waits) or empty (the
  // writer arrives once its reduction has read the part).
  static constexpr uint32_t kThreads = 128 + 32;
  CUTE_DEVICE static uint32_t full_barrier(int wg) { return wg == 0 ? kBwdDqFull0 : kBwdDqFull1; }
  CUTE_DEVICE static uint32_t empty_barrier(int wg) { return wg == 0 ? kBwdDqEmpty0 : kBwdDqEmpty1; }

  // MMA warpgroup `wg`, before staging: waits until the writer has read its previous part.
  CUTE_DEVICE static void acquire(int wg) {
    cutlass::arch::NamedBarrier::sync(kThreads, empty_barrier(wg));
  }
  // After staging: hands the part over without waiting for the reduction. st.shared is the
  // generic proxy, the bulk copies read through the async proxy.
  CUTE_DEVICE static void hand_over(int wg) {
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::arrive(kThreads, full_barrier(wg));
  }

  // The writer warp, after write() or in a CTA that adds nothing to dQ: every CTA of the grid adds
  // 1 to its (batch entry, head)'s count in dq_done (`done`, null: nothing waits on the CTAs),
  // `slot`, once its reduce-adds have landed in global memory, as the deterministic mode's turns
  // do: written (every lane waits; only the one that issued has bulk groups), made visible to the
  // generic proxy, released. The wait overlaps the MMA warpgroups' dK / dV epilogue.
  CUTE_DEVICE static void landed(int32_t* done, int64_t slot) {
    if (done == nullptr) return;
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if (cute::elect_one_sync()) Turns::pass_one(done + slot);
    __syncwarp();
  }

  // The writer warp (one warp of the producer warpgroup): for each query tile m, in `order`, and
  // each of the kParts warpgroups' parts, waits for the part, has one lane issue its reduce-add
  // (`issue(m, part)`: the bulk copy and its commit) and frees the part once the copy has read
  // it. Deterministic mode (`counter(m, part)` not null): before its reduction the writer waits
  // for the counter to read turn(m), and moves it on once the reduction has landed in global
  // memory; the MMA warpgroups never wait on a turn themselves.
  // `loads_issued` (one-stage Q / dO rings, else null): two mbarriers, the load thread arriving on
  // [t & 1] once it has issued step t's Q and dO (t after the first); the reduce-add of step t
  // waits for step t + 1's, so that the TMA unit takes the loads the next tile waits on before this
  // tile's 2 × 32 KB reduction.
  template <int kParts, class Order, class Counter, class Turn, class Issue>
  CUTE_DEVICE static void write(Order order, Counter const& counter, Turn const& turn,
                                uint64_t* loads_issued, Issue const& issue) {
    const int begin = order.tiles.begin, end = order.tiles.end;
    const bool issuer = cute::elect_one_sync();
    // Each part's first staging needs no wait; later ones wait for this warp's arrive below.
    for (int wg = 0; wg < kParts; ++wg)
      cutlass::arch::NamedBarrier::arrive(kThreads, empty_barrier(wg));
    CUTE_NO_UNROLL
    for (int step = begin; step < end; ++step) {
      const int m = order.tile(step);
      // When this warp gets here, the load thread may have issued step + 2 too (the MMA
      // warpgroups free step + 1's stage before they stage step + 1's dQ, which waits for this
      // reduction), not step + 3: with a barrier per parity of the step, neither is a phase
      // ahead.
      if (loads_issued != nullptr && step + 1 < end)
        cutlass::arch::ClusterBarrier::wait(&loads_issued[(step + 1) & 1],
                                            ((step - begin) >> 1) & 1);
      CUTE_UNROLL
      for (int wg = 0; wg < kParts; ++wg) {
        cutlass::arch::NamedBarrier::sync(kThreads, full_barrier(wg));
        if (issuer) {
          int32_t* const turns = counter(m, wg);
          if (turns != nullptr) {
            Turns::wait_one(turns, turn(m));
            // The previous turn's reduction (async proxy, ordered by the acquire) before this one.
            asm volatile("fence.proxy.async.global;" ::: "memory");
          }
          issue(m, wg);
          if (turns != nullptr) {
            // Done writing, not only reading the staging buffer (no .read), and made visible to
            // the generic proxy's release.
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("fence.proxy.async.global;" ::: "memory");
            Turns::pass_one(turns);
          } else {
            cute::tma_store_wait<0>();  // the part has been read
          }
        }
        __syncwarp();
        // No arrive after the last tile: every arrive is matched by a staging.
        if (step + 1 < end) cutlass::arch::NamedBarrier::arrive(kThreads, empty_barrier(wg));
      }
    }
  }
};

}  // namespace fa4::sm90
