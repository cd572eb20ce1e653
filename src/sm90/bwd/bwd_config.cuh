// Compile-time shape of one backward kernel instance (docs/sm90_backward.md): BwdConfig up to
// head dim 128, BwdWideConfig above; BwdConfigFor picks one.
//
// BwdConfig: a CTA owns one tile of kBlockN keys of one query head and walks the query tiles of kBlockM rows
// that see them. Each of the two MMA warpgroups owns 64 of the keys and computes, per query tile,
//   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ               (SS: 64 keys × kBlockM queries, K = head dim)
//   dV += Pᵀ dO, dK += dSᵀ Q              (RS: Pᵀ and dSᵀ straight from the Sᵀ / dPᵀ registers)
// and, with dS of both warpgroups in shared memory, half of the head dim (or, kDqSplitRows, of the
// query rows) of
//   dQ = dS K                             (SS: kBlockM queries × dim/2, K = kBlockN keys).
// Computing Sᵀ rather than S is what lets P and dS feed dV and dK from registers: the accumulator
// of a 64-row wgmma is the A operand of the next one, without a shuffle (fragment.cuh).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/register_budget.hpp"
#include "sm90/common/smem_atom.cuh"

// A/B switch (bench/ab_variants.sh): 1 or 0 forces BwdConfig::kDvBeforeDs; -1 chooses by tile.
#ifndef FA4_SM90_BWD_DV_BEFORE_DS
#define FA4_SM90_BWD_DV_BEFORE_DS -1
#endif
// A/B switch: 1 (default, measured +2 % on d64's backward) splits dQ by query rows where the
// query tile has a 64-row slice per MMA warpgroup (BwdConfig::kDqSplitRows); 0 splits it by
// head-dim halves.
#ifndef FA4_SM90_BWD_DQ_ROWS
#define FA4_SM90_BWD_DQ_ROWS 1
#endif

namespace fa4::sm90 {

using namespace cute;

template <int kHeadDim_, class Element_>
struct BwdConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using Accum = float;
  static constexpr bool kWide = false;  // Sᵀ, P and dS in registers (bwd_kernel.cuh)

  static constexpr int kHeadDim = kHeadDim_;  // of Q and K
  static constexpr int kHeadDimV = kHeadDim_;
  static constexpr int kMmaWarpgroups = 2;
  static constexpr int kBlockM = bwd_block_m(kHeadDim_);  // query rows per step
  static constexpr int kBlockN = 64 * kMmaWarpgroups;  // keys per CTA
  static_assert(kBlockN == bwd_block_n(kHeadDim_));
  static constexpr int kStages = 2;  // Q and dO rings
  static constexpr int kClusterCtas = 1;  // no key-tile pairs (bwd_pair.cuh)
  static constexpr int kDqDim = kHeadDim;  // dQ's columns this CTA computes
  // Without a band, key tiles walk the query tiles from the first (QueryOrder: rotated, no
  // faster here).
  static constexpr bool kRotateQueries = false;
  // dV issued right after the exponentials (to run during dS) rather than after dS: it keeps P
  // (kBlockM/4 registers) alive beside Sᵀ and dPᵀ, which 128-row tiles cannot afford.
  static constexpr bool kDvBeforeDs =
      FA4_SM90_BWD_DV_BEFORE_DS < 0 ? kBlockM == 64 : FA4_SM90_BWD_DV_BEFORE_DS != 0;
  // dQ split by query rows (each warpgroup an m64 × dim wgmma over the keys: it reads its half of
  // dS and all of K) rather than by head-dim halves (all of dS and half of K, in twice as many
  // m64 × dim/2 wgmmas): 64 against 80 KB of operand reads per step at d64, the only head dim
  // whose query tile (128 rows) has a 64-row slice per warpgroup. BwdDqReduce stages row halves.
  static constexpr bool kDqSplitRows = FA4_SM90_BWD_DQ_ROWS != 0 && kBlockM == 64 * kMmaWarpgroups;
  // dQ staged in fragment order (bwd_dq_fragments.cuh) where each warpgroup's part is one m64
  // wgmma's accumulator: 64-row tiles, or 128-row ones split by rows.
  static constexpr bool kDqFragments =
      bwd_dq_fragments(kHeadDim) && (kBlockM == 64 || kDqSplitRows);
  static constexpr int kThreads = 128 * (1 + kMmaWarpgroups);
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;

  // dK and dV (dim/2 registers each) live through the whole CTA, next to Sᵀ, dPᵀ (kBlockM/2 each)
  // and dQ (dim/4): the MMA warpgroups need the whole budget.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;
  static_assert(register_budget_fits(kProducerRegisters, kMmaWarpgroups, kMmaRegisters));

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using HeadDimV = HeadDim;
  using Stages = Int<kStages>;

