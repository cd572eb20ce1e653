#include "api/validate.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include "api/override_fields.hpp"
#include "common/numeric.hpp"
#include "common/seq_layout.hpp"

namespace fa4::detail {

namespace {

// One dimension of a strided view.
struct Dim {
  int64_t extent;
  int64_t stride;
};

// A strided view as validation sees it: where it starts, its element size, its dimensions.
struct Extent {
  const char* name;
  const void* data;
  int64_t elem_bytes;
  Dim dims[4];
  int rank;

  bool empty() const {
    for (int i = 0; i < rank; ++i)
      if (dims[i].extent == 0) return true;
    return false;
  }
};

// A (batch, seq, head, dim) view of elements of `dtype` (varlen: (total, head, dim)).
Extent tensor_extent(const char* name, const TensorView& t, const Problem& p, int64_t seqlen,
                     int64_t total, int64_t heads, int64_t dim, DType dtype) {
  const int64_t elem = int64_t(dtype_size(dtype));
  if (p.is_varlen())
    return {name, t.data, elem, {{total, t.seq_stride}, {heads, t.head_stride}, {dim, t.dim_stride}},
            3};
  return {name,
          t.data,
          elem,
          {{p.batch, t.batch_stride}, {seqlen, t.seq_stride}, {heads, t.head_stride},
           {dim, t.dim_stride}},
          4};
}

Extent lse_extent(const char* name, const LseView& t, const Problem& p) {
  if (p.is_varlen())
    return {name, t.data, 4, {{p.heads_q, t.head_stride}, {p.varlen.total_q, t.seq_stride}}, 2};
  return {name,
          t.data,
          4,
          {{p.batch, t.batch_stride}, {p.heads_q, t.head_stride}, {p.seqlen_q, t.seq_stride}},
          3};
}

// Non-null data, non-negative strides, unit innermost stride, and offsets that fit in int64 / the
// address space.
Status check_view(const Extent& e, int64_t innermost_stride, const char* innermost_name) {
  if (e.empty()) return Status::success();
  if (e.data == nullptr) return invalid("%s.data is null", e.name);
  if (innermost_stride != 1)
    return invalid("%s.%s is %lld; it must be 1 (the innermost dimension must be contiguous)",
                   e.name, innermost_name, (long long)innermost_stride);
  int64_t max_offset = 0;
  for (int i = 0; i < e.rank; ++i) {
    if (e.dims[i].stride < 0)
      return invalid("%s has a negative stride (%lld); strides must be >= 0", e.name,
                     (long long)e.dims[i].stride);
    int64_t term;
    if (__builtin_mul_overflow(e.dims[i].extent - 1, e.dims[i].stride, &term) ||
        __builtin_add_overflow(max_offset, term, &max_offset))
      return invalid("%s: element offsets overflow int64 with these sizes and strides", e.name);
  }
  int64_t count, last_byte;
  if (__builtin_add_overflow(max_offset, int64_t(1), &count) ||
      __builtin_mul_overflow(count, e.elem_bytes, &last_byte) ||
      uintptr_t(e.data) + uint64_t(last_byte) < uintptr_t(e.data))
    return invalid("%s: byte offsets overflow the address space with these sizes and strides",
                   e.name);
  return Status::success();
}

// Two distinct elements of an output must not share an address (else writes race / clobber).
Status check_no_self_overlap(const Extent& e) {
  if (e.empty()) return Status::success();
  Dim dims[4];
  int n = 0;
  for (int i = 0; i < e.rank; ++i)
    if (e.dims[i].extent > 1) dims[n++] = e.dims[i];
  for (int i = 1; i < n; ++i)  // insertion sort by stride: at most 4 dimensions
    for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) std::swap(dims[j], dims[j - 1]);
  int64_t span = 1;  // elements covered by the inner dimensions considered so far
  for (int i = 0; i < n; ++i) {
    if (dims[i].stride < span)
      return invalid("%s: strides make distinct output elements overlap (a dimension of extent "
                     "%lld has stride %lld, smaller than the %lld elements it must step over)",
                     e.name, (long long)dims[i].extent, (long long)dims[i].stride,
                     (long long)span);
    span = dims[i].stride * (dims[i].extent - 1) + span;
  }
  return Status::success();
}

Status check_input(const Extent& e) { return check_view(e, e.dims[e.rank - 1].stride, "dim_stride"); }

Status check_output(const Extent& e) {
  Status s = check_input(e);
  return s.ok() ? check_no_self_overlap(e) : s;
}

Status check_lse(const Extent& e, bool output) {
  Status s = check_view(e, e.dims[e.rank - 1].stride, "seq_stride");
  if (s.ok() && !e.empty() && reinterpret_cast<uintptr_t>(e.data) % alignof(float) != 0)
    return invalid("%s.data is not %zu-byte aligned (it holds floats)", e.name, alignof(float));
  if (s.ok() && output) s = check_no_self_overlap(e);
  return s;
}

// Rows of the cache (of the page table, when paged): cache_batch, or one per batch entry.
int64_t cache_rows(const Problem& p) {
  return p.kv_cache.cache_batch > 0 ? p.kv_cache.cache_batch : p.batch;
}

// Bytes of a tensor of these extents overflow int64.
bool bytes_overflow(int64_t outer, int64_t rows, int64_t heads, int64_t dim) {
  int64_t n = outer;
  return __builtin_mul_overflow(n, rows, &n) || __builtin_mul_overflow(n, heads, &n) ||
         __builtin_mul_overflow(n, dim, &n) || __builtin_mul_overflow(n, int64_t(8), &n);
}

Status validate_kv_cache(const Problem& p) {
  const KvCache& c = p.kv_cache;
  if (p.varlen.cu_seqlens_k != nullptr)
    return invalid("varlen.cu_seqlens_k is set with a KV cache, whose rows are not packed: keys "
                   "are the cache rows (seqused_k gives their lengths)");
  if (c.cache_batch < 0)
    return invalid("kv_cache.cache_batch is %lld; it must be >= 0 (0: batch)",
                   (long long)c.cache_batch);
  if (c.batch_idx == nullptr && cache_rows(p) < p.batch)
    return invalid("kv_cache.cache_batch is %lld, fewer than the batch's %lld entries, and "
                   "kv_cache.batch_idx is null (entry b reads cache row b)",
                   (long long)c.cache_batch, (long long)p.batch);
  if (c.paged()) {
    if (c.page_size < 1)
      return invalid("kv_cache.page_size is %lld; it must be >= 1", (long long)c.page_size);
    if (c.pages_per_seq < 0 || c.num_pages < 0)
      return invalid("kv_cache.pages_per_seq (%lld) and kv_cache.num_pages (%lld) must be >= 0",
                     (long long)c.pages_per_seq, (long long)c.num_pages);
    if (c.page_table_stride < c.pages_per_seq)
      return invalid("kv_cache.page_table_stride is %lld, less than pages_per_seq = %lld",
                     (long long)c.page_table_stride, (long long)c.pages_per_seq);
    int64_t capacity = 0;
    if (__builtin_mul_overflow(c.pages_per_seq, c.page_size, &capacity) || capacity != p.seqlen_k)
      return invalid("seqlen_k is %lld; with a page table it must be pages_per_seq · page_size "
                     "(%lld · %lld), each cache row's capacity",
                     (long long)p.seqlen_k, (long long)c.pages_per_seq, (long long)c.page_size);
    if (bytes_overflow(c.num_pages, c.page_size, p.heads_kv, std::max(p.head_dim_qk, p.head_dim_v)))
      return invalid("sizes overflow: num_pages·page_size·heads_kv·head_dim (in bytes) exceeds int64");
  } else if (c.page_size != 0 || c.pages_per_seq != 0 || c.num_pages != 0 ||
             c.page_table_stride != 0) {
    return invalid("kv_cache page sizes are set but kv_cache.page_table is null");
  } else if (bytes_overflow(cache_rows(p), p.seqlen_k, p.heads_kv,
                            std::max(p.head_dim_qk, p.head_dim_v))) {
    return invalid("sizes overflow: cache_batch·seqlen_k·heads_kv·head_dim (in bytes) exceeds int64");
  }
  if (c.seqlen_new < 0 || c.total_new < 0)
    return invalid("kv_cache.seqlen_new (%lld) and kv_cache.total_new (%lld) must be >= 0",
                   (long long)c.seqlen_new, (long long)c.total_new);
  if (c.cu_seqlens_new == nullptr && c.total_new != 0)
    return invalid("kv_cache.total_new is set but kv_cache.cu_seqlens_new is null");
  if (bytes_overflow(p.batch, c.seqlen_new, p.heads_kv, std::max(p.head_dim_qk, p.head_dim_v)) ||
      bytes_overflow(1, c.total_new, p.heads_kv, std::max(p.head_dim_qk, p.head_dim_v)))
    return invalid("sizes overflow: the appended rows (in bytes) exceed int64");
  if (c.rotary_dim != 0) {
    if (c.rotary_dim < 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > p.head_dim_qk)
      return invalid("kv_cache.rotary_dim is %lld; it must be even and in [2, head_dim_qk = %lld] "
                     "(0: no rotary embedding)",
                     (long long)c.rotary_dim, (long long)p.head_dim_qk);
    if (!c.appends())
      return invalid("kv_cache.rotary_dim is set without appended rows: the rotary embedding "
                     "applies to new keys (kv_cache.seqlen_new or cu_seqlens_new) and the queries");
    if (c.rotary_seqlen < 1)
      return invalid("kv_cache.rotary_seqlen is %lld; the rotary tables need >= 1 position",
                     (long long)c.rotary_seqlen);
  } else if (c.rotary_seqlen != 0) {
    return invalid("kv_cache.rotary_seqlen is set but kv_cache.rotary_dim is 0");
  }
  return Status::success();
}

}  // namespace

