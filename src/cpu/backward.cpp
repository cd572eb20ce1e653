// The CPU backward pass, deterministic by construction: every output element is owned by exactly
// one task and summed in a fixed order, so there are no atomics and no reductions across threads.
//   preprocess  D = rowsum(dO ∘ O) per query row, into the workspace;
// then, when there are at least as many (batch, kv head) pairs as threads, one pass:
//   per (batch, kv head): for each key tile, dV = Σ Pᵀ dO and dK = scale · Σ dSᵀ Q over the query
//   heads of the group and the query tiles that see it, and dQ += dS K into fp32 accumulators in
//   the workspace (the task owns its heads' rows): five products per block;
// else two passes, which keep every thread busy on a single pair at two more products per block:
//   pass 1      per (batch, query head, query tile): dQ = scale · Σ_keys dS K;
//   pass 2      per (batch, kv head, key tile): dV and dK as above.
// Both passes recompute P = exp(S − LSE) from the forward's LSE (a sink's share included), and
// dS = P ∘ (dP − D) with dP = dO Vᵀ, times 1 − tanh² when softcap is on; ALiBi's bias is part of
// S and leaves dS alone. With sinks, dsinks comes from LSE and D at the end. The products are
// OpenBLAS sgemm calls, each pass holding its blocks in the orientation that keeps every product
// untransposed on the right (OpenBLAS's fastest kernels on small tiles); the row and column
// operations are Highway's.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "common/seq_layout.hpp"
#include "cpu/blas.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/tiles.hpp"
#include "cpu/vec.hpp"

namespace fa4::cpu {

namespace {

// dst row r = factor · src[r] rounded to the dtype.
template <typename T>
void store_rows(const float* src, int64_t rows, int64_t dim, float factor, T* dst,
                int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim; ++c)
      dst[r * row_stride + c] = from_float<T>(factor * src[r * dim + c]);
}

// Where D lives in the workspace: (batch, head_q, row), or (head_q, total_q row) in varlen mode.
int64_t d_offset(const Problem& p, const SeqSpan& span, int64_t row, int64_t head) {
  return p.is_varlen() ? head * p.varlen.total_q + span.q_row + row
                       : (span.batch * p.heads_q + head) * p.seqlen_q + row;
}

// The query-side inputs of one tile: Q, dO, LSE, D; pass 1 also Q^T and dO^T.
struct QueryTile {
  QueryTile(int64_t dim_qk, int64_t dim_v, bool transposed)
      : q(kTileQ * dim_qk), dout(kTileQ * dim_v), qt(transposed ? dim_qk * kTileQ : 0),
        doutt(transposed ? dim_v * kTileQ : 0), lse(kTileQ), d(kTileQ) {}
  std::vector<float> q;      // [kTileQ][dqk]
  std::vector<float> dout;   // [kTileQ][dv]
  std::vector<float> qt;     // [dqk][kTileQ]
  std::vector<float> doutt;  // [dv][kTileQ]
  std::vector<float> lse, d;

