// Split-KV for the forward (split_kv.cuh), as the host-only backend sees it: how many splits a
// problem may take and the workspace their partial results need. Sizes only, the same on every
// device; the launcher picks the splits within this bound from the SM count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fa4/attention.hpp"
#include "sm90/host/env_switch.hpp"

namespace fa4::sm90 {

// The most splits of one query tile's keys.
constexpr int kMaxSplits = 128;
// Query rows × heads × splits the partial results may hold: 2^15 rows of (head dim v + 1) fp32
// values, at most 33 MB of workspace at head dim 256.
constexpr int64_t kSplitRowBudget = int64_t(1) << 15;
// Problems with fewer keys do not split by themselves: a split costs a Q load, an epilogue and
// the combine's traffic, which a few key tiles do not repay.
constexpr int64_t kMinSplitKeys = 512;
// Splits pay off only when the unsplit tiles leave SMs idle; no Hopper GPU has more SMs than this.
constexpr int64_t kMaxSms = 256;

// FA4_SM90_SPLITS=n (n ≥ 1) forces n splits wherever the row budget allows (read once), so that
// the tests run every problem through the split path; 0 or unset: the launcher's choice.
inline int forced_splits() {
  static const int forced = [] {
    const int n = env_int("FA4_SM90_SPLITS");
    return n < 0 ? 0 : n > kMaxSplits ? kMaxSplits : n;
  }();
  return forced;
}

// Query rows of the partials' layout per head: batch · seqlen_q, or total_q (varlen).
inline int64_t split_query_rows(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
}

// The most splits the launcher may choose for this problem (1: it never splits). A tile holds
// at least one query position of one kv head per sequence, so there are at least heads_kv · batch
// tiles: beyond kMaxSms / that, splitting would not fill idle SMs.
inline int max_splits(const Problem& p) {
  const int64_t rows = p.heads_q * split_query_rows(p);
  if (rows <= 0 || p.seqlen_k <= 0) return 1;
  int64_t cap = kSplitRowBudget / rows;
  cap = cap > kMaxSplits ? kMaxSplits : cap;
  if (forced_splits() > 0) {
    const int64_t n = forced_splits() < cap ? forced_splits() : cap;
    return n < 1 ? 1 : int(n);
  }
  if (p.seqlen_k < kMinSplitKeys) return 1;
  const int64_t fill = kMaxSms / (p.heads_kv * p.batch);
  cap = cap < fill ? cap : fill;
  return cap < 2 ? 1 : int(cap);
}

// A split's fewest key tiles when the launcher chooses.
constexpr int64_t kMinKeyTilesPerSplit = 2;

// The splits for `tiles` unsplit tiles of at most `key_tiles` key tiles each on `sm_count` SMs:
// as many as fill one wave (more would add a partial wave), within max_splits; forced, as many as
// asked for within the row budget, empty shares included (the tests' way to reach them).
inline int choose_splits(const Problem& p, int64_t tiles, int64_t key_tiles, int sm_count) {
  const int most = max_splits(p);
  if (most < 2 || tiles <= 0) return 1;
  // Grid entries are 32-bit, and the combine's 1-D grid has a warp per declared query row, head
  // and sequence (a varlen batch may declare far more rows than it has).
  if (tiles * most >= (int64_t(1) << 30) || p.seqlen_q * p.heads_q * p.batch >= (int64_t(1) << 33))
    return 1;
  if (forced_splits() > 0) return most;
  int64_t s = sm_count / tiles;
  s = s < key_tiles / kMinKeyTilesPerSplit ? s : key_tiles / kMinKeyTilesPerSplit;
  s = s < most ? s : most;
  return s < 2 ? 1 : int(s);
}

// Partial O (fp32, head dim v) and LSE per split, query head and row.
inline size_t split_workspace_bytes(const Problem& p, int splits) {
  if (splits < 2) return 0;
  const int64_t entries = int64_t(splits) * p.heads_q * split_query_rows(p);
  return size_t((entries * (p.head_dim_v + 1) * int64_t(sizeof(float)) + 255) / 256 * 256);
}
inline size_t split_workspace_bytes(const Problem& p) {
  return split_workspace_bytes(p, max_splits(p));
}

}  // namespace fa4::sm90
