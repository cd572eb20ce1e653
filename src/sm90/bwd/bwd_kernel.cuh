// The sm90 backward kernel (docs/sm90_backward.md): one CTA per (key tile, query head, batch entry).
//   warpgroup 0: one thread issues the TMA loads (bwd_load.cuh), warp 1 the dQ reduce-adds
//   warpgroups 1, 2 (MMA, 240 registers): the tile loop below (BwdConfig), or, above head dim 128,
//   bwd_mma_wide.cuh's (BwdWideConfig). Below: 64 keys each. Per query tile m that sees the keys:
//     Sᵀ = K Qᵀ                        wgmma
//     P = exp2(Sᵀ·scale·log2e − LSE·log2e)   from the forward's LSE: no max, no sum
//     dPᵀ = V dOᵀ, dV += Pᵀ dO         wgmma, Pᵀ from registers
//     dS = P ∘ (dP − D)                (∘ (1 − tanh²) with softcap)
//     dS → shared memory; dQ = dS K     (half the head dim or rows per warpgroup), staged in
//                                       shared memory for the writer warp (bwd_dq_reduce.cuh)
//     dK += dSᵀ Q                      wgmma, dSᵀ from registers
//   then dK ·= scale, and dK, dV written (or added to the GQA accumulators).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/math_constants.hpp"
#include "sm90/bwd/bwd_dq_reduce.cuh"
#include "sm90/common/grouped_order.hpp"
#include "sm90/bwd/bwd_load.cuh"
#include "sm90/bwd/bwd_mask.cuh"
#include "sm90/bwd/bwd_mma_wide.cuh"
#include "sm90/bwd/bwd_pair.cuh"
#include "sm90/bwd/bwd_scores.cuh"
#include "sm90/common/score_variants.cuh"
#include "sm90/bwd/bwd_store.cuh"
#include "sm90/common/fragment.cuh"
#include "sm90/common/named_barriers.cuh"
#include "sm90/common/ring_release.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/common/softcap.cuh"
#include "sm90/common/softmax.cuh"
#include "sm90/common/wgmma.cuh"

namespace fa4::sm90 {

using namespace cute;

// The kernel's parameters: one type for both modes.
template <class Config>
struct BwdParams {
  typename BwdLoad<Config>::Params load;
  typename BwdStore<Config>::Params store;
  typename BwdDqReduce<Config>::Params dq;
  SequenceParams sequences;
  BandMask band;  // window sides, causal folded in; each sequence's lengths replace its sizes
  SoftcapScores softcap;
  float score_scale_log2;  // log2 units per unit of the kernel's scores (scale, or cap, ·log2e)
  ScoreVariantParams variants;  // ALiBi's slopes (score_variants.cuh); sinks need nothing here
  GroupedOrder order;      // CTA → (key tile, head, batch entry); key tiles (on pairs: pairs of
                           // them, BwdKernel::unit) of the longest sequence
  int heads_q;
  bool rotate_queries;  // where Config::kRotateQueries: key tiles start at their own query tiles
};

// kDeterministic: the deterministic mode (bwd_turns.cuh) is its own instance, so that the default
// mode's tile loop carries none of its turn bookkeeping (measured 4-6 % when it did).
template <class Config, bool kDeterministic>
struct BwdKernel {
  using KernelConfig = Config;
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  using HeadDim = typename Config::HeadDim;
  using Load = BwdLoad<Config>;
  using Store = BwdStore<Config>;
  using Pipeline = typename Load::Pipeline;
  using PipelineState = typename Load::PipelineState;
  using Mask = KeyTileMask<Config::kBlockN, Config::kBlockM>;
  using Pair = BwdPair<Config>;  // key-tile pairs (Config::kClusterCtas 2)
  static constexpr int kThreads = Config::kThreads;
  static_assert(!(Pair::kEnabled && kDeterministic), "deterministic mode orders single key tiles");

  using Params = BwdParams<Config>;
  // The tile loop's wgmma descriptors advanced whole from k-block to k-block (wgmma.cuh): its loop
  // is 16-23 instructions shorter a step at d64 / d128 than with cute's low-word advance.
  static constexpr DescAdvance kDescAdvance = DescAdvance::kWhole;