  // Warpgroups stack along the keys for Sᵀ, dPᵀ, dV and dK, and split the head dim (or the
  // query rows: kDqSplitRows) for dQ.
  using KeyTiling = Layout<Shape<Int<kMmaWarpgroups>, _1, _1>>;
  using DimTiling = Layout<Shape<_1, Int<kMmaWarpgroups>, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<_64, BlockM, HeadDim>>(), KeyTiling{}));
  using TiledMmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, Accum, Shape<_64, HeadDim, BlockM>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      KeyTiling{}));
  using TiledMmaQ = std::conditional_t<
      kDqSplitRows,
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, Accum,
                                                   Shape<_64, HeadDim, BlockN>, GMMA::Major::K,
                                                   GMMA::Major::MN>(),
                              KeyTiling{})),
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, Accum,
                               Shape<BlockM, Int<kHeadDim / kMmaWarpgroups>, BlockN>,
                               GMMA::Major::K, GMMA::Major::MN>(),
          DimTiling{}))>;

  template <int kElements>
  using SmemAtom = sm90::SmemAtom<Element, kElements>;

  // Q and dO are read K-major (Sᵀ, dPᵀ: K = dim) and, transposed, MN-major (dK, dV: N = dim). K is
  // read K-major (Sᵀ) and transposed with N = dim / 2 per warpgroup (dQ; all of dim with
  // kDqSplitRows, two of these atoms along N): its swizzle must fit that half, since an MN-major
  // operand cannot start inside a swizzle atom.
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<HeadDim, BlockM, Stages>{}, Step<_2, _1, _3>{})));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom<kHeadDim / kMmaWarpgroups>{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<HeadDim, BlockN>{}, Step<_2, _1>{})));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<BlockN, HeadDim>{}));
  // dQ's K columns: all of K (no pairs).
  using DqDim = HeadDim;
  using SmemLayoutKDq = SmemLayoutK;
  using SmemLayoutDo = SmemLayoutQ;
  // dS, (query, key) per stage: the A operand of dQ, written transposed from the dSᵀ registers.
  using SmemLayoutDs = decltype(tile_to_shape(SmemAtom<kBlockN>{}, Shape<BlockM, BlockN, _2>{}));
  using SmemLayoutDst = decltype(composition(
      SmemLayoutDs{}, make_ordered_layout(Shape<BlockN, BlockM, _2>{}, Step<_2, _1, _3>{})));

  static constexpr int kBytesQ = kBlockM * kHeadDim * int(sizeof(Element));  // one stage
  static constexpr int kBytesDo = kBytesQ;
  // One query tile's LSE·log2e (with Q) or D (with dO), in the same stage.
  static constexpr int kBytesRowStat = kBlockM * int(sizeof(float));
  static constexpr int kBytesKV = 2 * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kBytesPartnerK = 0;

  static_assert(kHeadDim % 32 == 0,
                "dQ splits the head dim into halves of whole 16-element (32-byte) swizzle atoms");
  static_assert(kBlockM % 64 == 0, "Sᵀ's N and dQ's M are kBlockM");
  static_assert(kBwdStatAlign % kBlockM == 0, "each sequence's stat rows are padded for a whole tile");
};

// BwdWideConfig (head dims above 128): dK and dV of 128 keys do not fit beside the scores, so
// a CTA owns kBlockN = 64 keys, each of the two MMA warpgroups 32 of them for the scores; dK and
// dV are computed transposed:
//   S = Q Kᵀ, dP = dO Vᵀ                   (SS: kBlockM queries × 32 keys)
//   P, dS → shared memory                  (dVᵀ / dKᵀ and dQ read them back)
//   dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS             (SS, K = kBlockM queries; per warpgroup, when both head
//                                           dims are multiples of 128 (d256): half the head dim ×
//                                           all 64 keys, else all of it × its own 32 keys)
//   dQ = dS K                              (SS: kBlockM queries × dim/2, K = kBlockN keys)
// B operands of a wgmma come from shared memory only, so P and dS cannot feed dVᵀ / dKᵀ from the
// registers; in exchange dKᵀ and dVᵀ hold half of (head dim × 64 keys) per warpgroup either way.
// The split by head dim (kDkvByDim) gives dVᵀ / dKᵀ wgmmas of N = 64 rather than 32: per FLOP a
// third less shared memory read for their operands (the kernel is bound by shared memory there),
// at the cost of a second P stage (both warpgroups read every key's P).
//
// kClusterCtas_ 2: the CTAs of two adjacent key tiles form a cluster, and each computes dQ for
// half the head dim (kDqDim) over both key tiles, from its own dS and its partner's (bwd_pair.cuh):
// one reduce-add of half the size per CTA and query tile. The partner's K columns and dS take the
// shared memory that the halved dQ staging frees.
template <int kHeadDimQK_, int kHeadDimV_, class Element_, int kClusterCtas_ = 1>
struct BwdWideConfig {
  using Element = Element_;
  using Accum = float;
  static constexpr bool kWide = true;