Status validate_problem(const Problem& p) {
  if (p.batch < 0) return invalid("batch is %lld; it must be >= 0", (long long)p.batch);
  if (p.seqlen_q < 0) return invalid("seqlen_q is %lld; it must be >= 0", (long long)p.seqlen_q);
  if (p.seqlen_k < 0) return invalid("seqlen_k is %lld; it must be >= 0", (long long)p.seqlen_k);
  if (p.heads_q < 1) return invalid("heads_q is %lld; it must be >= 1", (long long)p.heads_q);
  if (p.heads_kv < 1) return invalid("heads_kv is %lld; it must be >= 1", (long long)p.heads_kv);
  if (p.heads_q % p.heads_kv != 0)
    return invalid("heads_q (%lld) must be a multiple of heads_kv (%lld) for GQA/MQA",
                   (long long)p.heads_q, (long long)p.heads_kv);
  if (p.head_dim_qk < 1)
    return invalid("head_dim_qk is %lld; it must be >= 1", (long long)p.head_dim_qk);
  if (p.head_dim_v < 1)
    return invalid("head_dim_v is %lld; it must be >= 1", (long long)p.head_dim_v);
  if (p.dtype != DType::kBF16 && p.dtype != DType::kFP16 && p.dtype != DType::kFP32 &&
      p.dtype != DType::kE4M3)
    return invalid("dtype %d is not a dtype (bf16 = 0, fp16 = 1, fp32 = 2, e4m3 = 3)",
                   int(p.dtype));
  if (p.dtype == DType::kE4M3 && p.fp8.out_dtype != DType::kBF16 &&
      p.fp8.out_dtype != DType::kFP16)
    return invalid("fp8.out_dtype is %d; e4m3 inputs give a bf16 (0) or fp16 (1) output",
                   int(p.fp8.out_dtype));
  if (p.window.left < -1)
    return invalid("window.left is %lld; it must be >= 0, or -1 for unbounded",
                   (long long)p.window.left);
  if (p.window.right < -1)
    return invalid("window.right is %lld; it must be >= 0, or -1 for unbounded",
                   (long long)p.window.right);
  if (!std::isfinite(p.softcap) || p.softcap < 0.0f)
    return invalid("softcap is %g; it must be 0 (off) or a finite positive number",
                   double(p.softcap));
  if (!std::isfinite(p.softmax_scale))
    return invalid("softmax_scale is %g; it must be finite (0 selects 1/sqrt(head_dim_qk))",
                   double(p.softmax_scale));
  if (p.varlen.cu_seqlens_k != nullptr && p.varlen.cu_seqlens_q == nullptr)
    return invalid("varlen.cu_seqlens_k is set but varlen.cu_seqlens_q is null; varlen mode needs both");
  if (p.is_varlen()) {
    if (p.varlen.cu_seqlens_k == nullptr && !p.kv_cache.enabled())
      return invalid("varlen.cu_seqlens_q is set but varlen.cu_seqlens_k is null; varlen mode needs both");
    if (p.varlen.total_q < 0 || p.varlen.total_k < 0)
      return invalid("varlen.total_q (%lld) and varlen.total_k (%lld) must be >= 0",
                     (long long)p.varlen.total_q, (long long)p.varlen.total_k);
  }
  if (p.alibi.data != nullptr) {
    const Extent e{"alibi", p.alibi.data, 4,
                   {{p.batch, p.alibi.batch_stride}, {p.heads_q, p.alibi.head_stride}}, 2};
    Status s = check_view(e, 1, "data");  // one slope per element: no innermost dimension
    if (!s.ok()) return s;
    if (reinterpret_cast<uintptr_t>(p.alibi.data) % alignof(float) != 0)
      return invalid("alibi.data is not %zu-byte aligned (it holds floats)", alignof(float));
  }
  if (p.sinks != nullptr && reinterpret_cast<uintptr_t>(p.sinks) % alignof(float) != 0)
    return invalid("sinks is not %zu-byte aligned (it holds floats)", alignof(float));
  if (p.num_splits < 0)
    return invalid("num_splits is %lld; it must be >= 0 (0: the library's choice, 1: none)",
                   (long long)p.num_splits);
  if (p.kv_cache.enabled()) {
    Status s = validate_kv_cache(p);
    if (!s.ok()) return s;
  }
  // Every tensor's byte count must fit in int64, so that no size derived from the problem
  // (workspace, grid, offsets) can wrap.
  const int64_t dim = std::max(p.head_dim_qk, p.head_dim_v);
  const struct {
    const char* what;
    int64_t outer, rows, heads, dim;
  } sizes[] = {{"batch·seqlen_q·heads_q·head_dim", p.batch, p.seqlen_q, p.heads_q, dim},
               {"batch·seqlen_k·heads_kv·head_dim", p.batch, p.seqlen_k, p.heads_kv, dim},
               {"total_q·heads_q·head_dim", 1, p.varlen.total_q, p.heads_q, dim},
               {"total_k·heads_kv·head_dim", 1, p.varlen.total_k, p.heads_kv, dim}};
  for (const auto& z : sizes) {
    int64_t n = z.outer;
    if (__builtin_mul_overflow(n, z.rows, &n) || __builtin_mul_overflow(n, z.heads, &n) ||
        __builtin_mul_overflow(n, z.dim, &n) || __builtin_mul_overflow(n, int64_t(8), &n))
      return invalid("sizes overflow: %s (in bytes) exceeds int64", z.what);
  }
  return Status::success();
}