  struct NoP {};
  using SmemP = std::conditional_t<Config::kWide, BwdWideSmemP<Config>, NoP>;
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutDo>, 1024> dout;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutDs>, 1024> ds;
    SmemP p;  // the wide kernel's P
    // Per stage: the query tile's LSE·log2e (arrives with Q) and D (with dO).
    cute::array_aligned<float, Config::kStages * Config::kBlockM, 128> lse;
    cute::array_aligned<float, Config::kStages * Config::kBlockM, 128> dpsum;
    cute::array_aligned<float, cosize_v<typename BwdDqReduce<Config>::SmemLayout>, 1024> dq;
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
    alignas(8) uint64_t kv_full;
    alignas(8) uint64_t loads_issued[2];  // one-stage rings: BwdDqReduce::write
    typename Pair::SharedStorage pair;    // last: empty without pairs
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(cosize_v<typename Config::SmemLayoutQ> >=
                        cosize_v<typename Store::template StagingLayout<Config::kHeadDim>> &&
                    cosize_v<typename Config::SmemLayoutDo> >=
                        cosize_v<typename Store::template StagingLayout<Config::kHeadDimV>>,
                "dK and dV are staged in the Q and dO buffers (BwdStore::store_dkv)");
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may have");

  // What this CTA works on; false when the key tile is past its sequence's keys or the sequence's
  // entries are invalid (nothing is written then).
  struct Work {
    int n_block, head, batch;
    int stored_k;  // the sequence's key rows in the tensor: dK and dV are written for all of them
    Sequence seq;
    Mask mask;
    // The query tiles that see the key tile (on a key-tile pair: either of its two key tiles;
    // empty: none), in the order it visits them.
    QueryOrder<Config::kRotateQueries && !kDeterministic> order;
  };
  // CTA `cta`'s (key tile, head, batch entry): on pairs, the grid's order is one of key-tile pairs,
  // and the two CTAs of a cluster (adjacent in the grid) take the pair's two key tiles.
  CUTE_DEVICE static GroupedOrder::Unit unit(Params const& p, int cta) {
    return p.order.cluster_unit(cta, p.heads_q, Config::kClusterCtas);
  }

  CUTE_DEVICE static bool find_work(Params const& p, SequenceParams const& sequences, Work& w) {
    const GroupedOrder::Unit unit = BwdKernel::unit(p, int(blockIdx.x));
    w.n_block = unit.block;
    // Deterministic mode: key tiles in descending order, the order in which they add to dQ (see
    // mma): with a causal band a key tile's first query tile is then one its predecessors in the
    // grid (which start earlier and have less to do) have already passed. The plan keeps the
    // plain order there; groups (forced by Overrides::bwd_group) keep every turn's predecessors
    // earlier in the grid too, a pair's key tiles and a key tile's query heads staying in order.
    if constexpr (kDeterministic) w.n_block = p.order.blocks - 1 - w.n_block;
    w.head = unit.head;
    w.batch = unit.batch;
    w.seq = load_sequence(sequences, w.batch);
    if (!w.seq.valid) return false;
    w.stored_k = stored_keys(sequences, w.batch);
    if (w.n_block * Config::kBlockN >= w.stored_k) return false;
    w.mask = Mask{BandMask::make(w.seq.len_q, w.seq.len_k, false, p.band.left, p.band.right)};
    // A key tile past seqused_k sees no query: it only writes dK = dV = 0.
    auto queries_of = [&](int n) {
      return n * Config::kBlockN < w.seq.len_k ? w.mask.query_tiles(n) : QueryTiles{};
    };
    QueryTiles queries = queries_of(w.n_block);
    // Both CTAs of a pair walk the query tiles either key tile sees, in the same order; tiles
    // outside a CTA's own range are masked whole.
    if constexpr (Pair::kEnabled) queries = query_tile_hull(queries, queries_of(w.n_block ^ 1));
    // Only configs with kRotateQueries rotate; deterministic mode keeps the order of its turns.
    // A pair starts where its first key tile would.
    w.order = decltype(w.order)::make(queries, w.n_block / Config::kClusterCtas, p.order.blocks,
                                      p.rotate_queries);
    return true;
  }

