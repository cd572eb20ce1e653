// Split-KV's partial results (split_kv.cuh) as the host-only plan sizes them: the most splits of a
// tile's keys and the workspace their partial O and LSE take. Sizes only, the same on every
// device; the plan (host/fwd_plan.hpp) chooses the splits within them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// The most splits of one query tile's keys.
constexpr int kMaxSplits = 128;
// Query rows × heads × splits the partial results may hold: 2^15 rows of (head dim v + 1) fp32
// values, at most 33 MB of workspace at head dim 256.
constexpr int64_t kSplitRowBudget = int64_t(1) << 15;

// Query rows of the partials' layout per head: batch · seqlen_q, or total_q (varlen).
inline int64_t split_query_rows(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
}

// The most splits the row budget allows for this problem (1: none), at most kMaxSplits.
inline int64_t split_row_cap(const Problem& p) {
  const int64_t rows = p.heads_q * split_query_rows(p);
  if (rows <= 0 || p.seqlen_k <= 0) return 1;
  const int64_t cap = kSplitRowBudget / rows;
  return cap > kMaxSplits ? kMaxSplits : cap < 1 ? 1 : cap;
}

// Partial O (fp32, head dim v) and LSE per split, query head and row.
inline size_t split_workspace_bytes(const Problem& p, int splits) {
  if (splits < 2) return 0;
  const int64_t entries = int64_t(splits) * p.heads_q * split_query_rows(p);
  return size_t((entries * (p.head_dim_v + 1) * int64_t(sizeof(float)) + 255) / 256 * 256);
}

}  // namespace fa4::sm90
