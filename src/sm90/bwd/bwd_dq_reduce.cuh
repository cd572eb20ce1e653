// dQ of one (query tile, key tile) pair added to the fp32 accumulator in the workspace by the TMA
// unit (cp.reduce.async.bulk.tensor .add), instead of per-thread atomics: each MMA warpgroup
// stages its part of the tile (half of the head dim, or with Config::kDqSplitRows its 64 query
// rows) in shared memory and hands it to a writer warp of the producer warpgroup, which issues
// the reduction (and, in deterministic mode, waits for its turn), so that the MMA warpgroups wait
// neither on the TMA unit nor on other CTAs. The accumulator is viewed like the inputs
// (gmem_layout.cuh), so rows past the sequence's end are clipped by the TMA unit.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/bwd/bwd_mask.cuh"
#include "sm90/bwd/bwd_turns.cuh"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/gmem_layout.cuh"
#include "sm90/common/named_barriers.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/common/smem_atom.cuh"

namespace fa4::sm90 {

using namespace cute;

template <class Config>
struct BwdDqReduce {
  using BlockM = typename Config::BlockM;
  // A warpgroup's share of the CTA's dQ columns (Config::kDqDim: all of the head dim, or half on a
  // key-tile pair, bwd_pair.cuh), "half" for short.
  using HalfDim = Int<Config::kDqDim / Config::kMmaWarpgroups>;
  // The part of the tile a warpgroup stages and the writer reduce-adds as one box: (BlockM rows,
  // its half of the columns), or with kDqSplitRows (its 64 rows, every column).
  static constexpr bool kSplitRows = Config::kDqSplitRows;
  using PartRows = Int<kSplitRows ? 64 : BlockM::value>;
  using PartCols = Int<kSplitRows ? Config::kDqDim : HalfDim::value>;
  // The atoms are a half's width either way (128 bytes = 32 floats, or 64 bytes for d96's
  // 48-float halves), so that dq_accum's column order is the same for both splits. Both parts in
  // one tile: atoms tile a part column by column, and the parts follow each other (column halves:
  // the atoms' own column-by-column order; row halves: one part after the other), so warpgroup w's
  // part is the w-th contiguous part of the buffer, laid out as SmemLayoutPart.
  using Atom = SmemAtom<float, HalfDim::value>;
  using SmemLayoutPart = decltype(tile_to_shape(Atom{}, Shape<PartRows, PartCols>{}));
  using SmemLayout = std::conditional_t<
      kSplitRows, decltype(tile_to_shape(SmemLayoutPart{}, Shape<BlockM, Int<Config::kDqDim>>{})),
      decltype(tile_to_shape(Atom{}, Shape<BlockM, Int<Config::kDqDim>>{}))>;
  static_assert(HalfDim::value * sizeof(float) % 64 == 0,
                "each half is a whole number of 64- or 128-byte swizzle atoms");
  static_assert(cosize_v<SmemLayout> == Config::kMmaWarpgroups * cosize_v<SmemLayoutPart>);
  static_assert(!kSplitRows || BlockM::value == 64 * Config::kMmaWarpgroups);
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

  // dq_accum: [heads_q][query rows][dim] fp32, dq_done: [batch][heads_q] (bwd_workspace.hpp).
  static Params make_params(const Problem& p, float* dq_accum, int64_t q_rows, int32_t* done) {
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

  // The writer warp, after write() or in a CTA that adds nothing to dQ: every CTA of the grid adds
  // 1 to its (batch entry, head)'s count in dq_done, `slot`, once its reduce-adds have landed in
  // global memory, as the deterministic mode's turns do: written (every lane waits; only the one
  // that issued has bulk groups), made visible to the generic proxy, released. The wait overlaps
  // the MMA warpgroups' dK / dV epilogue.
  CUTE_DEVICE static void landed(Params const& p, int64_t slot) {
    if (p.done == nullptr) return;
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if (cute::elect_one_sync()) Turns::pass_one(p.done + slot);
    __syncwarp();
  }

  CUTE_DEVICE static void prefetch_descriptor(Params const& p) {
    prefetch_tma_descriptor(p.tma.get_tma_descriptor());
  }

  // Where one sequence's rows are in the accumulator's view: made once, before the tile loop.
  CUTE_DEVICE static SeqRows rows(Params const& p, Sequence const& seq) {
    return seq.q_rows(get<0>(p.shape));
  }

  // The staging buffers' handshake: a warpgroup's part is full (its 128 threads arrive, the
  // writer warp waits) or empty (the writer arrives once its reduction has read the part).
  static constexpr uint32_t kHandshakeThreads = 128 + 32;
  CUTE_DEVICE static uint32_t full_barrier(int wg) { return wg == 0 ? kBwdDqFull0 : kBwdDqFull1; }
  CUTE_DEVICE static uint32_t empty_barrier(int wg) { return wg == 0 ? kBwdDqEmpty0 : kBwdDqEmpty1; }

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
    cutlass::arch::NamedBarrier::sync(kHandshakeThreads, empty_barrier(wg));
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
    // st.shared is the generic proxy, the TMA reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::arrive(kHandshakeThreads, full_barrier(wg));
  }