namespace {

// cu_seqlens-style offsets: arr[0] = 0, non-decreasing, each length ≤ max_len, arr[batch] ≤ total.
Status check_offsets(const char* name, const int32_t* cu, int64_t batch, int64_t total,
                     const char* total_name, int64_t max_len, const char* max_name) {
  if (cu[0] != 0) return invalid("%s[0] is %d; it must be 0", name, cu[0]);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = int64_t(cu[b + 1]) - cu[b];
    if (len < 0)
      return invalid("%s decreases at %lld (%d > %d)", name, (long long)b, cu[b], cu[b + 1]);
    if (len > max_len)
      return invalid("sequence %lld has length %lld in %s, more than %s = %lld (the maximum)",
                     (long long)b, (long long)len, name, max_name, (long long)max_len);
  }
  if (cu[batch] > total)
    return invalid("%s[batch] = %d exceeds the tensor's rows (%s = %lld)", name, cu[batch],
                   total_name, (long long)total);
  return Status::success();
}

// The KV cache's arrays, sequence by sequence: cache rows, left pads, appends within the capacity,
// the pages read and written, the rotary positions.
Status validate_kv_cache_arrays(const Problem& p) {
  const KvCache& c = p.kv_cache;
  if (c.cu_seqlens_new != nullptr) {
    Status s = check_offsets("kv_cache.cu_seqlens_new", c.cu_seqlens_new, p.batch, c.total_new,
                             "kv_cache.total_new", c.seqlen_new, "kv_cache.seqlen_new");
    if (!s.ok()) return s;
  }
  const bool banded = p.causal || p.window.left >= 0 || p.window.right >= 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqSpan s = seq_span(p, b);
    if (s.cache_row < 0 || s.cache_row >= cache_rows(p))
      return invalid("kv_cache.batch_idx[%lld] is %lld; it must be in [0, %lld) (the cache's rows)",
                     (long long)b, (long long)s.cache_row, (long long)cache_rows(p));
    if (s.k_first < 0 || s.k_first > s.cache_len)
      return invalid("kv_cache.leftpad[%lld] is %lld; it must be in [0, %lld] (the sequence's "
                     "cache length, seqused_k)",
                     (long long)b, (long long)s.k_first, (long long)s.cache_len);
    if (s.cache_len + s.new_rows > p.seqlen_k)
      return invalid("sequence %lld appends %lld rows to a cache row holding %lld of %lld: the "
                     "append runs past the cache's capacity (seqlen_k)",
                     (long long)b, (long long)s.new_rows, (long long)s.cache_len,
                     (long long)p.seqlen_k);
    if (c.paged() && s.k_first < s.cache_len + s.new_rows) {
      const int32_t* row = c.page_table + s.cache_row * c.page_table_stride;
      for (int64_t i = s.k_first / c.page_size; i <= (s.cache_len + s.new_rows - 1) / c.page_size;
           ++i)
        if (row[i] < 0 || row[i] >= c.num_pages)
          return invalid("kv_cache.page_table[%lld][%lld] is %d; it must be in [0, %lld) (the "
                         "cache's pages)",
                         (long long)s.cache_row, (long long)i, row[i], (long long)c.num_pages);
    }
    if (c.rotary_dim > 0) {
      int64_t last = s.new_rows > 0 ? s.cache_len + s.new_rows - 1 : -1;
      if (s.seqlen_q > 0) last = std::max(last, s.cache_len + (banded ? s.seqlen_q - 1 : 0));
      if (last >= c.rotary_seqlen)
        return invalid("sequence %lld needs rotary position %lld, but the tables hold %lld "
                       "(kv_cache.rotary_seqlen)",
                       (long long)b, (long long)last, (long long)c.rotary_seqlen);
    }
  }
  return Status::success();
}

}  // namespace

