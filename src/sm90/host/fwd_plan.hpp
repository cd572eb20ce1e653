// The forward's launch plan: every choice the launcher makes, from the problem, the device's facts
// and the caller's overrides, computed on the host without touching the device. The backend's
// workspace_size and the launcher (fwd_launch.cuh) both read it, so they cannot disagree, and the
// CPU tests check it over many shapes and devices.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"
#include "sm90/fwd/fwd_tile_shape.hpp"
#include "sm90/host/device_facts.hpp"

namespace fa4::sm90 {

// The forward's workspace: the varlen tile order at offset 0, then split-KV's partials, then a KV
// cache's per-sequence marks and rotated queries (cache/kv_prepare.cuh). Sized from the problem's
// sizes and the overrides alone, never the device or the cache's lengths, so that an engine sizes
// it once for every GPU and every step; a plan's choices always fit in it.
struct FwdWorkspace {
  size_t order_bytes = 0;  // one int32 per entry of the ordered grid (fwd/tile_order.hpp)
  int max_splits = 1;      // the most splits a plan may choose (1: none)
  size_t partials = 0;     // offset of the partial O and LSE (fwd/split_kv.hpp)
  size_t partials_bytes = 0;
  size_t cache_valid = 0;  // offset of the KV cache's marks: one int32 per batch entry
  size_t q_rotated = 0;    // offset of the rotated queries (a rotary embedding), like Q's rows
  size_t q_rotated_bytes = 0;
  size_t bytes = 0;

  static FwdWorkspace of(const Problem& problem, const Overrides& overrides);
};

struct FwdPlan {
  // The kernel: the tile table's row (fwd/fwd_tile_shape.hpp) or one of its variants.
  FwdVariant variant = FwdVariant::kMain;
  int block_m = 0, block_n = 0;
  // Query heads per tile (pack-GQA, fwd/query_rows.cuh): G = heads_q / heads_kv, else 1.
  int pack_group = 1;
  // The tiles (fwd/tile_scheduler.cuh): query tiles of `tile_heads` heads (kv heads when packed)
  // per batch entry, heaviest first under a causal diagonal.
  int m_blocks = 0;
  int tile_heads = 0;
  bool heavy_last_rows = false;
  int tiles = 0;  // m_blocks · tile_heads · batch
  // A varlen batch's tiles longest-first (fwd/tile_order.cuh): the grid is `ordered_entries`
  // entries of the order the tile-order kernel writes.
  bool ordered = false;
  int ordered_entries = 0;
  int splits = 1;   // each tile's keys shared out among this many CTAs (fwd/split_kv.cuh)
  int entries = 0;  // grid entries: the tiles or the ordered entries, times the splits
  // (head, batch entry) pairs numbered together, query tile by query tile (GroupedOrder).
  int group = 1;
  bool persistent = false;  // CTAs walk the zig-zag over the entries, else one CTA per entry
  int ctas = 0;             // the grid; 0: nothing to launch
  FwdWorkspace workspace;
};

// The plan for a problem the backend's can_implement accepted.
FwdPlan plan_forward(const Problem& problem, const DeviceFacts& device, const Overrides& overrides);

// The pieces of the plan, for its tests.
namespace fwd_plan {
// Problems with fewer keys do not split by themselves: a split costs a Q load, an epilogue and the
// combine's traffic, which a few key tiles do not repay.
constexpr int64_t kMinSplitKeys = 512;
// Splits pay off only when the unsplit tiles leave SMs idle; no Hopper GPU has more SMs than this.
constexpr int64_t kMaxSms = 256;
// A split's fewest key tiles when the plan chooses.
constexpr int64_t kMinKeyTilesPerSplit = 1;

// Whether the chunked variant runs (min_keys: the row's; 0: none exists).
bool takes_chunked_kv(const Problem& p, bool banded, int64_t min_keys, Choice forced);
// Whether the narrow variant runs: where the row has one, when forced, else when a query tile of
// `rows` rows (the packed rows of the longest sequence) fits its one slice, the main kernel's
// `tiles` leave half the SMs idle or more and the keys load as whole key tiles (contiguous
// caches, pages of whole tiles). With a fuller grid one warpgroup per CTA issues half the tensor
// work (at 128 tiles on 132 SMs: −3 % to +1 %); on pages of 16 keys (TMA boxes of 16-key pieces)
// long caches measured 4 % slower at GQA 32/8.
bool takes_narrow(bool exists, int64_t rows, int64_t tiles, int sm_count, bool whole_tiles,
                  Choice forced);
// Whether the row's wide-pieces variant runs rather than its main kernel: where it has one and the
// main kernel would load 16-key pieces from pages that hold whole 64-key pieces, without ALiBi.
bool takes_wide_pieces(const Problem& p, const FwdTileShape& shape);
// Whether the unmasked variant runs: where the row has one and keys load as whole tiles of its
// width (contiguous keys, pages of a multiple of it), when forced, else where nothing but the
// sequence end cuts a key tile (not `banded`, no ALiBi: its linear form is the main kernel's),
// `rows` (a sequence's packed rows) fill a query tile and the sequences have at least the
// variant's min_keys keys (the mean over a varlen batch): a wider tile's first QKᵀ and last P·V,
// exposed, are longer, which short rows do not repay.
bool takes_unmasked(const Problem& p, const FwdTileShape& shape, bool banded, int64_t rows,
                    Choice forced);
// Query heads per tile: G when packing fills the tiles markedly better, else 1.
int pack_group(const Problem& p, int block_m, Choice forced);
// The most splits the plan may choose for this problem (1: it never splits).
int max_splits(const Problem& p, const Overrides& overrides);
// Splits for `tiles` unsplit tiles of at most `key_tiles` key tiles each on `sm_count` SMs.
int choose_splits(const Problem& p, int64_t tiles, int64_t key_tiles, int sm_count, int most,
                  bool forced);
}  // namespace fwd_plan

}  // namespace fa4::sm90