  CUTE_DEVICE void operator()(Params const& p, char* smem_raw) const {
    auto& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int warpgroup = cutlass::canonical_warp_group_idx();
    const bool leader = warp == 0 && cute::elect_one_sync();

    if (leader) {
      Load::prefetch_descriptors(p.load);
      BwdDqReduce<Config>::prefetch_descriptor(p.dq);
      cutlass::arch::ClusterTransactionBarrier::init(&smem.kv_full, 1);
      cutlass::arch::ClusterBarrier::init(&smem.loads_issued[0], 1);
      cutlass::arch::ClusterBarrier::init(&smem.loads_issued[1], 1);
      if constexpr (Pair::kEnabled) Pair::init(smem.pair);
    }
    typename Pipeline::Params pipe;
    pipe.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                               : Pipeline::ThreadCategory::Consumer;
    pipe.is_leader = leader;
    pipe.num_consumers = ring_arrivals<Config::kMmaThreads>();  // ring_release.cuh
    pipe.transaction_bytes = Config::kBytesQ + Config::kBytesRowStat;  // Q and LSE
    Pipeline pipeline_q(smem.pipeline_q, pipe, Shape<_1, _1, _1>{});
    pipe.transaction_bytes = Config::kBytesDo + Config::kBytesRowStat;  // dO and D
    Pipeline pipeline_do(smem.pipeline_do, pipe, Shape<_1, _1, _1>{});
    cutlass::arch::fence_barrier_init();
    if constexpr (Pair::kEnabled)
      Pair::sync();
    else
      __syncthreads();

    Work w;
    const bool has_work = find_work(p, p.sequences, w);
    // Launched dependent on the prepare kernel (bwd_launch.cuh): every thread waits for it before
    // it reads what that kernel writes (the stats, dQ's cleared accumulator) or ends, so that this
    // grid's end implies that one's; the load thread once it has issued K and V (BwdLoad::run).
    const bool loads = leader && has_work && !w.order.tiles.empty();
    if (!loads) {
      cutlass::arch::wait_on_dependent_grids();
      // With counts (BwdDqReduce::Params::done), the dQ finish kernel may start once every CTA
      // has got here: its blocks wait for the CTAs of their own (batch entry, head) through
      // dq_done (bwd_rows.cuh), so that those done before the last round run on the SMs it
      // leaves idle. After the wait: the prepare kernel's clearing of dq_done is then visible
      // before any dQ block reads it.
      if (p.dq.done != nullptr) cutlass::arch::launch_dependent_grids();
    }
    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
      if (!has_work || w.order.tiles.empty()) {
        // No reduce-adds; the count has waited for the prepare kernel's clearing (above).
        if (warp == 1) BwdDqReduce<Config>::landed(p.dq, dq_done_slot(p));
        return;
      }
      if (leader) {
        Load::run(p.load, w.head, w.n_block, w.batch, w.seq, w.order, smem.q.data(),
                  smem.dout.data(), smem.k.data(), smem.v.data(), partner_k(smem), smem.lse.data(),
                  smem.dpsum.data(), smem.kv_full, pipeline_q, pipeline_do, loads_issued(smem));
      } else if (warp == 1) {
        write_dq(p, smem, w);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kMmaRegisters>();
      if (!has_work) return;
      if constexpr (Config::kWide)
        BwdMmaWide<BwdKernel>::run(p, smem, w, pipeline_q, pipeline_do);
      else
        mma(p, smem, w, pipeline_q, pipeline_do);
    }
  }

  // After the tile loop: dK ·= scale, and dK, dV written (or added to the GQA accumulators). The
  // sequence is read again rather than held through the loop (registers): the empty asm keeps the
  // compiler from reusing the first reads.
  // `smem`: its Q and dO buffers stage dK and dV on their way out (BwdStore::store_dkv).
  template <class ThrMma, class AccK, class AccV>
  CUTE_DEVICE static void store_dkv(Params const& p, ThrMma const& thr_kv, AccK& dK, AccV& dV,
                                    SharedStorage& smem) {
    SequenceParams again = p.sequences;
    asm volatile("" : "+l"(again.cu_seqlens_q), "+l"(again.cu_seqlens_k));
    Work done;
    find_work(p, again, done);
    Store::template store_dkv<kDeterministic>(p.store, done.batch, done.head, done.n_block,
                                              done.seq, done.stored_k, thr_kv, dK, dV,
                                              smem.q.data(), smem.dout.data());
  }

  // An MMA thread done with `state`'s stage of a Q / dO ring (ring_release.cuh). PipelineTmaAsync,
  // built here for a cluster of one CTA, sends each release to the cluster's first CTA; on key-tile
  // pairs, whose rings are still each CTA's own, every thread arrives on its own CTA's barrier
  // instead (with warp arrivals each warp arrives on its own CTA's barrier either way).
  CUTE_DEVICE static void release(typename Pipeline::SharedStorage& ring, Pipeline& pipeline,
                                  PipelineState const& state) {
    if constexpr (Pair::kEnabled && !kWarpArrivals) ring.empty_barrier_[state.index()].arrive();
    else release_stage(ring, pipeline, state);
  }

