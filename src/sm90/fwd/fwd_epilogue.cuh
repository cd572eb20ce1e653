// The forward epilogue: the normalized O accumulator is rounded to the output dtype, staged in
// shared memory with stmatrix and written by TMA, which drops rows past the sequence's end
// (gmem_layout.cuh): where there is room (Config::kOBuffer: d64, d96, d128 but its narrow
// variant) in a buffer of its own, each consumer warpgroup its 64 rows with a store of its own
// (store_own_o); elsewhere in V's ring, free once the last P·V is done, by one store of the whole
// tile (store_o). LSE rows are written straight from registers. A packed tile's rows (pack-GQA,
// query_rows.cuh) belong to several heads, which one box cannot address, nor can a box of a
// sequence's first tile whose rows the next tile overlaps (tile_rows.hpp): the consumer threads
// copy those out 16 bytes at a time instead. A tile without keys stages nothing: its zeros go
// straight out the same way. Split-KV's partial results (split_kv.cuh) go straight from
// registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/fragment.cuh"
#include "sm90/common/gmem_layout.cuh"
#include "sm90/common/named_barriers.cuh"
#include "sm90/fwd/query_rows.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/fwd/split_kv.cuh"
#include "sm90/fwd/tile_rows.hpp"
#include "sm90/fwd/tile_scheduler.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct FwdEpilogue {
  using Element = typename Config::ElementO;  // O's
  using BlockM = typename Config::BlockM;
  using HeadDimV = typename Config::HeadDimV;
  using SmemLayoutO = typename Config::SmemLayoutO;
  static constexpr int kConsumerThreads = 128 * Config::kConsumerWarpgroups;
  // The TMA store's box: a warpgroup's slice (Config::kOBuffer) or the whole tile.
  using StoreRows = std::conditional_t<Config::kOBuffer, _64, BlockM>;
  using SmemLayoutStore =
      std::conditional_t<Config::kOBuffer, typename Config::SmemLayoutOSlice, SmemLayoutO>;

  using TmaO = decltype(make_tma_copy(
      SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayout{}),
      SmemLayoutStore{}, Shape<StoreRows, HeadDimV>{}, _1{}));

  struct Params {
    TmaO tma_o;
    GmemShape shape_o;
    float* lse;  // null when the caller wants no LSE
    int64_t lse_batch_stride;
    int64_t lse_head_stride;
    int64_t lse_seq_stride;
    // O as given, for packed tiles: addressed like FwdLoad's q.
    Element* o;
    int64_t o_row_stride, o_head_stride, o_batch_stride;
  };

  static Params make_params(const Problem& p, const ForwardTensors& t) {
    const auto o = gmem_view(static_cast<Element*>(t.out.data), t.out, query_rows(p), p.head_dim_v,
                             p.heads_q);
    return {make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(o.base), o.layout),
                          SmemLayoutStore{}, Shape<StoreRows, HeadDimV>{}, _1{}),
            o.layout.shape(),
            p.return_lse ? t.lse.data : nullptr,
            p.is_varlen() ? 0 : t.lse.batch_stride,
            t.lse.head_stride,
            t.lse.seq_stride,
            static_cast<Element*>(t.out.data),
            t.out.seq_stride,
            t.out.head_stride,
            p.is_varlen() ? 0 : t.out.batch_stride};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
  }

  // tile_rows: the rows the tile stores (tile_rows.hpp); rows: the (rows, cols) view of the O
  // tile's identity tensor as this thread holds it.
  template <class Rows, class RowVector>
  CUTE_DEVICE static void store_lse(Params const& p, QueryRows const& query_rows, TileCoord tile,
                                    TileRows tile_rows, Sequence const& seq, Rows const& rows,
                                    RowVector const& lse, int thread) {
    if (p.lse == nullptr || thread % 4 != 0) return;  // a quad shares each row; its first writes
    float* base = p.lse + seq.batch * p.lse_batch_stride + seq.start_q * p.lse_seq_stride;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(rows); ++i) {
      const int r = tile_rows.first + get<0>(rows(i, 0));
      if (r < tile_rows.end) {
        const QueryRows::Row row = query_rows.locate(r, tile.head);
        base[row.head * p.lse_head_stride + row.position * p.lse_seq_stride] = lse[i];
      }
    }
  }

  // Split-KV (split_kv.cuh): this split's normalized O and LSE, fp32, straight from registers to
  // the partials (nothing staged in V's ring). tile_rows, rows: as for store_lse.
  template <class Rows, class FragO, class RowVector>
  CUTE_DEVICE static void store_partial(SplitPartials const& sp, QueryRows const& query_rows,
                                        TileCoord tile, TileRows tile_rows, int split,
                                        Sequence const& seq, Rows const& rows, FragO const& o,
                                        RowVector const& lse, int thread) {
    const auto o_rc = rowcol_view(o);
    CUTE_UNROLL
    for (int i = 0; i < size<0>(rows); ++i) {
      const int r = tile_rows.first + get<0>(rows(i, 0));
      if (r >= tile_rows.end) continue;
      const QueryRows::Row row = query_rows.locate(r, tile.head);
      const int64_t at = sp.row(split, row.head, seq, row.position);
      float* dst = sp.o + at * HeadDimV::value;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(rows); ++j) dst[get<1>(rows(i, j))] = o_rc(i, j);
      if (thread % 4 == 0) sp.lse[at] = lse[i];  // a quad shares each row; its first writes
    }
    __syncwarp();
  }

  // A tile without keys: its rows' O is 0, written straight to the output, 16 bytes per store, by
  // all consumer threads (nothing staged in V's ring: o_free is left alone).
  CUTE_DEVICE static void store_zero_o(Params const& p, QueryRows const& query_rows,
                                       TileCoord tile, TileRows tile_rows, Sequence const& seq,
                                       int thread) {
    store_rows(p, query_rows, tile, tile_rows, seq, 0, Config::kBlockM, thread, kConsumerThreads,
               [](int, int) { return uint128_t{}; });
    __syncwarp();
  }

  // O of a chunked kernel (Config::kChunked): one half of the head dim's columns, normalized,
  // straight from registers, two adjacent values per 4-byte store, rows past the tile's end
  // dropped (packed or not: rows are located one by one). rows: as for store_lse, with the half's
  // column offset. Nothing is staged, so nothing waits for the ring.
  template <class Rows, class FragO>
  CUTE_DEVICE static void store_o_direct(Params const& p, QueryRows const& query_rows,
                                         TileCoord tile, TileRows tile_rows, Sequence const& seq,
                                         Rows const& rows, FragO const& o) {
    Tensor o_low = make_tensor<Element>(o.layout());
    convert_fragment(o, o_low);
    const auto v = rowcol_view(o_low);
    Element* base = p.o + seq.batch * p.o_batch_stride + int64_t(seq.start_q) * p.o_row_stride;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(rows); ++i) {
      const int r = tile_rows.first + get<0>(rows(i, 0));
      if (r >= tile_rows.end) continue;
      const QueryRows::Row row = query_rows.locate(r, tile.head);
      Element* dst = base + row.position * p.o_row_stride + row.head * p.o_head_stride;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(rows); j += 2) {
        // Columns j and j + 1 of the view are adjacent (fragment.cuh).
        cutlass::Array<Element, 2> pair;
        pair[0] = v(i, j);
        pair[1] = v(i, j + 1);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + get<1>(rows(i, j))) = pair;
      }
    }
  }

  // o: the normalized fp32 accumulator of this thread; smem_o: V's ring, whose barrier
  // smem_o_free is arrived at once the store has read O from it. The store is issued by the first
  // thread of the last consumer warpgroup, which waits for that read: in the next tile it issues
  // its GEMMs last, so the wait overlaps the other warpgroups' first QKᵀ (with one warpgroup, the
  // next tile's loads).
  template <class TiledMma, class FragO>
  CUTE_DEVICE static void store_o(Params const& p, QueryRows const& query_rows, TileCoord tile,
                                  TileRows tile_rows, Sequence const& seq,
                                  TiledMma const& mma, FragO const& o, Element* smem_o,
                                  uint64_t& smem_o_free, int thread) {
    static_assert(!Config::kOBuffer, "store_own_o");
    Tensor o_low = make_tensor<Element>(o.layout());
    convert_fragment(o, o_low);

    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayoutO{});
    // Every consumer warpgroup must be past its last read of V before O overwrites the ring.
    stage(mma, o_low, sO, thread, [] {
      cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(ConsumerBarrier::kEpilogue));
    });

    if (query_rows.packed() ||
        tile_rows.box_overlaps_next(Config::kBlockM, query_rows.count(seq.len_q))) {
      // A packed tile's rows belong to several heads, which one TMA box cannot address; a box of
      // a sequence's first tile may hold the next tile's rows, which that tile stores.
      store_rows(p, query_rows, tile, tile_rows, seq, 0, Config::kBlockM, thread,
                 kConsumerThreads, chunks_of(sO));
      // Every thread has read its share of the ring.
      cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(ConsumerBarrier::kEpilogue));
      if (thread == kConsumerThreads - 128) cutlass::arch::ClusterBarrier::arrive(&smem_o_free);
    } else if (thread == kConsumerThreads - 128) {
      issue_store(p, tile, seq, tile_rows.first, sO);
      // Once the store has read the ring, the producer may load the next tile's V into it (and
      // the CTA may exit).
      tma_store_wait<0>();
      cutlass::arch::ClusterBarrier::arrive(&smem_o_free);
    }
    // The next tile starts with warp-collective instructions (bar.sync, wgmma: .aligned), which
    // need the warp's threads together again.
    __syncwarp();
  }

  // Config::kOBuffer: this thread's warpgroup stages its 64 rows of O in its slice of O's buffer
  // (smem_o) and stores them, waiting for no other warpgroup: once its previous store has read the
  // slice (the warpgroup's first thread, which issues its stores, waits for that, and the
  // warpgroup meets), stmatrix, a fence for the TMA's proxy, the warpgroup meets again, and its
  // first thread issues one 64-row box (not waited for: finish_stores). A slice a box cannot take
  // (a packed tile's rows, or the rows of a sequence's short first tile that the next tile
  // stores: as in store_o) is copied out row by row by its warpgroup instead.
  template <class TiledMma, class FragO>
  CUTE_DEVICE static void store_own_o(Params const& p, QueryRows const& query_rows,
                                      TileCoord tile, TileRows tile_rows, Sequence const& seq,
                                      TiledMma const& mma, FragO const& o, Element* smem_o,
                                      int thread) {
    static_assert(Config::kOBuffer, "store_o");
    Tensor o_low = make_tensor<Element>(o.layout());
    convert_fragment(o, o_low);
    // Warp-uniform (a shuffle), where thread / 128 would be a register of its own in every thread.
    const int warpgroup = cutlass::canonical_warp_group_idx() - 1, row0 = 64 * warpgroup;
    const uint32_t own = uint32_t(ConsumerBarrier::kWarpgroup0) + uint32_t(warpgroup);
    if (tile_rows.first + row0 >= tile_rows.end) return;  // no row of this slice is stored

    Tensor sO = make_tensor(make_smem_ptr(smem_o), typename Config::SmemLayoutOBuffer{});
    finish_stores(thread);
    stage(mma, o_low, sO, thread, [own] { cutlass::arch::NamedBarrier::sync(128, own); });

    if (query_rows.packed() ||
        tile_rows.slice_overlaps_next(row0, 64, query_rows.count(seq.len_q))) {
      // Read before the slice is staged again: after the warpgroup's next first barrier above.
      store_rows(p, query_rows, tile, tile_rows, seq, row0, 64, thread % 128, 128, chunks_of(sO));
    } else if (thread % 128 == 0) {
      issue_store(p, tile, seq, tile_rows.first + row0,
                  make_tensor(make_smem_ptr(smem_o + row0 * HeadDimV::value),
                              typename Config::SmemLayoutOSlice{}));
    }
    // The next tile starts with warp-collective instructions (bar.sync, wgmma: .aligned), which
    // need the warp's threads together again.
    __syncwarp();
  }

  // store_own_o's wait, by each warpgroup's first thread: its stores have read its slice (before
  // the slice is staged again, and before the CTA exits).
  CUTE_DEVICE static void finish_stores(int thread) {
    if (thread % 128 == 0) tma_store_wait<0>();
  }

 private:
  // O rounded to the output dtype (o_low) into sO by stmatrix, between two meetings of the
  // threads that share the buffer (`meet`): after the first it is free, after the second it is
  // staged. stmatrix writes through the generic proxy, the TMA store reads through the async
  // proxy: a fence between.
  template <class TiledMma, class FragLow, class SmemO, class Meet>
  CUTE_DEVICE static void stage(TiledMma const& mma, FragLow const& o_low, SmemO& sO, int thread,
                                Meet const& meet) {
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma);
    auto thr_copy = smem_copy.get_thread_slice(thread);
    meet();
    copy(smem_copy, thr_copy.retile_S(o_low), thr_copy.partition_D(sO));
    cutlass::arch::fence_view_async_shared();
    meet();
  }

  // One TMA box of StoreRows rows of O from the staged sO (SmemLayoutStore) to the rows from the
  // sequence's row `first` on, without waiting for it (tma_store_wait).
  template <class SmemO>
  CUTE_DEVICE static void issue_store(Params const& p, TileCoord tile, Sequence const& seq,
                                      int first, SmemO const& sO) {
    const SeqRows rows = seq.q_rows(get<0>(p.shape_o));
    Tensor mO = p.tma_o.get_tma_tensor(p.shape_o)(_, _, tile.head, rows.shift, rows.batch);
    Tensor gO = local_tile(domain_offset(make_coord(rows.offset + first, _0{}), mO),
                           Shape<StoreRows, HeadDimV>{}, make_coord(_0{}, _0{}));
    auto [tOgO, tOsO] = tma_partition(p.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                      group_modes<0, 2>(gO));
    copy(p.tma_o, tOsO, tOgO);
    tma_store_arrive();
  }

  // store_rows' chunk reader of a staged sO.
  template <class SmemO>
  CUTE_DEVICE static auto chunks_of(SmemO const& sO) {
    return [&sO](int r, int col) {
      return *reinterpret_cast<uint128_t const*>(raw_pointer_cast(&sO(r, col)));
    };
  }

  // Rows [row0, row0 + rows) of a tile's O to their heads, 16 bytes per store, by `threads`
  // threads (consecutive threads take consecutive chunks of a row; `thread` among them);
  // chunk(r, col) gives tile row r's 16 bytes at column col.
  template <class Chunk>
  CUTE_DEVICE static void store_rows(Params const& p, QueryRows const& query_rows,
                                     TileCoord tile, TileRows tile_rows, Sequence const& seq,
                                     int row0, int rows, int thread, int threads,
                                     Chunk const& chunk) {
    constexpr int kChunkElems = 16 / int(sizeof(Element));
    constexpr int kRowChunks = HeadDimV::value / kChunkElems;
    const int first = tile_rows.first;
    Element* o = p.o + seq.batch * p.o_batch_stride + int64_t(seq.start_q) * p.o_row_stride;
    CUTE_NO_UNROLL
    for (int c = row0 * kRowChunks + thread; c < (row0 + rows) * kRowChunks; c += threads) {
      const int r = c / kRowChunks, col = c % kRowChunks * kChunkElems;
      if (first + r >= tile_rows.end) continue;
      const QueryRows::Row row = query_rows.locate(first + r, tile.head);
      *reinterpret_cast<uint128_t*>(o + row.position * p.o_row_stride +
                                    row.head * p.o_head_stride + col) = chunk(r, col);
    }
  }
};

}  // namespace fa4::sm90
