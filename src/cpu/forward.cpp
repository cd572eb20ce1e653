// The CPU forward pass: tiled attention with an online softmax, the algorithm the GPU kernels
// implement. One task owns a tile of query rows of one (batch, head) and walks the key tiles its
// mask leaves visible, keeping per row a running max m, a running sum l and an fp32 accumulator
// that is rescaled whenever m grows. The tile products (S = Q Kᵀ, acc += P V) are OpenBLAS sgemm
// calls, the softmax's row operations Highway's vectorised ones; everything accumulates in fp32 and
// the output is rounded to the dtype once. e4m3 inputs are read through a table of their 256
// values; their descales join the score scale and the output's final scaling, and P stays fp32.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "common/rotary.hpp"
#include "common/seq_layout.hpp"
#include "cpu/blas.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/tiles.hpp"
#include "cpu/vec.hpp"

namespace fa4::cpu {

namespace {

// The storage types of a problem's tensors: In for Q, K, V (and the cache), Out for O, New for the
// appended rows, Table for the rotary tables. One type for all but with e4m3 inputs, whose output
// and tables are 16-bit, and whose appended rows are e4m3 or, quantised on write, 16-bit.
template <typename InT, typename OutT, typename NewT>
struct Storage {
  using In = InT;
  using Out = OutT;
  using New = NewT;
  using Table = std::conditional_t<std::is_same_v<InT, e4m3_t>, OutT, InT>;
  static constexpr bool kFp8 = std::is_same_v<InT, e4m3_t>;
};

// Calls fn(Storage<...>{}) for the problem's types.
template <typename Fn>
void visit_storage(const Problem& p, Fn&& fn) {
  if (p.dtype != DType::kE4M3) {
    visit_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      fn(Storage<T, T, T>{});
    });
    return;
  }
  const auto with_out = [&](auto out_tag) {
    using O = decltype(out_tag);
    if (p.fp8.quantize_appends) {
      fn(Storage<e4m3_t, O, O>{});
    } else {
      fn(Storage<e4m3_t, O, e4m3_t>{});
    }
  };
  if (p.fp8.out_dtype == DType::kFP16) {
    with_out(fp16_t{});
  } else {
    with_out(bf16_t{});
  }
}

// The descale of batch entry b, kv head h (1 without one).
float descale(const DescaleView& d, int64_t b, int64_t h) {
  return d.data != nullptr ? d.data[b * d.batch_stride + h * d.head_stride] : 1.0f;
}

// Query tiles per task: they share each key tile the task converts to fp32 (bf16 and fp16 inputs,
// the KV cache), so that a key tile is converted once per four query tiles.
constexpr int64_t kTilesPerTask = 4;

// One query tile's state. The scores are held transposed, keys along rows and query rows along
// columns: S^T = K Q^T and acc += (P^T)^T V are then the products OpenBLAS runs fastest on tiles
// this small (no operand packing), Q^T being made once per task; the softmax runs down the
// columns, each query row's max and sum in its own vector lane.
struct QueryState {
  QueryState(int64_t dim_qk, int64_t dim_v)
      : qt(dim_qk * kTileQ), acc(kTileQ * dim_v), m(kTileQ), l(kTileQ) {}
  std::vector<float> qt;   // [dqk][kTileQ]
  std::vector<float> acc;  // [kTileQ][dv]: unnormalised output
  std::vector<float> m;    // running row max (natural units)
  std::vector<float> l;    // running row sum of exp(s - m)
};

// A worker's fp32 tiles.
struct Scratch {
  Scratch(int64_t dim_qk, int64_t dim_v)
      : q(kTileQ * dim_qk), k(kTileK * dim_qk), v(kTileK * dim_v), st(kTileK * kTileQ),
        m_new(kTileQ), sub(kTileQ), rotary(dim_qk),
        tiles(size_t(kTilesPerTask), QueryState(dim_qk, dim_v)) {}
  std::vector<float> q;    // [kTileQ][dqk]: a tile's queries before they are transposed
  std::vector<float> k;    // [kTileK][dqk]: converted keys (fp32 keys of a plain layout are read
  std::vector<float> v;    // [kTileK][dv]    in place, as are their values)
  std::vector<float> st;   // [kTileK][kTileQ]: scores, then probabilities, transposed
  std::vector<float> m_new, sub;  // a step's new max, and what its exponentials subtract
  std::vector<float> rotary;      // a position's cos and sin (KV cache rotary)
  std::vector<QueryState> tiles;
};

