// dQ staged in fragment order (DqFragments, bwd_workspace.hpp): each MMA warpgroup's part of a
// query tile is one m64 wgmma's accumulator, stored as its fragments lie in the registers (16
// bytes per store, every thread's stores at constant offsets from one address) and added to its
// tile's block of dq_accum by one contiguous bulk reduce-add. Against the row order's swizzled
// staging (bwd_dq_reduce.cuh) half as many stores and no per-tile address arithmetic; the dQ
// finish kernel reads the order back (bwd_rows.cuh). Rows past a sequence's end add their zeros
// (their P and dS are 0) into the sequence's pad rows, which nothing reads.
#pragma once

#include <cute/tensor.hpp>

#include "fa4/attention.hpp"
#include "sm90/bwd/bwd_dq_handoff.cuh"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/sequence.cuh"

namespace fa4::sm90 {

template <class Config>
struct BwdDqFragments {
  static_assert(Config::kClusterCtas == 1, "no key-tile pairs: a CTA owns all of dQ's columns");
  static constexpr int kParts = Config::kMmaWarpgroups;
  static_assert(kParts == 2);
  // A part: 64 rows (the tile's half with 128-row tiles, else the whole tile) by kPartCols.
  static constexpr int kPartCols =
      Config::kBlockM == 128 ? Config::kDqDim : Config::kDqDim / kParts;
  static_assert(Config::kBlockM == 64 * (Config::kBlockM == 128 ? kParts : 1));
  static_assert(kPartCols % 8 == 0);
  static constexpr int kPartFloats = 64 * kPartCols;
  using SmemLayout = Layout<Shape<Int<kParts * kPartFloats>>>;
  static constexpr int kAccumAtom = 0;  // no column flip: the order is DqFragments

  struct Params {
    float* accum;       // dq_accum
    int64_t stat_rows;  // per head
    int32_t q_rows_per_batch;
    int32_t* done;  // dq_done (bwd_workspace.hpp), or null: nothing waits on the CTAs
  };

  static Params make_params(const Problem& p, float* dq_accum, int64_t /*q_rows*/,
                            int64_t stat_rows, int32_t* done) {
    return {dq_accum, stat_rows, int32_t(p.is_varlen() ? 0 : p.seqlen_q), done};
  }
  static DqFragments fragments() { return {Config::kBlockM, kPartCols}; }

  CUTE_DEVICE static void prefetch_descriptor(Params const&) {}

  // The stat row of the sequence's row 0 (`batch`: the sequence's index, also in varlen mode).
  CUTE_DEVICE static int64_t rows(Params const& p, Sequence const& seq, int batch) {
    return bwd_stat_row(seq.start_q + int64_t(seq.batch) * p.q_rows_per_batch, batch);
  }

  CUTE_DEVICE static void landed(Params const& p, int64_t slot) {
    BwdDqHandoff::landed(p.done, slot);
  }

  // Where MMA thread `thread` stages value v of its accumulator (in the wgmma's order, as
  // DqFragments in bwd_workspace.hpp numbers it): its part's 64 · kPartCols floats, then the
  // value's quad (512 floats each: 128 threads × 4), then the thread's 4.
  CUTE_HOST_DEVICE static constexpr int staged_at(int thread, int v) {
    return thread / 128 * kPartFloats + v / 4 * 512 + 4 * (thread % 128) + v % 4;
  }

  // Called by every thread of both MMA warpgroups, once per query tile, with the tiled MMA of dQ
  // and this thread's accumulator. `thread`: among the MMA threads. Waits until the writer has
  // read the warpgroup's previous part, stages this one and hands it over without waiting for the
  // reduction.
  template <class TiledMma, class Acc>
  CUTE_DEVICE static void stage(float* smem, TiledMma const&, Acc const& dq, int thread) {
    static_assert(decltype(size(dq))::value * 128 == kPartFloats, "one m64 accumulator a part");
    const int wg = thread / 128;
    BwdDqHandoff::acquire(wg);
    // One address a thread; every store at a constant offset from it.
    float* mine = smem + staged_at(thread, 0);
    CUTE_UNROLL
    for (int v = 0; v < size(dq); v += 4)
      *reinterpret_cast<float4*>(mine + staged_at(0, v)) =
          make_float4(dq(v), dq(v + 1), dq(v + 2), dq(v + 3));
    BwdDqHandoff::hand_over(wg);
  }

  // The writer warp (BwdDqHandoff::write): part w of query tile m is the w-th kPartFloats of the
  // tile's block.
  template <class Order, class Counter, class Turn>
  CUTE_DEVICE static void write(Params const& p, float* smem, int head, int64_t first_row,
                                Order order, Counter const& counter, Turn const& turn,
                                uint64_t* loads_issued, int /*first_half*/) {
    float* const sequence = p.accum + (int64_t(head) * p.stat_rows + first_row) * Config::kDqDim;
    BwdDqHandoff::write<kParts>(order, counter, turn, loads_issued, [&](int m, int wg) {
      float* dst = sequence + (int64_t(m) * Config::kBlockM * Config::kDqDim + wg * kPartFloats);
      const uint32_t src = uint32_t(__cvta_generic_to_shared(smem + wg * kPartFloats));
      asm volatile(
          "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
          "r"(src), "n"(kPartFloats * 4)
          : "memory");
      cute::tma_store_arrive();
    });
  }
};

}  // namespace fa4::sm90
