// The sm_90a forward kernel: a CTA computes O and LSE of query tiles (128 rows, 192 at d64, 64 in
// the narrow variant), each of one head of one sequence (fixed-length or varlen; sequence.cuh),
// one after the other (tile_scheduler.cuh).
//
//   warpgroup 0 (producer, 24 to 56 registers): one thread finds each tile and publishes it for
//   the consumers (tile_queue.cuh), then loads, by TMA, the tile's first K tile, its Q (once the
//   previous tile's last QKᵀ has read Q's buffer), then the other K and V tiles (the first V,
//   where O is staged in V's ring, once the previous tile's O has been stored; at d64 / d96 /
//   d128 (not the narrow variant) O has a buffer of its own, FwdConfig::kOBuffer). With pack-GQA
//   (query_rows.cuh) the tile's rows come from G heads and a second warp gathers Q; with a paged
//   KV cache whose pages do not hold whole key tiles a third and a fourth warp load K and V
//   through the page table, in pieces (issue_key_pieces) or row by row (gather_keys), and the
//   load thread loads Q alone. With e4m3 operands those two warps transpose each V stage into a
//   Vᵀ ring instead, which P·V reads (fwd_values.cuh).
//   warpgroups 1.. (consumers: two with 240 registers, three with 160 at d64, one with 240 in the
//   narrow variant): 64 query rows each, taking turns at the tensor cores. Per key tile j, going
//   down:
//     S = Q Kⱼᵀ                    wgmma, issued together with O += P Vⱼ₊₁ in this warpgroup's turn
//     S = softcap(S), mask(S)       only on tiles the band or seqlen_k cuts
//     m, P = online softmax(S)      exp2, scale·log2e folded into one FFMA
//     O *= exp2(m_old − m_new)      once O += P Vⱼ₊₁ has landed
//   then O /= rowsum, LSE = m + log(rowsum), O and LSE stored.
// The chunked variant (Config::kChunked, fwd_config.cuh: d256 with 128-key tiles) has one ring of
// half-head-dim K and V chunks instead of the two rings, and a different turn: P·V of tile j + 1,
// then, once it is done, QKᵀ of tile j (consume_chunked); its O is stored from registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/mask.hpp"
#include "sm90/fwd/fwd_epilogue.cuh"
#include "sm90/common/fragment.cuh"
#include "sm90/fwd/fwd_load.cuh"
#include "sm90/common/tile_mask.cuh"
#include "sm90/fwd/query_rows.cuh"
#include "sm90/common/ring_release.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/common/softcap.cuh"
#include "sm90/common/score_variants.cuh"
#include "sm90/common/softmax.cuh"
#include "sm90/fwd/tile_queue.cuh"
#include "sm90/fwd/tile_rows.hpp"
#include "sm90/fwd/tile_scheduler.cuh"
#include "sm90/fwd/warpgroup_turns.cuh"
#include "sm90/common/wgmma.cuh"
#include "sm90/fp8/descales.cuh"
#include "sm90/fwd/fwd_values.cuh"