  template <typename T>
  void load(const Problem& p, const BackwardTensors& t, const float* d_all, const SeqSpan& span,
            int64_t head, int64_t q0, int64_t rows) {
    const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
    load_rows(element<T>(t.q, q_offset(t.q, span, q0, head)), t.q.seq_stride, rows, dqk,
              q.data());
    load_rows(element<T>(t.dout, q_offset(t.dout, span, q0, head)), t.dout.seq_stride, rows, dv,
              dout.data());
    if (!qt.empty()) {
      transpose(rows, dqk, q.data(), dqk, qt.data(), kTileQ);
      transpose(rows, dv, dout.data(), dv, doutt.data(), kTileQ);
    }
    for (int64_t r = 0; r < rows; ++r) {
      lse[size_t(r)] = t.lse.data[lse_offset(t.lse, span, q0 + r, head)];
      d[size_t(r)] = d_all[d_offset(p, span, q0 + r, head)];
    }
  }
};

// Scores, probabilities, dP and dS of one (query tile × key tile) block: [kTileK][kTileQ] in pass
// 1 (transposed: keys along rows), [kTileQ][kTileK] in pass 2. A row whose LSE is +inf (it saw no
// key in the forward) gets P = exp(s − inf) = 0 and so dS = 0, with no test.
struct ScoreTile {
  ScoreTile() : s(kTileQ * kTileK), dp(kTileQ * kTileK), dcap(kTileQ * kTileK) {}
  std::vector<float> s;     // dot products, then P
  std::vector<float> dp;    // dO·v, then dS
  std::vector<float> dcap;  // 1 − tanh² (softcap)
};

// ---------------------------------------------------------------------------------------------
// Preprocess: D = rowsum(dO ∘ O), O as the forward stored it.

template <typename T>
void preprocess_task(const Problem& p, const BackwardTensors& t, float* d_all, const Task& task,
                     float* o, float* dout) {
  const SeqSpan span = seq_span(p, task.batch);
  const int64_t rows = std::min(kTileQ, span.seqlen_q - task.row0);
  const int64_t dv = p.head_dim_v;
  for (int64_t r = 0; r < rows; ++r) {
    load_row(element<T>(t.out, q_offset(t.out, span, task.row0 + r, task.head)), dv, o);
    load_row(element<T>(t.dout, q_offset(t.dout, span, task.row0 + r, task.head)), dv, dout);
    d_all[d_offset(p, span, task.row0 + r, task.head)] = vec::dot(dout, o, dv);
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 1: dQ of one query tile, over the key tiles it sees. Transposed blocks (keys along rows),
// as in the forward: S^T = K Q^T and dP^T = V dO^T from Q^T and dO^T made once per task, P^T and
// dS^T down the columns, dQ += (dS^T)^T K.

struct Pass1Scratch {
  Pass1Scratch(int64_t dim_qk, int64_t dim_v)
      : query(dim_qk, dim_v, /*transposed=*/true), k(kTileK * dim_qk), v(kTileK * dim_v),
        dq(kTileQ * dim_qk), o_row(dim_v), dout_row(dim_v) {}
  QueryTile query;
  ScoreTile block;
  std::vector<float> k;   // [kTileK][dqk]: converted keys (fp32 keys are read in place)
  std::vector<float> v;   // [kTileK][dv]
  std::vector<float> dq;  // [kTileQ][dqk]
  std::vector<float> o_row, dout_row;  // the preprocess's rows
};

template <typename T>
void dq_task(const Problem& p, const BackwardTensors& t, const ScoreMod& sm, const float* d_all,
             const Task& task, Pass1Scratch& w) {
  const SeqSpan span = seq_span(p, task.batch);
  const BandMask mask = band_mask(p, span);
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int64_t q0 = task.row0, rows = std::min(kTileQ, span.seqlen_q - q0);
  const int64_t kv_head = task.head / (p.heads_q / p.heads_kv);
  QueryTile& qt = w.query;
  ScoreTile& b = w.block;
  float* dcap = sm.cap > 0.0f ? b.dcap.data() : nullptr;
  const ScoreStep step = ScoreStep::of(p, sm, mask, task.batch, task.head);

  qt.load<T>(p, t, d_all, span, task.head, q0, rows);
  std::fill(w.dq.begin(), w.dq.end(), 0.0f);

  for_each_key_tile(mask, q0, rows, [&](int64_t k0, int64_t cols) {
    const Rows k = fp32_rows(element<T>(t.k, k_offset(t.k, span, k0, kv_head)), t.k.seq_stride,
                             cols, dqk, w.k.data());
    const Rows v = fp32_rows(element<T>(t.v, k_offset(t.v, span, k0, kv_head)), t.v.seq_stride,
                             cols, dv, w.v.data());
    // S^T = K Q^T and dP^T = V dO^T
    gemm(false, false, cols, rows, dqk, k.data, k.ld, qt.qt.data(), kTileQ, 0.0f, b.s.data(),
         kTileQ);
    gemm(false, false, cols, rows, dv, v.data, v.ld, qt.doutt.data(), kTileQ, 0.0f, b.dp.data(),
         kTileQ);
    // P^T, then dS^T in place of dP^T
    // (A linear score's scale goes into the exponentials instead of a pass of its own.)
    const bool whole = fully_visible(mask, q0, rows, k0, cols);
    for (int64_t j = 0; j < cols; ++j)
      step.key_row(k0 + j, q0, b.s.data() + j * kTileQ, rows, whole,
                   dcap != nullptr ? dcap + j * kTileQ : nullptr);
    vec::col_exp(b.s.data(), cols, rows, kTileQ, step.exp_scale(), qt.lse.data(), nullptr);
    vec::col_score_grad(b.s.data(), b.dp.data(), cols, rows, kTileQ, qt.d.data(), dcap,
                        b.dp.data());
    // dQ += dS K
    gemm(true, false, rows, dqk, cols, b.dp.data(), kTileQ, k.data, k.ld, 1.0f, w.dq.data(),
         dqk);
  });

  store_rows(w.dq.data(), rows, dqk, sm.scale,
             static_cast<T*>(t.dq.data) + q_offset(t.dq, span, q0, task.head), t.dq.seq_stride);
}

// ---------------------------------------------------------------------------------------------
// Pass 2: dK and dV of one key tile, over the query heads of its group and the query tiles that
// see it. Blocks in the forward orientation (queries along rows): S = Q K^T and dP = dO V^T from
// K^T and V^T made once per task, P and dS along the rows, dV += P^T dO and dK += dS^T Q.

struct Pass2Scratch {
  Pass2Scratch(int64_t dim_qk, int64_t dim_v)
      : query(dim_qk, dim_v, /*transposed=*/false), k(kTileK * dim_qk), v(kTileK * dim_v),
        kt(dim_qk * kTileK), vt(dim_v * kTileK), dk(kTileK * dim_qk), dv(kTileK * dim_v) {}
  QueryTile query;
  ScoreTile block;
  std::vector<float> k;   // [kTileK][dqk]: converted keys (fp32 keys are read in place)
  std::vector<float> v;   // [kTileK][dv]
  std::vector<float> kt;  // [dqk][kTileK]
  std::vector<float> vt;  // [dv][kTileK]
  std::vector<float> dk;  // [kTileK][dqk]
  std::vector<float> dv;  // [kTileK][dv]
};

// The key count of sequence b before seqused_k shortens it: dK / dV rows up to here are written.
int64_t stored_keys(const Problem& p, int64_t b) {
  return p.is_varlen() ? int64_t(p.varlen.cu_seqlens_k[b + 1]) - p.varlen.cu_seqlens_k[b]
                       : p.seqlen_k;
}

// dV += P^T dO and dK += dS^T Q (scale applied at the store) for the task's keys [k0, k0 + keys)
// against query rows [q0, q0 + rows) of query head h; with dq (the rows' fp32 dQ accumulator,
// dqk floats apart), also dQ += dS K.
template <typename T>
void dkdv_block(const Problem& p, const BackwardTensors& t, const ScoreMod& sm, const float* d_all,
                const SeqSpan& span, const BandMask& mask, int64_t h, int64_t q0, int64_t rows,
                int64_t k0, int64_t keys, const Rows& k, Pass2Scratch& w, float* dq) {
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  QueryTile& qt = w.query;
  ScoreTile& b = w.block;
  float* dcap = sm.cap > 0.0f ? b.dcap.data() : nullptr;

  qt.load<T>(p, t, d_all, span, h, q0, rows);
  // S = Q K^T and dP = dO V^T
  gemm(false, false, rows, keys, dqk, qt.q.data(), dqk, w.kt.data(), kTileK, 0.0f, b.s.data(),
       kTileK);
  gemm(false, false, rows, keys, dv, qt.dout.data(), dv, w.vt.data(), kTileK, 0.0f, b.dp.data(),
       kTileK);
  // P, then dS in place of dP (a linear score's scale goes into the exponentials)
  const bool whole = fully_visible(mask, q0, rows, k0, keys);
  const ScoreStep step = ScoreStep::of(p, sm, mask, span.index, h);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = b.s.data() + r * kTileK;
    float* row_dcap = dcap != nullptr ? dcap + r * kTileK : nullptr;
    step.query_row(q0 + r, k0, s, keys, whole, row_dcap);
    vec::exp(s, keys, step.exp_scale(), qt.lse[size_t(r)]);
    vec::score_grad(s, b.dp.data() + r * kTileK, qt.d[size_t(r)], row_dcap,
                    b.dp.data() + r * kTileK, keys);
  }
  gemm(true, false, keys, dv, rows, b.s.data(), kTileK, qt.dout.data(), dv, 1.0f, w.dv.data(),
       dv);
  gemm(true, false, keys, dqk, rows, b.dp.data(), kTileK, qt.q.data(), dqk, 1.0f, w.dk.data(),
       dqk);
  if (dq != nullptr)
    gemm(false, false, rows, dqk, keys, b.dp.data(), kTileK, k.data, k.ld, 1.0f, dq, dqk);
}

// Where a query row's fp32 dQ accumulator lives in the one-pass workspace, after D:
// (batch, head_q, row) or (head_q, total_q row) rows of dqk floats.
int64_t dq_acc_offset(const Problem& p, const SeqSpan& span, int64_t row, int64_t head) {
  return d_offset(p, span, row, head) * p.head_dim_qk;
}

// dK and dV of key tile [k0, k0 + kTileK) of the task's kv head, over the query heads of its
// group and the query tiles that see it; with dq_acc (the one pass), dQ too.
template <typename T>
void key_tile_grads(const Problem& p, const BackwardTensors& t, const ScoreMod& sm,
                    const float* d_all, int64_t batch, int64_t kv_head, int64_t k0,
                    Pass2Scratch& w, float* dq_acc) {
  const SeqSpan span = seq_span(p, batch);
  const BandMask mask = band_mask(p, span);
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int64_t group = p.heads_q / p.heads_kv;
  // The tile's rows in the tensor, and how many of them are used keys; the others (at or beyond
  // seqused_k) keep zero gradients.
  const int64_t tile_rows = std::min(kTileK, stored_keys(p, batch) - k0);
  const int64_t keys = std::clamp<int64_t>(span.seqlen_k - k0, 0, tile_rows);

  std::fill(w.dk.begin(), w.dk.end(), 0.0f);
  std::fill(w.dv.begin(), w.dv.end(), 0.0f);
  if (keys > 0) {
    const Rows k = fp32_rows(element<T>(t.k, k_offset(t.k, span, k0, kv_head)),
                             t.k.seq_stride, keys, dqk, w.k.data());
    const Rows v = fp32_rows(element<T>(t.v, k_offset(t.v, span, k0, kv_head)),
                             t.v.seq_stride, keys, dv, w.v.data());
    transpose(keys, dqk, k.data, k.ld, w.kt.data(), kTileK);
    transpose(keys, dv, v.data, v.ld, w.vt.data(), kTileK);
    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      for (int64_t q0 = 0; q0 < span.seqlen_q; q0 += kTileQ) {
        const int64_t rows = std::min(kTileQ, span.seqlen_q - q0);
        const KeyRange seen = visible_keys(mask, q0, rows);
        if (std::max(seen.begin, k0) >= std::min(seen.end, k0 + keys)) continue;
        float* dq = dq_acc != nullptr ? dq_acc + dq_acc_offset(p, span, q0, h) : nullptr;
        dkdv_block<T>(p, t, sm, d_all, span, mask, h, q0, rows, k0, keys, k, w, dq);
      }
    }
  }

  store_rows(w.dk.data(), tile_rows, dqk, sm.scale,
             static_cast<T*>(t.dk.data) + k_offset(t.dk, span, k0, kv_head), t.dk.seq_stride);
  store_rows(w.dv.data(), tile_rows, dv, 1.0f,
             static_cast<T*>(t.dv.data) + k_offset(t.dv, span, k0, kv_head), t.dv.seq_stride);
}

// The one pass's task: every key tile of (batch, kv head), then the group's dQ from its
// accumulators.
template <typename T>
void one_pass_task(const Problem& p, const BackwardTensors& t, const ScoreMod& sm,
                   const float* d_all, float* dq_acc, int64_t batch, int64_t kv_head,
                   Pass2Scratch& w) {
  const SeqSpan span = seq_span(p, batch);
  const int64_t dqk = p.head_dim_qk;
  const int64_t group = p.heads_q / p.heads_kv;
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    float* acc = dq_acc + dq_acc_offset(p, span, 0, h);
    std::fill(acc, acc + span.seqlen_q * dqk, 0.0f);
  }
  for (int64_t k0 = 0; k0 < stored_keys(p, batch); k0 += kTileK)
    key_tile_grads<T>(p, t, sm, d_all, batch, kv_head, k0, w, dq_acc);
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h)
    store_rows(dq_acc + dq_acc_offset(p, span, 0, h), span.seqlen_q, dqk, sm.scale,
               static_cast<T*>(t.dq.data) + q_offset(t.dq, span, 0, h), t.dq.seq_stride);
}