  static constexpr int kHeadDim = kHeadDimQK_;  // of Q and K
  static constexpr int kHeadDimV = kHeadDimV_;  // of V, dO (and O)
  static constexpr int kMmaWarpgroups = 2;
  static constexpr int kBlockM = bwd_block_m(kHeadDimQK_);
  static constexpr int kBlockN = bwd_block_n(kHeadDimQK_);
  static constexpr int kKeysPerWarpgroup = kBlockN / kMmaWarpgroups;
  static constexpr bool kDkvByDim = kHeadDimQK_ % 128 == 0 && kHeadDimV_ % 128 == 0;
  // Keys of one warpgroup's dVᵀ / dKᵀ, and P's stages: a warpgroup rewrites P only after its own
  // dVᵀ has read it, so one stage does while that dVᵀ is the only reader.
  static constexpr int kDkvKeys = kDkvByDim ? kBlockN : kKeysPerWarpgroup;
  static constexpr int kStagesP = kDkvByDim ? 2 : 1;
  // Q and dO rings: two stages need 64 KB more than the 227 KB at head dim 256 (dQ's fp32
  // staging alone is 64 KB there), so d256 loads each query tile after the last one is done.
  static constexpr int kStages = kHeadDimQK_ + kHeadDimV_ <= 384 ? 2 : 1;
  // Without a band, each key tile starts at its own query tile (QueryOrder) where that measured
  // faster: d256, whose 64 CTAs per head at 4k would otherwise add 64 KB of dQ each into the same
  // tile at once, behind one-stage rings (+2.6-3.0 %); not d192 / 192x128 (two stages, 48 KB:
  // -0.5 ... -1.1 %).
  static constexpr bool kRotateQueries = kStages == 1;
  // Key-tile pairs where dQ's staging (64 KB at d256) is what fills the shared memory; the plan
  // picks them per problem (host/bwd_plan.cpp).
  static constexpr bool kPairable = kStages == 1;
  static_assert(kPairable == bwd_one_stage(kHeadDimQK_, kHeadDimV_), "the host plan's rule");
  static constexpr int kClusterCtas = kClusterCtas_;
  static_assert(kClusterCtas == 1 || (kClusterCtas == 2 && kPairable));
  static constexpr int kDqDim = kHeadDim / kClusterCtas;
  static constexpr bool kDqSplitRows = false;  // dQ by head-dim halves: 64-row query tiles
  static constexpr bool kDqFragments = false;  // dQ staged by rows (bwd_dq_reduce.cuh)
  static constexpr int kThreads = 128 * (1 + kMmaWarpgroups);
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;
  static_assert(register_budget_fits(kProducerRegisters, kMmaWarpgroups, kMmaRegisters));

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using HeadDimV = Int<kHeadDimV>;
  using Stages = Int<kStages>;

