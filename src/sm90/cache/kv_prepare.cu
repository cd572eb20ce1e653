// The KV cache's prepare kernel (kv_prepare.cuh): checks, appends, rotated queries.
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "sm90/cache/kv_prepare.cuh"
#include "sm90/fp8/descales.cuh"
#include "sm90/host/launch.cuh"

namespace fa4::sm90 {
namespace {

constexpr int kThreads = 256;

template <class Element>
__device__ Element* at(RowsView const& v, int64_t batch, int64_t row, int64_t head) {
  return static_cast<Element*>(v.data) + batch * v.batch_stride + row * v.row_stride +
         head * v.head_stride;
}

// Element d of `x` rotated at table row `pos`, in fp32: the pairs (i, i + half), or (2i, 2i + 1)
// interleaved, turn by the angle whose cosine and sine the tables (of type Table) hold; dims past
// rotary_dim are the element itself.
template <class Table, class T>
__device__ float rotate(KvPrepareParams const& p, T const* x, int d, int pos) {
  if (d >= p.rotary_dim) return float(x[d]);
  const int half = p.rotary_dim / 2;
  int i, partner;
  bool first;
  if (p.interleaved) {
    i = d / 2;
    partner = d ^ 1;
    first = (d & 1) == 0;
  } else {
    first = d < half;
    i = first ? d : d - half;
    partner = first ? d + half : d - half;
  }
  const float cs = float(static_cast<Table const*>(p.cos)[pos * p.rotary_row_stride + i]);
  const float sn = float(static_cast<Table const*>(p.sin)[pos * p.rotary_row_stride + i]);
  const float a = float(x[d]), b = float(x[partner]);
  return first ? a * cs - b * sn : b * sn + a * cs;
}

// The storage types of one call: In for the queries and the cache, New for the appended rows
// (16-bit rows of an e4m3 cache are quantised on write: divided by their descale, then rounded to
// e4m3 with saturation), Table for the rotary tables (the output's dtype with e4m3 inputs).
template <class InT, class NewT, class TableT>
struct PrepareTypes {
  using In = InT;
  using New = NewT;
  using Table = TableT;
  static constexpr bool kQuantize = !std::is_same_v<In, New>;
};

// Whether sequence b's entries are consistent (see kv_prepare.cuh); the same answer in every thread.
__device__ bool sequence_ok(KvPrepareParams const& p, CacheSpan const& c, int b, int32_t q_start,
                            int32_t len_q) {
  bool ok = c.row >= 0 && c.row < p.cache_batch && c.cache_len >= 0 &&
            c.cache_len <= p.capacity && c.first >= 0 && c.first <= c.cache_len &&
            c.new_rows >= 0 && c.new_rows <= p.sequences.seqlen_new &&
            c.new_rows <= p.capacity - c.cache_len && len_q >= 0 &&
            len_q <= p.max_q;
  if (p.sequences.cu_seqlens_new != nullptr)
    ok = ok && c.new_start >= 0 && c.new_start <= p.total_new - c.new_rows;
  if (p.cu_seqlens_q != nullptr) ok = ok && q_start >= 0 && q_start <= p.total_q - len_q;
  if (ok && p.rotary_dim > 0) {
    if (c.new_rows > 0) ok = c.end() - 1 < p.rotary_seqlen;
    const int32_t last_q = p.query_positions ? c.cache_len + len_q - 1 : c.cache_len;
    if (len_q > 0) ok = ok && last_q < p.rotary_seqlen;
  }
  if (!ok || p.page_table == nullptr) return __syncthreads_and(ok);
  // Every page the call reads (from the left pad) or writes (the append).
  const int32_t* table = p.page_table + int64_t(c.row) * p.table_stride;
  const int32_t first_page = c.first / p.page_size;
  const int32_t end_page = (c.end() + p.page_size - 1) / p.page_size;
  for (int32_t i = first_page + int(threadIdx.x); i < end_page; i += kThreads) {
    const int32_t page = table[i];
    ok = ok && page >= 0 && page < p.num_pages;
  }
  return __syncthreads_and(ok);
}

template <class Types>
__global__ void __launch_bounds__(kThreads) kv_prepare(KvPrepareParams p, int chunks) {
  using In = typename Types::In;
  using New = typename Types::New;
  using Table = typename Types::Table;
  // The attention may start its prologue now; it reads nothing of this kernel's before its wait.
  cutlass::arch::launch_dependent_grids();
  const int b = int(blockIdx.x) / chunks;
  const int first_row = int(blockIdx.x) % chunks * kPrepareRows;
  const CacheSpan c = cache_span(p.sequences, p.seqused_k, p.capacity, b);
  int32_t q_start = 0, len_q = p.max_q;
  if (p.cu_seqlens_q != nullptr) {
    q_start = p.cu_seqlens_q[b];
    len_q = p.cu_seqlens_q[b + 1] - q_start;
  }
  const bool ok = sequence_ok(p, c, b, q_start, len_q);
  if (first_row == 0 && threadIdx.x == 0) p.valid[b] = ok ? 1 : 0;
  if (!ok) return;

  // Appended rows [first_row, first_row + kPrepareRows) into the cache, k rotated.
  const int64_t new_batch = p.sequences.cu_seqlens_new != nullptr ? 0 : b;
  const int rows_new = min(kPrepareRows, c.new_rows - first_row);
  const int width = p.dim_qk + p.dim_v;  // a K row then a V row per (row, head)
  for (int e = int(threadIdx.x); e < rows_new * p.heads_kv * width; e += kThreads) {
    const int d = e % width, h = e / width % p.heads_kv, j = first_row + e / width / p.heads_kv;
    const int32_t pos = c.cache_len + j;
    int64_t cache_batch = c.row, cache_row = pos;
    if (p.page_table != nullptr) {
      cache_batch = p.page_table[int64_t(c.row) * p.table_stride + pos / p.page_size];
      cache_row = pos % p.page_size;
    }
    const int64_t src_row = c.new_start + j;
    const bool key = d < p.dim_qk;
    const int col = key ? d : d - p.dim_qk;
    New const* x = at<New>(key ? p.k_new : p.v_new, new_batch, src_row, h);
    In* dst = at<In>(key ? p.k : p.v, cache_batch, cache_row, h) + col;
    if constexpr (!Types::kQuantize) {
      if (!(key && p.rotary_dim > 0)) {
        *dst = x[col];  // as given
        continue;
      }
    }
    const float value = key ? rotate<Table>(p, x, col, pos) : float(x[col]);
    *dst = In(Types::kQuantize ? value / fp8::descale_at(key ? p.k_descale : p.v_descale, b, h)
                               : value);
  }

  // Query rows [first_row, first_row + kPrepareRows), rotated, into the workspace.
  if (p.q_rotated == nullptr) return;
  const int rows_q = min(kPrepareRows, len_q - first_row);
  const int64_t q_base = p.cu_seqlens_q != nullptr ? q_start : int64_t(b) * p.max_q;
  const int64_t q_batch = p.cu_seqlens_q != nullptr ? 0 : b;
  for (int e = int(threadIdx.x); e < rows_q * p.heads_q * p.dim_qk; e += kThreads) {
    const int d = e % p.dim_qk, h = e / p.dim_qk % p.heads_q,
              i = first_row + e / p.dim_qk / p.heads_q;
    const int32_t pos = p.query_positions ? c.cache_len + i : c.cache_len;
    In const* x = at<In>(p.q, q_batch, q_start + i, h);
    static_cast<In*>(p.q_rotated)[((q_base + i) * p.heads_q + h) * p.dim_qk + d] =
        In(rotate<Table>(p, x, d, pos));
  }
}

// Calls fn(PrepareTypes<...>{}) for the problem's storage types.
template <class Fn>
cudaError_t visit_prepare_types(const Problem& p, Fn&& fn) {
  using bf16 = cutlass::bfloat16_t;
  using fp16 = cutlass::half_t;
  using e4m3 = cutlass::float_e4m3_t;
  if (p.dtype == DType::kFP16) return fn(PrepareTypes<fp16, fp16, fp16>{});
  if (p.dtype != DType::kE4M3) return fn(PrepareTypes<bf16, bf16, bf16>{});
  const bool fp16_out = p.fp8.out_dtype == DType::kFP16;
  if (p.fp8.quantize_appends)
    return fp16_out ? fn(PrepareTypes<e4m3, fp16, fp16>{}) : fn(PrepareTypes<e4m3, bf16, bf16>{});
  return fp16_out ? fn(PrepareTypes<e4m3, e4m3, fp16>{}) : fn(PrepareTypes<e4m3, e4m3, bf16>{});
}

}  // namespace

cudaError_t launch_kv_prepare(KvPrepareParams const& params, const Problem& p, void* stream) {
  if (params.batch == 0) return cudaSuccess;
  // seqlen_new bounds each sequence's appended rows (varlen appends too), max_q its queries.
  const int32_t rows = max(max(params.sequences.seqlen_new, params.max_q), 1);
  const int chunks = (rows + kPrepareRows - 1) / kPrepareRows;
  const dim3 grid{unsigned(int64_t(chunks) * params.batch)}, block{unsigned(kThreads)};
  return visit_prepare_types(p, [&](auto types) {
    return launch_kernel(kv_prepare<decltype(types)>, grid, block, 0, stream, params, chunks);
  });
}

}  // namespace fa4::sm90