// One step of the online softmax for query rows [0, rows) of tile qs: fold the transposed tile
// w.st (cols keys × rows), scores times 1 / `scale` (scale 1: the scores themselves), into
// (m, l, acc), leaving the probabilities exp(s − m_new) in w.st for the P·V product that follows.
// scale > 0.
void online_softmax_step(int64_t rows, int64_t cols, int64_t dv, float scale, Scratch& w,
                         QueryState& qs) {
  std::fill(w.m_new.begin(), w.m_new.begin() + rows, -kInf);
  vec::col_max(w.st.data(), cols, rows, kTileQ, w.m_new.data());
  for (int64_t r = 0; r < rows; ++r) {
    const float tile_max = scale * w.m_new[r];
    const float m_new = std::isnan(tile_max) ? tile_max : std::max(qs.m[r], tile_max);
    // A row without a visible key so far: its column is −inf, whose exp(−inf − 0) is 0 (and
    // exp(−inf − (−inf)) would be NaN); l and acc are still 0.
    w.sub[r] = m_new == -kInf ? 0.0f : m_new;
    if (m_new == -kInf) continue;
    const float alpha = std::exp(qs.m[r] - m_new);  // 0 when m was −inf, 1 when it did not grow
    if (alpha != 1.0f) {
      vec::scale(qs.acc.data() + r * dv, dv, alpha);
      qs.l[r] *= alpha;
    }
    qs.m[r] = m_new;
  }
  vec::col_exp(w.st.data(), cols, rows, kTileQ, scale, w.sub.data(), qs.l.data());
}

// The KV cache's rotary embedding of one row (fp32, in place) at cache position `pos`, from tables
// of storage type Table.
template <typename Table>
void rotate(const Problem& p, const RotaryView& r, int64_t pos, float* x, float* table) {
  const int64_t half = p.kv_cache.rotary_dim / 2;
  const Table* cos = static_cast<const Table*>(r.cos) + pos * r.row_stride;
  const Table* sin = static_cast<const Table*>(r.sin) + pos * r.row_stride;
  for (int64_t i = 0; i < half; ++i) {
    table[i] = to_float(cos[i]);
    table[half + i] = to_float(sin[i]);
  }
  rotate_row(x, p.kv_cache.rotary_dim, table, table + half, p.kv_cache.rotary_interleaved);
}

// A query's rotary position: its own under a causal or window mask (the new tokens attend
// causally, each at its place after the cache), else the cache's end for every query.
int64_t query_position(const Problem& p, const SeqSpan& span, int64_t i) {
  const bool banded = p.causal || p.window.left >= 0 || p.window.right >= 0;
  return span.cache_len + (banded ? i : 0);
}

