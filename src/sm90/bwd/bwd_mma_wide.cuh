// The backward's MMA warpgroups above head dim 128 (BwdWideConfig, bwd_config.cuh): the CTA's 64
// keys split 32 / 32 between the two warpgroups for S and dP, computed the forward's way round
// (queries × keys), P and dS through shared memory, dK and dV accumulated transposed (per
// warpgroup its own keys, or at d256 half the head dim: BwdWideConfig::kDkvByDim). Per query
// tile m that sees the keys:
//   S = Q Kᵀ, dP = dO Vᵀ                 wgmma, dP issued right behind S
//   P = exp2(S·scale·log2e − LSE·log2e)  from the forward's LSE
//   dS = P ∘ (dP − D)                    (∘ (1 − tanh²) with softcap)
//   P, dS → shared memory, then a barrier of both warpgroups (dQ reads every key's dS)
//   dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS           wgmma
//   dQ = dS K                            half the head dim per warpgroup, staged for the writer
//                                        warp (bwd_dq_reduce.cuh); on a key-tile pair, a quarter,
//                                        over both key tiles (bwd_pair.cuh)
// The rest of the kernel (loads, dQ writer, dK / dV store, deterministic mode) is BwdKernel's.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/bwd/bwd_dq_reduce.cuh"
#include "sm90/bwd/bwd_mask.cuh"
#include "sm90/bwd/bwd_pair.cuh"
#include "sm90/bwd/bwd_scores.cuh"
#include "sm90/common/fragment.cuh"
#include "sm90/common/tile_mask.cuh"
#include "sm90/common/named_barriers.cuh"
#include "sm90/common/softmax.cuh"
#include "sm90/common/wgmma.cuh"

namespace fa4::sm90 {

using namespace cute;

// P's shared memory (the narrow kernel has none).
template <class Config>
struct BwdWideSmemP {
  cute::array_aligned<typename Config::Element, cosize_v<typename Config::SmemLayoutP>, 1024> buf;
};

template <class Kernel>
struct BwdMmaWide {
  using Config = typename Kernel::KernelConfig;
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  using HeadDim = typename Config::HeadDim;
  using HeadDimV = typename Config::HeadDimV;
  using Pipeline = typename Kernel::Pipeline;
  using PipelineState = typename Kernel::PipelineState;
  using Pair = BwdPair<Config>;

  CUTE_DEVICE static void run(typename Kernel::Params const& p,
                              typename Kernel::SharedStorage& smem,
                              typename Kernel::Work const& w, Pipeline& pipeline_q,
                              Pipeline& pipeline_do) {
    const int thread = int(threadIdx.x) - 128;  // among the MMA threads
    typename Config::TiledMmaSdP mma_sdp;
    typename Config::TiledMmaKV mma_kv;
    typename Config::TiledMmaQ mma_q;
    auto thr_sdp = mma_sdp.get_thread_slice(thread);
    auto thr_kv = mma_kv.get_thread_slice(thread);
    auto wg_sdp = warpgroup_operand_slice(mma_sdp, 1);
    auto wg_kv = warpgroup_operand_slice(mma_kv, 1);
    auto wg_q = warpgroup_operand_slice(mma_q, 1);
    using LayoutQ = typename Config::SmemLayoutQ;
    using LayoutQt = typename Config::SmemLayoutQt;
    using LayoutDo = typename Config::SmemLayoutDo;
    using LayoutDot = typename Config::SmemLayoutDot;
    using LayoutK = typename Config::SmemLayoutK;
    using LayoutKDqt = typename Config::SmemLayoutKDqt;
    using LayoutV = typename Config::SmemLayoutV;
    using LayoutPt = typename Config::SmemLayoutPt;
    using LayoutDs = typename Config::SmemLayoutDs;
    using LayoutDst = typename Config::SmemLayoutDst;
    Tensor sP = make_tensor(make_smem_ptr(smem.p.buf.data()), typename Config::SmemLayoutP{});
    Tensor sDs = make_tensor(make_smem_ptr(smem.ds.data()), LayoutDs{});

    Tensor dVt = partition_fragment_C(mma_kv, Shape<HeadDimV, BlockN>{});
    Tensor dKt = partition_fragment_C(mma_kv, Shape<HeadDim, BlockN>{});
    clear(dVt);
    clear(dKt);
    // (query, key) of this thread's S values, as (rows, cols).
    const auto score_coords =
        rowcol_view(thr_sdp.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{})));
    using ScoreFrag = decltype(partition_fragment_C(mma_sdp, Shape<BlockM, BlockN>{}));
    const TileMask<Config::kBlockN> mask{w.mask.band};
    const QueryTiles unmasked = w.mask.unmasked_tiles(w.n_block);
    const auto order = w.order;
    // dQ's K columns in this CTA's K: all of them, or on a pair its rank's half.
    const int k_dq_offset =
        Pair::kEnabled ? int(cute::block_rank_in_cluster()) * cosize_v<typename Config::SmemLayoutKDq>
                       : 0;
    const int first = w.order.tiles.begin;

