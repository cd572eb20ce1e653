// One batch entry's sequence as a CTA sees it: its lengths (seqused_k applied), where its rows are
// in the TMA views (gmem_layout.cuh), and where its LSE rows start.
//
// cu_seqlens and seqused_k are device arrays the host cannot read without synchronising, so the
// kernel checks the entries it uses: a sequence whose offsets fall outside the tensors, run
// backwards, exceed the declared longest length, or whose seqused_k is out of range is not
// computed and nothing of it is written (docs/semantics.md). The TMA bounds keep every access
// inside the tensors whatever the arrays hold.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

#include "sm90/cache/cache_sequence.cuh"
#include "sm90/common/gmem_layout.cuh"

namespace fa4::sm90 {

struct SequenceParams {
  const int32_t* cu_seqlens_q;  // null: fixed-length batch
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_k;  // optional
  int32_t max_q, max_k;      // the problem's seqlen_q / seqlen_k
  int32_t total_q, total_k;  // rows of the packed tensors (varlen)
  CacheSequences cache{};    // a KV cache's sequences (keys from cache rows or pages), or none
};

struct Sequence {
  int32_t len_q = 0;
  int32_t len_k = 0;    // keys used
  int32_t start_q = 0;  // first row in the packed tensors (varlen), else 0
  int32_t start_k = 0;
  int32_t batch = 0;    // batch entry of fixed-length tensors, else 0
  int32_t k_batch = 0;  // batch entry of K / V: `batch`, or the cache row
  bool valid = false;

  CUTE_DEVICE SeqRows q_rows(int32_t max_q) const { return {max_q - len_q, start_q + len_q, batch}; }
  CUTE_DEVICE SeqRows k_rows(int32_t max_k) const {
    return {max_k - len_k, start_k + len_k, k_batch};
  }
};

// Keys sequence b has in the tensor, before seqused_k shortens it (the backward writes dK = dV = 0
// for the unused ones). Call after load_sequence found the sequence valid.
CUTE_DEVICE int32_t stored_keys(SequenceParams const& p, int b) {
  return p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b] : p.max_k;
}

// A KV cache's sequence: queries as usual, keys [first, end) of its cache row (the prepare kernel
// checked the cache's entries and marked the sequence).
CUTE_DEVICE Sequence load_cache_sequence(SequenceParams const& p, int b) {
  Sequence s;
  if (p.cu_seqlens_q != nullptr) {
    s.start_q = p.cu_seqlens_q[b];
    const int32_t end_q = p.cu_seqlens_q[b + 1];
    if (s.start_q < 0 || end_q < s.start_q || end_q > p.total_q) return s;
    s.len_q = end_q - s.start_q;
  } else {
    s.batch = b;
    s.len_q = p.max_q;
  }
  const CacheSpan c = cache_span(p.cache, p.seqused_k, p.max_k, b);
  s.start_k = c.first;
  s.len_k = c.keys();
  s.k_batch = c.row;
  s.valid = p.cache.valid[b] != 0 && s.len_q <= p.max_q;
  return s;
}

CUTE_DEVICE Sequence load_sequence(SequenceParams const& p, int b) {
  if (p.cache.enabled()) return load_cache_sequence(p, b);
  Sequence s;
  int32_t stored_k;  // keys the sequence has in the tensor (seqused_k may use fewer)
  if (p.cu_seqlens_q != nullptr) {
    s.start_q = p.cu_seqlens_q[b];
    s.start_k = p.cu_seqlens_k[b];
    const int32_t end_q = p.cu_seqlens_q[b + 1];
    const int32_t end_k = p.cu_seqlens_k[b + 1];
    if (s.start_q < 0 || end_q < s.start_q || end_q > p.total_q || s.start_k < 0 ||
        end_k < s.start_k || end_k > p.total_k)
      return s;
    s.len_q = end_q - s.start_q;
    stored_k = end_k - s.start_k;
  } else {
    s.batch = b;
    s.len_q = p.max_q;
    stored_k = p.max_k;
  }
  s.k_batch = s.batch;
  s.len_k = stored_k;
  if (p.seqused_k != nullptr) {
    const int32_t used = p.seqused_k[b];
    if (used < 0 || used > stored_k) return s;
    s.len_k = used;
  }
  s.valid = s.len_q <= p.max_q && stored_k <= p.max_k;
  return s;
}

}  // namespace fa4::sm90