namespace fa4::sm90 {

using namespace cute;

// kAlibiLinear_: the kernel for calls that pass ALiBi slopes, with the bias's linear form
// (Config::kAlibiLinearFits); the other kernels add ALiBi's full bias per key tile where a call
// passes slopes.
template <class Config, bool kAlibiLinear_ = false>
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
  static constexpr bool kFp8 = Config::kFp8;
  // P·V's operands (fwd_values.cuh): with e4m3, a Vᵀ ring that producer warps fill.
  using Values = FwdValues<Config>;
  using VtPipeline = typename Values::VtPipeline;
  using KeyRing = RingReader<Pipeline>;
  using ValueRing = typename Values::Reader;

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
    ScoreVariantParams variants;  // ALiBi, sinks (score_variants.cuh)
    fp8::Descales descales;  // e4m3 inputs' (fp8/descales.cuh); unused otherwise
  };

  using ChunkPipeline = typename Load::ChunkPipeline;
  using ChunkPipelineState = typename Load::ChunkPipelineState;
  struct Rings {  // K and V rings of whole tiles; O is staged in V's (without Config::kOBuffer)
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutV>, 1024> v;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
  };
  // e4m3: the Vᵀ ring right after V's (both whole multiples of 1 KB), so that O staged in V's ring
  // may span both.
  struct RingsVt {
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutVt>, 1024> vt;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    typename VtPipeline::SharedStorage pipeline_vt;
  };
  using KvRings = std::conditional_t<kFp8, RingsVt, Rings>;
  // The rings with O's own buffer (Config::kOBuffer).
  struct RingsAndO : KvRings {
    cute::array_aligned<typename Config::ElementO, cosize_v<typename Config::SmemLayoutOBuffer>,
                        1024>
        o;
  };
  struct ChunkRing {  // Config::kChunked
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutChunk>, 1024> c;
    typename ChunkPipeline::SharedStorage pipeline;
  };
  // The gathering warps' row tables (K's, V's: gather_keys), or, where pages hold whole pieces,
  // the load thread's ring of page-table entries of key tiles' pieces (FwdLoad::load_pieces);
  // the chunked and unmasked kernels do neither (Config::kGathers: they load whole key tiles).
  union GatherRows {
    alignas(16) uintptr_t rows[2][Config::kBlockN];
    alignas(16) int32_t pieces[Load::kEntrySets * Load::kPieces];
  };
  struct NoGatherRows {
    static constexpr int32_t* pieces = nullptr;  // FwdLoad::run reads no entries without pieces
  };
  // What a CTA does for one tile of the grid.
  struct Work {
    TileCoord tile;
    TileRows rows;  // of its sequence (tile_rows.hpp)
    int split;  // of the tile's keys (split_kv.cuh); 0 when not split
    Sequence seq;
    Mask mask;
    KeyTiles keys;

    CUTE_DEVICE bool valid() const { return seq.valid; }  // Work{} ends the TileQueue
  };
  using Tiles = TileQueue<Work>;
  static constexpr bool kOBuffer = Config::kOBuffer;
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<typename Config::SmemLayoutQ>, 1024> q;
    std::conditional_t<Config::kChunked, ChunkRing,
                       std::conditional_t<kOBuffer, RingsAndO, KvRings>>
        kv;
    typename Tiles::SharedStorage tiles;
    alignas(8) uint64_t q_full;   // Q of the current tile has landed
    alignas(8) uint64_t q_empty;  // every consumer warpgroup is past its last QKᵀ: Q may be reloaded
    alignas(8) uint64_t o_free;   // the last O staged in V's ring has left it: V may be reloaded
    std::conditional_t<Config::kGathers, GatherRows, NoGatherRows> gather;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may have");

  // The tile of grid entry `entry`; false when it is past its sequence's end (the grid covers the
  // longest one) or the sequence's entries are invalid.
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

  // Whether this tile's O is staged for a TMA store: tiles with keys, when not split.
  CUTE_DEVICE static bool stages_o(Params const& p, Work const& w) {
    return !p.split.enabled() && !w.keys.empty();
  }
  // Whether it is staged in V's ring, which the next tile's V then waits for (o_free).
  CUTE_DEVICE static bool stages_o_in_v(Params const& p, Work const& w) {
    return !kOBuffer && stages_o(p, w);
  }

  // The online softmax of this kernel's settings, for kRows rows per thread.
  template <int kRows>
  using Softmax = OnlineSoftmax<kRows, Config::kExp2PolyNum, Config::kExp2PolyDen,
                                Config::kRescaleThresholdLog2, Config::kSoftmaxChains,
                                Config::kRescaleVote,
                                std::conditional_t<Config::kRoundedRowSum, Element, float>,
                                Config::kPLog2Offset>;

  // ALiBi's linear form (fwd/alibi_linear.hpp): launched only where the call passes slopes.
  static constexpr bool kAlibiLinear = kAlibiLinear_;
  static_assert(!kAlibiLinear || Config::kAlibiLinearFits,
                "ALiBi's linear form needs registers for its rows' slopes and diagonals");

  // The score step, in the kernel's score units (see SoftcapScores): softcap (the tile's:
  // tile_softcap), ALiBi's bias, then the mask. `coords` and `row_keys` are this thread's
  // (Mask::row_keys), `visible` the tile's (Mask::visible_tiles), `variants` its rows'
  // (score_variants.cuh). Returns the shift the softmax adds back (ALiBi's linear form), else
  // NoRowShift.
  template <class Scores, class Coords, class RowKeys, class Alibi>
  CUTE_DEVICE static auto prepare_scores(Params const& p, Work const& w,
                                         SoftcapScores const& softcap, Scores& scores,
                                         Coords const& coords, RowKeys const& row_keys,
                                         KeyTiles visible, Alibi const& alibi, int n_block) {
    if (softcap.enabled()) softcap.apply(scores);
    auto shift = [&] {
      if constexpr (kAlibiLinear) {
        auto rc = rowcol_view(scores);
        return apply_alibi_linear<Config::kBlockN>(rc, coords, alibi, n_block, w.seq.len_k - 1);
      } else {
        // The rows' slopes and diagonals are made afresh per key tile: held through the tile
        // loop, they would take registers the three-warpgroup kernel (d64) does not have.
        if (p.variants.alibi != nullptr) {
          auto rc = rowcol_view(scores);
          apply_alibi<Config::kBlockN>(rc, coords, p.variants, p.rows, w.seq, w.tile.batch,
                                       w.tile.head, w.rows.first, n_block);
        }
        return NoRowShift{};
      }
    }();
    if (!visible.contains(n_block)) {
      auto rc = rowcol_view(scores);
      w.mask.apply(rc, coords, row_keys, n_block);
    }
    return shift;
  }

  // prepare_scores for one consumer thread's tile, its row keys, the tile's unmasked key tiles and
  // (ALiBi's linear form) its rows' slopes and diagonals made once.
  template <class Coords>
  CUTE_DEVICE static auto score_preparation(Params const& p, Work const& w, Coords const& coords,
                                            SoftcapScores const& softcap) {
    constexpr int kRows = decltype(cute::size<0>(coords))::value;
    auto alibi = [&] {
      if constexpr (kAlibiLinear) {
        return alibi_rows<kRows>(p.variants, p.rows, w.seq, w.tile.batch, w.tile.head,
                                 w.rows.first, coords);
      } else {
        return NoRowShift{};  // unused
      }
    }();
    return [&p, &w, &coords, &softcap, row_keys = w.mask.row_keys(coords, w.rows.first),
            visible = w.mask.visible_tiles(w.mask.span(w.rows)), alibi](auto& scores, int n_block) {
      return prepare_scores(p, w, softcap, scores, coords, row_keys, visible, alibi, n_block);
    };
  }

  // A tile's score scale, softcap and O factor: the kernel's, with e4m3 times the descales of the
  // tile's batch entry and kv head (fp8/descales.cuh). With softcap the descales scale the tanh's
  // argument (its prescale) and the softmax's scale stays the cap.
  struct TileScales {
    SoftcapScores softcap;
    float score_scale;
    float o = 1.0f;
  };
  CUTE_DEVICE static TileScales tile_scales(Params const& p, Work const& w) {
    if constexpr (kFp8) {
      const int kv_head = p.rows.packed() ? w.tile.head : w.tile.head / p.load.head_group;
      const auto d = fp8::TileDescales::of(p.descales, w.tile.batch, kv_head);
      if (p.softcap.enabled())
        return {SoftcapScores{p.softcap.prescale * d.qk}, p.score_scale, d.v};
      return {p.softcap, p.score_scale * d.qk, d.v};
    } else {
      return {p.softcap, p.score_scale};
    }
  }
  // The softcap prepare_scores applies: the tile's with e4m3, else the kernel's own parameter (read
  // where it is used, as before the descales existed).
  CUTE_DEVICE static SoftcapScores const& tile_softcap(Params const& p, TileScales const& s) {
    if constexpr (kFp8)
      return s.softcap;
    else
      return p.softcap;
  }

  // O's normalisation and LSE: with sinks (not split: the combine folds them in), each row's
  // sink joins its denominator.
  template <class Softmax, class RowVector, class Coords>
  CUTE_DEVICE static void finish_rows(Params const& p, Work const& w, Softmax& softmax,
                                      RowVector& o_scale, RowVector& lse, Coords const& coords) {
    if (p.variants.sinks != nullptr && !p.split.enabled())
      softmax.finish(o_scale, lse,
                     row_sinks<decltype(cute::size<0>(coords))::value>(
                         p.variants, p.rows, w.seq, w.tile.head, w.rows.first, coords));
    else
      softmax.finish(o_scale, lse);
  }

  // Q is loaded even for a tile that sees no key, so that the Q barriers' phases advance once per
  // tile. Once this warpgroup's QKᵀ of the last key tile (keys.begin) has completed, the producer
  // may load the next tile's Q: that load then overlaps the last P·V and the epilogue.
  CUTE_DEVICE static void release_q(SharedStorage& smem, int thread) {
    if (thread % 128 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.q_empty);
  }
  // A tile that sees no key: Q is waited for and released at once. No wgmma ties this
  // warpgroup's warps to their waits for Q here: they meet before Q is released, or a lagging warp
  // could wait on q_full after its phase had come round again.
  CUTE_DEVICE static void skip_keyless(SharedStorage& smem, int thread) {
    cutlass::arch::NamedBarrier::sync(128, uint32_t(ConsumerBarrier::kWarpgroup0) + thread / 128);
    release_q(smem, thread);
  }

  // The key tiles this consumer warpgroup's own rows see, within the tile's: those of its 64-row
  // slice of the rows the tile stores (Config::kOwnKeyTiles; else the tile's). A slice past them
  // (past the sequence's end, or the next tile's rows in a short first tile: tile_rows.hpp) sees
  // none, and on a causal diagonal the upper slices see fewer key tiles than the tile; the rest the
  // warpgroup only passes on (pass_key_tiles), so that the tensor cores and the MUFU run the other
  // warpgroups' work meanwhile.
  CUTE_DEVICE static KeyTiles own_key_tiles(Work const& w) {
    // Warp-uniform: from thread / 128 the branches on the result are not known to be uniform,
    // and d64's kernel then spills 84-100 bytes (measured).
    const int warpgroup = cutlass::canonical_warp_group_idx() - 1;
    TileRows slice{w.rows.first + 64 * warpgroup, 0};
    slice.end = cute::min(w.rows.end, slice.first + 64);
    if (slice.empty() || w.keys.empty()) return {};
    if constexpr (!Config::kOwnKeyTiles) {
      // Only a slice past the rows is skipped: a decode tile of a few packed rows then costs one
      // warpgroup's GEMMs and softmax, not all of them.
      return w.keys;
    } else {
      const KeyTiles own = w.mask.key_tiles(w.mask.span(slice));
      // Within the tile's key tiles, which a split narrows to its share.
      return {cute::max(own.begin, w.keys.begin), cute::min(own.end, w.keys.end)};
    }
  }

  // `count` key tiles this warpgroup's rows do not see, from the ring's next: each consumer
  // warpgroup releases every stage, and all take the same turns, so their K and V are waited for
  // and released and their turns passed on. One turn per key tile, as the GEMMs take them.
  CUTE_DEVICE static void pass_key_tiles(int count, Turns const& turns, KeyRing ring_k,
                                         ValueRing ring_v, PipelineState& read_k,
                                         PipelineState& read_v) {
    CUTE_NO_UNROLL
    for (int i = 0; i < count; ++i) {
      ring_k.wait(read_k);
      turns.wait();
      turns.pass();
      ring_k.release(read_k);
      ++read_k;
      ring_v.wait(read_v);
      ring_v.release(read_v);
      ++read_v;
    }
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
    if constexpr (Config::kChunked)
      run_chunked(p, smem, warp, warpgroup, leader);
    else
      run_rings(p, smem, warp, warpgroup, leader);
  }

 private:
  // Gathered K and V (`gathered`): each lane of a ring's gathering warp arrives on a stage's full
  // barrier when its copies land (FwdLoad::gather_key_tile); else the load thread, with the
  // stage's TMA bytes. The readers (the consumers; of V's ring with e4m3, the transposing warps)
  // release a stage through release_stage (ring_release.cuh).
  template <class PipelineT, int kReaders = 128 * Config::kConsumerWarpgroups>
  CUTE_DEVICE static typename PipelineT::Params pipeline_params(int warpgroup, bool leader,
                                                                 int bytes, bool gathered = false) {
    typename PipelineT::Params pipe;
    pipe.role = warpgroup == 0 ? PipelineT::ThreadCategory::Producer
                               : PipelineT::ThreadCategory::Consumer;
    pipe.is_leader = leader && !gathered;
    pipe.num_producers = gathered ? 32 : 1;
    pipe.num_consumers = ring_arrivals<kReaders>();  // ring_release.cuh
    pipe.transaction_bytes = bytes;
    return pipe;
  }

  // Launched after the tile order or a KV cache's prepare kernel (launch_kernel_dependent), the
  // prologue overlapped it; no global memory is read before this wait. Otherwise the wait returns
  // at once.
  CUTE_DEVICE static void end_prologue() {
    cutlass::arch::fence_barrier_init();
    __syncthreads();
    cutlass::arch::wait_on_dependent_grids();
  }

  // f(work, q_tile) for each tile this CTA runs, in order; q_tile counts them (Q's barriers'
  // phases). The load thread and pack-GQA's Q warp walk the same tiles and skip the same ones;
  // the consumers take them from the load thread (for_each_published_tile).
  template <class F>
  CUTE_DEVICE static void for_each_tile(Params const& p, F&& f) {
    int q_tile = 0;
    for (int t = TileScheduler::first(); TileScheduler::valid(p.scheduler, t);
         t = TileScheduler::next(t)) {
      Work w;
      if (find_work(p, t, w)) f(w, q_tile++);
    }
  }

  // The load thread's for_each_tile: each tile is published for the consumers (TileQueue) before
  // f loads it, and the end after the last.
  template <class F>
  CUTE_DEVICE static void publish_each_tile(Params const& p, Tiles& tiles, F&& f) {
    typename Tiles::State write = Tiles::producer_start();
    for_each_tile(p, [&](Work const& w, int q_tile) {
      tiles.publish(w, write);
      f(w, q_tile);
    });
    tiles.publish_end(write);
  }
  // The consumers' for_each_tile: the tiles as the load thread published them.
  template <class F>
  CUTE_DEVICE static void for_each_published_tile(Tiles& tiles, F&& f) {
    typename Tiles::State read;
    for (int q_tile = 0;; ++q_tile) {
      const Work w = tiles.take(read);
      if (!w.valid()) return;
      f(w, q_tile);
    }
  }

  // The producer's second warp with pack-GQA: packed Q tiles are gathered row by row.
  CUTE_DEVICE static void gather_packed_q(Params const& p, SharedStorage& smem) {
    for_each_tile(p, [&](Work const& w, int q_tile) {
      Load::load_packed_q(p.load, p.rows, w.tile, w.rows.first, w.seq, q_tile, smem.q.data(),
                          smem.q_full, smem.q_empty);
    });
  }

  // f(w) for each tile with keys this CTA runs, as the producer's third and fourth warps walk
  // them: V's warp (kValues) first waits for O's staging in V's ring, as the load thread would
  // (FwdLoad::run).
  template <bool kValues, class F>
  CUTE_DEVICE static void for_each_keyed_tile(Params const& p, SharedStorage& smem, F&& f) {
    int o_staged = 0;
    for_each_tile(p, [&](Work const& w, int) {
      const int staged_before = o_staged;
      if (stages_o_in_v(p, w)) ++o_staged;
      if (w.keys.empty()) return;
      if (kValues && staged_before > 0)
        cutlass::arch::ClusterBarrier::wait(&smem.o_free, (staged_before - 1) & 1);
      f(w);
    });
  }

  // The producer's third and fourth warps with a paged cache whose pages do not hold whole key
  // tiles: one gathers K, the other V (FwdLoad::gather_key_tile), in the order the load thread
  // would load them (per tile, last key tile first), V waiting for O's staging in V's ring as
  // the load thread would (FwdLoad::run). Each warp locates a key tile's rows in its row table
  // from the tile's page-table entries, loaded while the previous tile's copies were issued, then
  // loads the next tile's entries and copies (gather_key_tile ends with the warp together, before
  // the table is written again; the __syncwarp before the copies makes it visible to every lane).
  template <bool kValues>
  CUTE_DEVICE static void gather_keys(Params const& p, SharedStorage& smem, Pipeline& pipeline) {
    if constexpr (Load::kPieceWarps) {
      if (p.load.pieces) return issue_key_pieces<kValues>(p, smem, pipeline);
    }
    // Only kernels with the row tables (Config::kGathers) gather; the others load whole tiles.
    if constexpr (Config::kGathers) {
      PipelineState write = cutlass::make_producer_start_state<Pipeline>();
      using Layout = std::conditional_t<kValues, typename Config::SmemLayoutV,
                                        typename Config::SmemLayoutK>;
      Tensor s =
          make_tensor(make_smem_ptr(kValues ? smem.kv.v.data() : smem.kv.k.data()), Layout{});
      auto const& l = p.load;
      uintptr_t* rows = smem.gather.rows[kValues];
      for_each_keyed_tile<kValues>(p, smem, [&](Work const& w) {
        auto locate = [&](int n, int32_t pages) {
          const int kv_head = p.rows.packed() ? w.tile.head : w.tile.head / l.head_group;
          if constexpr (kValues)
            Load::locate_key_rows(l, l.v + kv_head * l.v_head_stride, l.v_page_stride,
                                  l.v_row_stride, w.seq, n, pages, rows);
          else
            Load::locate_key_rows(l, l.k + kv_head * l.k_head_stride, l.k_page_stride,
                                  l.k_row_stride, w.seq, n, pages, rows);
        };
        int32_t pages = Load::load_tile_pages(l, w.seq, w.keys.end - 1);
        for (int n = w.keys.end - 1; n >= w.keys.begin; --n) {
          locate(n, pages);
          // The next tile's entries load while this tile's copies are issued and fly.
          if (n > w.keys.begin) pages = Load::load_tile_pages(l, w.seq, n - 1);
          __syncwarp();
          pipeline.producer_acquire(write);
          Load::template gather_key_tile<kValues ? Config::kHeadDimV : Config::kHeadDimQK>(
              rows, s(_, _, write.index()), pipeline.producer_get_barrier(write));
          ++write;
        }
      });
    }
  }

  // The same two warps with pages of whole pieces of Config::kPieceRows keys (16-bit kernels:
  // Load::kPieceWarps): one issues K's pieces, the other V's (FwdLoad::issue_pieces), in
  // gather_keys' order and with its wait for O's staging. Each lane reads its piece's page-table
  // entry as many key tiles ahead as the ring has stages less one (kAhead): the ring lets the warp
  // run that far ahead of the consumers, so with a ring slot already free (a deep ring, or
  // consumers ahead) the entries the boxes need have still had the issue of kAhead tiles to land,
  // not just one's.
  template <bool kValues>
  CUTE_DEVICE static void issue_key_pieces(Params const& p, SharedStorage& smem,
                                           Pipeline& pipeline) {
    constexpr int kAhead = cute::max(Config::kStages - 1, 1);
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    auto const& l = p.load;
    for_each_keyed_tile<kValues>(p, smem, [&](Work const& w) {
      const int kv_head = p.rows.packed() ? w.tile.head : w.tile.head / l.head_group;
      const auto ring = Load::template piece_ring<kValues>(
          l, kv_head, w.seq, kValues ? smem.kv.v.data() : smem.kv.k.data());
      // entries[i]: tile (n - i)'s, for the tile n about to be issued; tiles before the work's
      // first are not read.
      int32_t entries[kAhead];
      CUTE_UNROLL
      for (int i = 0; i < kAhead; ++i) {
        const int n = w.keys.end - 1 - i;
        entries[i] = n >= w.keys.begin ? Load::piece_entry(l, w.seq, n) : 0;
      }
      for (int n = w.keys.end - 1; n >= w.keys.begin; --n) {
        pipeline.producer_acquire(write);
        Load::template issue_pieces<kValues>(l, w.seq, kv_head, n, entries[0], ring,
                                             write.index(), pipeline.producer_get_barrier(write));
        ++write;
        CUTE_UNROLL
        for (int i = 0; i + 1 < kAhead; ++i) entries[i] = entries[i + 1];
        if (n - kAhead >= w.keys.begin)
          entries[kAhead - 1] = Load::piece_entry(l, w.seq, n - kAhead);
      }
    });
  }

  CUTE_DEVICE static void run_chunked(Params const& p, SharedStorage& smem, int warp,
                                      int warpgroup, bool leader) {
    ChunkPipeline pipeline(smem.kv.pipeline,
                           pipeline_params<ChunkPipeline>(warpgroup, leader, Config::kBytesChunk),
                           Shape<_1, _1, _1>{});
    Tiles tiles(smem.tiles, warpgroup == 0, 128 * Config::kConsumerWarpgroups);
    end_prologue();
    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
      if (warp == 1 && p.rows.packed()) gather_packed_q(p, smem);
      if (!leader) return;
      ChunkPipelineState write = cutlass::make_producer_start_state<ChunkPipeline>();
      publish_each_tile(p, tiles, [&](Work const& w, int q_tile) {
        Load::run_chunked(p.load, p.rows, w.tile, w.rows.first, w.seq, w.keys, q_tile,
                          smem.q.data(), smem.kv.c.data(), smem.q_full, smem.q_empty, pipeline,
                          write);
      });
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
      const int thread = int(threadIdx.x) - 128;
      const Turns turns(thread / 128);
      turns.start();
      ChunkPipelineState read;
      for_each_published_tile(tiles, [&](Work const& w, int q_tile) {
        consume_chunked(p, smem, w, q_tile & 1, turns, pipeline, read);
      });
      turns.finish();
    }
  }

  CUTE_DEVICE static void run_rings(Params const& p, SharedStorage& smem, int warp,
                                    int warpgroup, bool leader) {
    const bool gathered = p.load.gather;
    // Pieces issued by the third and fourth warps: their first lanes arrive on the full barriers.
    const bool piece_warps = Load::kPieceWarps && p.load.pieces;
    const bool lane0 = cutlass::canonical_lane_idx() == 0;
    Pipeline pipeline_k(smem.kv.pipeline_k,
                        pipeline_params<Pipeline>(warpgroup,
                                                  piece_warps ? warp == 2 && lane0 : leader,
                                                  Config::kBytesK, gathered),
                        Shape<_1, _1, _1>{});
    Pipeline pipeline_v(
        smem.kv.pipeline_v,
        pipeline_params<Pipeline, Values::kVReaders>(
            warpgroup, piece_warps ? warp == 3 && lane0 : leader, Config::kBytesV, gathered),
        Shape<_1, _1, _1>{});
    auto pipeline_vt = Values::make_vt_pipeline(smem.kv, warpgroup);
    Tiles tiles(smem.tiles, warpgroup == 0, 128 * Config::kConsumerWarpgroups);
    end_prologue();

    // The K / V ring states and the Q barriers' phases carry over from tile to tile.
    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
      if (warp == 1 && p.rows.packed()) gather_packed_q(p, smem);
      if constexpr (kFp8) {
        if (Values::transposes(warp))
          Values::transpose(smem.kv, pipeline_v, pipeline_vt, [&](auto&& f) {
            for_each_tile(p, [&](Work const& w, int) { f(w.keys.count()); });
          });
      } else {
        if (warp == 2 && (p.load.gather || piece_warps)) gather_keys<false>(p, smem, pipeline_k);
        if (warp == 3 && (p.load.gather || piece_warps)) gather_keys<true>(p, smem, pipeline_v);
      }
      if (!leader) return;
      PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
      PipelineState write_v = cutlass::make_producer_start_state<Pipeline>();
      int o_staged = 0;
      publish_each_tile(p, tiles, [&](Work const& w, int q_tile) {
        const int staged_before = o_staged;
        if (stages_o_in_v(p, w)) ++o_staged;
        Load::run(p.load, p.rows, w.tile, w.rows.first, w.seq, w.keys, q_tile, staged_before,
                  smem.q.data(), smem.kv.k.data(), smem.kv.v.data(), smem.gather.pieces,
                  smem.q_full, smem.q_empty,
                  smem.o_free, pipeline_k, pipeline_v, write_k, write_v);
      });
    } else {
      cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
      const int thread = int(threadIdx.x) - 128;  // among the consumer threads
      const Turns turns(thread / 128);
      turns.start();
      PipelineState read_k, read_v;
      for_each_published_tile(tiles, [&](Work const& w, int q_tile) {
        consume(p, smem, w, q_tile & 1, turns, KeyRing{pipeline_k, smem.kv.pipeline_k},
                Values::reader(smem.kv, pipeline_v, pipeline_vt), read_k, read_v);
      });
      turns.finish();
      // The last store must have read O's buffer before the CTA's shared memory goes.
      if constexpr (kOBuffer) Epilogue::finish_stores(thread);
    }
  }

  CUTE_DEVICE static void consume(Params const& p, SharedStorage& smem, Work const& w,
                                  int q_phase, Turns const& turns, KeyRing ring_k,
                                  ValueRing ring_v, PipelineState& read_k,
                                  PipelineState& read_v) {
    const TileCoord tile = w.tile;
    const KeyTiles keys = w.keys;
    const int thread = int(threadIdx.x) - 128;  // among the consumer threads
    typename Config::TiledMmaQK mma_qk;
    typename Config::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread);
    auto thr_pv = mma_pv.get_thread_slice(thread);
    auto wg_qk = warpgroup_operand_slice(mma_qk, 1);
    auto wg_pv = warpgroup_operand_slice(mma_pv, 1);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.kv.k.data()), typename Config::SmemLayoutK{});
    Tensor sVt =
        make_tensor(make_smem_ptr(Values::operand(smem.kv)), typename Config::SmemLayoutVt{});
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

    const TileScales scales = tile_scales(p, w);
    Softmax<decltype(size<0>(score_coords))::value> softmax(scales.score_scale,
                                                            scales.score_scale * kLog2e);
    typename decltype(softmax)::RowVector rescale;
    Tensor tOrP = Values::p_fragment(thr_pv);

    const auto prepare_scores = score_preparation(p, w, score_coords, tile_softcap(p, scales));
    auto release_q = [&] { FwdKernel::release_q(smem, thread); };
    // Gathered K / V stages were written through the generic proxy (cp.async); the wgmmas read
    // them through the async proxy.
    const bool gathered = p.load.gather;
    auto gathered_fence = [gathered] {
      if (gathered) cutlass::arch::fence_view_async_shared();
    };
    cutlass::arch::ClusterBarrier::wait(&smem.q_full, q_phase);
    const KeyTiles own = own_key_tiles(w);
    auto pass_key_tiles = [&](int count) {
      FwdKernel::pass_key_tiles(count, turns, ring_k, ring_v, read_k, read_v);
    };
    if (own.empty()) {
      skip_keyless(smem, thread);
      if (!keys.empty()) {  // the tile's turns: one per key tile, one for the last P·V
        pass_key_tiles(keys.count());
        turns.wait();
        turns.pass();
      }
    } else {
      // Key tiles go from the last to the first: those above this warpgroup's own come first.
      pass_key_tiles(keys.end - own.end);
      int n_block = own.end - 1;
      {
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
        ring_k.wait(read_k);
        gathered_fence();
        turns.wait();
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        turns.pass();
        warpgroup_wait<0>();
        ring_k.release(read_k);
        ++read_k;
        if (n_block == own.begin) release_q();
        const auto shift = prepare_scores(tSrS, n_block);
        auto scores = rowcol_view(tSrS);
        softmax.update_max(scores, rescale, shift);  // O is still empty: nothing to rescale
        softmax.exponentiate(scores, shift);
        Values::to_p(tSrS, tOrP);
      }

      // One key-tile step; `plain` (a std::bool_constant) compiles it without the score step's
      // run-time tests (softcap, ALiBi, the mask, the gather's fence), for the key tiles that need
      // none of them (Config::kPlainSteps): the general step's tests and the mask's live registers
      // then stay out of the loop most tiles run.
      auto step = [&](auto plain) {
        constexpr bool kPlain = decltype(plain)::value;
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
        ring_k.wait(read_k);
        if constexpr (!kPlain) gathered_fence();
        turns.wait();
        wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        ring_v.wait(read_v);
        if constexpr (!kPlain) gathered_fence();
        wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        turns.pass();

        warpgroup_wait<1>();  // S of tile n_block − 1 is ready; P·V of tile n_block still runs
        ring_k.release(read_k);
        ++read_k;
        if (n_block - 1 == own.begin) release_q();
        const auto shift = [&] {
          if constexpr (kPlain)
            return NoRowShift{};
          else
            return prepare_scores(tSrS, n_block - 1);
        }();
        auto scores = rowcol_view(tSrS);
        const bool rescale_o = softmax.update_max(scores, rescale, shift);  // warp-uniform
        softmax.exponentiate(scores, shift);

        warpgroup_wait<0>();  // P·V done: O may be rescaled and P overwritten
        ring_v.release(read_v);
        ++read_v;
        if (rescale_o) {
          auto o = rowcol_view(tOrO);
          scale_rows(o, rescale);
        }
        Values::to_p(tSrS, tOrP);
      };
      auto steps = [&](auto plain, int stop) {
        CUTE_NO_UNROLL
        for (; n_block > stop; --n_block) step(plain);
      };
      if constexpr (Config::kPlainSteps && !kAlibiLinear) {
        // Segments of the walk down the key tiles: general steps above the tiles every row sees
        // whole (a causal diagonal, a sequence's ragged last tile), plain ones through them,
        // general ones below (a window's left edge). ALiBi's linear-form kernel biases every
        // tile: it has no plain steps.
        const KeyTiles visible = w.mask.visible_tiles(w.mask.span(w.rows));
        const bool plain_ok =
            !tile_softcap(p, scales).enabled() && p.variants.alibi == nullptr && !gathered;
        while (n_block > own.begin) {
          const int next = n_block - 1;
          if (plain_ok && visible.contains(next))
            steps(std::true_type{}, cute::max(visible.begin, own.begin));
          else
            steps(std::false_type{},
                  next >= visible.end ? cute::max(visible.end, own.begin) : own.begin);
        }
      } else {
        CUTE_NO_UNROLL
        for (; n_block > own.begin; --n_block) step(std::false_type{});
      }

      ring_v.wait(read_v);
      gathered_fence();
      turns.wait();
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      turns.pass();
      warpgroup_wait<0>();
      ring_v.release(read_v);
      ++read_v;  // the ring carries over to the next tile
      pass_key_tiles(own.begin - keys.begin);  // below this warpgroup's own (a window's left side)
    }

    typename decltype(softmax)::RowVector o_scale, lse;
    finish_rows(p, w, softmax, o_scale, lse, score_coords);
    if constexpr (kFp8) {
      CUTE_UNROLL
      for (int i = 0; i < int(o_scale.size()); ++i) o_scale[i] *= scales.o;
    }
    auto o = rowcol_view(tOrO);
    scale_rows(o, o_scale);
    if (p.split.enabled()) {
      Epilogue::store_partial(p.split, p.rows, tile, w.rows, w.split, w.seq, out_coords, tOrO,
                              lse, thread);
      return;
    }
    Epilogue::store_lse(p.epilogue, p.rows, tile, w.rows, w.seq, out_coords, lse, thread);
    if (!stages_o(p, w))
      Epilogue::store_zero_o(p.epilogue, p.rows, tile, w.rows, w.seq, thread);
    else if constexpr (kOBuffer)
      Epilogue::store_own_o(p.epilogue, p.rows, tile, w.rows, w.seq, mma_pv, tOrO,
                            smem.kv.o.data(), thread);
    else
      Epilogue::store_o(p.epilogue, p.rows, tile, w.rows, w.seq, mma_pv, tOrO,
                        reinterpret_cast<typename Config::ElementO*>(smem.kv.v.data()),
                        smem.o_free, thread);
  }
  // consume for Config::kChunked. S (64 registers at 128 keys), P (32) and O (128) do not fit in
  // registers together, so a warpgroup's QKᵀ cannot run beside its own P·V: in one turn it issues
  // P·V of the tile before, waits for it, then issues QKᵀ, and the tensor pipe runs its two GEMMs
  // back to back while the other warpgroup's softmax runs. QKᵀ spans both K chunks of a tile (one
  // batch, one accumulator), P·V both V chunks (O's two column halves).
  CUTE_DEVICE static void consume_chunked(Params const& p, SharedStorage& smem, Work const& w,
                                          int q_phase, Turns const& turns,
                                          ChunkPipeline& pipeline, ChunkPipelineState& read) {
    using ChunkCols = typename Config::ChunkCols;
    const TileCoord tile = w.tile;
    const KeyTiles keys = w.keys;
    const int thread = int(threadIdx.x) - 128;
    typename Config::TiledMmaQK mma_qk;
    typename Config::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread);
    auto thr_pv = mma_pv.get_thread_slice(thread);
    auto wg_qk = warpgroup_operand_slice(mma_qk, 1);
    auto wg_pv = warpgroup_operand_slice(mma_pv, 1);

    Tensor sQ = flat_divide(
        make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{}),
        Shape<BlockM, ChunkCols>{});  // (M, cols, 1, half)
    Tensor sC = make_tensor(make_smem_ptr(smem.kv.c.data()), typename Config::SmemLayoutChunk{});
    Tensor sCt = make_tensor(make_smem_ptr(smem.kv.c.data()), typename Config::SmemLayoutChunkT{});
    Tensor tSrQ0 = wg_qk.partition_fragment_A(sQ(_, _, _0{}, _0{}));
    Tensor tSrQ1 = wg_qk.partition_fragment_A(sQ(_, _, _0{}, _1{}));
    Tensor tSrK = wg_qk.partition_fragment_B(sC);   // (MMA, N, K, chunk)
    Tensor tOrV = wg_pv.partition_fragment_B(sCt);  // (MMA, D/2, N, chunk)

    Tensor tOrO0 = partition_fragment_C(mma_pv, Shape<BlockM, ChunkCols>{});
    Tensor tOrO1 = partition_fragment_C(mma_pv, Shape<BlockM, ChunkCols>{});
    clear(tOrO0);
    clear(tOrO1);
    const auto score_coords =
        rowcol_view(thr_qk.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{})));
    Tensor cO = flat_divide(make_identity_tensor(Shape<BlockM, HeadDimV>{}),
                            Shape<BlockM, ChunkCols>{});
    const auto out_coords0 = rowcol_view(thr_pv.partition_C(cO(_, _, _0{}, _0{})));
    const auto out_coords1 = rowcol_view(thr_pv.partition_C(cO(_, _, _0{}, _1{})));

    Softmax<decltype(size<0>(score_coords))::value> softmax(p.score_scale,
                                                            p.score_scale * kLog2e);
    typename decltype(softmax)::RowVector rescale;
    using ScoreFrag = decltype(partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{}));
    Tensor tOrP = make_tensor<Element>(acc_to_operand_a_layout(ScoreFrag{}.layout()));

    const auto prepare_scores = score_preparation(p, w, score_coords, p.softcap);
    auto release_q = [&] { FwdKernel::release_q(smem, thread); };
    // Two chunks of the ring from `at` on (K's or V's halves): waited for, released.
    auto wait_pair = [&](ChunkPipelineState at) {
      pipeline.consumer_wait(at);
      ++at;
      pipeline.consumer_wait(at);
    };
    auto release = [&](ChunkPipelineState at) { release_stage(smem.kv.pipeline, pipeline, at); };
    auto release_pair = [&](ChunkPipelineState at) {
      release(at);
      ++at;
      release(at);
    };
    auto advance = [](ChunkPipelineState at, int chunks) {
      for (int i = 0; i < chunks; ++i) ++at;
      return at;
    };
    auto issue_qk = [&](auto& scores, ChunkPipelineState at) {
      ChunkPipelineState high = at;
      ++high;
      wgmma_issue_split_k<true>(mma_qk, tSrQ0, tSrK(_, _, _, at.index()), tSrQ1,
                                tSrK(_, _, _, high.index()), scores);
    };
    // O's two column halves, one batch each (two accumulators): the first V chunk can be
    // released while the second half runs.
    auto issue_pv = [&](ChunkPipelineState at) {
      ChunkPipelineState high = at;
      ++high;
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, at.index()), tOrO0);
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, high.index()), tOrO1);
    };

    cutlass::arch::ClusterBarrier::wait(&smem.q_full, q_phase);
    if (keys.empty()) {
      skip_keyless(smem, thread);
    } else {
      // The ring holds K of the last key tile, then per key tile n (last to first) V of n and K of
      // n − 1 (FwdLoad::run_chunked). One turn issues P·V of n and, once it is done (S, P and O do
      // not fit in registers together), QKᵀ of n − 1: the tensor pipe runs a warpgroup's two GEMMs
      // back to back, under which the other warpgroup's softmax runs.
      int n_block = keys.end - 1;
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
      auto softmax_step = [&](int n, bool first) {
        warpgroup_wait<0>();
        release_pair(read);
        read = advance(read, 2);
        if (n == keys.begin) release_q();
        const auto shift = prepare_scores(tSrS, n);
        auto scores = rowcol_view(tSrS);
        const bool rescale_o = softmax.update_max(scores, rescale, shift);  // warp-uniform
        if (!first && rescale_o) {  // the first tile's O is still empty
          auto o0 = rowcol_view(tOrO0);
          auto o1 = rowcol_view(tOrO1);
          scale_rows(o0, rescale);
          scale_rows(o1, rescale);
        }
        softmax.exponentiate(scores, shift);
        convert_fragment(tSrS, tOrP);
      };
      wait_pair(read);
      turns.wait();
      issue_qk(tSrS, read);
      turns.pass();
      softmax_step(n_block, true);
      CUTE_NO_UNROLL
      for (; n_block > keys.begin; --n_block) {
        const ChunkPipelineState k_at = advance(read, 2);
        wait_pair(read);
        turns.wait();
        issue_pv(read);
        // Between P·V and QKᵀ the tensor pipe idles: only the wait for P·V's end stays there.
        wait_pair(k_at);
        warpgroup_wait<1>();
        release(read);  // V's low half has been read
        warpgroup_wait<0>();  // P may be overwritten: S is next
        issue_qk(tSrS, k_at);
        turns.pass();
        release(advance(read, 1));
        read = k_at;
        softmax_step(n_block - 1, false);
      }
      wait_pair(read);
      turns.wait();
      issue_pv(read);
      turns.pass();
      warpgroup_wait<0>();
      release_pair(read);
      read = advance(read, 2);
    }

    typename decltype(softmax)::RowVector o_scale, lse;
    finish_rows(p, w, softmax, o_scale, lse, score_coords);
    {
      auto o0 = rowcol_view(tOrO0);
      auto o1 = rowcol_view(tOrO1);
      scale_rows(o0, o_scale);
      scale_rows(o1, o_scale);
    }
    if (p.split.enabled()) {
      Epilogue::store_partial(p.split, p.rows, tile, w.rows, w.split, w.seq, out_coords0, tOrO0,
                              lse, thread);
      Epilogue::store_partial(p.split, p.rows, tile, w.rows, w.split, w.seq, out_coords1, tOrO1,
                              lse, thread);
      return;
    }
    Epilogue::store_lse(p.epilogue, p.rows, tile, w.rows, w.seq, out_coords0, lse, thread);
    if (keys.empty()) {
      Epilogue::store_zero_o(p.epilogue, p.rows, tile, w.rows, w.seq, thread);
    } else {
      Epilogue::store_o_direct(p.epilogue, p.rows, tile, w.rows, w.seq, out_coords0, tOrO0);
      Epilogue::store_o_direct(p.epilogue, p.rows, tile, w.rows, w.seq, out_coords1, tOrO1);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    fwd_kernel(__grid_constant__ const typename Kernel::Params params) {
  extern __shared__ __align__(1024) char smem[];
  Kernel{}(params, smem);
}

}  // namespace fa4::sm90