  // ALiBi's slope of this CTA's (batch entry, query head), in the kernel's score units (both tile
  // loops: this one's and bwd_mma_wide.cuh's).
  CUTE_DEVICE static float alibi_slope(Params const& p, Work const& w) {
    return sm90::alibi_slope(p.variants, w.batch, w.head);  // score_variants.cuh
  }

 private:
  CUTE_DEVICE static void mma(Params const& p, SharedStorage& smem, Work const& w,
                              Pipeline& pipeline_q, Pipeline& pipeline_do) {
    const int thread = int(threadIdx.x) - 128;  // among the MMA threads
    typename Config::TiledMmaSdP mma_sdp;
    typename Config::TiledMmaKV mma_kv;
    typename Config::TiledMmaQ mma_q;
    auto thr_sdp = mma_sdp.get_thread_slice(thread);
    auto thr_kv = mma_kv.get_thread_slice(thread);
    auto wg_sdp = warpgroup_operand_slice(mma_sdp, 1);
    auto wg_kv = warpgroup_operand_slice(mma_kv, 1);
    auto wg_q = warpgroup_operand_slice(mma_q, 1);

    // The wgmma operands' shared-memory descriptors are made where each GEMM is issued
    // (opaque_smem_tensor); at d128 where they are made makes no difference to the spills.
    auto smem_tensor = [](auto* data, auto layout) { return opaque_smem_tensor(data, layout); };
    using LayoutQ = typename Config::SmemLayoutQ;  // also dO's
    using LayoutQt = typename Config::SmemLayoutQt;
    using LayoutK = typename Config::SmemLayoutK;
    using LayoutKt = typename Config::SmemLayoutKt;
    using LayoutV = typename Config::SmemLayoutV;
    using LayoutDs = typename Config::SmemLayoutDs;
    Tensor sDst = make_tensor(make_smem_ptr(smem.ds.data()), typename Config::SmemLayoutDst{});
    constexpr int kDsStageElements = Config::kBlockM * Config::kBlockN;
    static_assert(typename Config::SmemLayoutDst{}(0, 0, 1) == kDsStageElements);
    const AccumulatorStore<SM90_U16x8_STSM_T, typename Config::TiledMmaSdP, Element> store_ds(
        thread, sDst(_, _, 0));

    Tensor dV = partition_fragment_C(mma_kv, Shape<BlockN, HeadDim>{});
    Tensor dK = partition_fragment_C(mma_kv, Shape<BlockN, HeadDim>{});
    clear(dV);
    clear(dK);
    // (key, query) of this thread's Sᵀ values, as (rows, cols).
    const auto score_coords =
        rowcol_view(thr_sdp.partition_C(make_identity_tensor(Shape<BlockN, BlockM>{})));
    using ScoreFrag = decltype(partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{}));
    Tensor tKVrP = make_tensor<Element>(acc_to_operand_a_layout(ScoreFrag{}.layout()));
    Tensor tKVrDs = make_tensor<Element>(acc_to_operand_a_layout(ScoreFrag{}.layout()));
    // P written value by value, in the accumulator's register order (= the operand's).
    auto p_rc = rowcol_view(make_tensor(tKVrP.data(), ScoreFrag{}.layout()));

    const auto row_queries = w.mask.row_queries(score_coords, w.n_block);
    // This thread's first query column. Its others lie 1, 8 and 9 past it and again every 16
    // (an m64nN accumulator's columns; tests/gpu/test_sm90_bwd_stat_quads.cu): stat_quad's order.
    const int first_query = get<1>(score_coords(0, 0));
    const QueryTiles unmasked = w.mask.unmasked_tiles(w.n_block);
    const auto order = w.order;