// One pass over (batch, kv head) pairs when there are at least as many of them as threads.
bool one_pass(const Problem& p, int threads) {
  return p.batch * p.heads_kv >= thread_count(threads);
}

// Query rows of D (and of the one pass's dQ accumulators) per query head.
int64_t query_rows(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
}

// dsinks[h] = −Σ over the rows of every sequence of exp(sinks[h] − LSE) · D: the sink's share of
// each row's softmax times D = rowsum(dO ∘ O) (a row that saw no key has O = 0, so D = 0). In
// row order, one head at a time: the same bits on any thread count.
void sink_grads(const Problem& p, const BackwardTensors& t, const float* d_all) {
  for (int64_t h = 0; h < p.heads_q; ++h) {
    double sum = 0.0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqSpan span = seq_span(p, b);
      for (int64_t i = 0; i < span.seqlen_q; ++i) {
        const float lse = t.lse.data[lse_offset(t.lse, span, i, h)];
        sum += double(std::exp(p.sinks[h] - lse)) * double(d_all[d_offset(p, span, i, h)]);
      }
    }
    t.dsinks[h] = float(-sum);
  }
}

}  // namespace

size_t workspace_size(const Problem& problem, Pass pass, int threads) {
  if (pass != Pass::kBackward) return 0;
  const size_t d = size_t(query_rows(problem)) * size_t(problem.heads_q);
  const size_t dq = one_pass(problem, threads) ? d * size_t(problem.head_dim_qk) : 0;
  return (d + dq) * sizeof(float);
}

Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                int threads) {
  const Problem& p = problem;
  const ScoreMod sm = ScoreMod::of(p);
  float* d_all = static_cast<float*>(workspace.data);
  const auto queries = [&](int64_t b) { return seq_span(p, b).seqlen_q; };
  const auto keys = [&](int64_t b) { return stored_keys(p, b); };
  const std::vector<Task> q_tasks = make_tasks(p, p.heads_q, kTileQ, queries);
  std::vector<Pass1Scratch> pass1 = make_scratch<Pass1Scratch>(q_tasks, p, threads);

  if (one_pass(p, threads)) {
    float* dq_acc = d_all + query_rows(p) * p.heads_q;
    // One task per (batch, kv head): row0 is unused.
    std::vector<Task> pairs;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.heads_kv; ++h) pairs.push_back({b, h, 0});
    std::vector<Pass2Scratch> scratch = make_scratch<Pass2Scratch>(pairs, p, threads);
    visit_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      run_tasks(q_tasks, pass1, [&](const Task& task, Pass1Scratch& w) {
        preprocess_task<T>(p, tensors, d_all, task, w.o_row.data(), w.dout_row.data());
      });
      run_tasks(pairs, scratch, [&](const Task& task, Pass2Scratch& w) {
        one_pass_task<T>(p, tensors, sm, d_all, dq_acc, task.batch, task.head, w);
      });
    });
    if (p.sinks != nullptr && tensors.dsinks != nullptr) sink_grads(p, tensors, d_all);
    return Status::success();
  }

  const std::vector<Task> k_tasks = make_tasks(p, p.heads_kv, kTileK, keys);
  std::vector<Pass2Scratch> pass2 = make_scratch<Pass2Scratch>(k_tasks, p, threads);
  visit_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    run_tasks(q_tasks, pass1, [&](const Task& task, Pass1Scratch& w) {
      preprocess_task<T>(p, tensors, d_all, task, w.o_row.data(), w.dout_row.data());
    });
    run_tasks(q_tasks, pass1, [&](const Task& task, Pass1Scratch& w) {
      dq_task<T>(p, tensors, sm, d_all, task, w);
    });
    run_tasks(k_tasks, pass2, [&](const Task& task, Pass2Scratch& w) {
      key_tile_grads<T>(p, tensors, sm, d_all, task.batch, task.head, task.row0, w, nullptr);
    });
  });
  if (p.sinks != nullptr && tensors.dsinks != nullptr) sink_grads(p, tensors, d_all);
  return Status::success();
}

}  // namespace fa4::cpu
