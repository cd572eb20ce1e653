// Key-tile pairs (BwdWideConfig with kClusterCtas 2, docs/sm90_backward.md): the CTAs of key
// tiles 2j and 2j + 1 of one (head, batch entry) form a cluster and walk the same query tiles in
// the same order. Per query tile, CTA c computes dQ's column half c over both key tiles,
//   dQ[:, half c] = dS_own · K_own[:, half c] + dS_partner · K_partner[:, half c],
// so each query tile takes one reduce-add of half the head dim per CTA instead of one of all of
// it: half the L2 traffic of dQ, half its staging in shared memory. What a CTA needs of its
// partner: the partner's K columns of its half (loaded with K and V, BwdLoad) and, every step,
// the partner's dS (8 KB at d256), which the partner copies into this CTA's shared memory with
// one bulk copy (the DSMEM path).
//
// Per step, two stages alternating by step as the own dS does (bwd_mma_wide.cuh):
// - before a CTA writes dS of step t into its stage t & 1, the partner must have read its copy
//   of step t − 2 (ds_free, arrived on remotely by each of the partner's MMA warpgroups once its
//   dQ wgmma has completed), which also means the copy of step t − 2 has read the stage;
// - once both warpgroups' dS is in shared memory, one thread arms the partner's ds_full for the
//   stage's bytes and issues the copy, which completes it;
// - the dQ wgmma waits for its own ds_full.
// A CTA exits only once nothing of its partner's can still reach it (drain): it has waited for
// every copy into it (each step's ds_full), and for the partner's last releases of its stages,
// which also mean that its own last copies have been read. Both CTAs were started together
// (cluster launch), so these waits cannot deadlock.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace fa4::sm90 {

template <class Config>
struct BwdPair {
  using Element = typename Config::Element;
  static constexpr bool kEnabled = Config::kClusterCtas == 2;
  static constexpr int kDsStageElements = Config::kBlockM * Config::kBlockN;
  static constexpr uint32_t kDsStageBytes = uint32_t(kDsStageElements * sizeof(Element));
  static_assert(kDsStageBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

  struct Storage {
    // The partner's K columns of this CTA's dQ half, and its dS (two stages).
    cute::array_aligned<Element, cute::cosize_v<typename Config::SmemLayoutKDq>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<typename Config::SmemLayoutDs>, 1024> ds;
    alignas(8) uint64_t ds_full[2];  // the partner's dS of the stage has landed here
    alignas(8) uint64_t ds_free[2];  // the partner has read this CTA's dS of the stage
  };
  struct NoStorage {};
  using SharedStorage = std::conditional_t<kEnabled, Storage, NoStorage>;

  // By one thread, before fence_barrier_init and the cluster's sync.
  CUTE_DEVICE static void init(Storage& s) {
    for (int i = 0; i < 2; ++i) {
      cutlass::arch::ClusterTransactionBarrier::init(&s.ds_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&s.ds_free[i], Config::kMmaWarpgroups);
    }
  }

  // All threads of both CTAs, after init: the partner's barriers are initialized before either
  // CTA signals them.
  CUTE_DEVICE static void sync() {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }

  CUTE_DEVICE static uint32_t partner() { return cute::block_rank_in_cluster() ^ 1u; }

  // The stage's uses before `step`'s ((step − first) >> 1: the steps of one parity since the
  // walk's first step `first`) give the phase parities.
  CUTE_DEVICE static int use(int step, int first) { return (step - first) >> 1; }

  // Every MMA thread, before it writes dS of `step` into its stage.
  CUTE_DEVICE static void wait_free(Storage& s, int step, int first) {
    const int u = use(step, first);
    if (u > 0) cutlass::arch::ClusterBarrier::wait(&s.ds_free[step & 1], uint32_t((u - 1) & 1));
  }

  // One thread, once both warpgroups' dS of `step` is in shared memory and fenced for the async
  // proxy: into the partner's stage.
  CUTE_DEVICE static void send(Storage& s, Element const* own_stage, int step) {
    const uint32_t to = partner();
    uint64_t* full = &s.ds_full[step & 1];
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, kDsStageBytes, to, 1u);
    const uint32_t dst =
        cute::set_block_rank(cute::cast_smem_ptr_to_uint(s.ds.data() + (step & 1) * kDsStageElements), to);
    const uint32_t bar = cute::set_block_rank(cute::cast_smem_ptr_to_uint(full), to);
    asm volatile(
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(dst),
        "r"(cute::cast_smem_ptr_to_uint(own_stage)), "r"(kDsStageBytes), "r"(bar)
        : "memory");
  }

  // Every MMA thread, before the dQ wgmma that reads the partner's dS of `step`.
  CUTE_DEVICE static void wait_full(Storage& s, int step, int first) {
    cutlass::arch::ClusterTransactionBarrier::wait(&s.ds_full[step & 1],
                                                   uint32_t(use(step, first) & 1));
  }

  // One thread per MMA warpgroup, once its dQ wgmma of `step` has completed. The arrive and the
  // waits are CUTLASS's, as in its pipelines whose consumers free stages that the TMA of another
  // CTA of the cluster fills; an explicit cluster-scope release / acquire instead would cost a
  // full memory barrier (MEMBAR.GPU) and an L1 invalidation every step, 19 % of the kernel's time
  // (ncu).
  CUTE_DEVICE static void release(Storage& s, int step) {
    cutlass::arch::ClusterBarrier::arrive(&s.ds_free[step & 1], partner(), 1u);
  }

  // Every MMA thread, after the walk [first, end) (not empty): the partner's releases of the last
  // two steps' stages.
  CUTE_DEVICE static void drain(Storage& s, int first, int end) {
    for (int step = end - 2 < first ? first : end - 2; step < end; ++step)
      cutlass::arch::ClusterBarrier::wait(&s.ds_free[step & 1], uint32_t(use(step, first) & 1));
  }
};

}  // namespace fa4::sm90
