// Where sequence b of a (validated) problem lives, for host code: the CPU backend and validation.
// Fixed-length batches address rows as b·batch_stride + s·seq_stride; varlen batches as
// (cu_seqlens[b] + s)·seq_stride. seqused_k shortens the keys a sequence uses (and with it the
// bottom-right alignment of causal / window masks), as in flash_attn. With a KV cache
// (Problem::kv_cache) the keys are rows [leftpad, seqused_k + appended) of the sequence's cache row,
// read directly or through the page table.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4 {

struct SeqSpan {
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;  // keys used (after seqused_k; with a cache, leftpad to the last append)
  int64_t q_row = 0;     // first row in the packed tensor (varlen), else 0
  int64_t k_row = 0;
  int64_t batch = 0;     // batch index for fixed-length addressing, else 0
  int64_t index = 0;     // the sequence's batch index, b
  // KV cache only.
  int64_t cache_row = 0;  // the cache (or page-table) row the sequence reads and appends to
  int64_t k_first = 0;    // its first key's cache position (leftpad)
  int64_t cache_len = 0;  // its cache positions in use before the append (seqused_k)
  int64_t new_rows = 0;   // appended rows
  int64_t new_row = 0;    // their first row in k_new / v_new (varlen appends), else 0
};

inline SeqSpan seq_span(const Problem& p, int64_t b) {
  SeqSpan s;
  s.index = b;
  if (p.is_varlen()) {
    s.q_row = p.varlen.cu_seqlens_q[b];
    s.seqlen_q = p.varlen.cu_seqlens_q[b + 1] - s.q_row;
  } else {
    s.batch = b;
    s.seqlen_q = p.seqlen_q;
  }
  if (p.is_varlen_k()) {
    s.k_row = p.varlen.cu_seqlens_k[b];
    s.seqlen_k = p.varlen.cu_seqlens_k[b + 1] - s.k_row;
  } else {
    s.seqlen_k = p.seqlen_k;
  }
  if (p.seqused_k != nullptr) s.seqlen_k = p.seqused_k[b];
  const KvCache& c = p.kv_cache;
  if (c.enabled()) {
    s.cache_row = c.batch_idx != nullptr ? c.batch_idx[b] : b;
    s.k_first = c.leftpad != nullptr ? c.leftpad[b] : 0;
    s.cache_len = s.seqlen_k;
    if (c.cu_seqlens_new != nullptr) {
      s.new_row = c.cu_seqlens_new[b];
      s.new_rows = c.cu_seqlens_new[b + 1] - s.new_row;
    } else {
      s.new_rows = c.seqlen_new;
    }
    s.seqlen_k = s.cache_len - s.k_first + s.new_rows;
  }
  return s;
}

// Element offset of row `row` (within the span), head h, of a (batch, seq, head, dim) view.
inline int64_t q_offset(const TensorView& t, const SeqSpan& s, int64_t row, int64_t h) {
  return s.batch * t.batch_stride + (s.q_row + row) * t.seq_stride + h * t.head_stride;
}
inline int64_t k_offset(const TensorView& t, const SeqSpan& s, int64_t row, int64_t h) {
  return s.batch * t.batch_stride + (s.k_row + row) * t.seq_stride + h * t.head_stride;
}
inline int64_t lse_offset(const LseView& t, const SeqSpan& s, int64_t row, int64_t h) {
  return s.batch * t.batch_stride + h * t.head_stride + (s.q_row + row) * t.seq_stride;
}

// Element offset of cache position `pos` of the sequence's cache row, head h, in the cache view t
// (k or v): through the page table when paged.
inline int64_t cache_offset(const TensorView& t, const Problem& p, const SeqSpan& s, int64_t pos,
                            int64_t h) {
  const KvCache& c = p.kv_cache;
  if (!c.paged()) return s.cache_row * t.batch_stride + pos * t.seq_stride + h * t.head_stride;
  const int64_t page = c.page_table[s.cache_row * c.page_table_stride + pos / c.page_size];
  return page * t.batch_stride + (pos % c.page_size) * t.seq_stride + h * t.head_stride;
}

// Element offset of key `j` (within the span: j < seqlen_k), head h, of k or v.
inline int64_t key_offset(const TensorView& t, const Problem& p, const SeqSpan& s, int64_t j,
                          int64_t h) {
  return p.kv_cache.enabled() ? cache_offset(t, p, s, s.k_first + j, h) : k_offset(t, s, j, h);
}

// Element offset of appended row j (< new_rows), head h, of k_new or v_new.
inline int64_t new_offset(const TensorView& t, const Problem& p, const SeqSpan& s, int64_t j,
                          int64_t h) {
  const int64_t batch = p.kv_cache.cu_seqlens_new != nullptr ? 0 : s.index;
  return batch * t.batch_stride + (s.new_row + j) * t.seq_stride + h * t.head_stride;
}

}  // namespace fa4