// The appends of every sequence, before any attention reads the cache: k_new (rotated) and v_new
// written at cache positions cache_len … cache_len + new_rows − 1; with e4m3 caches fed 16-bit
// rows, each element divided by its descale and rounded to e4m3. One thread, in batch order: two
// sequences appending to one cache row or page write in that order.
template <typename S>
void append_to_cache(const Problem& p, const ForwardTensors& t) {
  using In = typename S::In;
  using New = typename S::New;
  constexpr bool kQuantize = !std::is_same_v<In, New>;
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  std::vector<float> row(static_cast<size_t>(std::max(dqk, dv)));
  std::vector<float> table(static_cast<size_t>(p.kv_cache.rotary_dim));
  // Rows in fp32 (rotated keys) stored as the cache's type, scaled by 1 / descale when quantised.
  const auto store = [&](const float* x, int64_t n, float descale_of_row, In* dst) {
    for (int64_t c = 0; c < n; ++c)
      dst[c] = from_float<In>(kQuantize ? x[c] / descale_of_row : x[c]);
  };
  for (int64_t b = 0; b < p.batch; ++b) {
    const SeqSpan span = seq_span(p, b);
    for (int64_t j = 0; j < span.new_rows; ++j) {
      const int64_t pos = span.cache_len + j;
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const New* k_new = element<New>(t.k_new, new_offset(t.k_new, p, span, j, h));
        const New* v_new = element<New>(t.v_new, new_offset(t.v_new, p, span, j, h));
        In* k = static_cast<In*>(t.k.data) + cache_offset(t.k, p, span, pos, h);
        In* v = static_cast<In*>(t.v.data) + cache_offset(t.v, p, span, pos, h);
        if (p.kv_cache.rotary_dim > 0 || kQuantize) {
          load_row(k_new, dqk, row.data());
          if (p.kv_cache.rotary_dim > 0)
            rotate<typename S::Table>(p, t.rotary, pos, row.data(), table.data());
          store(row.data(), dqk, descale(t.k_descale, b, h), k);
        } else if constexpr (!kQuantize) {
          std::copy(k_new, k_new + dqk, k);
        }
        if constexpr (kQuantize) {
          load_row(v_new, dv, row.data());
          store(row.data(), dv, descale(t.v_descale, b, h), v);
        } else {
          std::copy(v_new, v_new + dv, v);
        }
      }
    }
  }
}

// Keys and values [k0, k0 + cols) of kv head `head` as fp32 rows.
template <typename T>
void key_tile(const Problem& p, const ForwardTensors& t, const SeqSpan& span, int64_t head,
              int64_t k0, int64_t cols, Scratch& w, Rows* k, Rows* v) {
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  if (p.kv_cache.enabled()) {
    // Row by row: a tile's keys may span pages.
    for (int64_t j = 0; j < cols; ++j) {
      load_row(element<T>(t.k, key_offset(t.k, p, span, k0 + j, head)), dqk, w.k.data() + j * dqk);
      load_row(element<T>(t.v, key_offset(t.v, p, span, k0 + j, head)), dv, w.v.data() + j * dv);
    }
    *k = {w.k.data(), dqk};
    *v = {w.v.data(), dv};
    return;
  }
  *k = fp32_rows(element<T>(t.k, k_offset(t.k, span, k0, head)), t.k.seq_stride, cols, dqk,
                 w.k.data());
  *v = fp32_rows(element<T>(t.v, k_offset(t.v, span, k0, head)), t.v.seq_stride, cols, dv,
                 w.v.data());
}