  // The writer warp (one warp of the producer warpgroup): for each query tile m, in `order`,
  // and each warpgroup's part, waits for the part, issues its reduce-add and frees the part once
  // the TMA unit has read it. `first_half`: the CTA's first column block of HalfDim in the
  // accumulator (0, or on a key-tile pair its rank · kMmaWarpgroups); with row parts, part w of
  // query tile m is the accumulator's 64-row tile 2m + w. Deterministic mode
  // (`counter(m, wg)` not null): before its reduction the writer waits for the counter to read
  // turn(m), and moves it on once the reduction has landed in global memory; the MMA warpgroups
  // never wait on a turn themselves.
  // `loads_issued` (one-stage Q / dO rings, else null): two mbarriers, the load thread arriving on
  // [t & 1] once it has issued step t's Q and dO (t after the first); the reduce-add of step t
  // waits for step t + 1's, so that the TMA unit takes the loads the next tile waits on before this
  // tile's 2 × 32 KB reduction.
  template <class Order, class Counter, class Turn>
  CUTE_DEVICE static void write(Params const& p, float* smem, int head, SeqRows rows, Order order,
                                Counter const& counter, Turn const& turn, uint64_t* loads_issued,
                                int first_half) {
    const int begin = order.tiles.begin, end = order.tiles.end;
    const bool issuer = cute::elect_one_sync();
    Tensor mDq = p.tma.get_tma_tensor(p.shape)(_, _, head, rows.shift, rows.batch);
    Tensor gDq = local_tile(domain_offset(make_coord(rows.offset, _0{}), mDq),
                            Shape<PartRows, PartCols>{}, make_coord(_, _));
    // Each half's first staging needs no wait; later ones wait for this warp's arrive below.
    for (int wg = 0; wg < Config::kMmaWarpgroups; ++wg)
      cutlass::arch::NamedBarrier::arrive(kHandshakeThreads, empty_barrier(wg));
    CUTE_NO_UNROLL
    for (int step = begin; step < end; ++step) {
      const int m = order.tile(step);
      // When this warp gets here, the load thread may have issued step + 2 too (the MMA
      // warpgroups free step + 1's stage before they stage step + 1's dQ, which waits for this
      // reduction), not step + 3: with a barrier per parity of the step, neither is a phase
      // ahead.
      if (loads_issued != nullptr && step + 1 < end)
        cutlass::arch::ClusterBarrier::wait(&loads_issued[(step + 1) & 1],
                                            ((step - begin) >> 1) & 1);
      CUTE_UNROLL
      for (int wg = 0; wg < Config::kMmaWarpgroups; ++wg) {
        cutlass::arch::NamedBarrier::sync(kHandshakeThreads, full_barrier(wg));
        if (issuer) {
          Tensor sDqPart = make_tensor(make_smem_ptr(smem + wg * cosize_v<SmemLayoutPart>),
                                       SmemLayoutPart{});
          Tensor gDqPart = kSplitRows ? gDq(_, _, Config::kMmaWarpgroups * m + wg, 0)
                                      : gDq(_, _, m, first_half + wg);
          auto [tDgDq, tDsDq] = tma_partition(p.tma, _0{}, Layout<_1>{},
                                              group_modes<0, 2>(sDqPart),
                                              group_modes<0, 2>(gDqPart));
          int32_t* const turns = counter(m, wg);
          if (turns != nullptr) {
            Turns::wait_one(turns, turn(m));
            // The previous turn's reduction (async proxy, ordered by the acquire) before this one.
            asm volatile("fence.proxy.async.global;" ::: "memory");
          }
          copy(p.tma, tDsDq, tDgDq);
          tma_store_arrive();
          if (turns != nullptr) {
            // Done writing, not only reading the staging buffer (no .read), and made visible to
            // the generic proxy's release.
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("fence.proxy.async.global;" ::: "memory");
            Turns::pass_one(turns);
          } else {
            tma_store_wait<0>();  // the part has been read
          }
        }
        __syncwarp();
        // No arrive after the last tile: every arrive is matched by a staging.
        if (step + 1 < end) cutlass::arch::NamedBarrier::arrive(kHandshakeThreads, empty_barrier(wg));
      }
    }
  }
};

}  // namespace fa4::sm90
