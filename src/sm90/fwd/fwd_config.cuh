// Compile-time shape of one forward kernel instance: tile sizes, shared-memory layouts and the two
// warpgroup MMAs (QKᵀ from shared memory, PV with P from registers). Everything the kernel's
// pieces agree on lives here, so a new head dim is one more row in the tile table below.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/common/register_budget.hpp"
#include "sm90/common/smem_atom.cuh"

#ifndef FA4_SM90_EXP2_POLY_NUM
#define FA4_SM90_EXP2_POLY_NUM 0
#endif
#ifndef FA4_SM90_EXP2_POLY_DEN
#define FA4_SM90_EXP2_POLY_DEN 1
#endif
#ifndef FA4_SM90_RESCALE_THRESHOLD_LOG2
#define FA4_SM90_RESCALE_THRESHOLD_LOG2 0
#endif
// A/B switch (bench/ab_variants.sh): 1 or 0 forces FwdConfig::kRescaleVote; -1 takes the table's.
#ifndef FA4_SM90_RESCALE_VOTE
#define FA4_SM90_RESCALE_VOTE -1
#endif

namespace fa4::sm90 {

using namespace cute;

// Key-tile rows per (head dim qk, head dim v), bf16/fp16, and the consumer warpgroups: the query
// tile has one 64-row slice per consumer warpgroup (128 rows with two, 192 with three). The key
// tile shrinks as the head dims grow so that Q, two K stages and two V stages fit in shared memory
// (227 KB) and S, P and O fit in the registers per thread (240 with two consumer warpgroups, 160
// with three; O takes dv/2, S N/2 and P N/4 registers). kSoftmaxChains: independent max / sum chains
// per row in the softmax (softmax.cuh); 4 measured +2-6 % at d128, -3-4 % at d64 (bench/NOTES.md,
// v3); the other head dims keep 1 until measured. kRescaleVote: O rescaled only on tiles where a
// row of the warp has a new max (softmax.cuh), rather than on every tile. kOwnKeyTiles: each
// consumer warpgroup computes only the key tiles its own 64 rows see (FwdKernel::own_key_tiles),
// set where key tiles are narrower than query tiles, so that a slice can see fewer than its tile
// (measured +3-5 % at d64 causal 512-2k, +2-4 % at d192; at d128, where every slice sees the
// tile's key tiles, the extra steps cost 2-3 % at causal 512-1k: bench/NOTES.md, twenty-fifth
// session).
template <int kHeadDimQK, int kHeadDimV>
struct FwdTileSize;
template <>
struct FwdTileSize<64, 64> {
  static constexpr int kBlockN = 128;
  static constexpr int kSoftmaxChains = 1;
  static constexpr bool kRescaleVote = false;
  // d64 is bound by the softmax (MUFU): three consumer warpgroups (192 query rows, 160 registers
  // each) keep more of it in flight per SM, as FA3 does.
  static constexpr int kConsumerWarpgroups = 3;
  // 192-row tiles on 128-key tiles: slices of a diagonal or short tile see fewer key tiles.
  static constexpr bool kOwnKeyTiles = true;
};
template <>
struct FwdTileSize<96, 96> {
  static constexpr int kBlockN = 128;
  static constexpr int kSoftmaxChains = 1;
  static constexpr bool kRescaleVote = false;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr bool kOwnKeyTiles = false;
};
template <>
struct FwdTileSize<128, 128> {
  static constexpr int kBlockN = 128;
  static constexpr int kSoftmaxChains = 4;
  static constexpr bool kRescaleVote = false;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr bool kOwnKeyTiles = false;
};
// O takes 96 registers: S and P of 96 keys leave room for the rest without spilling.
template <>
struct FwdTileSize<192, 192> {
  static constexpr int kBlockN = 96;
  static constexpr int kSoftmaxChains = 1;
  static constexpr bool kRescaleVote = false;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr bool kOwnKeyTiles = true;  // 96-key tiles under 128-row tiles
};
template <>
struct FwdTileSize<192, 128> {
  static constexpr int kBlockN = 128;
  static constexpr int kSoftmaxChains = 1;
  static constexpr bool kRescaleVote = false;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr bool kOwnKeyTiles = false;
};
// FA3 uses 80 here; with this kernel's register budget 80 spills 16 bytes (measured), 64 does not.
// O's rescale is 128 multiplies per thread and tile here, 4x the exponentials: skipping it when no
// row of the warp has a new max measured +2-8 % (bench/NOTES.md, forward v6; level or worse at
// d128 and d192).
template <>
struct FwdTileSize<256, 256> {
  static constexpr int kBlockN = 64;
  static constexpr int kSoftmaxChains = 1;
  static constexpr bool kRescaleVote = true;
  static constexpr int kConsumerWarpgroups = 2;
  // Own key tiles measured +1-2 % at causal 512-4k, but spill 12 bytes here (tile-level values).
  static constexpr bool kOwnKeyTiles = false;
};

// The chunked variant of a head dim, where one exists (FwdConfig<..., true>; the launcher takes it
// without a causal or window mask from kMinKeys keys per sequence on, fwd_launch.cuh): wider key
// tiles whose K and V go through one ring of kKvChunks chunks of half the head dim. At d256, 128
// keys rather than 64 halve the re-reads of Q per key: 17 % fewer shared-memory bytes per FLOP and
// fewer instructions, so less power, which sets the clock under the H200's 700 W cap
// (bench/NOTES.md, nineteenth session). Q (64 KB) with two 64 KB stages of K and of V would not fit
// in shared memory; five 32 KB chunks do. S (64 registers), P (32) and O (128) do not fit together,
// so a warpgroup's QKᵀ follows its P·V (FwdKernel::consume_chunked).
template <int kHeadDimQK, int kHeadDimV>
struct FwdChunkedTileSize {
  static constexpr bool kExists = false;
  static constexpr int kKvChunks = 0;
  static constexpr int64_t kMinKeys = 0;
};
template <>
struct FwdChunkedTileSize<256, 256> : FwdTileSize<256, 256> {
  static constexpr bool kExists = true;
  static constexpr int kBlockN = 128;
  static constexpr int kKvChunks = 5;
  // Against the 64-key kernel without a mask, five rounds: 512 keys −14 %, 1k −4 %, 2k −1 %, 4k
  // +2.6 %, 8k +1.5 %, 16k +3.9 % (a tile's first QKᵀ and last P·V, exposed, are twice as long).
  static constexpr int64_t kMinKeys = 4096;
};

template <int kHeadDimQK_, int kHeadDimV_, class Element_, bool kChunked_ = false>
struct FwdConfig {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using Accum = float;

  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kChunked = kChunked_;
  static_assert(!kChunked || FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kExists,
                "no chunked variant of these head dims");
  using TileSize = std::conditional_t<kChunked, FwdChunkedTileSize<kHeadDimQK, kHeadDimV>,
                                      FwdTileSize<kHeadDimQK, kHeadDimV>>;
  static constexpr int kConsumerWarpgroups = TileSize::kConsumerWarpgroups;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = TileSize::kBlockN;
  static constexpr bool kOwnKeyTiles = TileSize::kOwnKeyTiles && !kChunked;
  static constexpr int kStages = 2;  // K and V ring depth
  // Chunked: K and V share one ring of kKvChunks chunks of (kBlockN keys, half the head dim),
  // loaded in the order the consumers take them (FwdLoad::run_chunked); else K and V rings of
  // kStages whole tiles.
  static constexpr int kKvChunks = FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kKvChunks * kChunked;
  static constexpr int kChunkCols = kChunked ? kHeadDimQK / 2 : kHeadDimQK;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);

