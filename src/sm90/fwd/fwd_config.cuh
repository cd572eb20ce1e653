// Compile-time shape of one forward kernel instance: tile sizes (a row of fwd_tile_shape.hpp),
// shared-memory layouts and the two warpgroup MMAs (QKᵀ from shared memory, PV with P from
// registers). Everything the kernel's pieces agree on lives here, so a new head dim is one more
// row in the tile table.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/cache/page_tiles.hpp"
#include "sm90/common/register_budget.hpp"
#include "sm90/common/smem_atom.cuh"
#include "sm90/fwd/fwd_tile_shape.hpp"

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
// A/B switch: 1 sums each row's probabilities as P·V receives them, rounded to the element type
// (FwdConfig::kRoundedRowSum); 0 (default) sums them in fp32.
#ifndef FA4_SM90_ROUNDED_ROW_SUM
#define FA4_SM90_ROUNDED_ROW_SUM 0
#endif

namespace fa4::sm90 {

using namespace cute;

// A row of the tile table (fwd_tile_shape.hpp; its e4m3 table with kE4m3) as compile-time
// constants.
template <int kHeadDimQK, int kHeadDimV, bool kE4m3 = false>
struct FwdTileSize {
  static constexpr FwdTileShape kShape = fwd_tile_shape(kHeadDimQK, kHeadDimV, kE4m3);
  static_assert(kShape.block_n > 0, "no row of the forward's tile table has these head dims");
  static constexpr int kBlockN = kShape.block_n;
  static constexpr int kSoftmaxChains = kShape.softmax_chains;
  static constexpr bool kRescaleVote = kShape.rescale_vote;
  static constexpr int kConsumerWarpgroups = kShape.consumer_warpgroups;
  static constexpr bool kOwnKeyTiles = kShape.own_key_tiles;
  static constexpr bool kKvPieces = kShape.kv_pieces;
  static constexpr bool kPlainSteps = kShape.plain_steps;
  static constexpr int kPieceRows = kKeyPieceRows;  // keys per piece (cache/page_tiles.hpp)
  static constexpr int kStages = 2;
};

// The row's chunked variant (FwdConfig<..., FwdVariant::kChunked>), where it has one.
template <int kHeadDimQK, int kHeadDimV>
struct FwdChunkedTileSize : FwdTileSize<kHeadDimQK, kHeadDimV> {
  static constexpr FwdTileShape::Chunked kVariant = fwd_tile_shape(kHeadDimQK, kHeadDimV).chunked;
  static constexpr bool kExists = kVariant.block_n > 0;
  static constexpr int kBlockN = kVariant.block_n;
  static constexpr int kKvChunks = kVariant.kv_chunks;
  static constexpr int64_t kMinKeys = kVariant.min_keys;
};

// The row's narrow variant (FwdConfig<..., FwdVariant::kNarrow>), where it has one: one consumer
// warpgroup, the row's key tile, a deeper ring.
template <int kHeadDimQK, int kHeadDimV>
struct FwdNarrowTileSize : FwdTileSize<kHeadDimQK, kHeadDimV> {
  static constexpr FwdTileShape::Narrow kVariant = fwd_tile_shape(kHeadDimQK, kHeadDimV).narrow;
  static constexpr bool kExists = kVariant.stages > 0;
  static constexpr int kConsumerWarpgroups = 1;
  static constexpr bool kOwnKeyTiles = false;  // one slice: it sees all of its tile's keys
  static constexpr int kStages = kVariant.stages;
};

// The row's wide-pieces variant (FwdConfig<..., FwdVariant::kWidePieces>), where it has one: the
// main kernel with key tiles in pieces of kWideKeyPieceRows keys.
template <int kHeadDimQK, int kHeadDimV>
struct FwdWidePiecesTileSize : FwdTileSize<kHeadDimQK, kHeadDimV> {
  static constexpr bool kExists = fwd_tile_shape(kHeadDimQK, kHeadDimV).has_wide_pieces();
  static constexpr int kPieceRows = kWideKeyPieceRows;
};

// The row's unmasked variant (FwdConfig<..., FwdVariant::kUnmasked>), where it has one: the main
// kernel with wider key tiles, which load as whole tiles only (no pieces, no gathering warps).
template <int kHeadDimQK, int kHeadDimV>
struct FwdUnmaskedTileSize : FwdTileSize<kHeadDimQK, kHeadDimV> {
  static constexpr FwdTileShape::Unmasked kVariant =
      fwd_tile_shape(kHeadDimQK, kHeadDimV).unmasked;
  static constexpr bool kExists = kVariant.block_n > 0;
  static constexpr int kBlockN = kVariant.block_n;
  static constexpr bool kKvPieces = false;
};

template <int kHeadDimQK_, int kHeadDimV_, class Element_,
          FwdVariant kVariant_ = FwdVariant::kMain, class ElementO_ = Element_>
struct FwdConfig {
  using Element = Element_;  // Q, K and V: cutlass::bfloat16_t, cutlass::half_t or float_e4m3_t
  // O as stored: the operands' type, except where the operands are 8-bit (an FP8 forward writes
  // bf16 or fp16).
  using ElementO = ElementO_;
  using Accum = float;
  // e4m3 operands (fp8/): the P·V wgmma takes its B operand K-major only, so producer warps
  // transpose each V stage into a Vᵀ ring of its own (fp8/transpose_v.cuh), and P is packed into
  // the k32 A operand in key_slots.hpp's key order (fp8/p_operand.cuh).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static_assert(!kFp8 || std::is_same_v<Element, cutlass::float_e4m3_t>, "8-bit operands are e4m3");

  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr FwdVariant kVariant = kVariant_;
  static constexpr bool kChunked = kVariant == FwdVariant::kChunked;
  static constexpr bool kNarrow = kVariant == FwdVariant::kNarrow;
  static constexpr bool kWidePieces = kVariant == FwdVariant::kWidePieces;
  static constexpr bool kUnmasked = kVariant == FwdVariant::kUnmasked;
  static_assert(!kChunked || FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kExists,
                "no chunked variant of these head dims");
  static_assert(!kNarrow || FwdNarrowTileSize<kHeadDimQK, kHeadDimV>::kExists,
                "no narrow variant of these head dims");
  static_assert(!kWidePieces || FwdWidePiecesTileSize<kHeadDimQK, kHeadDimV>::kExists,
                "no wide-pieces variant of these head dims");
  static_assert(!kUnmasked || FwdUnmaskedTileSize<kHeadDimQK, kHeadDimV>::kExists,
                "no unmasked variant of these head dims");
  static_assert(kVariant == FwdVariant::kMain || !kFp8, "the e4m3 tile table has no variants");
  using TileSize = std::conditional_t<
      kChunked, FwdChunkedTileSize<kHeadDimQK, kHeadDimV>,
      std::conditional_t<
          kNarrow, FwdNarrowTileSize<kHeadDimQK, kHeadDimV>,
          std::conditional_t<
              kWidePieces, FwdWidePiecesTileSize<kHeadDimQK, kHeadDimV>,
              std::conditional_t<kUnmasked, FwdUnmaskedTileSize<kHeadDimQK, kHeadDimV>,
                                 FwdTileSize<kHeadDimQK, kHeadDimV, kFp8>>>>>;
  static constexpr int kConsumerWarpgroups = TileSize::kConsumerWarpgroups;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = TileSize::kBlockN;
  static constexpr bool kOwnKeyTiles = TileSize::kOwnKeyTiles && !kChunked;
  static constexpr bool kKvPieces = TileSize::kKvPieces;
  static constexpr bool kPlainSteps = TileSize::kPlainSteps;  // FwdTileShape::plain_steps
  static constexpr int kPieceRows = TileSize::kPieceRows;  // keys per piece of a paged key tile
  static constexpr int kStages = TileSize::kStages;  // K and V ring depth
  // Whether the kernel can load key tiles of a paged cache whose pages do not hold them whole: in
  // pieces or row by row, through the producer's third and fourth warps and their tables in
  // shared memory. The chunked and unmasked variants load whole tiles only (the plan takes them
  // for such keys alone, the launcher refuses others).
  static constexpr bool kGathers = !kChunked && !kUnmasked;
  // Chunked: K and V share one ring of kKvChunks chunks of (kBlockN keys, half the head dim),
  // loaded in the order the consumers take them (FwdLoad::run_chunked); else K and V rings of
  // kStages whole tiles.
  static constexpr int kKvChunks = FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kKvChunks * kChunked;
  static constexpr int kChunkCols = kChunked ? kHeadDimQK / 2 : kHeadDimQK;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);

