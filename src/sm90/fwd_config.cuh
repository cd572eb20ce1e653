// Compile-time shape of one forward kernel instance: tile sizes, shared-memory layouts and the two
// warpgroup MMAs (QKᵀ from shared memory, PV with P from registers). Everything the kernel's
// pieces agree on lives here, so a new head dim is one more row in the tile table below.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

namespace fa4::sm90 {

using namespace cute;

// Tile sizes per head dim (bf16/fp16). The query tile is always 128 rows: one 64-row slice per
// consumer warpgroup. The key tile shrinks as the head dim grows so that Q, two K stages and two V
// stages fit in shared memory (227 KB) and S, P and O fit in 240 registers per thread.
template <int kHeadDim>
struct FwdTileSize;
template <>
struct FwdTileSize<64> {
  static constexpr int kBlockN = 128;
};
template <>
struct FwdTileSize<128> {
  static constexpr int kBlockN = 128;
};
// FA3 uses 80 here; with this kernel's register budget 80 spills 16 bytes (measured), 64 does not.
template <>
struct FwdTileSize<256> {
  static constexpr int kBlockN = 64;
};

template <int kHeadDim_, class Element_>
struct FwdConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using Accum = float;

  static constexpr int kHeadDim = kHeadDim_;  // head_dim_qk == head_dim_v
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = FwdTileSize<kHeadDim>::kBlockN;
  static constexpr int kStages = 2;  // K and V ring depth
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);

  // setmaxnreg budgets: the producer only issues TMA; the consumers hold S, P and O.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kProducerRegisters + kConsumerWarpgroups * kConsumerRegisters <= 512,
                "register budget exceeds the 64K registers of an SM");

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using Stages = Int<kStages>;

  // Consumer warpgroups stack along M: warpgroup w owns rows [64w, 64w + 64) of the query tile.
  using WarpgroupTiling = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<_64, BlockN, HeadDim>>(),
      WarpgroupTiling{}));
  // PV: A = P (registers, K-major), B = Vᵀ read from V's row-major tile (MN-major).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, Accum, Shape<_64, HeadDim, BlockN>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      WarpgroupTiling{}));

  // 128-byte swizzle: rows of 64 elements, conflict-free for wgmma and the TMA box width.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim, Stages>{}));
  using SmemLayoutV = SmemLayoutK;
  // The same bytes as V, indexed (dim, key, stage): the B operand of PV.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<HeadDim, BlockN, Stages>{}, Step<_2, _1, _3>{})));
  // O is staged through Q's buffer once the last QKᵀ has read it.
  using SmemLayoutO = SmemLayoutQ;

  static constexpr int kBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kBytesKV = kBlockN * kHeadDim * int(sizeof(Element));  // one stage of K or V

  static_assert(kHeadDim % 64 == 0, "the 128-byte swizzle needs head dims in multiples of 64");
  static_assert(kBlockN % 16 == 0, "P is the A operand of a k16 wgmma");
};

}  // namespace fa4::sm90
