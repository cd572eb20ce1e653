// The forward's tile table: one row per (head dim qk, head dim v). Plain C++, so that the host's
// launch plan (host/fwd_plan.hpp) and the kernels' configs (fwd_config.cuh) read the same numbers.
//
// The query tile has one 64-row slice per consumer warpgroup (128 rows with two, 192 with three,
// 64 in a narrow variant's one).
// The key tile shrinks as the head dims grow so that Q, two K stages and two V stages fit in shared
// memory (227 KB) and S, P and O fit in the registers per thread (240 with two consumer
// warpgroups, 160 with three; O takes dv/2, S N/2 and P N/4 registers).
#pragma once

#include <cstdint>

namespace fa4::sm90 {

struct FwdTileShape {
  int head_dim_qk = 0, head_dim_v = 0;
  // 64 query rows each. d64 is bound by the softmax (MUFU): three warpgroups (192 query rows,
  // 160 registers each) keep more of it in flight per SM.
  int consumer_warpgroups = 2;
  int block_n = 0;  // keys per key tile
  // Independent max / sum chains per row in the softmax (common/softmax.cuh): 4 measured
  // +2-6 % at d128 and -3-4 % at d64; the other head dims keep 1 until measured.
  int softmax_chains = 1;
  // O rescaled only on tiles where a row of the warp has a new max, rather than on every tile:
  // worth it where O's rescale is many multiplies per exponential (d256: +2-8 %; level or worse
  // at d128 and d192).
  bool rescale_vote = false;
  // Each consumer warpgroup computes only the key tiles its own 64 rows see
  // (FwdKernel::own_key_tiles), where key tiles are narrower than query tiles, so that a slice can
  // see fewer than its tile: +3-5 % at d64 causal 512-2k, +2-4 % at d192; at d128 every slice sees
  // the tile's key tiles and the extra steps cost 2-3 % at causal 512-1k.
  bool own_key_tiles = false;
  // Pages of whole 16-key pieces load as one TMA box per piece (FwdLoad::issue_piece), else row by
  // row (the gather). On where the KV-cache GPU tests run at the row's head dims (d192 × 128 has
  // no such case: its value dim differs); d256's load thread (24 registers) spills with them.
  bool kv_pieces = false;
  // The chunked variant (block_n 0: none): wider key tiles whose K and V go through one ring of
  // kv_chunks chunks of half the head dim, taken without a causal or window mask from min_keys
  // keys per sequence on (FwdKernel::consume_chunked).
  struct Chunked {
    int block_n = 0;
    int kv_chunks = 0;
    int64_t min_keys = 0;
  } chunked;
  // The narrow variant (stages 0: none): one consumer warpgroup, so 64-row query tiles, for grids
  // of few tiles whose rows fit one slice (decode of few sequences, host/fwd_plan.cpp). There each
  // CTA streams a few key tiles with nothing to hide their latency but the ring: the second
  // warpgroup's registers and shared memory go to a deeper K / V ring instead.
  struct Narrow {
    int stages = 0;  // K and V ring depth
  } narrow;
  // The wide-pieces variant (kv_pieces rows of the 16-bit table): where pages hold whole 64-key
  // pieces (cache/page_tiles.hpp), the main kernel's twin that loads key tiles as one TMA box per
  // 64-key piece rather than per 16, a quarter of the boxes. A twin, not a branch of the one
  // kernel: with both paths compiled into it, latency-bound decode (batch 1, contiguous caches and
  // pages of 16) measured 3 % slower.
  bool wide_pieces = false;
  // Key tiles that need no score step (no softcap, no ALiBi, no mask: every row sees the whole
  // tile) run in a loop of their own, compiled without the step's run-time tests
  // (FwdKernel::consume). d128: +1-6 % at 16k, level to +2 % at 1k-4k. d64: +1-4 % from 4k, but
  // its short causal rows (1k) 2.6 % slower, their few steps split among more loops; off there.
  // The other head dims are not measured yet.
  bool plain_steps = false;
  // The unmasked variant (block_n 0: none): the main kernel with wider key tiles, taken where
  // nothing but the sequence end cuts a key tile (no causal or window mask, no ALiBi), the keys
  // load as whole tiles, the query rows fill a tile and sequences have at least min_keys keys
  // (host/fwd_plan.cpp). A step's fixed part (the waits, the turn, the row max and sum
  // reductions, O's rescale) then spreads over more keys. It has no gathering warps: their
  // one-lane-per-row-of-32-keys tables fit neither the wider tiles nor the shared memory.
  struct Unmasked {
    int block_n = 0;
    int64_t min_keys = 0;
  } unmasked{};