    // The tile loop, compiled once per (softcap, ALiBi) setting (run_by_variant): with softcap,
    // P must be rounded before Sᵀ becomes dS's factor.
    // Inlined by force: left to itself the compiler outlines the four instances into calls, and
    // wgmmas in flight across a call are serialized (ptxas C7510).
    auto tiles = [&](auto softcap_tag, auto alibi_tag) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kSoftcap = decltype(softcap_tag)::value;
      constexpr bool kAlibi = decltype(alibi_tag)::value;
      const BwdAlibi alibi{kAlibi ? alibi_slope(p, w) : 0.0f};
      // P rounded with the exponentials (Config::kDvBeforeDs), or from Sᵀ once dS is known.
      constexpr bool kEarlyP = Config::kDvBeforeDs || kSoftcap;
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.kv_full, 0);
      PipelineState read;  // the Q and dO rings advance together
      CUTE_NO_UNROLL
      for (int step = w.order.tiles.begin; step < w.order.tiles.end; ++step) {
        const int m = order.tile(step);
        const int stage = read.index();
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
        pipeline_q.consumer_wait(read);
        wgmma_issue<true, kDescAdvance>(
            mma_sdp, wg_sdp.partition_fragment_A(smem_tensor(smem.k.data(), LayoutK{})),
            wg_sdp.partition_fragment_B(smem_tensor(smem.q.data(), LayoutQ{}))(_, _, _, stage),
            tSrS);
        // dPᵀ right behind Sᵀ, as FA3 does: it runs during the exponentials.
        Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
        pipeline_do.consumer_wait(read);
        wgmma_issue<true, kDescAdvance>(
            mma_sdp, wg_sdp.partition_fragment_A(smem_tensor(smem.v.data(), LayoutV{})),
            wg_sdp.partition_fragment_B(smem_tensor(smem.dout.data(), LayoutQ{}))(_, _, _, stage),
            tSrDp);
        auto s = rowcol_view(tSrS);
        // LSE and D are read from shared memory per column where they are used: held in
        // registers for the whole tile they would push dK and dV out of the register file.
        warpgroup_wait<1>();  // Sᵀ is ready (dPᵀ may still run)
        const float* lse_row = stage_stats<Config::kBlockM>(smem.lse.data(), stage);
        if constexpr (kSoftcap) p.softcap.apply(tSrS);
        if (!unmasked.contains(m))
          Mask::apply(s, score_coords, row_queries, m);
        static_assert(decltype(size<1>(s))::value % 4 == 0, "whole 16-column blocks (stat_quad)");
        // Rows are keys, columns queries (Sᵀ).
        const float alibi_first =
            kAlibi ? BwdAlibi::first<true>(w.n_block * Config::kBlockN + get<0>(score_coords(0, 0)),
                                           m * Config::kBlockM + get<1>(score_coords(0, 0)),
                                           w.seq.len_k - w.seq.len_q)
                   : 0.0f;
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          // Columns come in fours (stat_quad); ptxas folds the repeated loads into one.
          const float lse = quad_value(stat_quad(lse_row, first_query, j / 4), j % 4);
          CUTE_UNROLL
          for (int i = 0; i < size<0>(s); ++i) {
            const float t = s(i, j);
            // ALiBi's bias enters P only: dS's softcap factor is of the capped score itself.
            const float biased =
                kAlibi ? alibi.add<true>(t, alibi_first,
                                         get<0>(score_coords(i, 0)) - get<0>(score_coords(0, 0)),
                                         get<1>(score_coords(0, j)) - get<1>(score_coords(0, 0)))
                       : t;
            const float prob = bwd_probability(biased, p.score_scale_log2, lse);
            if constexpr (kEarlyP) p_rc(i, j) = Element(prob);
            s(i, j) = ds_factor<kSoftcap>(prob, t);
          }
        }
        // The exponentials before the wait for dPᵀ, which they are to overlap. This orders them
        // for the compiler only: ptxas may still place the wait first, and does at d64 (SASS),
        // where nothing issued in between depends on them.
        warpgroup_fence_operand(tSrS);
        if constexpr (Config::kDvBeforeDs)
          wgmma_issue<false, kDescAdvance>(
              mma_kv, tKVrP,
              wg_kv.partition_fragment_B(smem_tensor(smem.dout.data(), LayoutQt{}))(_, _, _, stage),
              dV);
        auto dp = rowcol_view(tSrDp);
        // dPᵀ is ready (dV may still run: P's registers stay as they are)
        warpgroup_wait<Config::kDvBeforeDs ? 1 : 0>();
        const float* dpsum_row = stage_stats<Config::kBlockM>(smem.dpsum.data(), stage);
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          const float dpsum =
              quad_value(stat_quad(dpsum_row, first_query, j / 4), j % 4);
          CUTE_UNROLL
          for (int i = 0; i < size<0>(s); ++i) dp(i, j) = s(i, j) * (dp(i, j) - dpsum);
        }
        if constexpr (!kEarlyP) convert_fragment(tSrS, tKVrP);
        convert_fragment(tSrDp, tKVrDs);
        // dS of both warpgroups into shared memory for dQ. Its two stages alternate by step: a
        // warpgroup writing step + 1's may still be ahead of the other's dQ reading this step's,
        // never further, since each waits for its own dQ before the next step's barrier.
        // stmatrix.trans: the (query, key) tile from the (key, query) registers.
        store_ds(make_tensor(tKVrDs.data(), ScoreFrag{}.layout()), sDst(_, _, 0),
                 (step & 1) * kDsStageElements);
        if constexpr (!Config::kDvBeforeDs)
          wgmma_issue<false, kDescAdvance>(
              mma_kv, tKVrP,
              wg_kv.partition_fragment_B(smem_tensor(smem.dout.data(), LayoutQt{}))(_, _, _, stage),
              dV);

        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(Config::kMmaThreads, kBwdDsReadyBarrier);

        Tensor dQ = partition_fragment_C(mma_q, Shape<BlockM, HeadDim>{});
        wgmma_issue<true, kDescAdvance>(
            mma_q,
            wg_q.partition_fragment_A(smem_tensor(smem.ds.data(), LayoutDs{}))(_, _, _, step & 1),
            wg_q.partition_fragment_B(smem_tensor(smem.k.data(), LayoutKt{})), dQ);
        wgmma_issue<false, kDescAdvance>(
            mma_kv, tKVrDs,
            wg_kv.partition_fragment_B(smem_tensor(smem.q.data(), LayoutQt{}))(_, _, _, stage), dK);
        warpgroup_wait<1>();  // dV and dQ are done
        release(smem.pipeline_do, pipeline_do, read);  // dPᵀ, dV and D were the stage's readers
        BwdDqReduce<Config>::stage(smem.dq.data(), mma_q, dQ, thread);
        warpgroup_wait<0>();  // dK is done: Q's stage is free
        release(smem.pipeline_q, pipeline_q, read);
        ++read;
      }
    };
    if (!w.order.tiles.empty())
      run_by_variant(p.softcap.enabled(), p.variants.alibi != nullptr, tiles);
    store_dkv(p, thr_kv, dK, dV, smem);
  }

  // The dQ writer warp (bwd_dq_reduce.cuh). Deterministic mode: dQ of a query tile is added from
  // its last key tile down, this key tile's turn being how many key tiles after it see the tile.
  CUTE_DEVICE static void write_dq(Params const& p, SharedStorage& smem, Work const& w) {
    const auto rows = BwdDqReduce<Config>::rows(p.dq, w.seq, w.batch);
    auto counter = [&](int m, int wg) -> int32_t* {
      if constexpr (kDeterministic) return Store::dq_counter(p.store, w.batch, w.head, m, wg);
      else return nullptr;
    };
    auto turn = [&](int m) { return w.mask.last_tile(m) - w.n_block; };
    // On a pair, this CTA's half of the head dim: its rank's.
    const int first_half =
        Pair::kEnabled ? int(cute::block_rank_in_cluster()) * Config::kMmaWarpgroups : 0;
    BwdDqReduce<Config>::write(p.dq, smem.dq.data(), w.head, rows, w.order, counter, turn,
                               loads_issued(smem), first_half);
    BwdDqReduce<Config>::landed(p.dq, dq_done_slot(p));
  }

  // This CTA's (batch entry, head) in dq_done ([batch][heads_q]), found again from the CTA's index
  // rather than held through the tile loop by the producer warpgroup (24 registers: holding it
  // spilled in the deterministic mode).
  CUTE_DEVICE static int64_t dq_done_slot(Params const& p) {
    int cta = int(blockIdx.x);
    asm volatile("" : "+r"(cta));
    const GroupedOrder::Unit u = unit(p, cta);
    return int64_t(u.batch) * p.heads_q + u.head;
  }

  CUTE_DEVICE static Element* partner_k(SharedStorage& smem) {
    if constexpr (Pair::kEnabled) return smem.pair.k.data();
    else return nullptr;
  }

  // With one-stage Q / dO rings, the next tile's loads are on the critical path: the dQ writer
  // waits for them to be issued (bwd_dq_reduce.cuh).
  CUTE_DEVICE static uint64_t* loads_issued(SharedStorage& smem) {
    return Config::kStages == 1 ? smem.loads_issued : nullptr;
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    bwd_kernel(__grid_constant__ const typename Kernel::Params params) {
  extern __shared__ __align__(1024) char smem[];
  Kernel{}(params, smem);
}

}  // namespace fa4::sm90
