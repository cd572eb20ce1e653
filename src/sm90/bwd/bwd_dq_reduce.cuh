// dQ of one (query tile, key tile) pair added to the fp32 accumulator in the workspace by bulk
// reduce-adds of the TMA unit, instead of per-thread atomics: each MMA warpgroup stages its part
// of the tile (half of the head dim, or with Config::kDqSplitRows its 64 query rows) in shared
// memory and hands it to the writer warp (bwd_dq_handoff.cuh). Two ways of staging, chosen per
// config (BwdDqReduce below):
//   BwdDqFragments (bwd_dq_fragments.cuh), where each part is one m64 wgmma's accumulator: the
//     part is stored as the fragments lie in the registers, 16 bytes per store from one address
//     per thread, and added as one contiguous block; dq_accum holds each tile in that order.
//   BwdDqRows (this file), the wide kernel's (and d64's with FA4_SM90_BWD_DQ_ROWS=0, whose parts
//     are 128 rows high): the part is stored row by row under a swizzle and
//     added by a tensor reduce-add (cp.reduce.async.bulk.tensor .add); dq_accum is the rows' own
//     order, and rows past the sequence's end are clipped by the TMA unit.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/bwd/bwd_dq_fragments.cuh"
#include "sm90/bwd/bwd_dq_handoff.cuh"
#include "sm90/bwd/bwd_mask.cuh"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/gmem_layout.cuh"
#include "sm90/common/named_barriers.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/common/smem_atom.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct BwdDqRows {
  using BlockM = typename Config::BlockM;
  // A warpgroup's share of the CTA's dQ columns (Config::kDqDim: all of the head dim, or half on a
  // key-tile pair, bwd_pair.cuh), "half" for short.
  using HalfDim = Int<Config::kDqDim / Config::kMmaWarpgroups>;
  // The part of the tile a warpgroup stages and the writer reduce-adds as one box: (BlockM rows,
  // its half of the columns). (Row halves are one m64 accumulator each: BwdDqFragments.)
  static_assert(!Config::kDqSplitRows, "row parts are staged in fragment order");
  using PartRows = BlockM;
  using PartCols = HalfDim;
  // The atoms are a half's width (128 bytes = 32 floats, or 64 bytes for 48-float halves). Both
  // parts in one tile: atoms tile a part column by column, and the parts follow each other, so
  // warpgroup w's part is the w-th contiguous part of the buffer, laid out as SmemLayoutPart.
  using Atom = SmemAtom<float, HalfDim::value>;
  using SmemLayoutPart = decltype(tile_to_shape(Atom{}, Shape<PartRows, PartCols>{}));
  using SmemLayout = decltype(tile_to_shape(Atom{}, Shape<BlockM, Int<Config::kDqDim>>{}));
  static_assert(HalfDim::value * sizeof(float) % 64 == 0,
                "each half is a whole number of 64- or 128-byte swizzle atoms");
  static_assert(cosize_v<SmemLayout> == Config::kMmaWarpgroups * cosize_v<SmemLayoutPart>);
  // dq_accum's column order (bwd_workspace.hpp): the staging's swizzle width in floats, every
  // row's 8-column blocks permuted within it so that the staging's stores are free of bank
  // conflicts. With one-stage rings (d256) that pays only together with write()'s ordered
  // reduce-adds: alone it measured 7–10 % slower there.
  static constexpr int kAccumAtom = decltype(size<1>(Atom{}))::value;  // 32 or 16

  using Tma = decltype(make_tma_copy(
      SM90_TMA_REDUCE_ADD{}, make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)), GmemLayout{}),
      SmemLayoutPart{}, Shape<PartRows, PartCols>{}, _1{}));

  struct Params {
    Tma tma;
    GmemShape shape;
    int32_t* done;  // dq_done (bwd_workspace.hpp), or null: nothing waits on the CTAs
  };

  // dq_accum: [heads_q][query rows][dim] fp32 (in a buffer of stat rows per head, which are more),
  // dq_done: [batch][heads_q] (bwd_workspace.hpp).
  static Params make_params(const Problem& p, float* dq_accum, int64_t q_rows, int64_t /*stat_rows*/,
                            int32_t* done) {
    TensorView t;
    t.data = dq_accum;
    t.seq_stride = p.head_dim_qk;
    t.head_stride = q_rows * p.head_dim_qk;
    // At least one row per batch entry: a problem without query rows still encodes this view (its
    // reduction never runs), and a zero stride over several batch entries cannot be encoded.
    t.batch_stride = p.is_varlen() ? 0 : (p.seqlen_q > 0 ? p.seqlen_q : 1) * p.head_dim_qk;
    const auto view = gmem_view(dq_accum, t, query_rows(p), p.head_dim_qk, p.heads_q);
    return {make_tma_copy(SM90_TMA_REDUCE_ADD{}, make_tensor(make_gmem_ptr(view.base), view.layout),
                          SmemLayoutPart{}, Shape<PartRows, PartCols>{}, _1{}),
            view.layout.shape(), done};
  }

  CUTE_DEVICE static void landed(Params const& p, int64_t slot) {
    BwdDqHandoff::landed(p.done, slot);
  }

  // The rows policy's accumulator order for the finish kernel: its own rows, no fragments.
  static DqFragments fragments() { return {}; }

  CUTE_DEVICE static void prefetch_descriptor(Params const& p) {
    prefetch_tma_descriptor(p.tma.get_tma_descriptor());
  }

  // Where one sequence's rows are in the accumulator's view: made once, before the tile loop.
  CUTE_DEVICE static SeqRows rows(Params const& p, Sequence const& seq, int /*batch*/) {
    return seq.q_rows(get<0>(p.shape));
  }

  // Called by every thread of both MMA warpgroups, once per query tile, with the tiled MMA of
  // dQ. `thread`: among the MMA threads. Waits until the writer has read the warpgroup's previous
  // part, stages this one and hands it over without waiting for the reduction.
  template <class TiledMma, class Acc>
  CUTE_DEVICE static void stage(float* smem, TiledMma const& mma, Acc const& dq, int thread) {
    // The four swizzled staging addresses come from an index the compiler cannot see through, so
    // that they are computed here, a few integer ops per tile, instead of hoisted out of the tile
    // loop: held there, these registers pushed scores out to local memory around dPᵀ (d128).
    asm volatile("" : "+r"(thread));
    const int wg = thread / 128;
    BwdDqHandoff::acquire(wg);
    // Element offsets from the buffer's base (a pointer whose bits are XORed is no longer known to
    // point into shared memory: generic stores through 64-bit addresses), in the accumulator's
    // column order (bwd_workspace.hpp). Every row of a thread's fragment is its lane / 4 modulo 8,
    // so the swizzle and the flip are one XOR, y, on the bits of the column within its 16-byte
    // chunks' group, the same for all of the thread's stores: offset = (t + k) ^ y with t the
    // thread's first element and k a constant of the fragment, whose column bits (8-column blocks)
    // never carry into t's (its first column pair). So each block's address is computed once
    // and the stores take the rest as immediates, as cute's swizzled copy does.
    constexpr auto linear = get_nonswizzle_portion(SmemLayout{});
    // The atom's swizzle acts on byte addresses; here on float offsets.
    constexpr auto swizzle = recast_layout<uint8_t, float>(get_swizzle_portion(SmemLayout{}));
    // Partitioned by an unsigned index: the layout's divisions by its power-of-two extents are
    // then shifts and masks, not signed-division sequences (a compare and a fix-up each).
    Tensor tS = mma.get_thread_slice(uint32_t(thread))
                    .partition_C(make_tensor(make_smem_ptr(smem), linear));
    static_assert(decltype(size<0, 0>(tS))::value == 2, "a value pair is two adjacent columns");
    constexpr int kBlocks = kAccumAtom / 8;
    const int t = int(tS.data().get() - smem);
    const int y = dq_accum_flip(uint32_t(thread) % 32 / 4, kAccumAtom) ^ swizzle(t) ^ t;
    int block[kBlocks];
    CUTE_UNROLL
    for (int b = 0; b < kBlocks; ++b) block[b] = (t ^ (y & 7)) + ((8 * b) ^ (y & (kAccumAtom - 8)));
    CUTE_UNROLL
    for (int i = 0; i < size(dq); i += 2) {
      const int k = tS.layout()(i);
      *reinterpret_cast<float2*>(smem + block[k / 8 % kBlocks] + (k & -kAccumAtom)) =
          make_float2(dq(i), dq(i + 1));
    }
    BwdDqHandoff::hand_over(wg);
  }

  // The writer warp (BwdDqHandoff::write): part w of query tile m is the accumulator's box of
  // column half first_half + w (`first_half`: the CTA's first column block of HalfDim, 0, or on a
  // key-tile pair its rank · kMmaWarpgroups).
  template <class Order, class Counter, class Turn>
  CUTE_DEVICE static void write(Params const& p, float* smem, int head, SeqRows rows, Order order,
                                Counter const& counter, Turn const& turn, uint64_t* loads_issued,
                                int first_half) {
    Tensor mDq = p.tma.get_tma_tensor(p.shape)(_, _, head, rows.shift, rows.batch);
    Tensor gDq = local_tile(domain_offset(make_coord(rows.offset, _0{}), mDq),
                            Shape<PartRows, PartCols>{}, make_coord(_, _));
    BwdDqHandoff::write<Config::kMmaWarpgroups>(
        order, counter, turn, loads_issued, [&](int m, int wg) {
          Tensor sDqPart = make_tensor(make_smem_ptr(smem + wg * cosize_v<SmemLayoutPart>),
                                       SmemLayoutPart{});
          Tensor gDqPart = gDq(_, _, m, first_half + wg);
          auto [tDgDq, tDsDq] = tma_partition(p.tma, _0{}, Layout<_1>{},
                                              group_modes<0, 2>(sDqPart),
                                              group_modes<0, 2>(gDqPart));
          copy(p.tma, tDsDq, tDgDq);
          tma_store_arrive();
        });
  }
};

// The staging of a config: in fragment order where each warpgroup's part is one m64 wgmma's
// accumulator (Config::kDqFragments), else by rows.
template <class Config>
using BwdDqReduce =
    std::conditional_t<Config::kDqFragments, BwdDqFragments<Config>, BwdDqRows<Config>>;

}  // namespace fa4::sm90
