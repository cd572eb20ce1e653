// Workspace of the forward's longest-first varlen tile order (tile_order.cuh), as the host-only
// backend reports it: one int32 tile index per CTA of the ordered grid.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// Sequences are sorted in shared memory: larger batches run in input order.
constexpr int64_t kMaxOrderedBatch = 8192;
// The forward's query tiles have at least this many rows (fwd_config.cuh: 64 per consumer
// warpgroup; one warpgroup in the narrow variants).
constexpr int64_t kMinQueryTileRows = 64;

// Entries of the ordered grid for tiles of `block_m` rows, with `heads` tile heads (query heads,
// or kv heads holding `group` query heads each when packed): one per query tile of every
// sequence, which with sequences of at most seqlen_q rows and total_q rows in all is at most
// heads · min(batch · ceil(seqlen_q·g / block_m), ceil(total_q·g / block_m) + batch). With
// g = heads_q / heads and block_m ≥ r this never exceeds the bound for heads_q unpacked heads and
// r rows (ceil(g·x) ≤ g·ceil(x)), which is what the workspace holds (r: the head dims' shortest
// query tile, tile_order_workspace_bytes).
inline int64_t ordered_tile_entries(int64_t batch, int64_t seqlen_q_rows, int64_t total_q_rows,
                                    int64_t heads, int64_t block_m) {
  const int64_t per_sequence = (seqlen_q_rows + block_m - 1) / block_m;
  const int64_t by_total = (total_q_rows + block_m - 1) / block_m + batch;
  return heads * (batch * per_sequence < by_total ? batch * per_sequence : by_total);
}

// Bytes of workspace the sm90 forward asks for: the order of a varlen batch's tiles of at least
// `tile_rows` rows (the fewest any kernel of the problem's head dims has, at least
// kMinQueryTileRows); none for fixed-length batches or batches too large to sort. The same on
// every device.
inline size_t tile_order_workspace_bytes(const Problem& p,
                                         int64_t tile_rows = kMinQueryTileRows) {
  if (!p.is_varlen() || p.batch > kMaxOrderedBatch) return 0;
  const int64_t entries = ordered_tile_entries(p.batch, p.seqlen_q, p.varlen.total_q, p.heads_q,
                                               tile_rows);
  return size_t((entries * int64_t(sizeof(int32_t)) + 255) / 256 * 256);
}

}  // namespace fa4::sm90
