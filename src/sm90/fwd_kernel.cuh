// The sm_90a forward kernel: a CTA computes O and LSE of query tiles (128 rows, 192 at d64), each
// of one head of one sequence (fixed-length or varlen; sequence.cuh), one after the other
// (tile_scheduler.cuh).
//
//   warpgroup 0 (producer, 24 or 32 registers): one thread loads, by TMA, each tile's first K
//   tile, its Q (once the previous tile's last QKᵀ has read Q's buffer), then the other K and V
//   tiles (the first V once the previous tile's O, staged in V's ring, has been stored). With
//   pack-GQA (query_rows.cuh) the tile's rows come from G heads and a second warp gathers Q.
//   warpgroups 1.. (consumers: two with 240 registers, three with 160 at d64): 64 query rows
//   each, taking turns at the tensor cores. Per key tile j, going down:
//     S = Q Kⱼᵀ                    wgmma, issued together with O += P Vⱼ₊₁ in this warpgroup's turn
//     S = softcap(S), mask(S)       only on tiles the band or seqlen_k cuts
//     m, P = online softmax(S)      exp2, scale·log2e folded into one FFMA
//     O *= exp2(m_old − m_new)      once O += P Vⱼ₊₁ has landed
//   then O /= rowsum, LSE = m + log(rowsum), O and LSE stored.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/mask.hpp"
#include "sm90/epilogue.cuh"
#include "sm90/fragment.cuh"
#include "sm90/load_pipeline.cuh"
#include "sm90/mask.cuh"
#include "sm90/query_rows.cuh"
#include "sm90/sequence.cuh"
#include "sm90/softcap.cuh"
#include "sm90/softmax.cuh"
#include "sm90/tile_rows.hpp"
#include "sm90/tile_scheduler.cuh"
#include "sm90/warpgroup_turns.cuh"
#include "sm90/wgmma.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct FwdKernel {
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  using HeadDimV = typename Config::HeadDimV;
  using Load = FwdLoad<Config>;
  using Epilogue = FwdEpilogue<Config>;
  using Pipeline = typename Load::Pipeline;
  using PipelineState = typename Load::PipelineState;
  using Mask = TileMask<Config::kBlockN>;
  static constexpr int kThreads = Config::kThreads;
  using Turns = WarpgroupTurns<Config::kConsumerWarpgroups>;

  struct Params {
    typename Load::Params load;
    typename Epilogue::Params epilogue;
    TileScheduler::Params scheduler;  // tiles of query heads, or of kv heads when packed
    SequenceParams sequences;
    QueryRows rows;  // pack-GQA or not (query_rows.cuh)
    SplitPartials split;  // split-KV's partial results (split_kv.cuh), or none
    BandMask band;  // window sides, causal folded in; each sequence's lengths replace its sizes
    SoftcapScores softcap;
    float score_scale;  // natural-log logit per unit of the kernel's scores (scale, or cap)
  };

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutQ>, 1024> q;  // then O
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutV>, 1024> v;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    alignas(8) uint64_t q_full;   // Q of the current tile has landed
    alignas(8) uint64_t q_empty;  // every consumer warpgroup is past its last QKᵀ: Q may be reloaded
    alignas(8) uint64_t o_free;   // the last O staged in V's ring has left it: V may be reloaded
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));

  // What a CTA does for one tile of the grid; false when the tile is past its sequence's end (the
  // grid covers the longest one) or the sequence's entries are invalid.
  struct Work {
    TileCoord tile;
    TileRows rows;  // of its sequence (tile_rows.hpp)
    int split;  // of the tile's keys (split_kv.cuh); 0 when not split
    Sequence seq;
    Mask mask;
    KeyTiles keys;
  };
  CUTE_DEVICE static bool find_work(Params const& p, int entry, Work& w) {
    const int tile_index = TileScheduler::tile_at(p.scheduler, entry);
    if (tile_index < 0) return false;
    w.tile = TileScheduler::coord(p.scheduler, tile_index);
    w.split = TileScheduler::split_at(p.scheduler, entry);
    w.seq = load_sequence(p.sequences, w.tile.batch);
    if (!w.seq.valid) return false;
    // Under a causal diagonal the short tile goes first (tile_rows.hpp).
    w.rows = TileRows::of(w.tile.m_block, Config::kBlockM, p.rows.count(w.seq.len_q),
                          p.scheduler.heavy_last_rows);
    if (w.rows.empty()) return false;
    w.mask = Mask{BandMask::make(w.seq.len_q, w.seq.len_k, false, p.band.left, p.band.right),
                  p.rows};
    w.keys = w.mask.key_tiles(w.mask.span(w.rows));
    if (p.scheduler.splits > 1) w.keys = split_share(w.keys, w.split, p.scheduler.splits);
    return true;
  }

  // Whether this tile's O goes through V's ring (o_free): tiles with keys, when not split.
  CUTE_DEVICE static bool stages_o(Params const& p, Work const& w) {
    return !p.split.enabled() && !w.keys.empty();
  }

  CUTE_DEVICE void operator()(Params const& p, char* smem_raw) const {
    auto& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int warpgroup = cutlass::canonical_warp_group_idx();
    const bool leader = warp == 0 && cute::elect_one_sync();

    if (leader) {
      Load::prefetch_descriptors(p.load);
      Epilogue::prefetch_descriptors(p.epilogue);
      cutlass::arch::ClusterTransactionBarrier::init(&smem.q_full, 1);
      cutlass::arch::ClusterBarrier::init(&smem.q_empty, Config::kConsumerWarpgroups);
      cutlass::arch::ClusterBarrier::init(&smem.o_free, 1);
    }
    typename Pipeline::Params pipe;
    pipe.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                               : Pipeline::ThreadCategory::Consumer;
    pipe.is_leader = leader;
    pipe.num_consumers = 128 * Config::kConsumerWarpgroups;
    pipe.transaction_bytes = Config::kBytesK;
    Pipeline pipeline_k(smem.pipeline_k, pipe, Shape<_1, _1, _1>{});
    pipe.transaction_bytes = Config::kBytesV;
    Pipeline pipeline_v(smem.pipeline_v, pipe, Shape<_1, _1, _1>{});
    cutlass::arch::fence_barrier_init();
    __syncthreads();
    // Launched after the tile order (launch_kernel_dependent), this prologue overlapped it; no
    // global memory is read before this wait. Otherwise the wait returns at once.
    cutlass::arch::wait_on_dependent_grids();

    // Producer and consumers walk the same tiles and skip the same ones. The K / V ring states and
    // the Q barriers' phases carry over from tile to tile.
    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
      if (warp == 1 && p.rows.packed()) {  // packed Q tiles are gathered row by row
        int q_tiles = 0;
        for (int t = TileScheduler::first(); TileScheduler::valid(p.scheduler, t);
             t = TileScheduler::next(t)) {
          Work w;
          if (!find_work(p, t, w)) continue;
          Load::load_packed_q(p.load, p.rows, w.tile, w.rows.first, w.seq, q_tiles++, smem.q.data(),
                              smem.q_full, smem.q_empty);
        }
      }
      if (!leader) return;
      PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
      PipelineState write_v = cutlass::make_producer_start_state<Pipeline>();
      int q_tiles = 0, o_staged = 0;
      for (int t = TileScheduler::first(); TileScheduler::valid(p.scheduler, t);
           t = TileScheduler::next(t)) {
        Work w;
        if (!find_work(p, t, w)) continue;
        const int staged_before = o_staged;
        if (stages_o(p, w)) ++o_staged;
        Load::run(p.load, p.rows, w.tile, w.rows.first, w.seq, w.keys, q_tiles++, staged_before,
                  smem.q.data(),
                  smem.k.data(),
                  smem.v.data(), smem.q_full, smem.q_empty, smem.o_free, pipeline_k, pipeline_v,
                  write_k, write_v);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
      const int thread = int(threadIdx.x) - 128;  // among the consumer threads
      const Turns turns(thread / 128);
      turns.start();
      PipelineState read_k, read_v;
      int q_tiles = 0;
      for (int t = TileScheduler::first(); TileScheduler::valid(p.scheduler, t);
           t = TileScheduler::next(t)) {
        Work w;
        if (!find_work(p, t, w)) continue;
        consume(p, smem, w, (q_tiles++) & 1, turns, pipeline_k, pipeline_v, read_k, read_v);
      }
      turns.finish();
    }
  }

 private:
  CUTE_DEVICE static void consume(Params const& p, SharedStorage& smem, Work const& w,
                                  int q_phase, Turns const& turns, Pipeline& pipeline_k,
                                  Pipeline& pipeline_v, PipelineState& read_k,
                                  PipelineState& read_v) {
    const TileCoord tile = w.tile;
    const Mask& mask = w.mask;
    const KeyTiles keys = w.keys;
    const int thread = int(threadIdx.x) - 128;  // among the consumer threads
    typename Config::TiledMmaQK mma_qk;
    typename Config::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread);
    auto thr_pv = mma_pv.get_thread_slice(thread);
    auto wg_qk = warpgroup_operand_slice(mma_qk, 1);
    auto wg_pv = warpgroup_operand_slice(mma_pv, 1);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Config::SmemLayoutVt{});
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);
    Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage)

    Tensor tOrO = partition_fragment_C(mma_pv, Shape<BlockM, HeadDimV>{});
    clear(tOrO);
    // Tile coordinates of this thread's score and output values, for the mask and the LSE rows.
    const auto score_coords =
        rowcol_view(thr_qk.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{})));
    const auto out_coords =
        rowcol_view(thr_pv.partition_C(make_identity_tensor(Shape<BlockM, HeadDimV>{})));

    OnlineSoftmax<decltype(size<0>(score_coords))::value, Config::kExp2PolyNum,
                  Config::kExp2PolyDen, Config::kRescaleThresholdLog2, Config::kSoftmaxChains,
                  Config::kRescaleVote>
        softmax(p.score_scale, p.score_scale * kLog2e);
    typename decltype(softmax)::RowVector rescale;
    using ScoreFrag = decltype(partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{}));
    Tensor tOrP = make_tensor<Element>(acc_to_operand_a_layout(ScoreFrag{}.layout()));

    // Softcap, then the mask, in the kernel's score units (see SoftcapScores).
    const auto row_keys = mask.row_keys(score_coords, w.rows.first);
    const auto span = mask.span(w.rows);
    auto prepare_scores = [&](auto& scores, int n_block) {
      if (p.softcap.enabled()) p.softcap.apply(scores);
      if (!mask.fully_visible(span, n_block)) {
        auto rc = rowcol_view(scores);
        mask.apply(rc, score_coords, row_keys, n_block);
      }
    };

    // Q is loaded even for a tile that sees no key, so that the Q barriers' phases advance once per
    // tile. Once this warpgroup's QKᵀ of the last key tile (keys.begin) has completed, the producer
    // may load the next tile's Q: that load then overlaps the last P·V and the epilogue.
    auto release_q = [&] {
      if (thread % 128 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.q_empty);
    };
    cutlass::arch::ClusterBarrier::wait(&smem.q_full, q_phase);
    if (keys.empty()) {
      // No wgmma ties this warpgroup's warps to their waits for Q here: they meet before Q is
      // released, or a lagging warp could wait on q_full after its phase had come round again.
      cutlass::arch::NamedBarrier::sync(128, uint32_t(ConsumerBarrier::kQRelease0) + thread / 128);
      release_q();
    } else {
      int n_block = keys.end - 1;
      {
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
        pipeline_k.consumer_wait(read_k);
        turns.wait();
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        turns.pass();
        warpgroup_wait<0>();
        pipeline_k.consumer_release(read_k);
        ++read_k;
        if (n_block == keys.begin) release_q();
        prepare_scores(tSrS, n_block);
        auto scores = rowcol_view(tSrS);
        softmax.update_max(scores, rescale);  // O is still empty: nothing to rescale
        softmax.exponentiate(scores);
        convert_fragment(tSrS, tOrP);
      }

      CUTE_NO_UNROLL
      for (; n_block > keys.begin; --n_block) {
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
        pipeline_k.consumer_wait(read_k);
        turns.wait();
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        pipeline_v.consumer_wait(read_v);
        wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        turns.pass();

        warpgroup_wait<1>();  // S of tile n_block − 1 is ready; P·V of tile n_block still runs
        pipeline_k.consumer_release(read_k);
        ++read_k;
        if (n_block - 1 == keys.begin) release_q();
        prepare_scores(tSrS, n_block - 1);
        auto scores = rowcol_view(tSrS);
        const bool rescale_o = softmax.update_max(scores, rescale);  // warp-uniform
        softmax.exponentiate(scores);

        warpgroup_wait<0>();  // P·V done: O may be rescaled and P overwritten
        pipeline_v.consumer_release(read_v);
        ++read_v;
        if (rescale_o) {
          auto o = rowcol_view(tOrO);
          scale_rows(o, rescale);
        }
        convert_fragment(tSrS, tOrP);
      }

      pipeline_v.consumer_wait(read_v);
      turns.wait();
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      turns.pass();
      warpgroup_wait<0>();
      pipeline_v.consumer_release(read_v);
      ++read_v;  // the ring carries over to the next tile
    }

    typename decltype(softmax)::RowVector o_scale, lse;
    softmax.finish(o_scale, lse);
    auto o = rowcol_view(tOrO);
    scale_rows(o, o_scale);
    if (p.split.enabled()) {
      Epilogue::store_partial(p.split, p.rows, tile, w.rows, w.split, w.seq, out_coords, tOrO,
                              lse, thread);
      return;
    }
    Epilogue::store_lse(p.epilogue, p.rows, tile, w.rows, w.seq, out_coords, lse, thread);
    if (stages_o(p, w))
      Epilogue::store_o(p.epilogue, p.rows, tile, w.rows, w.seq, mma_pv, tOrO, smem.v.data(),
                        smem.o_free, thread);
    else
      Epilogue::store_zero_o(p.epilogue, p.rows, tile, w.rows, w.seq, thread);
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    fwd_kernel(__grid_constant__ const typename Kernel::Params params) {
  extern __shared__ __align__(1024) char smem[];
  Kernel{}(params, smem);
}

}  // namespace fa4::sm90