  // setmaxnreg budgets: the producer only issues TMA (and, e4m3, transposes V: the routine takes
  // 30-32 registers, its loop over the tiles some more, and spills at 32); the consumers hold S, P
  // and O. With one consumer warpgroup registers are plentiful: at 24 the producer spills 220
  // bytes (a 64-bit division routine and the tile walk), at 56 nothing.
  static constexpr int kProducerRegisters =
      kConsumerWarpgroups == 1 ? 56 : kFp8 ? 40 : kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters =
      kConsumerWarpgroups <= 2 ? (kFp8 ? 232 : 240) : (kFp8 ? 152 : 160);
  // The producer warps that transpose V (e4m3): warps 2 and 3, which gather K and V row by row in
  // the 16-bit kernels (the e4m3 kernels take no gathered pages).
  static constexpr int kTransposeWarps = kFp8 ? 2 : 0;
  static constexpr int kFirstTransposeWarp = 2;
  static_assert(register_budget_fits(kProducerRegisters, kConsumerWarpgroups, kConsumerRegisters),
                "register budget exceeds the CTA's launch allocation");

  // Softmax (softmax.cuh): kExp2PolyNum of every kExp2PolyDen exponentials on the FMA pipe (FA4's
  // software exp2), and O rescaled only when a row's scaled max grows by more than `threshold`
  // in log2 units, so P may reach 2^threshold (0: the exact online softmax, O rescaled on every
  // tile). The FA4_SM90_* macros build A/B variants of the same tree (bench/ab_variants.sh).
  // Measured on the H200: threshold 8 is 2-6 % faster than 0 but fails the tests' accuracy rule
  // (docs/testing.md) on some inputs (the dominant probability is not exactly 1, so its bf16
  // rounding adds error the rule does not allow); a polynomial share of 1/4 or 1/2 gains nothing
  // at d64, loses 4-10 % at d128 and its 8.6e-5 relative error fails the LSE rule. Both stay off
  // until they pass.
  static constexpr int kExp2PolyNum = FA4_SM90_EXP2_POLY_NUM;
  static constexpr int kExp2PolyDen = FA4_SM90_EXP2_POLY_DEN;
  static constexpr int kRescaleThresholdLog2 = FA4_SM90_RESCALE_THRESHOLD_LOG2;
  // e4m3 P is offset by 2^8 before its conversion (the row sums carry it, softmax.cuh takes it out
  // of O and LSE): the small probabilities of a long row stay above e4m3's subnormals (2^-6), and
  // the largest, 256, below its 448. A threshold would let P grow past 448: none with e4m3.
  static constexpr int kPLog2Offset = kFp8 ? 8 : 0;
  static_assert(!kFp8 || kRescaleThresholdLog2 == 0, "e4m3 P saturates at 448 = 2^8 · 1.75");
  static constexpr int kSoftmaxChains = TileSize::kSoftmaxChains;
  // At threshold 0, O rescaled only when a row of the warp has a new max (softmax.cuh).
  static constexpr bool kRescaleVote = FA4_SM90_RESCALE_VOTE < 0
                                           ? TileSize::kRescaleVote
                                           : FA4_SM90_RESCALE_VOTE != 0;
  // With a threshold above 0 a row's dominant probability is 2^k·p, not exactly 1, and its
  // rounding for P·V lands on O's largest term; summed as rounded, the normalisation cancels
  // most of it (O = Σ r(P)·V / Σ r(P)), at one more operation per score. bench/rescale_emulation.py
  // emulates both against the test rule; off until measured on the device.
  static constexpr bool kRoundedRowSum = FA4_SM90_ROUNDED_ROW_SUM != 0;
  // ALiBi's linear form (fwd/alibi_linear.hpp) holds each row's slope and diagonal through the
  // tile loop, two registers per row, which the kernels of two consumer warpgroups below d256 have
  // to spare; these compile a kernel of their own for calls that pass slopes (FwdKernel's
  // kAlibiLinear), so that calls without ALiBi keep a kernel without it. e4m3 takes no ALiBi; the
  // narrow variant takes the full form (no second kernel for the decode grids it runs).
  static constexpr bool kAlibiLinearFits =
      kConsumerWarpgroups == 2 && kHeadDimQK < 256 && !kChunked && !kFp8;

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
  // PV: A = P (registers, K-major), B = Vᵀ read from V's row-major tile (MN-major), or with e4m3
  // from the Vᵀ ring (K-major). Chunked, one P·V computes one chunk's half of O's columns.
  using PVCols = Int<kChunked ? kChunkCols : kHeadDimV>;
  static constexpr GMMA::Major kMajorVt = kFp8 ? GMMA::Major::K : GMMA::Major::MN;
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, Accum, Shape<_64, PVCols, BlockN>, GMMA::Major::K,
                           kMajorVt>(),
      WarpgroupTiling{}));

  // 128-byte swizzle for rows of multiples of 64 elements, 64 bytes for 96 (smem_atom.cuh).
  template <int kRowElements>
  using SmemAtom = sm90::SmemAtom<Element, kRowElements>;
  template <int kRowElements>
  using SmemAtomO = sm90::SmemAtom<ElementO, kRowElements>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<kHeadDimQK>{}, Shape<BlockM, HeadDimQK>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom<kHeadDimQK>{}, Shape<BlockN, HeadDimQK, Stages>{}));
  using SmemLayoutV =
      decltype(tile_to_shape(SmemAtom<kHeadDimV>{}, Shape<BlockN, HeadDimV, Stages>{}));
  // The B operand of PV, (dim, key, stage): the same bytes as V; with e4m3 the Vᵀ ring, keys
  // contiguous (in key_slots.hpp's order), as fp8::transpose_v writes it.
  using SmemLayoutVt = std::conditional_t<
      kFp8, decltype(tile_to_shape(SmemAtom<kBlockN>{}, Shape<HeadDimV, BlockN, Stages>{})),
      decltype(composition(SmemLayoutV{}, make_ordered_layout(Shape<HeadDimV, BlockN, Stages>{},
                                                              Step<_2, _1, _3>{})))>;
  // O is staged in V's ring once the last P·V has read it (Q's buffer has been released for the
  // next tile's Q by then): the ring's bytes hold O's tile (the assertion below).
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomO<kHeadDimV>{}, Shape<BlockM, HeadDimV>{}));

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
  static constexpr int kBytesO = kBlockM * kHeadDimV * int(sizeof(ElementO));
  static constexpr int kBytesVt = kFp8 ? kBytesV : 0;  // one stage of the Vᵀ ring

  // O staged in a buffer of its own where shared memory has room for one beside Q, the rings and
  // the gather's row tables (d64, d96, d128; 2 KB left for the barriers): each consumer warpgroup
  // then stages and stores its own 64 rows, waiting for nobody (FwdEpilogue::store_own_o), and the
  // next tile's V loads wait for nothing of the epilogue. Elsewhere (d192, 192x128, unchunked
  // d256, d128's narrow variant with its third stage and its unmasked variant with 176-key rings)
  // O goes through V's ring (store_o).
  static constexpr int kBytesGatherRows = kGathers ? 2 * kBlockN * int(sizeof(uintptr_t)) : 0;
  static constexpr bool kOBuffer =
      !kChunked && kBytesQ + kStages * (kBytesK + kBytesV + kBytesVt) + kBytesO +
                           kBytesGatherRows + 2048 <=
                       227 * 1024;
  using SmemLayoutOSlice = decltype(tile_to_shape(SmemAtomO<kHeadDimV>{}, Shape<_64, HeadDimV>{}));
  // O's buffer: the warpgroups' slices one after the other.
  using SmemLayoutOBuffer = decltype(tile_to_shape(SmemLayoutOSlice{}, Shape<BlockM, HeadDimV>{}));

  static_assert(kHeadDimQK % 32 == 0 && kHeadDimV % 32 == 0,
                "rows must fill whole 64-byte swizzle atoms");
  // With e4m3, the Vᵀ ring follows V's (FwdKernel::Rings) and O's staging spans both.
  static_assert(kChunked || cosize_v<SmemLayoutO> * sizeof(ElementO) <=
                                 kStages * (kBytesV + kBytesVt),
                "O is staged in V's ring");
  static_assert(!kChunked || (kHeadDimQK == kHeadDimV && kChunkCols % 64 == 0),
                "chunks split both head dims in two halves of whole 128-byte swizzle atoms");
  static_assert(kBlockN % 16 == 0, "P is the A operand of a k16 wgmma");
};

}  // namespace fa4::sm90