  // setmaxnreg budgets: the producer only issues TMA; the consumers hold S, P and O.
  static constexpr int kProducerRegisters = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 240 : 160;
  static_assert(register_budget_fits(kProducerRegisters, kConsumerWarpgroups, kConsumerRegisters),
                "register budget exceeds the CTA's launch allocation");

  // Softmax (softmax.cuh): kExp2PolyNum of every kExp2PolyDen exponentials on the FMA pipe (FA4's
  // software exp2), and O rescaled only when a row's scaled max grows by more than `threshold`
  // in log2 units, so P may reach 2^threshold (0: the exact online softmax, O rescaled on every
  // tile). The FA4_SM90_* macros build A/B variants of the same tree (bench/ab_variants.sh). Measured on the H200 (bench/NOTES.md, v2): threshold 8 is 2-6 % faster
  // than 0 but fails DESIGN.md §4's rule on some inputs (the dominant probability is no longer
  // exactly 1, so its bf16 rounding adds error the rule does not allow); a polynomial share of 1/4
  // or 1/2 gains nothing at d64, loses 4-10 % at d128 and its 8.6e-5 relative error fails the LSE
  // rule. Both stay off until they pass.
  static constexpr int kExp2PolyNum = FA4_SM90_EXP2_POLY_NUM;
  static constexpr int kExp2PolyDen = FA4_SM90_EXP2_POLY_DEN;
  static constexpr int kRescaleThresholdLog2 = FA4_SM90_RESCALE_THRESHOLD_LOG2;
  static constexpr int kSoftmaxChains = TileSize::kSoftmaxChains;
  // At threshold 0, O rescaled only when a row of the warp has a new max (softmax.cuh).
  static constexpr bool kRescaleVote = FA4_SM90_RESCALE_VOTE < 0
                                           ? TileSize::kRescaleVote
                                           : FA4_SM90_RESCALE_VOTE != 0;

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDimQK = Int<kHeadDimQK>;
  using HeadDimV = Int<kHeadDimV>;
  using Stages = Int<kStages>;