Status validate_sequence_arrays(const Problem& p) {
  if (p.is_varlen()) {
    Status s = check_offsets("cu_seqlens_q", p.varlen.cu_seqlens_q, p.batch, p.varlen.total_q,
                             "varlen.total_q", p.seqlen_q, "seqlen_q");
    if (!s.ok()) return s;
  }
  if (p.is_varlen_k()) {
    Status s = check_offsets("cu_seqlens_k", p.varlen.cu_seqlens_k, p.batch, p.varlen.total_k,
                             "varlen.total_k", p.seqlen_k, "seqlen_k");
    if (!s.ok()) return s;
  }
  if (p.seqused_k != nullptr) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t len = p.is_varlen_k()
                              ? int64_t(p.varlen.cu_seqlens_k[b + 1]) - p.varlen.cu_seqlens_k[b]
                              : p.seqlen_k;
      if (p.seqused_k[b] < 0 || p.seqused_k[b] > len)
        return invalid("seqused_k[%lld] is %d; it must be in [0, %lld] (the sequence's keys)",
                       (long long)b, p.seqused_k[b], (long long)len);
    }
  }
  return p.kv_cache.enabled() ? validate_kv_cache_arrays(p) : Status::success();
}

namespace {

struct Views {
  Extent q, k, v;
};

Views input_extents(const Problem& p, const TensorView& q, const TensorView& k,
                    const TensorView& v) {
  return {
      tensor_extent("q", q, p, p.seqlen_q, p.varlen.total_q, p.heads_q, p.head_dim_qk, p.dtype),
      tensor_extent("k", k, p, p.seqlen_k, p.varlen.total_k, p.heads_kv, p.head_dim_qk, p.dtype),
      tensor_extent("v", v, p, p.seqlen_k, p.varlen.total_k, p.heads_kv, p.head_dim_v, p.dtype)};
}

}  // namespace