  static constexpr int kSliceRows = 64;  // query rows per consumer warpgroup (the narrow tile)
  constexpr int block_m() const { return kSliceRows * consumer_warpgroups; }
  constexpr bool has_chunked() const { return chunked.block_n > 0; }
  constexpr bool has_narrow() const { return narrow.stages > 0; }
  constexpr bool has_wide_pieces() const { return wide_pieces && kv_pieces; }
  constexpr bool has_unmasked() const { return unmasked.block_n > 0; }
  // The fewest rows of a query tile of this row's kernels (the narrow variant's, where it has one).
  constexpr int min_block_m() const { return has_narrow() ? kSliceRows : block_m(); }
};

// The kernel a plan runs of a row: the row itself, or one of its variants.
enum class FwdVariant : int {
  kMain = 0,
  kChunked = 1,
  kNarrow = 2,
  kWidePieces = 3,
  kUnmasked = 4
};

inline constexpr FwdTileShape kFwdTileShapes[] = {
    {64, 64, 3, 128, 1, false, true, true, {}, {}},
    {96, 96, 2, 128, 1, false, false, true, {}, {}},
    // Narrow: three stages of 128 keys. Against the main kernel (two warpgroups, two stages) at
    // GQA 32/8 and 8/1 decode: batch 1 and 4, 8k keys +1-10 %; at 128 sequences (a full grid)
    // -3 % to +1 %; on pages of 16-key pieces with long caches -4 % at GQA 32/8. So the plan takes
    // it only for grids that leave half the SMs idle, with keys in whole tiles.
    // Wide pieces: chunked prefill (512 queries, 8k keys, GQA 32/8) on pages of 64 11.6 % faster,
    // 0.965x a contiguous cache; paged decode on pages of 64 level to +4 %.
    // Unmasked: 176-key tiles, 613 instructions a plain step against 483 for 128 keys (3.48 a
    // key against 3.77); Q and two stages of K and of V take 208 KB, so O goes through V's ring.
    // Against the main kernel (H100, do_bench and sustained calls): 8k-16k +1-4 %, 2k-4k -1 to
    // -3 % (the wider tile's exposed first QKᵀ and last P·V), 1k forced on -2 %: hence min_keys.
    // 160-key tiles (O in its own buffer) were 0.5-1.9 % behind 176 from 8k.
    {128, 128, 2, 128, 4, false, false, true, {}, {3}, true, true, {176, 8192}},
    // O takes 96 registers: S and P of 96 keys leave room for the rest without spilling.
    {192, 192, 2, 96, 1, false, true, true, {}, {}},
    {192, 128, 2, 128, 1, false, false, false, {}, {}},
    // 80 keys spill 16 bytes with this kernel's register budget; 64 do not. Own key tiles measured
    // +1-2 % at causal 512-4k but spill 12 bytes here. Chunked: 128 keys rather than 64 halve the
    // re-reads of Q per key (17 % fewer shared-memory bytes per FLOP and fewer instructions, so
    // less power, which sets the clock under the H200's 700 W cap); Q (64 KB) with two 64 KB
    // stages of K and of V would not fit in shared memory, five 32 KB chunks do. Against the
    // 64-key kernel without a mask: 512 keys -14 %, 1k -4 %, 2k -1 %, 4k +2.6 %, 8k +1.5 %,
    // 16k +3.9 % (a tile's first QKᵀ and last P·V, exposed, are twice as long), hence min_keys.
    {256, 256, 2, 64, 1, true, false, false, {128, 5, 4096}, {}},
};

// e4m3 operands (fp8/): K and V take half the bytes, but Vᵀ needs a ring of its own (the FP8 P·V
// reads its B operand K-major only) and the producer warpgroup transposes V into it, at 40
// registers, which leaves the consumers 232 (152 with three); S, P (N/8 registers) and O still
// bound the key tile (N a multiple of 32, the e4m3 P·V's k). d128: 192 keys spill 16 bytes at 232.
inline constexpr FwdTileShape kFwdFp8TileShapes[] = {
    {64, 64, 3, 128, 1, false, true, true, {}, {}},
    {128, 128, 2, 160, 2, false, false, true, {}, {}},
    // O alone is 128 registers: 96 keys leave S and P room within 232.
    {256, 256, 2, 96, 1, true, false, true, {}, {}},
};

// The row of these head dims (of the e4m3 table with `e4m3`); a row of zeros (block_n 0) where the
// table has none.
template <int kRows>
constexpr FwdTileShape fwd_tile_row(const FwdTileShape (&table)[kRows], int head_dim_qk,
                                    int head_dim_v) {
  for (const FwdTileShape& s : table)
    if (s.head_dim_qk == head_dim_qk && s.head_dim_v == head_dim_v) return s;
  return FwdTileShape{};
}
constexpr FwdTileShape fwd_tile_shape(int head_dim_qk, int head_dim_v, bool e4m3 = false) {
  return e4m3 ? fwd_tile_row(kFwdFp8TileShapes, head_dim_qk, head_dim_v)
              : fwd_tile_row(kFwdTileShapes, head_dim_qk, head_dim_v);
}

}  // namespace fa4::sm90