  // Consumer warpgroups stack along M: warpgroup w owns rows [64w, 64w + 64) of the query tile.
  using WarpgroupTiling = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, Accum, Shape<_64, BlockN, HeadDimQK>>(),
      WarpgroupTiling{}));
  // PV: A = P (registers, K-major), B = Vᵀ read from V's row-major tile (MN-major).
  // Chunked, one P·V computes one chunk's half of O's columns.
  using PVCols = Int<kChunked ? kChunkCols : kHeadDimV>;
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, Accum, Shape<_64, PVCols, BlockN>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      WarpgroupTiling{}));

  // 128-byte swizzle for rows of multiples of 64 elements, 64 bytes for 96 (smem_atom.cuh).
  template <int kRowElements>
  using SmemAtom = sm90::SmemAtom<Element, kRowElements>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<kHeadDimQK>{}, Shape<BlockM, HeadDimQK>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom<kHeadDimQK>{}, Shape<BlockN, HeadDimQK, Stages>{}));
  using SmemLayoutV =
      decltype(tile_to_shape(SmemAtom<kHeadDimV>{}, Shape<BlockN, HeadDimV, Stages>{}));
  // The same bytes as V, indexed (dim, key, stage): the B operand of PV.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<HeadDimV, BlockN, Stages>{}, Step<_2, _1, _3>{})));
  // O is staged in V's ring once the last P·V has read it (Q's buffer has been released for the
  // next tile's Q by then): the ring's stages hold 2·kBlockN ≥ kBlockM rows.
  using SmemLayoutO = decltype(tile_to_shape(SmemAtom<kHeadDimV>{}, Shape<BlockM, HeadDimV>{}));

  using ChunkCols = Int<kChunkCols>;
  using Chunks = Int<kChunked ? kKvChunks : 1>;
  using SmemLayoutChunk =
      decltype(tile_to_shape(SmemAtom<kChunkCols>{}, Shape<BlockN, ChunkCols, Chunks>{}));
  // A V chunk as the B operand of P·V: (dims, keys, chunk).
  using SmemLayoutChunkT = decltype(composition(
      SmemLayoutChunk{},
      make_ordered_layout(Shape<ChunkCols, BlockN, Chunks>{}, Step<_2, _1, _3>{})));
  static constexpr int kBytesChunk = kBlockN * kChunkCols * int(sizeof(Element));

  static constexpr int kBytesQ = kBlockM * kHeadDimQK * int(sizeof(Element));
  static constexpr int kBytesK = kBlockN * kHeadDimQK * int(sizeof(Element));  // one stage
  static constexpr int kBytesV = kBlockN * kHeadDimV * int(sizeof(Element));
  static constexpr int kBytesO = kBlockM * kHeadDimV * int(sizeof(Element));

  // O staged in a buffer of its own where shared memory has room for one beside Q and the rings
  // (d64, d96, d128; 1 KB left for the barriers): each consumer warpgroup then stages and stores
  // its own 64 rows, waiting for nobody (FwdEpilogue::store_own_o), and the next tile's V loads
  // wait for nothing of the epilogue. Elsewhere (d192, 192x128, unchunked d256) O goes through V's
  // ring (store_o).
  static constexpr bool kOBuffer = !kChunked &&
                                   kBytesQ + kStages * (kBytesK + kBytesV) + kBytesO + 1024 <=
                                       227 * 1024;
  using SmemLayoutOSlice = decltype(tile_to_shape(SmemAtom<kHeadDimV>{}, Shape<_64, HeadDimV>{}));
  // O's buffer: the warpgroups' slices one after the other.
  using SmemLayoutOBuffer = decltype(tile_to_shape(SmemLayoutOSlice{}, Shape<BlockM, HeadDimV>{}));

  static_assert(kHeadDimQK % 32 == 0 && kHeadDimV % 32 == 0,
                "rows must fill whole 64-byte swizzle atoms");
  static_assert(kChunked || cosize_v<SmemLayoutO> <= cosize_v<SmemLayoutV>,
                "O is staged in V's ring");
  static_assert(!kChunked || (kHeadDimQK == kHeadDimV && kChunkCols % 64 == 0),
                "chunks split both head dims in two halves of whole 128-byte swizzle atoms");
  static_assert(kBlockN % 16 == 0, "P is the A operand of a k16 wgmma");
};

}  // namespace fa4::sm90