template <typename S>
void forward_task(const Problem& p, const ForwardTensors& t, const ScoreMod& problem_mod,
                  const Task& task, Scratch& w) {
  using T = typename S::In;
  const SeqSpan span = seq_span(p, task.batch);
  const BandMask mask = band_mask(p, span);
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int64_t q0 = task.row0;
  const int64_t task_rows = std::min(kTilesPerTask * kTileQ, span.seqlen_q - q0);
  const int64_t n_tiles = (task_rows + kTileQ - 1) / kTileQ;
  const int64_t kv_head = task.head / (p.heads_q / p.heads_kv);
  // e4m3: the descales of Q and K scale the scores, V's the output.
  ScoreMod mod = problem_mod;
  float out_scale = 1.0f;
  if constexpr (S::kFp8) {
    mod.scale *= descale(t.q_descale, task.batch, kv_head) *
                 descale(t.k_descale, task.batch, kv_head);
    out_scale = descale(t.v_descale, task.batch, kv_head);
  }
  const auto tile_rows = [&](int64_t i) { return std::min(kTileQ, task_rows - i * kTileQ); };
  const ScoreStep step = ScoreStep::of(p, mod, mask, task.batch, task.head);
  const Sink sink = sink_of(p, task.head);

  for (int64_t i = 0; i < n_tiles; ++i) {
    const int64_t qi = q0 + i * kTileQ, rows = tile_rows(i);
    QueryState& qs = w.tiles[size_t(i)];
    load_rows(element<T>(t.q, q_offset(t.q, span, qi, task.head)), t.q.seq_stride, rows, dqk,
              w.q.data());
    if (p.kv_cache.rotary_dim > 0)
      for (int64_t r = 0; r < rows; ++r) {
        float* x = w.q.data() + r * dqk;
        rotate<typename S::Table>(p, t.rotary, query_position(p, span, qi + r), x,
                                  w.rotary.data());
        // Rotated e4m3 queries stay e4m3 values.
        if constexpr (S::kFp8)
          for (int64_t c = 0; c < p.kv_cache.rotary_dim; ++c) x[c] = round_to(DType::kE4M3, x[c]);
      }
    transpose(rows, dqk, w.q.data(), dqk, qs.qt.data(), kTileQ);
    std::fill(qs.m.begin(), qs.m.end(), -kInf);
    std::fill(qs.l.begin(), qs.l.end(), 0.0f);
    std::fill(qs.acc.begin(), qs.acc.end(), 0.0f);
  }

  for_each_key_tile(mask, q0, task_rows, [&](int64_t k0, int64_t cols) {
    Rows k, v;
    key_tile<T>(p, t, span, kv_head, k0, cols, w, &k, &v);
    for (int64_t i = 0; i < n_tiles; ++i) {
      const int64_t qi = q0 + i * kTileQ, rows = tile_rows(i);
      const KeyRange seen = visible_keys(mask, qi, rows);
      if (std::max(seen.begin, k0) >= std::min(seen.end, k0 + cols)) continue;
      QueryState& qs = w.tiles[size_t(i)];
      // S^T = K Q^T
      gemm(false, false, cols, rows, dqk, k.data, k.ld, qs.qt.data(), kTileQ, 0.0f, w.st.data(),
           kTileQ);
      // Scores: a linear score's scale goes into the exponentials instead of a pass of its own.
      const bool whole = fully_visible(mask, qi, rows, k0, cols);
      for (int64_t j = 0; j < cols; ++j)
        step.key_row(k0 + j, qi, w.st.data() + j * kTileQ, rows, whole);
      online_softmax_step(rows, cols, dv, step.exp_scale(), w, qs);
      // acc += P V
      gemm(true, false, rows, dv, cols, w.st.data(), kTileQ, v.data, v.ld, 1.0f, qs.acc.data(),
           dv);
    }
  });

  // O = acc / l and LSE = ln Σ exp(S) = m + ln l, the sink joining both; a row that saw no key gets
  // O = 0 and LSE = +inf (the sink's logit with a sink).
  for (int64_t i = 0; i < n_tiles; ++i) {
    const int64_t qi = q0 + i * kTileQ, rows = tile_rows(i);
    const QueryState& qs = w.tiles[size_t(i)];
    using Out = typename S::Out;
    Out* out = static_cast<Out*>(t.out.data) + q_offset(t.out, span, qi, task.head);
    for (int64_t r = 0; r < rows; ++r) {
      float m = qs.m[r], l = qs.l[r];
      const bool saw_keys = m != -kInf;
      // The sink joins the denominator: O's factor exp(m − m') / l' (0 for a row without keys).
      const float alpha = sink.fold(m, l);
      const float o_factor = saw_keys ? alpha / l : 0.0f;
      const float* acc = qs.acc.data() + r * dv;
      for (int64_t c = 0; c < dv; ++c) {
        float o = acc[c] * o_factor;
        if constexpr (S::kFp8) o *= out_scale;
        out[r * t.out.seq_stride + c] = from_float<Out>(o);
      }
      if (p.return_lse)
        t.lse.data[lse_offset(t.lse, span, qi + r, task.head)] =
            m != -kInf ? m + std::log(l) : kInf;
    }
  }
}

}  // namespace

Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace, int threads) {
  const ScoreMod mod = ScoreMod::of(problem);
  const std::vector<Task> tasks = make_tasks(
      problem, problem.heads_q, kTilesPerTask * kTileQ,
      [&](int64_t b) { return seq_span(problem, b).seqlen_q; });
  std::vector<Scratch> scratch = make_scratch<Scratch>(tasks, problem, threads);
  visit_storage(problem, [&](auto storage) {
    using S = decltype(storage);
    if (problem.kv_cache.appends()) append_to_cache<S>(problem, tensors);
    run_tasks(tasks, scratch, [&](const Task& task, Scratch& w) {
      forward_task<S>(problem, tensors, mod, task, w);
    });
  });
  return Status::success();
}

}  // namespace fa4::cpu
