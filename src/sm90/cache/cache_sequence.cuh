// One sequence of a KV-cache problem (Problem::kv_cache) as the sm90 kernels read it: which cache
// row it uses, where its keys start (the left pad), how long its cache is before the append and
// how many rows the append adds. The prepare kernel (kv_prepare.cuh) checks these entries and the
// page table once per call and marks each sequence valid or not in the workspace; the attention
// and combine kernels read the mark (sequence.cuh) and skip a sequence the check rejected.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace fa4::sm90 {

struct CacheSequences {
  const int32_t* valid = nullptr;  // per batch entry, written by the prepare kernel; null: no cache
  const int32_t* batch_idx = nullptr;
  const int32_t* leftpad = nullptr;
  const int32_t* cu_seqlens_new = nullptr;
  int32_t seqlen_new = 0;

  CUTE_HOST_DEVICE bool enabled() const { return valid != nullptr; }
};

struct CacheSpan {
  int32_t row = 0;        // cache row (page-table row when paged)
  int32_t first = 0;      // the first key's cache position (left pad)
  int32_t cache_len = 0;  // positions in use before the append (seqused_k)
  int32_t new_rows = 0;   // appended rows
  int32_t new_start = 0;  // their first row in k_new / v_new (varlen appends), else 0

  CUTE_HOST_DEVICE int32_t keys() const { return cache_len + new_rows - first; }
  CUTE_HOST_DEVICE int32_t end() const { return cache_len + new_rows; }  // one past the last key
};

// The entries as given; the prepare kernel checks them, the other kernels trust its mark.
CUTE_DEVICE CacheSpan cache_span(CacheSequences const& c, const int32_t* seqused_k,
                                 int32_t capacity, int b) {
  CacheSpan s;
  s.row = c.batch_idx != nullptr ? c.batch_idx[b] : b;
  s.first = c.leftpad != nullptr ? c.leftpad[b] : 0;
  s.cache_len = seqused_k != nullptr ? seqused_k[b] : capacity;
  if (c.cu_seqlens_new != nullptr) {
    s.new_start = c.cu_seqlens_new[b];
    s.new_rows = c.cu_seqlens_new[b + 1] - s.new_start;
  } else {
    s.new_rows = c.seqlen_new;
  }
  return s;
}

}  // namespace fa4::sm90