  // Warpgroups side by side along the keys (S, dP; dVᵀ, dKᵀ unless kDkvByDim) and along the head
  // dim (dQ; dVᵀ, dKᵀ with kDkvByDim, where M is the head dim).
  using NTiling = Layout<Shape<_1, Int<kMmaWarpgroups>, _1>>;
  using MTiling = Layout<Shape<Int<kMmaWarpgroups>, _1, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<BlockM, Int<kKeysPerWarpgroup>, HeadDim>>(),
      NTiling{}));
  using TiledMmaKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<_64, Int<kDkvKeys>, BlockM>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kDkvByDim, MTiling, NTiling>{}));
  using TiledMmaQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<BlockM, Int<kDqDim / kMmaWarpgroups>, BlockN>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      NTiling{}));

  template <int kElements>
  using SmemAtom = sm90::SmemAtom<Element, kElements>;
  // Q and dO are read K-major (S, dP) and transposed, MN-major in 64-row slices of the head dim
  // (dKᵀ, dVᵀ); K K-major (S) and transposed with N = dim / 2 per warpgroup (dQ); V K-major.
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<HeadDim, BlockM, Stages>{}, Step<_2, _1, _3>{})));
  using SmemLayoutDo =
      decltype(tile_to_shape(SmemAtom<kHeadDimV>{}, Shape<BlockM, HeadDimV, Stages>{}));
  using SmemLayoutDot = decltype(composition(
      SmemLayoutDo{}, make_ordered_layout(Shape<HeadDimV, BlockM, Stages>{}, Step<_2, _1, _3>{})));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom<kDqDim / kMmaWarpgroups>{}, Shape<BlockN, HeadDim>{}));
  // The K columns of this CTA's dQ (on a pair: its half of its own K, and the partner's copy),
  // transposed for dQ. Atoms tile K column by column, so half c of K is its c-th contiguous
  // block, laid out like this.
  using DqDim = Int<kDqDim>;
  using SmemLayoutKDq =
      decltype(tile_to_shape(SmemAtom<kDqDim / kMmaWarpgroups>{}, Shape<BlockN, DqDim>{}));
  using SmemLayoutKDqt = decltype(composition(
      SmemLayoutKDq{}, make_ordered_layout(Shape<DqDim, BlockN>{}, Step<_2, _1>{})));
  static_assert(SmemLayoutK{}(0, kDqDim % kHeadDim) == cosize_v<SmemLayoutKDq> % cosize_v<SmemLayoutK>,
                "half c of K starts c blocks of SmemLayoutKDq in");
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom<kHeadDimV>{}, Shape<BlockN, HeadDimV>{}));
  // P (kStagesP) and dS (two stages, as in BwdConfig), (query, key); read transposed from the
  // first key of a warpgroup's dVᵀ / dKᵀ, so the swizzle atom spans kDkvKeys keys at most.
  using SmemLayoutP =
      decltype(tile_to_shape(SmemAtom<kDkvKeys>{}, Shape<BlockM, BlockN, Int<kStagesP>>{}));
  using SmemLayoutPt = decltype(composition(
      SmemLayoutP{},
      make_ordered_layout(Shape<BlockN, BlockM, Int<kStagesP>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutDs =
      decltype(tile_to_shape(SmemAtom<kDkvKeys>{}, Shape<BlockM, BlockN, _2>{}));
  using SmemLayoutDst = decltype(composition(
      SmemLayoutDs{}, make_ordered_layout(Shape<BlockN, BlockM, _2>{}, Step<_2, _1, _3>{})));

  static constexpr int kBytesQ = kBlockM * kHeadDim * int(sizeof(Element));  // one stage
  static constexpr int kBytesDo = kBlockM * kHeadDimV * int(sizeof(Element));
  static constexpr int kBytesRowStat = kBlockM * int(sizeof(float));
  static constexpr int kBytesKV = kBlockN * (kHeadDim + kHeadDimV) * int(sizeof(Element));
  // On a pair, the partner's K columns of this CTA's dQ, loaded with K and V.
  static constexpr int kBytesPartnerK =
      kClusterCtas == 1 ? 0 : kBlockN * kDqDim * int(sizeof(Element));

  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0,
                "dKᵀ and dVᵀ are 64-row wgmma atoms along the head dim");
  static_assert(kDqDim / kMmaWarpgroups % 16 == 0, "dQ's halves: whole 64-byte float atoms");
  static_assert(kKeysPerWarpgroup % 16 == 0, "a warpgroup's keys: whole k16 / 32-byte atoms");
  static_assert(!kDkvByDim || (kHeadDim % (64 * kMmaWarpgroups) == 0 &&
                               kHeadDimV % (64 * kMmaWarpgroups) == 0),
                "dVᵀ / dKᵀ by head dim: whole 64-row wgmma atoms per warpgroup");
  static_assert(kBwdStatAlign % kBlockM == 0, "each sequence's stat rows are padded for a whole tile");
};

// The configuration of a (head dim qk, head dim v) backward instance.
template <int kHeadDimQK, int kHeadDimV, class Element>
using BwdConfigFor =
    std::conditional_t<(kHeadDimQK <= 128), BwdConfig<kHeadDimQK, Element>,
                       BwdWideConfig<kHeadDimQK, kHeadDimV, Element>>;

// Its key-tile-pair configuration where it has one (kPairable), else itself.
template <class Config, bool = Config::kWide>
struct BwdPairedConfig {
  using type = Config;
};
template <class Config>
struct BwdPairedConfig<Config, true> {
  using type = std::conditional_t<
      Config::kPairable,
      BwdWideConfig<Config::kHeadDim, Config::kHeadDimV, typename Config::Element, 2>, Config>;
};

}  // namespace fa4::sm90
