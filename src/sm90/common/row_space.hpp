// The rows of the tensors the sm90 kernels address through TMA, per batch entry, as plain host
// code: gmem_layout.cuh builds the views from them, and the backend's checks of strides and
// addresses use the same extents.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// The rows of one tensor kind (query rows or key rows) across the batch.
struct RowSpace {
  int64_t max_rows;      // R: the longest sequence (the problem's seqlen_q / seqlen_k)
  int64_t shift_rows;    // rows the shift mode spans: total rows + 1 (varlen), else R + 1
  int64_t batch;         // 1 in varlen mode: every sequence is in batch entry 0
};

inline RowSpace query_rows(const Problem& p) {
  return p.is_varlen() ? RowSpace{p.seqlen_q, p.varlen.total_q + 1, 1}
                       : RowSpace{p.seqlen_q, p.seqlen_q + 1, p.batch};
}
// With a KV cache the keys are the cache's: cache_batch rows of seqlen_k keys (a sequence's keys
// start at its left pad: SeqRows::shift = its end), or num_pages pages of page_size keys.
inline RowSpace key_rows(const Problem& p) {
  const KvCache& c = p.kv_cache;
  if (c.paged()) return {c.page_size, c.page_size + 1, c.num_pages};
  if (c.enabled()) return {p.seqlen_k, p.seqlen_k + 1, c.cache_batch > 0 ? c.cache_batch : p.batch};
  return p.is_varlen() ? RowSpace{p.seqlen_k, p.varlen.total_k + 1, 1}
                       : RowSpace{p.seqlen_k, p.seqlen_k + 1, p.batch};
}

}  // namespace fa4::sm90