namespace {

// The KV cache's views: the cache (pages or rows; written where rows are appended), the appended
// rows, the rotary tables.
Status validate_kv_cache_tensors(const Problem& p, const ForwardTensors& t) {
  const KvCache& c = p.kv_cache;
  const int64_t elem = int64_t(dtype_size(p.dtype));
  // Appended rows in the output's precision are quantised on write (e4m3 caches).
  const int64_t new_elem = int64_t(
      dtype_size(p.dtype == DType::kE4M3 && p.fp8.quantize_appends ? p.fp8.out_dtype : p.dtype));
  const int64_t table_elem = int64_t(dtype_size(output_dtype(p)));
  const int64_t outer = c.paged() ? c.num_pages : cache_rows(p);
  const int64_t rows = c.paged() ? c.page_size : p.seqlen_k;
  const struct {
    const char* name;
    const TensorView& view;
    int64_t dim;
  } caches[] = {{"k", t.k, p.head_dim_qk}, {"v", t.v, p.head_dim_v}};
  for (const auto& x : caches) {
    const Extent e{x.name,
                   x.view.data,
                   elem,
                   {{outer, x.view.batch_stride}, {rows, x.view.seq_stride},
                    {p.heads_kv, x.view.head_stride}, {x.dim, x.view.dim_stride}},
                   4};
    Status s = c.appends() ? check_output(e) : check_input(e);
    if (!s.ok()) return s;
  }
  if (c.appends()) {
    const struct {
      const char* name;
      const TensorView& view;
      int64_t dim;
    } news[] = {{"k_new", t.k_new, p.head_dim_qk}, {"v_new", t.v_new, p.head_dim_v}};
    for (const auto& x : news) {
      const Extent e =
          c.cu_seqlens_new != nullptr
              ? Extent{x.name,
                       x.view.data,
                       new_elem,
                       {{c.total_new, x.view.seq_stride}, {p.heads_kv, x.view.head_stride},
                        {x.dim, x.view.dim_stride}},
                       3}
              : Extent{x.name,
                       x.view.data,
                       new_elem,
                       {{p.batch, x.view.batch_stride}, {c.seqlen_new, x.view.seq_stride},
                        {p.heads_kv, x.view.head_stride}, {x.dim, x.view.dim_stride}},
                       4};
      Status s = check_input(e);
      if (!s.ok()) return s;
    }
  }
  if (c.rotary_dim > 0) {
    if (t.rotary.row_stride < c.rotary_dim / 2)
      return invalid("rotary.row_stride is %lld; it must be at least rotary_dim / 2 = %lld",
                     (long long)t.rotary.row_stride, (long long)(c.rotary_dim / 2));
    for (const auto& [name, data] : {std::pair<const char*, const void*>{"rotary.cos", t.rotary.cos},
                                     {"rotary.sin", t.rotary.sin}}) {
      const Extent e{name,
                     data,
                     table_elem,
                     {{c.rotary_seqlen, t.rotary.row_stride}, {c.rotary_dim / 2, 1}},
                     2};
      Status s = check_input(e);
      if (!s.ok()) return s;
    }
  }
  return Status::success();
}

// The descales: only with e4m3 inputs; fp32 (batch, heads_kv) views whose offsets fit.
Status validate_descales(const Problem& p, const ForwardTensors& t) {
  const struct {
    const char* name;
    const DescaleView& view;
  } descales[] = {{"q_descale", t.q_descale}, {"k_descale", t.k_descale},
                  {"v_descale", t.v_descale}};
  for (const auto& d : descales) {
    if (d.view.data == nullptr) continue;
    if (p.dtype != DType::kE4M3)
      return invalid("%s is set, but dtype is %s: descales scale e4m3 inputs only", d.name,
                     dtype_name(p.dtype));
    const Extent e{d.name, d.view.data, 4,
                   {{p.batch, d.view.batch_stride}, {p.heads_kv, d.view.head_stride}}, 2};
    Status s = check_view(e, 1, "data");  // a scalar per element: no innermost dimension
    if (!s.ok()) return s;
    if (reinterpret_cast<uintptr_t>(d.view.data) % alignof(float) != 0)
      return invalid("%s.data is not %zu-byte aligned (it holds floats)", d.name, alignof(float));
  }
  return Status::success();
}

}  // namespace

