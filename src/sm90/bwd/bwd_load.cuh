// The producer side of the backward kernel: one thread loads the CTA's K and V tiles once (one
// mbarrier for both), then Q and dO of each query tile the keys are seen by, into two rings guarded
// by CUTLASS's PipelineTmaAsync, and with them the tile's LSE·log2e and D from the workspace (bulk
// copies on the same barriers: read per column of Sᵀ, from global memory they stalled every step
// on their latency). Rows past a sequence's end arrive as zeros (gmem_layout.cuh); their LSE and D
// come from the sequence's pad in the workspace (+inf and 0, bwd_workspace.hpp), so those queries'
// probabilities and dS are 0 with no check in the consumers.
#pragma once

#include <type_traits>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/gmem_layout.cuh"
#include "sm90/common/sequence.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct BwdLoad {
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  using HeadDim = typename Config::HeadDim;
  using HeadDimV = typename Config::HeadDimV;
  using SmemLayoutQ = typename Config::SmemLayoutQ;
  using SmemLayoutDo = typename Config::SmemLayoutDo;
  using SmemLayoutK = typename Config::SmemLayoutK;
  using SmemLayoutV = typename Config::SmemLayoutV;

  using Pipeline = cutlass::PipelineTmaAsync<Config::kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  template <class SmemLayout, class Box>
  using Tma = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayout{}, Box{}, _1{}));
  using TmaQ = Tma<decltype(take<0, 2>(SmemLayoutQ{})), Shape<BlockM, HeadDim>>;
  using TmaDo = Tma<decltype(take<0, 2>(SmemLayoutDo{})), Shape<BlockM, HeadDimV>>;
  using TmaK = Tma<SmemLayoutK, Shape<BlockN, HeadDim>>;
  using TmaV = Tma<SmemLayoutV, Shape<BlockN, HeadDimV>>;
  // On a key-tile pair (bwd_pair.cuh): the partner's K columns of this CTA's dQ half.
  static constexpr bool kPair = Config::kClusterCtas == 2;
  using DqBox = Shape<BlockN, typename Config::DqDim>;
  struct NoTma {};
  using TmaKDq =
      std::conditional_t<kPair, Tma<typename Config::SmemLayoutKDq, DqBox>, NoTma>;

  struct Params {
    TmaQ tma_q;
    TmaDo tma_do;
    TmaK tma_k;
    TmaV tma_v;
    TmaKDq tma_k_dq;
    GmemShape shape_q, shape_do, shape_k, shape_v;
    int head_group;     // query heads per kv head (GQA)
    const float* lse_log2;  // workspace, [heads_q][stat rows] (bwd_workspace.hpp)
    const float* dpsum;
    int64_t stat_rows;
    int32_t q_rows_per_batch;  // seqlen_q (fixed length), 0 (varlen: rows start at cu_seqlens_q)
  };

  static Params make_params(const Problem& p, const BackwardTensors& t, const float* lse_log2,
                            const float* dpsum, int64_t stat_rows) {
    auto gmem = [](auto view) { return make_tensor(make_gmem_ptr(view.base), view.layout); };
    const auto q = gmem_view(static_cast<Element const*>(t.q.data), t.q, query_rows(p),
                             p.head_dim_qk, p.heads_q);
    const auto dout = gmem_view(static_cast<Element const*>(t.dout.data), t.dout, query_rows(p),
                                p.head_dim_v, p.heads_q);
    const auto k = gmem_view(static_cast<Element const*>(t.k.data), t.k, key_rows(p),
                             p.head_dim_qk, p.heads_kv);
    const auto v = gmem_view(static_cast<Element const*>(t.v.data), t.v, key_rows(p), p.head_dim_v,
                             p.heads_kv);
    TmaKDq tma_k_dq{};
    if constexpr (kPair)
      tma_k_dq = make_tma_copy(SM90_TMA_LOAD{}, gmem(k), typename Config::SmemLayoutKDq{}, DqBox{},
                               _1{});
    return {make_tma_copy(SM90_TMA_LOAD{}, gmem(q), take<0, 2>(SmemLayoutQ{}),
                          Shape<BlockM, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(dout), take<0, 2>(SmemLayoutDo{}),
                          Shape<BlockM, HeadDimV>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(k), SmemLayoutK{}, Shape<BlockN, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(v), SmemLayoutV{}, Shape<BlockN, HeadDimV>{}, _1{}),
            tma_k_dq,
            q.layout.shape(),
            dout.layout.shape(),
            k.layout.shape(),
            v.layout.shape(),
            int(p.heads_q / p.heads_kv),
            lse_log2,
            dpsum,
            stat_rows,
            int32_t(p.is_varlen() ? 0 : p.seqlen_q)};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (kPair) prefetch_tma_descriptor(p.tma_k_dq.get_tma_descriptor());
  }


  // Runs on a single thread. Query tiles in `order`, Q before dO (Sᵀ, which needs Q, is issued
  // before dPᵀ).
  // `batch`: the sequence's index (also in varlen mode). smem_lse / smem_dpsum: kBlockM floats
  // per stage. smem_partner_k: on a pair, where the partner's K columns go (else unused).
  template <class Order>
  CUTE_DEVICE static void run(Params const& p, int head, int n_block, int batch,
                              Sequence const& seq, Order order, Element* smem_q,
                              Element* smem_do, Element* smem_k, Element* smem_v,
                              Element* smem_partner_k, float* smem_lse, float* smem_dpsum,
                              uint64_t& kv_full, Pipeline& pipeline_q, Pipeline& pipeline_do,
                              uint64_t* loads_issued) {
    const int kv_head = head / p.head_group;
    const SeqRows q_rows = seq.q_rows(get<0>(p.shape_q));
    const SeqRows k_rows = seq.k_rows(get<0>(p.shape_k));

    Tensor gK = sequence_tiles(p.tma_k, p.shape_k, kv_head, k_rows, Shape<BlockN, HeadDim>{});
    Tensor gV = sequence_tiles(p.tma_v, p.shape_v, kv_head, k_rows, Shape<BlockN, HeadDimV>{});
    Tensor sK = make_tensor(make_smem_ptr(smem_k), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), SmemLayoutV{});
    auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                      group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                      group_modes<0, 2>(gV));
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
        &kv_full, Config::kBytesKV + Config::kBytesPartnerK);
    copy(p.tma_k.with(kv_full), tKgK(_, n_block), tKsK);
    copy(p.tma_v.with(kv_full), tVgV(_, n_block), tVsV);
    if constexpr (kPair) {
      // The partner's key tile (n_block ^ 1), columns of this CTA's half (its rank).
      Tensor gKDq = sequence_tiles_2d(p.tma_k_dq, p.shape_k, kv_head, k_rows, DqBox{});
      Tensor sKDq = make_tensor(make_smem_ptr(smem_partner_k), typename Config::SmemLayoutKDq{});
      auto [tKgKDq, tKsKDq] = tma_partition(p.tma_k_dq, _0{}, Layout<_1>{},
                                            group_modes<0, 2>(sKDq), group_modes<0, 2>(gKDq));
      copy(p.tma_k_dq.with(kv_full), tKgKDq(_, n_block ^ 1, int(cute::block_rank_in_cluster())),
           tKsKDq);
    }
    // LSE·log2e and D come from the prepare kernel, which this kernel may overlap (a dependent
    // launch: bwd_kernel.cuh); K and V are the caller's.
    cutlass::arch::wait_on_dependent_grids();

    Tensor gQ = sequence_tiles(p.tma_q, p.shape_q, head, q_rows, Shape<BlockM, HeadDim>{});
    Tensor gDo = sequence_tiles(p.tma_do, p.shape_do, head, q_rows, Shape<BlockM, HeadDimV>{});
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), SmemLayoutQ{});  // (M, D, stage)
    Tensor sDo = make_tensor(make_smem_ptr(smem_do), SmemLayoutDo{});
    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                      group_modes<0, 2>(gQ));
    auto [tDgDo, tDsDo] = tma_partition(p.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sDo),
                                        group_modes<0, 2>(gDo));
    const int64_t first_stat =
        int64_t(head) * p.stat_rows +
        bwd_stat_row(seq.start_q + int64_t(seq.batch) * p.q_rows_per_batch, batch);
    PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
    CUTE_NO_UNROLL
    for (int step = order.tiles.begin; step < order.tiles.end; ++step) {
      const int m = order.tile(step);
      const int64_t stat = first_stat + int64_t(m) * Config::kBlockM;
      pipeline_q.producer_acquire(write_q);
      uint64_t* full_q = pipeline_q.producer_get_barrier(write_q);
      copy(p.tma_q.with(*full_q), tQgQ(_, m), tQsQ(_, write_q.index()));
      SM90_BULK_COPY_G2S::copy(p.lse_log2 + stat, full_q,
                               smem_lse + write_q.index() * Config::kBlockM,
                               Config::kBytesRowStat);
      ++write_q;
      pipeline_do.producer_acquire(write_do);
      uint64_t* full_do = pipeline_do.producer_get_barrier(write_do);
      copy(p.tma_do.with(*full_do), tDgDo(_, m), tDsDo(_, write_do.index()));
      SM90_BULK_COPY_G2S::copy(p.dpsum + stat, full_do,
                               smem_dpsum + write_do.index() * Config::kBlockM,
                               Config::kBytesRowStat);
      ++write_do;
      // The dQ writer's reduction of step − 1's tile may go now (bwd_dq_reduce.cuh).
      if (loads_issued != nullptr && step > order.tiles.begin)
        cutlass::arch::ClusterBarrier::arrive(&loads_issued[step & 1]);
    }
  }
};

}  // namespace fa4::sm90
