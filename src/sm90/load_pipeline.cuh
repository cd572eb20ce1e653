// The producer side of the forward kernel: one thread issues TMA loads of the query tile (once) and
// of the key / value tiles into two multi-stage shared-memory rings, each guarded by CUTLASS's
// PipelineTmaAsync (a full mbarrier completed by the TMA's byte count, an empty mbarrier completed by
// the consumers' release). Out-of-range rows (past seqlen) arrive as zeros from the TMA unit.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90/gmem_layout.cuh"
#include "sm90/mask.cuh"
#include "sm90/tile_scheduler.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct FwdLoad {
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  using HeadDim = typename Config::HeadDim;
  using SmemLayoutQ = typename Config::SmemLayoutQ;
  using SmemLayoutK = typename Config::SmemLayoutK;
  using SmemLayoutV = typename Config::SmemLayoutV;

  using Pipeline = cutlass::PipelineTmaAsync<Config::kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayoutQ{}, Shape<BlockM, HeadDim>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      take<0, 2>(SmemLayoutK{}), Shape<BlockN, HeadDim>{}, _1{}));

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    GmemShape shape_q;
    GmemShape shape_kv;
    int head_group;  // query heads per kv head (GQA)
  };

  static Params make_params(const Problem& p, const ForwardTensors& t) {
    const int64_t elem = sizeof(Element);
    const GmemLayout q = gmem_layout(t.q, p.seqlen_q, p.head_dim_qk, p.heads_q, p.batch, elem);
    const GmemLayout k = gmem_layout(t.k, p.seqlen_k, p.head_dim_qk, p.heads_kv, p.batch, elem);
    const GmemLayout v = gmem_layout(t.v, p.seqlen_k, p.head_dim_v, p.heads_kv, p.batch, elem);
    // With no keys K and V may be empty views without memory; their descriptors are never used
    // but must be encodable, so they borrow Q's address.
    const void* k_data = p.seqlen_k > 0 ? t.k.data : t.q.data;
    const void* v_data = p.seqlen_k > 0 ? t.v.data : t.q.data;
    auto gmem = [](const void* data, GmemLayout layout) {
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(data)), layout);
    };
    return {make_tma_copy(SM90_TMA_LOAD{}, gmem(t.q.data, q), SmemLayoutQ{},
                          Shape<BlockM, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(k_data, k), take<0, 2>(SmemLayoutK{}),
                          Shape<BlockN, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(v_data, v), take<0, 2>(SmemLayoutV{}),
                          Shape<BlockN, HeadDim>{}, _1{}),
            q.shape(),
            k.shape(),
            int(p.heads_q / p.heads_kv)};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // Runs on a single thread. Key tiles go from the last to the first (the order the consumers
  // take them: with a causal mask the partly masked tiles come first); V trails K by one tile
  // because the consumers need K of tile j together with V of tile j+1.
  CUTE_DEVICE static void run(Params const& p, TileCoord tile, KeyTiles keys, Element* smem_q,
                              Element* smem_k, Element* smem_v, uint64_t& q_full,
                              Pipeline& pipeline_k, Pipeline& pipeline_v) {
    const int kv_head = tile.head / p.head_group;

    Tensor gQ = local_tile(p.tma_q.get_tma_tensor(p.shape_q)(_, _, tile.head, tile.batch),
                           Shape<BlockM, HeadDim>{}, make_coord(tile.m_block, _0{}));
    Tensor gK = local_tile(p.tma_k.get_tma_tensor(p.shape_kv)(_, _, kv_head, tile.batch),
                           Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));  // (N, D, n_block)
    Tensor gV = local_tile(p.tma_v.get_tma_tensor(p.shape_kv)(_, _, kv_head, tile.batch),
                           Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem_k), SmemLayoutK{});  // (N, D, stage)
    Tensor sV = make_tensor(make_smem_ptr(smem_v), SmemLayoutV{});

    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                      group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                      group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                      group_modes<0, 2>(gV));

    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&q_full, Config::kBytesQ);
    copy(p.tma_q.with(q_full), tQgQ, tQsQ);

    PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_v = cutlass::make_producer_start_state<Pipeline>();
    auto load = [](auto const& tma, Pipeline& pipeline, PipelineState& state, auto const& src,
                   auto& dst) {
      pipeline.producer_acquire(state);
      copy(tma.with(*pipeline.producer_get_barrier(state)), src, dst(_, state.index()));
      ++state;
    };

    int n_block = keys.end - 1;
    load(p.tma_k, pipeline_k, write_k, tKgK(_, n_block), tKsK);
    CUTE_NO_UNROLL
    for (; n_block > keys.begin; --n_block) {
      load(p.tma_k, pipeline_k, write_k, tKgK(_, n_block - 1), tKsK);
      load(p.tma_v, pipeline_v, write_v, tVgV(_, n_block), tVsV);
    }
    load(p.tma_v, pipeline_v, write_v, tVgV(_, keys.begin), tVsV);
  }
};

}  // namespace fa4::sm90