    // Inlined by force: left to itself the compiler outlines the four instances into calls, and
    // wgmmas in flight across a call are serialized (ptxas C7510).
    auto tiles = [&](auto softcap_tag, auto alibi_tag) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kSoftcap = decltype(softcap_tag)::value;
      constexpr bool kAlibi = decltype(alibi_tag)::value;
      const BwdAlibi alibi{kAlibi ? Kernel::alibi_slope(p, w) : 0.0f};
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.kv_full, 0);
      PipelineState read;  // the Q and dO rings advance together
      CUTE_NO_UNROLL
      for (int step = w.order.tiles.begin; step < w.order.tiles.end; ++step) {
        const int m = order.tile(step);
        const int stage = read.index();
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockM, BlockN>{});
        pipeline_q.consumer_wait(read);
        wgmma_issue<true>(
            mma_sdp, wg_sdp.partition_fragment_A(opaque_smem_tensor(smem.q.data(), LayoutQ{}))(
                         _, _, _, stage),
            wg_sdp.partition_fragment_B(opaque_smem_tensor(smem.k.data(), LayoutK{})), tSrS);
        Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<BlockM, BlockN>{});
        pipeline_do.consumer_wait(read);
        wgmma_issue<true>(
            mma_sdp, wg_sdp.partition_fragment_A(opaque_smem_tensor(smem.dout.data(), LayoutDo{}))(
                         _, _, _, stage),
            wg_sdp.partition_fragment_B(opaque_smem_tensor(smem.v.data(), LayoutV{})), tSrDp);
        auto s = rowcol_view(tSrS);
        warpgroup_wait<1>();  // S is ready (dP may still run)
        const float* lse_row = stage_stats<Config::kBlockM>(smem.lse.data(), stage);
        if constexpr (kSoftcap) p.softcap.apply(tSrS);
        if (!unmasked.contains(m))
          mask.apply(s, score_coords, mask.row_keys(score_coords, int64_t(m) * Config::kBlockM),
                     w.n_block);
        Tensor tP = make_tensor<Element>(ScoreFrag{}.layout());
        auto p_rc = rowcol_view(tP);
        // Rows are queries, columns keys (S).
        const float alibi_first =
            kAlibi ? BwdAlibi::first<false>(m * Config::kBlockM + get<0>(score_coords(0, 0)),
                                            w.n_block * Config::kBlockN + get<1>(score_coords(0, 0)),
                                            w.seq.len_k - w.seq.len_q)
                   : 0.0f;
        CUTE_UNROLL
        for (int i = 0; i < size<0>(s); ++i) {
          // No bounds check: rows past the sequence's end read the workspace's pad, LSE +inf.
          const float lse = lse_row[bwd_stat_slot(int(get<0>(score_coords(i, 0))))];
          CUTE_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            const float t = s(i, j);
            // ALiBi's bias enters P only: dS's softcap factor is of the capped score itself.
            const float biased =
                kAlibi ? alibi.add<false>(t, alibi_first,
                                          get<0>(score_coords(i, 0)) - get<0>(score_coords(0, 0)),
                                          get<1>(score_coords(0, j)) - get<1>(score_coords(0, 0)))
                       : t;
            const float prob = bwd_probability(biased, p.score_scale_log2, lse);
            p_rc(i, j) = Element(prob);
            s(i, j) = ds_factor<kSoftcap>(prob, t);
          }
        }
        warpgroup_fence_operand(tSrS);
        warpgroup_wait<0>();  // dP is ready
        const float* dpsum_row = stage_stats<Config::kBlockM>(smem.dpsum.data(), stage);
        auto dp = rowcol_view(tSrDp);
        CUTE_UNROLL
        for (int i = 0; i < size<0>(s); ++i) {
          const float dpsum = dpsum_row[bwd_stat_slot(int(get<0>(score_coords(i, 0))))];
          CUTE_UNROLL
          for (int j = 0; j < size<1>(s); ++j) dp(i, j) = s(i, j) * (dp(i, j) - dpsum);
        }
        Tensor tDs = make_tensor<Element>(ScoreFrag{}.layout());
        convert_fragment(tSrDp, tDs);
        // dS alternates between two stages by step, as in the narrow kernel: a warpgroup writing
        // step + 1's may be ahead of the other's dQ reading this step's, never further. So does P
        // where both warpgroups read every key's P; with one stage, this warpgroup's last dVᵀ, its
        // only reader, finished last step.
        const int p_stage = Config::kStagesP == 2 ? (step & 1) : 0;
        store_accumulator<SM90_U32x4_STSM_N, typename Config::TiledMmaSdP>(thread, tP,
                                                                            sP(_, _, p_stage));
        // On a pair, the stage's last copy to the partner has been read (and the partner is done
        // with it) before it is overwritten.
        if constexpr (Pair::kEnabled) Pair::wait_free(smem.pair, step, first);
        store_accumulator<SM90_U32x4_STSM_N, typename Config::TiledMmaSdP>(thread, tDs,
                                                                            sDs(_, _, step & 1));
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores before wgmma reads
        cutlass::arch::NamedBarrier::sync(Config::kMmaThreads, kBwdDsReadyBarrier);
        if constexpr (Pair::kEnabled) {
          if (thread == 0)
            Pair::send(smem.pair, smem.ds.data() + (step & 1) * Pair::kDsStageElements, step);
        }

        wgmma_issue<false>(
            mma_kv, wg_kv.partition_fragment_A(opaque_smem_tensor(smem.dout.data(), LayoutDot{}))(
                        _, _, _, stage),
            wg_kv.partition_fragment_B(opaque_smem_tensor(smem.p.buf.data(), LayoutPt{}))(
                _, _, _, p_stage),
            dVt);
        wgmma_issue<false>(
            mma_kv, wg_kv.partition_fragment_A(opaque_smem_tensor(smem.q.data(), LayoutQt{}))(
                        _, _, _, stage),
            wg_kv.partition_fragment_B(opaque_smem_tensor(smem.ds.data(), LayoutDst{}))(
                _, _, _, step & 1),
            dKt);
        Tensor dQ = partition_fragment_C(mma_q, Shape<BlockM, typename Config::DqDim>{});
        auto own_ds = wg_q.partition_fragment_A(opaque_smem_tensor(smem.ds.data(), LayoutDs{}))(
            _, _, _, step & 1);
        auto own_k =
            wg_q.partition_fragment_B(opaque_smem_tensor(smem.k.data() + k_dq_offset, LayoutKDqt{}));
        if constexpr (Pair::kEnabled) {
          // Both key tiles' shares in one batch (K = 2 × 64 keys), once the partner's dS is here.
          Pair::wait_full(smem.pair, step, first);
          wgmma_issue_split_k<true>(
              mma_q, own_ds, own_k,
              wg_q.partition_fragment_A(opaque_smem_tensor(smem.pair.ds.data(), LayoutDs{}))(
                  _, _, _, step & 1),
              wg_q.partition_fragment_B(opaque_smem_tensor(smem.pair.k.data(), LayoutKDqt{})), dQ);
        } else {
          wgmma_issue<true>(mma_q, own_ds, own_k, dQ);
        }
        // dVᵀ and dKᵀ are done: Q's and dO's stage is free (with one stage, as at d256, the next
        // tile's loads start here, while dQ runs).
        warpgroup_wait<1>();
        Kernel::release(smem.pipeline_do, pipeline_do, read);
        Kernel::release(smem.pipeline_q, pipeline_q, read);
        warpgroup_wait<0>();
        if constexpr (Pair::kEnabled) {
          if (thread % 128 == 0) Pair::release(smem.pair, step);
        }
        // After the release above, not before: BwdDqReduce::write's loads_issued barriers rely on
        // the load thread being at most one tile past the writer (bwd_dq_reduce.cuh).
        BwdDqReduce<Config>::stage(smem.dq.data(), mma_q, dQ, thread);
        ++read;
      }
    };
    if (!w.order.tiles.empty())
      run_by_variant(p.softcap.enabled(), p.variants.alibi != nullptr, tiles);
    Kernel::store_dkv(p, thr_kv, dKt, dVt, smem);
    if constexpr (Pair::kEnabled) {
      if (!w.order.tiles.empty()) Pair::drain(smem.pair, first, w.order.tiles.end);
    }
  }
};

}  // namespace fa4::sm90
