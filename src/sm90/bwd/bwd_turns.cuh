// The backward's deterministic mode: fp32 sums that several CTAs add to (dQ of a query tile over
// its key tiles; with GQA, dK / dV of a key tile over the query heads of its kv head) are added in
// a fixed order, so that every run rounds the same way. Each sum has a counter in the workspace
// (bwd_workspace.hpp, cleared before the kernel); the CTA whose turn is t waits until the counter
// reads t, adds, and moves it on.
//
// No CTA waits on one launched after it: turns follow the grid order (key tiles descending within
// a query head: dQ of a query tile is added from its last key tile down; query heads ascending),
// CTAs start in grid order, and each CTA's own first turn never waits on a later one.
#pragma once

#include <cstdint>

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

namespace fa4::sm90 {

struct Turns {
  // One thread: until the counter reads `turn`; what it does next is ordered after the previous
  // turn's adds (acquire).
  CUTE_DEVICE static void wait_one(const int32_t* counter, int turn) {
    int32_t now;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
    } while (now != turn);
  }

  // One thread: until the counter reads at least `count` (its last adder's release), backing off
  // between reads: the waits that use it last microseconds, not one turn.
  CUTE_DEVICE static void wait_at_least(const int32_t* counter, int count) {
    int32_t now;
    while (true) {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
      if (now >= count) return;
      __nanosleep(500);
    }
  }

  // One thread, after its adds are complete and visible: the next turn.
  CUTE_DEVICE static void pass_one(int32_t* counter) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" : : "l"(counter) : "memory");
  }

  // One thread waits, then the group of `threads` threads at named barrier `id` goes on.
  CUTE_DEVICE static void wait(const int32_t* counter, int turn, bool leader, uint32_t threads,
                               uint32_t id) {
    if (leader) wait_one(counter, turn);
    __syncwarp();  // the barrier below is .aligned: the leader's warp must be converged at it
    cutlass::arch::NamedBarrier::sync(threads, id);
  }

  // After the group's adds (atomics, generic proxy): every thread's adds are ordered before the
  // counter's move (the fence by each, the barrier, then one release increment).
  CUTE_DEVICE static void pass(int32_t* counter, bool leader, uint32_t threads, uint32_t id) {
    __threadfence();
    cutlass::arch::NamedBarrier::sync(threads, id);
    if (leader) pass_one(counter);
    __syncwarp();  // what follows (wgmma, barriers) is warp-collective
  }
};

}  // namespace fa4::sm90
