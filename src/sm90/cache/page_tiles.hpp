// How the forward loads a key tile of a paged KV cache: as one TMA box where each key tile lies in
// one page, as one box per piece of kKeyPieceRows keys where each piece does, else row by row
// through the page table (fwd_load.cuh). Host code (the plan, the launcher) decides with it.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// Keys per piece: two 8-row swizzle atoms, so that a piece's box fills whole atoms of the key
// tile's buffer, and the largest power of two that divides the page sizes engines use (16, 32,
// 64, ...).
inline constexpr int kKeyPieceRows = 16;

// Pages of a multiple of `block_n` keys, each sequence starting at the first row of its first
// page (no left pad); true for caches that are not paged.
inline bool pages_hold_key_tiles(const Problem& p, int64_t block_n) {
  const KvCache& c = p.kv_cache;
  return !c.paged() || (block_n > 0 && c.page_size % block_n == 0 && c.leftpad == nullptr);
}

// Keys per wide piece: the wide-pieces variant's (FwdTileShape::wide_pieces). A 16-key piece is
// two 2 KB boxes at d128 (a 128-byte swizzle atom holds 64 columns), 16 per key tile of K and 16 of
// V; a 64-key piece, a quarter as many boxes for the same bytes.
inline constexpr int kWideKeyPieceRows = 64;

enum class KeyLoad { kTiles, kPieces, kGather };

// Tiles where pages hold whole key tiles of `block_n` keys; pieces, where the kernel has them
// (FwdTileShape::kv_pieces), where they hold whole pieces (a multiple of kKeyPieceRows keys, no
// left pad); else the gather.
inline KeyLoad key_load_of(const Problem& p, int64_t block_n, bool pieces) {
  if (pages_hold_key_tiles(p, block_n)) return KeyLoad::kTiles;
  const KvCache& c = p.kv_cache;
  return pieces && c.page_size % kKeyPieceRows == 0 && c.leftpad == nullptr ? KeyLoad::kPieces
                                                                             : KeyLoad::kGather;
}

// Where pieces load (key_load_of): whether pages and key tiles of `block_n` keys both hold whole
// wide pieces.
inline bool wide_key_pieces(const Problem& p, int64_t block_n) {
  return block_n % kWideKeyPieceRows == 0 && p.kv_cache.page_size % kWideKeyPieceRows == 0;
}

}  // namespace fa4::sm90
