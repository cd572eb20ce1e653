// The KV cache's prepare kernel, run before the attention on the same stream (which it lets start
// early: programmatic dependent launch). Per sequence it
//   - checks the entries the host cannot read: cache row, left pad, cache length, appended rows,
//     query rows, the page-table entries of every position the call reads or writes, and the
//     rotary positions; and marks the sequence valid or not (CacheSequences::valid). A rejected
//     sequence is neither appended to nor computed, and nothing of it is written;
//   - writes the appended rows k_new / v_new into the cache (k rotated by the rotary embedding);
//   - writes the queries rotated (rotary embedding) into the workspace, where the attention reads
//     them.
// A sequence's rows are shared out among a row of CTAs (grid.x), each of which checks the sequence
// itself, so no CTA waits for another.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fa4/attention.hpp"
#include "sm90/cache/cache_sequence.cuh"

namespace fa4::sm90 {

// A (row, head, dim) view in elements; batch_stride 0 for packed (varlen) rows.
struct RowsView {
  void* data = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};

struct KvPrepareParams {
  CacheSequences sequences;  // `valid` is written here
  int32_t* valid;
  const int32_t* seqused_k;
  const int32_t* cu_seqlens_q;  // null: max_q rows per sequence
  int32_t batch, max_q, total_q;
  int32_t capacity;     // keys per cache row (seqlen_k)
  int32_t cache_batch;  // cache rows
  int32_t total_new;    // rows of k_new / v_new with cu_seqlens_new
  // Pages (table null: not paged).
  const int32_t* page_table;
  int64_t table_stride;
  int32_t page_size, num_pages;
  // The cache (batch_stride: a cache row's, or a page's) and the appended rows.
  RowsView k, v, k_new, v_new;
  int32_t heads_q, heads_kv, dim_qk, dim_v;
  // Rotary embedding (rotary_dim 0: none): cos / sin rows of rotary_dim / 2.
  const void* cos;
  const void* sin;
  int64_t rotary_row_stride;
  int32_t rotary_dim, rotary_seqlen;
  bool interleaved;
  bool query_positions;  // each query row at its own position (causal or window), else all at 0
  RowsView q;            // the queries as given
  void* q_rotated;       // (rows, heads_q, dim_qk) contiguous, rows as q's; null without rotary
  // e4m3 caches fed 16-bit rows (Fp8::quantize_appends): each appended row's (batch, kv head)
  // descale, by which it is divided before the rounding.
  DescaleView k_descale, v_descale;
};

// Rows of one sequence each CTA of the prepare kernel takes.
constexpr int kPrepareRows = 16;

// The kernel for the problem's storage types (its dtype; with e4m3, the output's for the rotary
// tables and, quantising, for the appended rows).
cudaError_t launch_kv_prepare(KvPrepareParams const& params, const Problem& p, void* stream);

// The prepare kernel's parameters for a (validated) problem with a KV cache: marks written to
// `valid` (batch int32), rotated queries to `q_rotated` (null without a rotary embedding).
inline KvPrepareParams make_kv_prepare_params(const Problem& p, const ForwardTensors& t,
                                              int32_t* valid, void* q_rotated) {
  const KvCache& c = p.kv_cache;
  auto rows = [](const TensorView& v, bool packed) {
    return RowsView{v.data, packed ? 0 : v.batch_stride, v.seq_stride, v.head_stride};
  };
  KvPrepareParams k{};
  k.sequences = {valid, c.batch_idx, c.leftpad, c.cu_seqlens_new, int32_t(c.seqlen_new)};
  k.valid = valid;
  k.seqused_k = p.seqused_k;
  k.cu_seqlens_q = p.varlen.cu_seqlens_q;
  k.batch = int32_t(p.batch);
  k.max_q = int32_t(p.seqlen_q);
  k.total_q = int32_t(p.varlen.total_q);
  k.capacity = int32_t(p.seqlen_k);
  k.cache_batch = int32_t(c.cache_batch > 0 ? c.cache_batch : p.batch);
  k.total_new = int32_t(c.total_new);
  k.page_table = c.page_table;
  k.table_stride = c.page_table_stride;
  k.page_size = int32_t(c.page_size);
  k.num_pages = int32_t(c.num_pages);
  k.k = rows(t.k, false);
  k.v = rows(t.v, false);
  k.k_new = rows(t.k_new, c.cu_seqlens_new != nullptr);
  k.v_new = rows(t.v_new, c.cu_seqlens_new != nullptr);
  k.heads_q = int32_t(p.heads_q);
  k.heads_kv = int32_t(p.heads_kv);
  k.dim_qk = int32_t(p.head_dim_qk);
  k.dim_v = int32_t(p.head_dim_v);
  k.cos = t.rotary.cos;
  k.sin = t.rotary.sin;
  k.rotary_row_stride = t.rotary.row_stride;
  k.rotary_dim = int32_t(c.rotary_dim);
  k.rotary_seqlen = int32_t(c.rotary_seqlen);
  k.interleaved = c.rotary_interleaved;
  k.query_positions = p.causal || p.window.left >= 0 || p.window.right >= 0;
  k.q = rows(t.q, p.is_varlen());
  k.q_rotated = c.rotary_dim > 0 ? q_rotated : nullptr;
  k.k_descale = t.k_descale;
  k.v_descale = t.v_descale;
  return k;
}

}  // namespace fa4::sm90