Status validate_forward_tensors(const Problem& p, const ForwardTensors& t) {
  const Views in = input_extents(p, t.q, t.k, t.v);
  for (const Extent* e : {&in.q, &in.k, &in.v}) {
    if (p.kv_cache.enabled() && e != &in.q) continue;  // the cache's own views, below
    Status s = check_input(*e);
    if (!s.ok()) return s;
  }
  if (p.kv_cache.enabled()) {
    Status s = validate_kv_cache_tensors(p, t);
    if (!s.ok()) return s;
  }
  Status s = check_output(tensor_extent("out", t.out, p, p.seqlen_q, p.varlen.total_q, p.heads_q,
                                        p.head_dim_v, output_dtype(p)));
  if (!s.ok()) return s;
  s = validate_descales(p, t);
  if (!s.ok()) return s;
  if (p.return_lse) return check_lse(lse_extent("lse", t.lse, p), /*output=*/true);
  return Status::success();
}

Status validate_backward_tensors(const Problem& p, const BackwardTensors& t) {
  const Views in = input_extents(p, t.q, t.k, t.v);
  const Extent inputs[] = {
      in.q, in.k, in.v,
      tensor_extent("out", t.out, p, p.seqlen_q, p.varlen.total_q, p.heads_q, p.head_dim_v,
                    p.dtype),
      tensor_extent("dout", t.dout, p, p.seqlen_q, p.varlen.total_q, p.heads_q, p.head_dim_v,
                    p.dtype)};
  for (const Extent& e : inputs) {
    Status s = check_input(e);
    if (!s.ok()) return s;
  }
  Status s = check_lse(lse_extent("lse", t.lse, p), /*output=*/false);
  if (!s.ok()) return s;
  const Extent outputs[] = {
      tensor_extent("dq", t.dq, p, p.seqlen_q, p.varlen.total_q, p.heads_q, p.head_dim_qk,
                    p.dtype),
      tensor_extent("dk", t.dk, p, p.seqlen_k, p.varlen.total_k, p.heads_kv, p.head_dim_qk,
                    p.dtype),
      tensor_extent("dv", t.dv, p, p.seqlen_k, p.varlen.total_k, p.heads_kv, p.head_dim_v,
                    p.dtype)};
  for (const Extent& e : outputs) {
    Status s2 = check_output(e);
    if (!s2.ok()) return s2;
  }
  if (t.dsinks != nullptr && p.sinks == nullptr)
    return invalid("dsinks is set, but the problem has no sinks (Problem::sinks is null)");
  if (t.dsinks != nullptr && reinterpret_cast<uintptr_t>(t.dsinks) % alignof(float) != 0)
    return invalid("dsinks is not %zu-byte aligned (it holds floats)", alignof(float));
  return Status::success();
}

Status validate_overrides(const Overrides& o) {
  for (const ChoiceField& f : kChoiceFields) {
    const int v = int(o.*f.member);
    if (v < -1 || v > 1)
      return invalid("overrides.%s is %d; it must be Choice::kAuto (-1), kOff (0) or kOn (1)",
                     f.name, v);
  }
  for (const CountField& f : kCountFields)
    if (o.*f.member < 0)
      return invalid("overrides.%s is %d; it must be >= 0 (0: the library's choice)", f.name,
                     o.*f.member);
  return Status::success();
}

}  // namespace fa4::detail
