// Compile-time shape of one backward kernel instance (docs/sm90_backward.md).
//
// A CTA owns one tile of kBlockN keys of one query head and walks the query tiles of kBlockM rows
// that see them. Each of the two MMA warpgroups owns 64 of the keys and computes, per query tile,
//   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ               (SS: 64 keys × kBlockM queries, K = head dim)
//   dV += Pᵀ dO, dK += dSᵀ Q              (RS: Pᵀ and dSᵀ straight from the Sᵀ / dPᵀ registers)
// and, with dS of both warpgroups in shared memory, half of the head dim of
//   dQ = dS K                             (SS: kBlockM queries × dim/2, K = kBlockN keys).
// Computing Sᵀ rather than S is what lets P and dS feed dV and dK from registers: the accumulator
// of a 64-row wgmma is the A operand of the next one, without a shuffle (fragment.cuh).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/bwd_workspace.hpp"
#include "sm90/smem_atom.cuh"

// A/B switch (bench/ab_variants.sh): 1 or 0 forces BwdConfig::kDvBeforeDs; -1 chooses by tile.
#ifndef FA4_SM90_BWD_DV_BEFORE_DS
#define FA4_SM90_BWD_DV_BEFORE_DS -1
#endif

namespace fa4::sm90 {

using namespace cute;

template <int kHeadDim_, class Element_>
struct BwdConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using Accum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMmaWarpgroups = 2;
  static constexpr int kBlockM = bwd_block_m(kHeadDim_);  // query rows per step
  static constexpr int kBlockN = 64 * kMmaWarpgroups;  // keys per CTA
  static_assert(kBlockN == kBwdBlockN);
  static constexpr int kStages = 2;  // Q and dO rings
  // dV issued right after the exponentials (to run during dS) rather than after dS: it keeps P
  // (kBlockM/4 registers) alive beside Sᵀ and dPᵀ, which 128-row tiles cannot afford.
  static constexpr bool kDvBeforeDs =
      FA4_SM90_BWD_DV_BEFORE_DS < 0 ? kBlockM == 64 : FA4_SM90_BWD_DV_BEFORE_DS != 0;
  static constexpr int kThreads = 128 * (1 + kMmaWarpgroups);
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;

  // dK and dV (dim/2 registers each) live through the whole CTA, next to Sᵀ, dPᵀ (kBlockM/2 each)
  // and dQ (dim/4): the MMA warpgroups need the whole budget.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;
  static_assert(kProducerRegisters + kMmaWarpgroups * kMmaRegisters <= 512);

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using Stages = Int<kStages>;

  // Warpgroups stack along the keys for Sᵀ, dPᵀ, dV and dK, and split the head dim for dQ.
  using KeyTiling = Layout<Shape<Int<kMmaWarpgroups>, _1, _1>>;
  using DimTiling = Layout<Shape<_1, Int<kMmaWarpgroups>, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<_64, BlockM, HeadDim>>(), KeyTiling{}));
  using TiledMmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, Accum, Shape<_64, HeadDim, BlockM>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      KeyTiling{}));
  using TiledMmaQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<BlockM, Int<kHeadDim / kMmaWarpgroups>, BlockN>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      DimTiling{}));

  template <int kElements>
  using SmemAtom = sm90::SmemAtom<Element, kElements>;

  // Q and dO are read K-major (Sᵀ, dPᵀ: K = dim) and, transposed, MN-major (dK, dV: N = dim). K is
  // read K-major (Sᵀ) and transposed with N = dim / 2 per warpgroup (dQ): its swizzle must fit
  // that half, since an MN-major operand cannot start inside a swizzle atom.
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<HeadDim, BlockM, Stages>{}, Step<_2, _1, _3>{})));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom<kHeadDim / kMmaWarpgroups>{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<HeadDim, BlockN>{}, Step<_2, _1>{})));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom<kHeadDim>{}, Shape<BlockN, HeadDim>{}));
  // dS, (query, key) per stage: the A operand of dQ, written transposed from the dSᵀ registers.
  using SmemLayoutDs = decltype(tile_to_shape(SmemAtom<kBlockN>{}, Shape<BlockM, BlockN, _2>{}));
  using SmemLayoutDst = decltype(composition(
      SmemLayoutDs{}, make_ordered_layout(Shape<BlockN, BlockM, _2>{}, Step<_2, _1, _3>{})));

  static constexpr int kBytesQ = kBlockM * kHeadDim * int(sizeof(Element));  // one stage; = dO
  // One query tile's LSE·log2e (with Q) or D (with dO), in the same stage.
  static constexpr int kBytesRowStat = kBlockM * int(sizeof(float));
  static constexpr int kBytesKV = 2 * kBlockN * kHeadDim * int(sizeof(Element));

  static_assert(kHeadDim % 32 == 0,
                "dQ splits the head dim into halves of whole 16-element (32-byte) swizzle atoms");
  static_assert(kBlockM % 64 == 0, "Sᵀ's N and dQ's M are kBlockM");
  static_assert(kBwdStatAlign % kBlockM == 0, "each sequence's stat rows are padded for a whole tile");
};

}  // namespace fa4::sm90
