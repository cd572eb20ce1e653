// The producer side of the forward kernel: one thread issues TMA loads of each query tile and
// of its key / value tiles into two multi-stage shared-memory rings, each guarded by CUTLASS's
// PipelineTmaAsync (a full mbarrier completed by the TMA's byte count, an empty mbarrier completed by
// the consumers' release). Rows past the sequence's end arrive as zeros (gmem_layout.cuh). With
// pack-GQA a tile's Q rows come from several heads, which one box cannot address: a warp gathers
// them with 16-byte cp.async copies instead. With a KV cache the keys are rows of the sequence's
// cache row, or of the pages its page-table row names (cache/page_tiles.hpp): where pages hold
// whole key tiles a key tile lies inside one page, whose rows the tile's box addresses; where they
// hold whole pieces of Config::kPieceRows keys (16, or 64 in the wide-pieces variant) each piece
// does, one box per piece (load_pieces, issue_pieces);
// otherwise two warps of the producer warpgroup gather K and V row by row (gather_key_tile).
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/fast_math.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90/cache/page_tiles.hpp"
#include "sm90/common/cp_async.cuh"
#include "sm90/common/gmem_layout.cuh"
#include "sm90/common/tile_mask.cuh"
#include "sm90/fwd/query_rows.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/fwd/tile_scheduler.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct FwdLoad {
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  using HeadDimQK = typename Config::HeadDimQK;
  using HeadDimV = typename Config::HeadDimV;
  using SmemLayoutQ = typename Config::SmemLayoutQ;
  using SmemLayoutK = typename Config::SmemLayoutK;
  using SmemLayoutV = typename Config::SmemLayoutV;

  using Pipeline = cutlass::PipelineTmaAsync<Config::kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // Config::kChunked: one ring of K and V chunks (run_chunked).
  using ChunkPipeline = cutlass::PipelineTmaAsync<Config::Chunks::value>;
  using ChunkPipelineState = typename ChunkPipeline::PipelineState;
  // One TMA box of K or V: a whole key tile, or (chunked) half of its head dim.
  static constexpr bool kChunked = Config::kChunked;
  using SmemLayoutChunk = typename Config::SmemLayoutChunk;
  using SmemLayoutKBox =
      decltype(take<0, 2>(std::conditional_t<kChunked, SmemLayoutChunk, SmemLayoutK>{}));
  using SmemLayoutVBox =
      decltype(take<0, 2>(std::conditional_t<kChunked, SmemLayoutChunk, SmemLayoutV>{}));
  using KBox = Shape<BlockN, Int<kChunked ? Config::kChunkCols : HeadDimQK::value>>;
  using VBox = Shape<BlockN, Int<kChunked ? Config::kChunkCols : HeadDimV::value>>;

  template <class SmemLayout, class Box>
  using Tma = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayout{}, Box{}, _1{}));
  using TmaQ = Tma<SmemLayoutQ, Shape<BlockM, HeadDimQK>>;
  using TmaK = Tma<SmemLayoutKBox, KBox>;
  using TmaV = Tma<SmemLayoutVBox, VBox>;
  // One piece of a key tile (pages of whole pieces): Config::kPieceRows rows of the tile's buffer,
  // laid out as the same swizzle atoms as the whole tile's, so that a piece's box lands in its
  // rows.
  using PieceRows = Int<Config::kPieceRows>;
  static constexpr int kPieces = BlockN::value / PieceRows::value;
  // Sets of entries in the load thread's ring (load_pieces): three live, a power of two.
  static constexpr int kEntrySets = 4;
  static_assert(BlockN::value % PieceRows::value == 0, "a key tile is whole pieces");
  using KPieceBox = Shape<PieceRows, HeadDimQK>;
  using VPieceBox = Shape<PieceRows, HeadDimV>;
  using SmemLayoutKPiece =
      decltype(tile_to_shape(typename Config::template SmemAtom<HeadDimQK::value>{}, KPieceBox{}));
  using SmemLayoutVPiece =
      decltype(tile_to_shape(typename Config::template SmemAtom<HeadDimV::value>{}, VPieceBox{}));
  using TmaKPiece = Tma<SmemLayoutKPiece, KPieceBox>;
  using TmaVPiece = Tma<SmemLayoutVPiece, VPieceBox>;
  // Whether the kernel has the pieces' loads (its tile row's kv_pieces).
  static constexpr bool kKvPieces = Config::kKvPieces;
  // Who issues the pieces' boxes. In the 16-bit kernels the producer's third and fourth warps
  // (idle unless they gather rows): K's and V's side by side, each lane holding one piece's
  // page-table entry, read key tiles ahead (FwdKernel::issue_key_pieces, issue_pieces); the
  // load thread keeps Q and the tile queue. In the e4m3 kernels, whose third and fourth warps
  // transpose V, the load thread (run, load_pieces).
  static constexpr bool kPieceWarps = kKvPieces && !Config::kFp8;
  static_assert(!kPieceWarps || kPieces <= 32, "the issuing warp holds one piece per lane");

  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    TmaKPiece tma_k_piece;
    TmaVPiece tma_v_piece;
    GmemShape shape_q;
    GmemShape shape_k;
    GmemShape shape_v;
    int head_group;  // query heads per kv head (GQA)
    // Q as given, for the packed gather: row i of head h of batch entry b at
    // q + b·q_batch_stride + h·q_head_stride + i·q_row_stride (varlen: i counts from the start).
    Element const* q;
    int64_t q_row_stride, q_head_stride, q_batch_stride;
    // A paged KV cache (table non-null): key position j of a sequence is row j % page_size of page
    // table[k_batch · table_stride + j / page_size]; K and V are viewed as pages of rows.
    const int32_t* table;
    int64_t table_stride;
    int32_t page_size;
    // How key tiles are loaded (cache/page_tiles.hpp): whole, in pieces, or gathered. Gathered,
    // K and V are read through their page, row and head strides; a position's page and row are
    // found by page_rows (page_size, divided by a multiply-high), also for pieces.
    bool pieces;
    bool gather;
    cutlass::FastDivmod page_rows;
    // A key tile's page-table entries fit in a warp's lanes (load_tile_pages).
    bool tile_pages_in_lanes;
    Element const* k;
    Element const* v;
    int64_t k_page_stride, k_row_stride, k_head_stride;
    int64_t v_page_stride, v_row_stride, v_head_stride;
  };

  static Params make_params(const Problem& p, const ForwardTensors& t) {
    // With no key rows at all K and V may be empty views without memory or strides; their
    // descriptors are never used but must be encodable, so they borrow Q's view.
    const RowSpace key_space = key_rows(p);
    const bool has_keys = p.kv_cache.enabled()
                              ? key_space.max_rows > 0 && key_space.batch > 0
                              : (p.is_varlen() ? p.varlen.total_k : p.seqlen_k) > 0;
    const TensorView& tk = has_keys ? t.k : t.q;
    const TensorView& tv = has_keys ? t.v : t.q;
    const auto q = gmem_view(static_cast<Element const*>(t.q.data), t.q, query_rows(p),
                             p.head_dim_qk, p.heads_q);
    const auto k = gmem_view(static_cast<Element const*>(tk.data), tk, key_space, p.head_dim_qk,
                             p.heads_kv);
    const auto v = gmem_view(static_cast<Element const*>(tv.data), tv, key_space, p.head_dim_v,
                             p.heads_kv);
    auto gmem = [](auto view) { return make_tensor(make_gmem_ptr(view.base), view.layout); };
    const KvCache& cache = p.kv_cache;
    const KeyLoad key_load = key_load_of(p, BlockN::value, kKvPieces);
    // The pieces' descriptors are encoded only where pieces load (host time per call).
    const bool pieces = key_load == KeyLoad::kPieces;
    return {make_tma_copy(SM90_TMA_LOAD{}, gmem(q), SmemLayoutQ{}, Shape<BlockM, HeadDimQK>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(k), SmemLayoutKBox{}, KBox{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, gmem(v), SmemLayoutVBox{}, VBox{}, _1{}),
            pieces ? make_tma_copy(SM90_TMA_LOAD{}, gmem(k), SmemLayoutKPiece{}, KPieceBox{}, _1{})
                   : TmaKPiece{},
            pieces ? make_tma_copy(SM90_TMA_LOAD{}, gmem(v), SmemLayoutVPiece{}, VPieceBox{}, _1{})
                   : TmaVPiece{},
            q.layout.shape(),
            k.layout.shape(),
            v.layout.shape(),
            int(p.heads_q / p.heads_kv),
            static_cast<Element const*>(t.q.data),
            t.q.seq_stride,
            t.q.head_stride,
            p.is_varlen() ? 0 : t.q.batch_stride,
            cache.page_table,
            cache.page_table_stride,
            int32_t(cache.page_size),
            pieces,
            key_load == KeyLoad::kGather,
            cutlass::FastDivmod(cache.page_size > 0 ? int(cache.page_size) : 1),
            // A tile's rows span at most (BlockN - 1) / page_size + 2 entries.
            cache.page_size > 0 && (BlockN::value - 1) / cache.page_size + 2 <= 32,
            static_cast<Element const*>(t.k.data),
            static_cast<Element const*>(t.v.data),
            t.k.batch_stride,
            t.k.seq_stride,
            t.k.head_stride,
            t.v.batch_stride,
            t.v.seq_stride,
            t.v.head_stride};
  }

  CUTE_DEVICE static void prefetch_descriptors(Params const& p) {
    prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    if (kKvPieces && p.pieces) {
      prefetch_tma_descriptor(p.tma_k_piece.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_v_piece.get_tma_descriptor());
    } else {
      prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    }
  }


  // One TMA box into the ring slot `state` names, once the consumers have released it.
  template <class Tma, class PipelineT, class State, class Src, class Dst>
  CUTE_DEVICE static void load_stage(Tma const& tma, PipelineT& pipeline, State& state,
                                     Src const& src, Dst& dst) {
    pipeline.producer_acquire(state);
    copy(tma.with(*pipeline.producer_get_barrier(state)), src, dst(_, state.index()));
    ++state;
  }

  // Key tile n of the sequence as rows of the K / V views (gmem_layout.cuh): rows of the sequence,
  // or of the page that holds the tile (whole tiles per page, the sequence starting at position 0
  // of its table row). Rows past the sequence's end are out of the view's bounds either way (a
  // tile wholly past it reads row page_size onwards: zeros, and no table entry is read).
  CUTE_DEVICE static SeqRows key_tile_rows(Params const& p, Sequence const& seq, SeqRows rows,
                                           int n) {
    if (p.table == nullptr) return {rows.offset + n * BlockN::value, rows.shift, rows.batch};
    const int32_t pos = seq.start_k + n * BlockN::value;
    const int32_t index = pos / p.page_size;
    const int32_t page_start = index * p.page_size;
    const int32_t in_page = cute::min(p.page_size, seq.start_k + seq.len_k - page_start);
    if (in_page <= 0) return {p.page_size, 0, 0};
    const int32_t page = __ldg(p.table + int64_t(seq.k_batch) * p.table_stride + index);
    return {p.page_size - in_page + (pos - page_start), in_page, page};
  }
  // The same for the piece of PieceRows keys from key `key` on (pages of whole pieces), whose
  // page-table entry `page` the load thread has already read (load_key_page); page_rows divides.
  CUTE_DEVICE static SeqRows piece_rows(Params const& p, Sequence const& seq, int32_t key,
                                        int32_t page) {
    int32_t index, in_page_pos;
    p.page_rows.fast_divmod(index, in_page_pos, seq.start_k + key);
    const int32_t in_page =
        cute::min(p.page_size, seq.start_k + seq.len_k - index * p.page_size);
    if (in_page <= 0) return {p.page_size, 0, 0};
    return {p.page_size - in_page + in_page_pos, in_page, page};
  }
  // The page-table entry of the page holding key `key` into shared memory at `dst` by a 4-byte
  // cp.async (0 where piece_rows reads no row of the page): the entries of a tile's pieces then
  // fly together and hold no registers of the load thread (24 of them at d128).
  CUTE_DEVICE static void load_key_page(Params const& p, Sequence const& seq, int32_t key,
                                        uint32_t dst) {
    const int32_t index = p.page_rows.div(seq.start_k + key);
    const bool read = index * p.page_size < seq.start_k + seq.len_k;
    const int32_t* src = p.table + int64_t(seq.k_batch) * p.table_stride + (read ? index : 0);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(read ? 4 : 0));
  }
  // The TMA source of the box at `at` for the buffer `s` ((box rows, cols), rest...).
  template <class Tma, class SmemTensor, class Box>
  CUTE_DEVICE static auto key_box(Tma const& tma, GmemShape const& shape, int head, SeqRows at,
                                  SmemTensor const& s, Box box) {
    Tensor g = sequence_tiles_2d(tma, shape, head, at, box);
    return get<0>(tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s),
                                group_modes<0, 2>(g)));  // (TMA, row tile, col tile)
  }
  // The TMA source of key tile n (key_tile_rows) for the ring buffer `s` (box, cols, stage).
  template <class Tma, class SmemTensor, class Box>
  CUTE_DEVICE static auto key_tile(Params const& p, Tma const& tma, GmemShape const& shape,
                                   int head, Sequence const& seq, SeqRows rows, int n,
                                   SmemTensor const& s, Box box) {
    return key_box(tma, shape, head, key_tile_rows(p, seq, rows, n), s, box);
  }

  // The page-table entries of key tile n's pieces into their set of the ring `entries` (kEntrySets
  // sets of kPieces), by cp.async: issued a tile ahead (run), they arrive while the load thread
  // waits for ring slots and issues boxes, so that a tile's boxes do not wait a table read.
  // Pieces wholly past the sequence's end take its last piece's entry (piece_key).
  CUTE_DEVICE static void fetch_entries(Params const& p, Sequence const& seq, int n,
                                        int32_t* entries) {
    const uint32_t at = cast_smem_ptr_to_uint(entries + (n & (kEntrySets - 1)) * kPieces);
    CUTE_UNROLL
    for (int i = 0; i < kPieces; ++i) load_key_page(p, seq, piece_key(seq, n, i), at + 4 * i);
  }
  // The first key of piece i of key tile n. Pieces wholly past the sequence's end load its last
  // piece again: every box then starts on rows of the sequence. The keys' mask hides those rows.
  CUTE_DEVICE static int32_t piece_key(Sequence const& seq, int n, int i) {
    constexpr int kRows = PieceRows::value;
    const int32_t last = cute::max(seq.len_k - 1, 0) / kRows * kRows;
    return cute::min(n * BlockN::value + i * kRows, last);
  }

  // Key tile n of K or V (kValues) in pieces into the ring slot `state` names, once the consumers
  // have released it (`ring`: piece_ring). The pieces' entries are in their set of `entries`
  // (fetch_entries); `wait`: they may still be in flight (K's load, the first to use them; V's
  // finds them landed). Then tile `next`'s entries are fetched (-1: none). The slot's full
  // barrier expects the whole tile's bytes, which the boxes complete (rows past the sequence's end
  // arrive as zeros and count).
  template <bool kValues, class Ring>
  CUTE_DEVICE static void load_pieces(Params const& p, int head, Sequence const& seq, int n,
                                      bool wait, int next, int32_t* entries, Pipeline& pipeline,
                                      PipelineState& state, Ring const& ring) {
    pipeline.producer_acquire(state);
    if (wait) asm volatile("cp.async.wait_all;\n" ::: "memory");
    int32_t const* set = entries + (n & (kEntrySets - 1)) * kPieces;
    CUTE_UNROLL
    for (int i = 0; i < kPieces; ++i)
      issue_piece<kValues>(p, seq, head, n, i, set[i], ring, state.index(),
                           pipeline.producer_get_barrier(state));
    ++state;
    if (next >= 0) fetch_entries(p, seq, next, entries);
  }

  template <bool kValues>
  CUTE_DEVICE static auto const& piece_tma(Params const& p) {
    if constexpr (kValues) return p.tma_v_piece;
    else return p.tma_k_piece;
  }
  // K's or V's ring (smem: (N, D, stage)) as pieces, (piece rows, cols, piece, 1, stage), and its
  // TMA partition for one kv head of the sequence: the boxes' destinations.
  template <bool kValues>
  CUTE_DEVICE static auto piece_ring(Params const& p, int head, Sequence const& seq,
                                     Element* smem) {
    using RingLayout = std::conditional_t<kValues, SmemLayoutV, SmemLayoutK>;
    using PieceBox = std::conditional_t<kValues, VPieceBox, KPieceBox>;
    Tensor sp = flat_divide(make_tensor(make_smem_ptr(smem), RingLayout{}), PieceBox{});
    Tensor gp = sequence_tiles(piece_tma<kValues>(p), kValues ? p.shape_v : p.shape_k, head,
                               seq.k_rows(get<0>(p.shape_k)), PieceBox{});
    return cute::make_tuple(sp, get<1>(tma_partition(piece_tma<kValues>(p), _0{}, Layout<_1>{},
                                                     group_modes<0, 2>(sp),
                                                     group_modes<0, 2>(gp))));
  }

  // The page-table entry of piece `lane` of key tile n, one lane per piece (0 past the tile's
  // pieces and where piece_rows reads no row of the page), read tiles ahead of the boxes by the
  // warp that issues them (FwdKernel::issue_key_pieces).
  CUTE_DEVICE static int32_t piece_entry(Params const& p, Sequence const& seq, int n) {
    const int lane = cutlass::canonical_lane_idx();
    const int32_t index =
        p.page_rows.div(seq.start_k + piece_key(seq, n, cute::min(lane, kPieces - 1)));
    if (lane >= kPieces || index * p.page_size >= seq.start_k + seq.len_k) return 0;
    return __ldg(p.table + int64_t(seq.k_batch) * p.table_stride + index);
  }
  // Key tile n's pieces into ring slot `stage` (`ring`: piece_ring), completing the full barrier
  // `bar`, by a whole warp: each lane locates its own piece from its entry (piece_entry), all
  // lanes at once, and lane 0 takes each piece's coordinates by shuffles and issues its boxes, so
  // that no division or clamp stands between two boxes. Located here rather than with the entry,
  // tiles ahead: the producer's registers hold one value per piece across the ring's waits, not
  // three (d192's would spill).
  template <bool kValues, class Ring>
  CUTE_DEVICE static void issue_pieces(Params const& p, Sequence const& seq, int head, int n,
                                       int32_t entry, Ring const& ring, int stage,
                                       uint64_t* bar) {
    const int lane = cutlass::canonical_lane_idx();
    const SeqRows at = piece_rows(p, seq, piece_key(seq, n, cute::min(lane, kPieces - 1)), entry);
    const bool issuer = lane == 0;
    CUTE_UNROLL
    for (int i = 0; i < kPieces; ++i) {
      const SeqRows piece{__shfl_sync(0xffffffffu, at.offset, i),
                          __shfl_sync(0xffffffffu, at.shift, i),
                          __shfl_sync(0xffffffffu, at.batch, i)};
      if (issuer) issue_piece_at<kValues>(p, head, piece, i, ring, stage, bar);
    }
  }
  // Piece i of key tile n, in the page whose table entry is `page`, as one TMA box into ring slot
  // `stage` (`ring`: piece_ring), completing the full barrier `bar`.
  template <bool kValues, class Ring>
  CUTE_DEVICE static void issue_piece(Params const& p, Sequence const& seq, int head, int n, int i,
                                      int32_t page, Ring const& ring, int stage, uint64_t* bar) {
    issue_piece_at<kValues>(p, head, piece_rows(p, seq, piece_key(seq, n, i), page), i, ring,
                            stage, bar);
  }
  // Piece i of a key tile, whose rows `at` addresses, as one TMA box into ring slot `stage`.
  template <bool kValues, class Ring>
  CUTE_DEVICE static void issue_piece_at(Params const& p, int head, SeqRows at, int i,
                                         Ring const& ring, int stage, uint64_t* bar) {
    using PieceBox = std::conditional_t<kValues, VPieceBox, KPieceBox>;
    auto src = key_box(piece_tma<kValues>(p), kValues ? p.shape_v : p.shape_k, head, at,
                       get<0>(ring), PieceBox{});
    copy(piece_tma<kValues>(p).with(*bar), src(_, 0, 0), get<1>(ring)(_, i, 0, stage));
  }

  // The tile's Q box and Q's buffer, TMA-partitioned: the box starts at the tile's row 0
  // (TileRows::first, ≥ 0), which need not be a multiple of BlockM.
  CUTE_DEVICE static auto q_tiles(Params const& p, TileCoord tile, int first_row,
                                  Sequence const& seq, Element* smem_q) {
    const SeqRows q_rows = seq.q_rows(get<0>(p.shape_q));
    Tensor gQ = sequence_tiles(p.tma_q, p.shape_q, tile.head,
                               SeqRows{q_rows.offset + first_row, q_rows.shift, q_rows.batch},
                               Shape<BlockM, HeadDimQK>{})(_, _, 0);
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), SmemLayoutQ{});
    return tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                         group_modes<0, 2>(gQ));
  }
  // Q into its buffer once the previous tile's last QKᵀ has read it (q_empty); with pack-GQA
  // load_packed_q's warp gathers it instead.
  template <class QTiles>
  CUTE_DEVICE static void load_q(Params const& p, QueryRows const& rows, QTiles& q,
                                 int q_tile, uint64_t& q_full, uint64_t& q_empty) {
    if (rows.packed()) return;
    if (q_tile > 0) cutlass::arch::ClusterBarrier::wait(&q_empty, (q_tile - 1) & 1);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&q_full, Config::kBytesQ);
    copy(p.tma_q.with(q_full), get<0>(q), get<1>(q));
  }


  // Runs on a single thread, once per tile; `q_tile` counts the tiles before this one, `o_staged`
  // those whose O went through V's ring (tiles with keys, when not split, where O has no buffer
  // of its own: FwdConfig::kOBuffer). Key tiles go from the last to the first (the order the
  // consumers take them: with a causal mask the partly masked tiles come first); V trails K by
  // one tile because the consumers need K of tile j together with V of tile j+1. Q's buffer is
  // free once the previous tile's last QKᵀ is done, V's ring once the last staged O has been
  // stored: the first K tile is issued before waiting for the one, the next K tile before waiting
  // for the other. Every tile after the first waits for Q's buffer (also one without keys); only
  // a tile that loads V waits for the ring, so the consumers, who need that V, cannot run two
  // phases of o_free ahead of this wait (tiles without keys, whose Q a second warp may gather,
  // stage nothing: the epilogue stores their zeros directly).
  CUTE_DEVICE static void run(Params const& p, QueryRows const& rows, TileCoord tile,
                              int first_row, Sequence const& seq, KeyTiles keys,
                              int q_tile, int o_staged, Element* smem_q, Element* smem_k,
                              Element* smem_v, int32_t* piece_entries,
                              uint64_t& q_full, uint64_t& q_empty, uint64_t& o_free,
                              Pipeline& pipeline_k,
                              Pipeline& pipeline_v, PipelineState& write_k,
                              PipelineState& write_v) {
    const int kv_head = rows.packed() ? tile.head : tile.head / p.head_group;
    auto q = q_tiles(p, tile, first_row, seq, smem_q);
    // K and V are the third and fourth warps' (FwdKernel::gather_keys, issue_key_pieces).
    if (p.gather || (kPieceWarps && p.pieces)) {
      load_q(p, rows, q, q_tile, q_full, q_empty);
      return;
    }
    const SeqRows k_rows = seq.k_rows(get<0>(p.shape_k));
    Tensor sK = make_tensor(make_smem_ptr(smem_k), SmemLayoutK{});  // (N, D, stage)
    Tensor sV = make_tensor(make_smem_ptr(smem_v), SmemLayoutV{});
    Tensor gK = sequence_tiles(p.tma_k, p.shape_k, kv_head, k_rows, Shape<BlockN, HeadDimQK>{});
    Tensor gV = sequence_tiles(p.tma_v, p.shape_v, kv_head, k_rows, Shape<BlockN, HeadDimV>{});
    Tensor tKsK = get<1>(tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                       group_modes<0, 2>(gK)));
    Tensor tVsV = get<1>(tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                       group_modes<0, 2>(gV)));
    // The rings as pieces, for pages of whole pieces (issued here in the e4m3 kernels only:
    // kPieceWarps).
    const auto ring_kp = piece_ring<false>(p, kv_head, seq, smem_k);
    const auto ring_vp = piece_ring<true>(p, kv_head, seq, smem_v);
    // With pieces, K's load of tile n fetches tile n - 1's entries (the work's first K tile its
    // own too); V's of tile n, which follows K's of tile n - 1, finds its entries still in their
    // set: K(n), K(n - 1) and the fetch for n - 2 keep three sets live.
    auto load_k = [&](int n) {
      if (kKvPieces && !kPieceWarps && p.pieces) {
        if (n == keys.end - 1) fetch_entries(p, seq, n, piece_entries);
        load_pieces<false>(p, kv_head, seq, n, true, n > keys.begin ? n - 1 : -1,
                           piece_entries, pipeline_k, write_k, ring_kp);
        return;
      }
      load_stage(p.tma_k, pipeline_k, write_k,
                 key_tile(p, p.tma_k, p.shape_k, kv_head, seq, k_rows, n, sK,
                          Shape<BlockN, HeadDimQK>{})(_, 0, 0),
                 tKsK);
    };
    auto load_v = [&](int n) {
      if (kKvPieces && !kPieceWarps && p.pieces) {
        load_pieces<true>(p, kv_head, seq, n, false, -1, piece_entries, pipeline_v, write_v,
                          ring_vp);
        return;
      }
      load_stage(p.tma_v, pipeline_v, write_v,
                 key_tile(p, p.tma_v, p.shape_v, kv_head, seq, k_rows, n, sV,
                          Shape<BlockN, HeadDimV>{})(_, 0, 0),
                 tVsV);
    };

    int n_block = keys.end - 1;
    if (!keys.empty()) load_k(n_block);
    load_q(p, rows, q, q_tile, q_full, q_empty);
    // Without keys n_block < keys.begin: no K tile.
    if (n_block > keys.begin) load_k(n_block - 1);
    if (keys.empty()) return;
    if (o_staged > 0) cutlass::arch::ClusterBarrier::wait(&o_free, (o_staged - 1) & 1);
    CUTE_NO_UNROLL
    for (; n_block > keys.begin; --n_block) {
      load_v(n_block);
      if (n_block - 1 > keys.begin) load_k(n_block - 2);
    }
    load_v(keys.begin);
  }

  // run for Config::kChunked: per key tile (last to first) K's low and high halves of the head dim,
  // then V's, into the next slots of one ring, the order in which every consumer warpgroup takes
  // them (FwdKernel::consume_chunked). The tile's first K chunks go before the wait for Q's
  // buffer, as in run. Nothing waits for O: the chunked epilogue stores from registers.
  CUTE_DEVICE static void run_chunked(Params const& p, QueryRows const& rows, TileCoord tile,
                                      int first_row, Sequence const& seq, KeyTiles keys, int q_tile,
                                      Element* smem_q, Element* smem_c, uint64_t& q_full,
                                      uint64_t& q_empty, ChunkPipeline& pipeline,
                                      ChunkPipelineState& write) {
    const int kv_head = rows.packed() ? tile.head : tile.head / p.head_group;
    auto q = q_tiles(p, tile, first_row, seq, smem_q);
    const SeqRows k_rows = seq.k_rows(get<0>(p.shape_k));
    Tensor gK = sequence_tiles_2d(p.tma_k, p.shape_k, kv_head, k_rows, KBox{});  // (.., n, half)
    Tensor gV = sequence_tiles_2d(p.tma_v, p.shape_v, kv_head, k_rows, VBox{});
    Tensor sC = make_tensor(make_smem_ptr(smem_c), typename Config::SmemLayoutChunk{});
    Tensor tKsC = get<1>(tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sC),
                                       group_modes<0, 2>(gK)));
    Tensor tVsC = get<1>(tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sC),
                                       group_modes<0, 2>(gV)));
    // Both halves of key tile n's K or V.
    auto load_halves = [&](auto const& tma, GmemShape const& shape, auto box, auto& dst, int n) {
      auto src = key_tile(p, tma, shape, kv_head, seq, k_rows, n, sC, box);
      load_stage(tma, pipeline, write, src(_, 0, 0), dst);
      load_stage(tma, pipeline, write, src(_, 0, 1), dst);
    };
    int n_block = keys.end - 1;
    if (!keys.empty()) load_halves(p.tma_k, p.shape_k, KBox{}, tKsC, n_block);
    load_q(p, rows, q, q_tile, q_full, q_empty);
    if (keys.empty()) return;
    CUTE_NO_UNROLL
    for (; n_block >= keys.begin; --n_block) {
      if (n_block < keys.end - 1) load_halves(p.tma_k, p.shape_k, KBox{}, tKsC, n_block);
      load_halves(p.tma_v, p.shape_v, VBox{}, tVsC, n_block);
    }
  }

  // The page-table entries of key tile n, one per lane (lane i: the tile's first entry + i;
  // 0 past the sequence's last), where they fit in a warp (tile_pages_in_lanes); else 0 and
  // locate_key_rows loads each row's. One coalesced load per tile, issued a tile ahead
  // (FwdKernel::gather_keys), so that its latency hides behind the copies of the tile before.
  CUTE_DEVICE static int32_t load_tile_pages(Params const& p, Sequence const& seq, int n) {
    if (!p.tile_pages_in_lanes) return 0;
    const int lane = cutlass::canonical_lane_idx();
    const int32_t first = p.page_rows.div(seq.start_k + n * BlockN::value);
    const int32_t last =
        p.page_rows.div(seq.start_k + cute::min((n + 1) * BlockN::value, seq.len_k) - 1);
    const int32_t* table = p.table + int64_t(seq.k_batch) * p.table_stride;
    return first + lane <= last ? __ldg(table + first + lane) : 0;
  }

  // Where each row of key tile n lies in K or V: `rows[r]` is row r's address, or `base` with
  // its lowest bit set past the sequence's end (rows are 16-byte aligned), one lane per row;
  // `pages` is load_tile_pages' for the tile, whose entries the lanes take by shuffle. The
  // copies then wait on no table load and hold no strides.
  CUTE_DEVICE static void locate_key_rows(Params const& p, Element const* base,
                                          int64_t page_stride, int64_t row_stride,
                                          Sequence const& seq, int n, int32_t pages,
                                          uintptr_t* rows) {
    constexpr int kGroups = BlockN::value / 32;
    static_assert(BlockN::value % 32 == 0, "a lane locates one row of each 32");
    const int lane = cutlass::canonical_lane_idx();
    const int32_t* table = p.table + int64_t(seq.k_batch) * p.table_stride;
    const int32_t first = n * BlockN::value + lane;
    const int32_t first_index = p.page_rows.div(seq.start_k + n * BlockN::value);
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      // Every lane takes part in the shuffle; a row past the end takes the tile's last entry.
      int index, in_page;
      p.page_rows.fast_divmod(index, in_page,
                              seq.start_k + cute::min(first + 32 * g, seq.len_k - 1));
      int32_t page = __shfl_sync(0xffffffffu, pages, (index - first_index) & 31);
      if (!p.tile_pages_in_lanes && first + 32 * g < seq.len_k) page = __ldg(table + index);
      rows[32 * g + lane] =
          first + 32 * g < seq.len_k
              ? reinterpret_cast<uintptr_t>(base + int64_t(page) * page_stride +
                                            int64_t(in_page) * row_stride)
              : reinterpret_cast<uintptr_t>(base) | 1;
    }
  }

  // Key tile n (K or V, kCols wide) into `s` (this stage's (keys, cols) buffer) by one warp, from
  // the rows locate_key_rows found: 16 bytes per cp.async, a warp's copies covering whole rows
  // (coalesced), zeros for rows past the sequence's end. The destinations are offsets in the
  // buffer's swizzled layout (32-bit shared-memory arithmetic). Each lane's arrival on the stage's
  // full barrier then waits for its copies (noinc: the barrier expects one per lane of the
  // gathering warp), so that the warp moves on while they fly. cp.async writes through the
  // generic proxy: the consumers fence before their wgmmas read the stage (FwdKernel::consume).
  template <int kCols, class SmemTensor>
  CUTE_DEVICE static void gather_key_tile(uintptr_t const* rows, SmemTensor&& s, uint64_t* full) {
    constexpr int kChunkElems = 16 / int(sizeof(Element));
    constexpr int kRowChunks = kCols / kChunkElems;
    constexpr int kSteps = BlockN::value * kRowChunks / 32;
    static_assert(BlockN::value * kRowChunks % 32 == 0, "whole warps of chunks per tile");
    const int lane = cutlass::canonical_lane_idx();
    Tensor sp = as_position_independent_swizzle_tensor(s);
    const uint32_t smem = cast_smem_ptr_to_uint(raw_pointer_cast(sp.data()));
#pragma unroll 2
    for (int i = 0; i < kSteps; ++i) {
      const int f = i * 32 + lane;
      const int r = f / kRowChunks, col = f % kRowChunks * kChunkElems;
      const uintptr_t at = rows[r];
      cp_async_zfill_16(smem + uint32_t(sp.layout()(r, col)) * uint32_t(sizeof(Element)),
                        reinterpret_cast<Element const*>(at & ~uintptr_t(1)) + col,
                        (at & 1) == 0);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(full);
    __syncwarp();  // every lane has read `rows` before the warp writes it again
  }

  // Pack-GQA: one warp gathers the tile's Q rows (rows.locate) into Q's buffer, 16 bytes per
  // cp.async, and zeros the rows past the sequence that a consumer warpgroup still computes: those
  // of a 64-row slice with a row of the tile (FwdKernel::own_key_tiles), or every row in the
  // chunked kernel, whose warpgroups compute their slices alike. Called once per tile like run,
  // whose Q barrier protocol it follows. No other row is written: a decode tile has a few rows,
  // and a walk over all BlockM rows by this warp of few registers (a row locate per 16 bytes)
  // costs microseconds at the head of the tile's critical path. cp.async and the zeros' stores
  // write through the generic proxy and the wgmmas read through the async one: the warp waits for
  // its copies and fences before it signals q_full.
  CUTE_DEVICE static void load_packed_q(Params const& p, QueryRows const& rows, TileCoord tile,
                                        int first_row, Sequence const& seq, int q_tile,
                                        Element* smem_q,
                                        uint64_t& q_full, uint64_t& q_empty) {
    constexpr int kChunkElems = 16 / int(sizeof(Element));
    constexpr int kRowChunks = HeadDimQK::value / kChunkElems;
    const int lane = cutlass::canonical_lane_idx();
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), SmemLayoutQ{});
    // 32 bits: packed rows stay below 2³⁰ (QueryRows::make), and this warp has few registers.
    const int count = int(rows.count(seq.len_q));
    const int loaded = cute::min(int(BlockM::value), count - first_row);  // >= 1: a tile has rows
    Element const* q = p.q + seq.batch * p.q_batch_stride + int64_t(seq.start_q) * p.q_row_stride;
    // The 16 bytes at column col of tile row r (r < loaded).
    auto source = [&](int r, int col) {
      const QueryRows::Row row = rows.locate(first_row + r, tile.head);
      return reinterpret_cast<uint128_t const*>(q + row.position * p.q_row_stride +
                                                row.head * p.q_head_stride + col);
    };
    auto target = [&](int r, int col) {
      return reinterpret_cast<uint128_t*>(raw_pointer_cast(&sQ(r, col)));
    };
    if (q_tile > 0) cutlass::arch::ClusterBarrier::wait(&q_empty, (q_tile - 1) & 1);
    if constexpr (Config::kChunked) {
      // Every row, by zero-filling copies: the chunked kernel's producer warps have no registers
      // for the two loops below (they spill), and it runs long sequences, whose tiles are full.
      CUTE_NO_UNROLL
      for (int c = lane; c < BlockM::value * kRowChunks; c += 32) {
        const int r = c / kRowChunks, col = c % kRowChunks * kChunkElems;
        const bool exists = r < loaded;
        SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(
            *(exists ? source(r, col) : reinterpret_cast<uint128_t const*>(p.q)),
            *target(r, col), exists);
      }
      cp_async_fence();
    } else {
      // The rows with a query, then zeros for the rest of their 64-row slices, stored while the
      // copies fly.
      CUTE_NO_UNROLL
      for (int c = lane; c < loaded * kRowChunks; c += 32) {
        const int r = c / kRowChunks, col = c % kRowChunks * kChunkElems;
        SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(*source(r, col), *target(r, col));
      }
      cp_async_fence();
      const int computed = cute::min(int(BlockM::value), (loaded + 63) / 64 * 64);
      CUTE_NO_UNROLL
      for (int c = loaded * kRowChunks + lane; c < computed * kRowChunks; c += 32) {
        const int r = c / kRowChunks, col = c % kRowChunks * kChunkElems;
        *reinterpret_cast<uint4*>(target(r, col)) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&q_full);
  }
};

}  // namespace fa4::sm90
