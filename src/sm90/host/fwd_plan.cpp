#include "sm90/host/fwd_plan.hpp"

#include <algorithm>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "sm90/cache/page_tiles.hpp"
#include "sm90/common/grouped_order.hpp"
#include "sm90/fwd/fwd_tile_shape.hpp"
#include "sm90/fwd/split_kv.hpp"
#include "sm90/fwd/tile_order.hpp"
#include "sm90/fwd/zigzag.hpp"
#include "sm90/host/causal_schedule.hpp"

namespace fa4::sm90 {
namespace {

// Whether persistent CTAs in the zig-zag get about equal work (within 4 % of the mean) when a
// query tile costs as many key tiles as it sees under the causal diagonal. The zig-zag balances
// exactly only when its 2·ctas-tile rounds line up with the tiles per head, or average out over
// many rounds: at 16k on 132 SMs the busiest CTA had 1.5–1.8× the mean (measured 25–33 % slower
// than one CTA per tile), while at ≤ 4k it stays within 3 % and persistence gains 4–11 %.
// O(tiles) integer steps (beyond kMaxTilesChecked, no), once per shape and thread: the last answer
// is kept for the next call.
bool zigzag_balanced(int m_blocks, int tiles, int ctas) {
  constexpr int kMaxTilesChecked = 1 << 14;
  if (tiles > kMaxTilesChecked || ctas <= 0) return false;
  struct Last {
    int m_blocks = -1, tiles = -1, ctas = -1;
    bool balanced = false;
  };
  static thread_local Last last;
  if (last.m_blocks == m_blocks && last.tiles == tiles && last.ctas == ctas) return last.balanced;
  int64_t total = 0, busiest = 0;
  for (int c = 0; c < ctas && c < tiles; ++c) {
    int64_t load = 0;
    for (int t = c; t < tiles; t = zigzag_next(t, c, ctas)) load += m_blocks - t % m_blocks;
    total += load;
    busiest = load > busiest ? load : busiest;
  }
  last = {m_blocks, tiles, ctas, busiest * 100 * int64_t(ctas) <= total * 104};
  return last.balanced;
}

// CausalSchedule::choose for this shape. The model walks the tiles a few times (up to about a
// millisecond at kMaxTilesChecked; beyond, one CTA per tile), once per shape and thread: the
// answers for the last kKept shapes are kept (a model's layers alternate a few).
CausalSchedule causal_schedule(CausalSchedule::Shape const& s) {
  constexpr int64_t kMaxTilesChecked = 1 << 14;
  constexpr int kKept = 8;
  if (int64_t(s.blocks()) * s.pairs > kMaxTilesChecked || s.ctas <= 0) return {false, 1};
  struct Kept {
    CausalSchedule::Shape shape{};
    CausalSchedule schedule{false, 1};
    bool valid = false;
  };
  static thread_local Kept kept[kKept];
  static thread_local int next = 0;
  for (Kept const& k : kept)
    if (k.valid && k.shape == s) return k.schedule;
  kept[next] = {s, CausalSchedule::choose(s), true};
  const CausalSchedule chosen = kept[next].schedule;
  next = (next + 1) % kKept;
  return chosen;
}

// The tile order's workspace holds the entries of tiles kMinQueryTileRows high: no taller tile has
// more (tile_order.hpp).
constexpr bool query_tiles_at_least_min_rows() {
  for (const FwdTileShape& s : kFwdTileShapes)
    if (s.min_block_m() < kMinQueryTileRows) return false;
  for (const FwdTileShape& s : kFwdFp8TileShapes)
    if (s.min_block_m() < kMinQueryTileRows) return false;
  return true;
}
static_assert(query_tiles_at_least_min_rows(), "the tile order's workspace bound needs it");

}  // namespace

namespace fwd_plan {
namespace {

// A sequence's keys for the wider-tile rules: the mean over a varlen batch; seqlen_k, their bound,
// with seqused_k. The batch is not empty.
int64_t keys_per_sequence(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_k / p.batch : p.seqlen_k;
}

}  // namespace

// Wider key tiles pay only when nothing but the sequence end cuts them and the sequences are long
// (keys_per_sequence), since each tile's first QKᵀ and last P·V are exposed for longer.
bool takes_chunked_kv(const Problem& p, bool banded, int64_t min_keys, Choice forced) {
  if (min_keys <= 0) return false;
  if (forced != Choice::kAuto) return forced == Choice::kOn;
  if (banded || p.batch <= 0) return false;
  return keys_per_sequence(p) >= min_keys;
}

bool takes_narrow(bool exists, int64_t rows, int64_t tiles, int sm_count, bool whole_tiles,
                  Choice forced) {
  if (!exists) return false;
  if (forced != Choice::kAuto) return forced == Choice::kOn;
  return whole_tiles && rows <= FwdTileShape::kSliceRows && 2 * tiles <= sm_count;
}

bool takes_wide_pieces(const Problem& p, const FwdTileShape& shape) {
  // Calls with ALiBi slopes keep the ALiBi kernel (its linear form, FwdKernel's second argument).
  return shape.has_wide_pieces() && p.alibi.data == nullptr &&
         key_load_of(p, shape.block_n, shape.kv_pieces) == KeyLoad::kPieces &&
         wide_key_pieces(p, shape.block_n);
}

bool takes_unmasked(const Problem& p, const FwdTileShape& shape, bool banded, int64_t rows,
                    Choice forced) {
  if (!shape.has_unmasked() || !pages_hold_key_tiles(p, shape.unmasked.block_n)) return false;
  if (forced != Choice::kAuto) return forced == Choice::kOn;
  if (banded || p.alibi.data != nullptr || rows < shape.block_m() || p.batch <= 0) return false;
  return keys_per_sequence(p) >= shape.unmasked.min_keys;
}

// Pack when the heads fill the query tiles markedly better than the positions alone (short query
// sequences: decode, chunked prefill), as long as the packed rows stay below 2³⁰.
int pack_group(const Problem& p, int block_m, Choice forced) {
  const int64_t g = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  const int64_t rows = p.seqlen_q * g;
  bool pack = forced != Choice::kOff && g > 1 && rows < (int64_t(1) << 30);
  if (pack && forced == Choice::kAuto) {
    // Share of the computed rows that exist, unpacked and packed.
    auto fill = [block_m](int64_t n) {
      return double(n) / double((n + block_m - 1) / block_m * block_m);
    };
    pack = fill(p.seqlen_q) < 0.9 * fill(rows);
  }
  return pack ? int(g) : 1;
}

// A tile holds at least one query position of one kv head per sequence, so there are at least
// heads_kv · batch tiles: beyond kMaxSms / that, splitting would not fill idle SMs. Never more than
// the problem's num_splits (when set); forced, as many as asked for within those bounds.
int max_splits(const Problem& p, const Overrides& overrides) {
  int64_t cap = split_row_cap(p);
  if (p.num_splits > 0) cap = std::min(cap, p.num_splits);  // the caller's bound
  if (overrides.splits > 0)
    return int(std::max<int64_t>(1, std::min<int64_t>(overrides.splits, cap)));
  if (p.seqlen_k < kMinSplitKeys || p.heads_kv * p.batch <= 0) return 1;
  const int64_t most = std::min(cap, kMaxSms / (p.heads_kv * p.batch));
  return most < 2 ? 1 : int(most);
}

// As many as fill one wave (more would add a partial wave), within `most`; forced, `most`, empty
// shares included (the tests' way to reach them).
int choose_splits(const Problem& p, int64_t tiles, int64_t key_tiles, int sm_count, int most,
                  bool forced) {
  if (most < 2 || tiles <= 0) return 1;
  // Grid entries are 32-bit, and the combine's 1-D grid has a warp per declared query row, head
  // and sequence (a varlen batch may declare far more rows than it has).
  if (tiles * most >= (int64_t(1) << 30) || p.seqlen_q * p.heads_q * p.batch >= (int64_t(1) << 33))
    return 1;
  if (forced) return most;
  const int64_t s = std::min({int64_t(sm_count) / tiles, key_tiles / kMinKeyTilesPerSplit,
                              int64_t(most)});
  return s < 2 ? 1 : int(s);
}

}  // namespace fwd_plan

FwdWorkspace FwdWorkspace::of(const Problem& p, const Overrides& overrides) {
  FwdWorkspace w;
  // A cache's sequences are not ordered: their lengths are the prepare kernel's to read.
  if (overrides.longest_first != Choice::kOff && !p.kv_cache.enabled()) {
    const FwdTileShape shape =
        fwd_tile_shape(int(p.head_dim_qk), int(p.head_dim_v), p.dtype == DType::kE4M3);
    w.order_bytes = tile_order_workspace_bytes(p, shape.min_block_m());
  }
  w.max_splits = fwd_plan::max_splits(p, overrides);
  w.partials = w.order_bytes;
  w.partials_bytes = split_workspace_bytes(p, w.max_splits);
  w.bytes = w.partials + w.partials_bytes;
  if (p.kv_cache.enabled()) {
    auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
    w.cache_valid = w.bytes;
    w.q_rotated = w.cache_valid + aligned(size_t(p.batch) * sizeof(int32_t));
    if (p.kv_cache.rotary_dim > 0)
      w.q_rotated_bytes =
          aligned(size_t(p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q) *
                  size_t(p.heads_q * p.head_dim_qk) * dtype_size(p.dtype));
    w.bytes = w.q_rotated + w.q_rotated_bytes;
  }
  return w;
}

FwdPlan plan_forward(const Problem& p, const DeviceFacts& device, const Overrides& overrides) {
  FwdPlan plan;
  plan.workspace = FwdWorkspace::of(p, overrides);
  // Nothing to write (and Q / O may be views without memory).
  if (p.batch == 0 || p.seqlen_q == 0 || (p.is_varlen() && p.varlen.total_q == 0)) return plan;

  const FwdTileShape shape =
      fwd_tile_shape(int(p.head_dim_qk), int(p.head_dim_v), p.dtype == DType::kE4M3);
  const BandMask band = BandMask::make(p.seqlen_q, p.seqlen_k, p.causal, p.window.left,
                                       p.window.right);
  const bool chunked = fwd_plan::takes_chunked_kv(p, band.banded(), shape.chunked.min_keys,
                                                  overrides.chunked_kv) &&
                       pages_hold_key_tiles(p, shape.chunked.block_n);
  plan.variant = chunked ? FwdVariant::kChunked : FwdVariant::kMain;
  plan.block_m = shape.block_m();
  plan.block_n = chunked ? shape.chunked.block_n : shape.block_n;
  plan.pack_group = fwd_plan::pack_group(p, plan.block_m, overrides.pack_gqa);
  const int64_t group = plan.pack_group;
  const int sm_count = device.sm_count;
  plan.tile_heads = int(p.heads_q / group);
  const int64_t rows = p.seqlen_q * group;  // a sequence's rows in its query tiles
  auto tiles_of = [&](int block_m) {
    return (rows + block_m - 1) / block_m * plan.tile_heads * p.batch;
  };
  // The narrow variant (one consumer warpgroup) where one slice holds a tile's rows, the main
  // kernel's tiles leave half the SMs idle or more (so split-KV shares out their keys) and the
  // keys load as whole tiles: the same tiles, each CTA with a deeper K / V ring.
  if (!chunked && fwd_plan::takes_narrow(shape.has_narrow(), rows, tiles_of(plan.block_m),
                                         sm_count, pages_hold_key_tiles(p, shape.block_n),
                                         overrides.narrow)) {
    plan.variant = FwdVariant::kNarrow;
    plan.block_m = FwdTileShape::kSliceRows;
  }
  // The unmasked variant's wider key tiles where nothing but the sequence end cuts them.
  if (plan.variant == FwdVariant::kMain &&
      fwd_plan::takes_unmasked(p, shape, band.banded(), rows, overrides.unmasked)) {
    plan.variant = FwdVariant::kUnmasked;
    plan.block_n = shape.unmasked.block_n;
  }
  // The wide-pieces twin where the main kernel would load pages of whole 64-key pieces in 16-key
  // pieces.
  if (plan.variant == FwdVariant::kMain && fwd_plan::takes_wide_pieces(p, shape))
    plan.variant = FwdVariant::kWidePieces;
  plan.m_blocks = int((rows + plan.block_m - 1) / plan.block_m);
  plan.heavy_last_rows = band.right >= 0;
  plan.tiles = int(tiles_of(plan.block_m));

  // A (head, batch entry) pair's K and V rows in L2, for the numberings in groups under a causal
  // diagonal (unpacked GQA: a kv head's K / V counted once per query head of it).
  const int64_t pairs = int64_t(plan.tile_heads) * p.batch;
  const int64_t sharing = p.heads_kv > 0 ? p.heads_q / p.heads_kv / group : 1;
  const int64_t kv_row_bytes =
      ((p.head_dim_qk + p.head_dim_v) * int64_t(dtype_size(p.dtype)) + sharing - 1) / sharing;
  // Persistent CTAs take tiles in a fixed order (tile_scheduler.cuh): balanced when every sequence
  // has the same length and nothing but the sequence end masks keys, and, with the causal
  // diagonal, where the zig-zag's share per CTA comes out even. With the diagonal alone (no
  // window) and seqlen_q = seqlen_k, unpacked, a model with each tile's key tiles decides, and may
  // number the zig-zag's tiles in groups (causal_schedule.hpp); otherwise (a right-only window,
  // seqlen_q ≠ seqlen_k, pack-GQA) a query tile counts as its index.
  const bool fixed_lengths = !p.is_varlen() && p.seqused_k == nullptr;
  const bool causal_model = fixed_lengths && band.left < 0 && band.right == 0 &&
                            p.seqlen_q == p.seqlen_k && group == 1;
  CausalSchedule causal{false, 1};
  if (causal_model) {
    const int64_t fit = GroupedOrder::l2_pairs(pairs, p.seqlen_k, kv_row_bytes, device.l2_bytes);
    causal = causal_schedule({int(p.seqlen_q), plan.block_m, plan.block_n, int(pairs), sm_count,
                              int(fit < pairs ? fit : pairs)});
  }
  const bool balanced_static_order =
      fixed_lengths && band.left < 0 &&
      (band.right < 0 ||
       (causal_model ? causal.persistent : zigzag_balanced(plan.m_blocks, plan.tiles, sm_count)));

  // Split-KV when the tiles leave SMs idle: each tile's keys shared out (split_kv.cuh).
  plan.splits = fwd_plan::choose_splits(p, plan.tiles,
                                        (p.seqlen_k + plan.block_n - 1) / plan.block_n, sm_count,
                                        plan.workspace.max_splits, overrides.splits > 0);
  // Varlen batches of more tiles than one wave (with fewer, every tile starts at once) run their
  // tiles longest-first: the grid becomes the ordered entries.
  plan.ordered = plan.workspace.order_bytes > 0 &&
                 (overrides.longest_first == Choice::kOn || plan.tiles > sm_count);
  if (plan.ordered)
    plan.ordered_entries = int(ordered_tile_entries(p.batch, p.seqlen_q * group,
                                                    p.varlen.total_q * group, plan.tile_heads,
                                                    plan.block_m));
  plan.entries = (plan.ordered ? plan.ordered_entries : plan.tiles) * plan.splits;

  plan.persistent = overrides.persistent == Choice::kAuto ? balanced_static_order
                                                          : overrides.persistent == Choice::kOn;
  const int persistent_ctas =
      overrides.persistent_ctas > 0 ? overrides.persistent_ctas : std::max(sm_count, 1);
  plan.ctas = plan.persistent && persistent_ctas < plan.entries ? persistent_ctas : plan.entries;
  // One CTA per tile under a causal diagonal, more tiles than SMs: the grid numbered in groups of
  // a few heads, query tile by query tile (grouped_order.hpp), so that the hardware's greedy
  // hand-out ends on light tiles (head by head it ends on the last head's heaviest: a model puts
  // the busiest SM 11.7 % over the mean at d256 causal 8k, 0.8 % grouped). The persistent zig-zag
  // in the group the causal schedule chose (1: head by head), or the one the overrides force. Not
  // for the varlen order, whose entries use the plain numbering.
  if (!plan.ordered) {
    if (plan.heavy_last_rows && plan.ctas == plan.entries && plan.ctas > sm_count) {
      plan.group = GroupedOrder::dividing_group_for(pairs, p.seqlen_k, kv_row_bytes,
                                                    device.l2_bytes);
    } else if (plan.ctas < plan.entries) {
      const int chosen = causal.persistent ? causal.group : 1;
      plan.group = overrides.zigzag_group > 0
                       ? int(std::min<int64_t>(overrides.zigzag_group, pairs))
                       : chosen;
    }
  }
  return plan;
}

}  // namespace fa4::sm90
