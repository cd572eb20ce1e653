// The CPU backward pass, deterministic by construction: every output element is owned by exactly
// one task and summed in a fixed order, so there are no atomics and no reductions across threads.
//   preprocess  D = rowsum(dO ∘ O) per query row, into the workspace;
//   pass 1      per (batch, query head, query tile): dQ = scale · Σ_keys dS K;
//   pass 2      per (batch, kv head, key tile): dV = Σ Pᵀ dO and dK = scale · Σ dSᵀ Q over the
//               query heads of the group and the query tiles that see the key tile.
// Both passes recompute P = exp(S − LSE) from the forward's LSE, and dS = P ∘ (dP − D) with
// dP = dO Vᵀ, times 1 − tanh² when softcap is on. The products are OpenBLAS sgemm calls (the
// transposed ones by its transpose flags), the row operations Highway's.
#include <algorithm>
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

// The query-side inputs of one tile: Q, dO, LSE, D.
struct QueryTile {
  QueryTile(int64_t dim_qk, int64_t dim_v)
      : q(kTileQ * dim_qk), dout(kTileQ * dim_v), lse(kTileQ), d(kTileQ) {}
  std::vector<float> q;     // [kTileQ][dqk]
  std::vector<float> dout;  // [kTileQ][dv]
  std::vector<float> lse, d;

  template <typename T>
  void load(const Problem& p, const BackwardTensors& t, const float* d_all, const SeqSpan& span,
            int64_t head, int64_t q0, int64_t rows) {
    load_rows(element<T>(t.q, q_offset(t.q, span, q0, head)), t.q.seq_stride, rows,
              p.head_dim_qk, q.data());
    load_rows(element<T>(t.dout, q_offset(t.dout, span, q0, head)), t.dout.seq_stride, rows,
              p.head_dim_v, dout.data());
    for (int64_t r = 0; r < rows; ++r) {
      lse[size_t(r)] = t.lse.data[lse_offset(t.lse, span, q0 + r, head)];
      d[size_t(r)] = d_all[d_offset(p, span, q0 + r, head)];
    }
  }
};

// Scores, probabilities, dP and dS of one (query tile × key tile) block, [kTileQ][kTileK].
struct ScoreTile {
  ScoreTile() : s(kTileQ * kTileK), dp(kTileQ * kTileK), dcap(kTileK) {}
  std::vector<float> s;     // dot products, then P
  std::vector<float> dp;    // dO·v, then dS
  std::vector<float> dcap;  // one row's 1 − tanh² (softcap)
};

// The block of query rows [q0, q0 + rows) × keys [k0, k0 + cols) of query tile qt, its dot products
// in b.s and dO·v in b.dp: P replaces the dot products and dS = P ∘ (dP − D) [∘ (1 − tanh²)]
// replaces dP. Masked keys and rows that saw no key in the forward (LSE = +inf) get P = dS = 0.
void probabilities_and_grads(const ScoreMod& sm, const BandMask& mask, const QueryTile& qt,
                             int64_t q0, int64_t rows, int64_t k0, int64_t cols, ScoreTile& b) {
  const bool whole = fully_visible(mask, q0, rows, k0, cols);
  float* dcap = sm.cap > 0.0f ? b.dcap.data() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = b.s.data() + r * kTileK;
    float* dp = b.dp.data() + r * kTileK;
    const float lse = qt.lse[size_t(r)];
    if (lse == kInf) {
      std::fill(s, s + cols, 0.0f);
      std::fill(dp, dp + cols, 0.0f);
      continue;
    }
    sm.apply(s, cols, dcap);
    if (!whole) mask_row(mask, q0 + r, k0, s, cols);
    vec::exp_sum(s, cols, lse);
    vec::score_grad(s, dp, qt.d[size_t(r)], dcap, dp, cols);
  }
}

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
// Pass 1: dQ of one query tile, over the key tiles it sees.

struct Pass1Scratch {
  Pass1Scratch(int64_t dim_qk, int64_t dim_v)
      : query(dim_qk, dim_v), k(kTileK * dim_qk), v(kTileK * dim_v), dq(kTileQ * dim_qk),
        o_row(dim_v), dout_row(dim_v) {}
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

  qt.load<T>(p, t, d_all, span, task.head, q0, rows);
  std::fill(w.dq.begin(), w.dq.end(), 0.0f);

  for_each_key_tile(mask, q0, rows, [&](int64_t k0, int64_t cols) {
    const Rows k = fp32_rows(element<T>(t.k, k_offset(t.k, span, k0, kv_head)), t.k.seq_stride,
                             cols, dqk, w.k.data());
    const Rows v = fp32_rows(element<T>(t.v, k_offset(t.v, span, k0, kv_head)), t.v.seq_stride,
                             cols, dv, w.v.data());
    // S = Q Kᵀ and dP = dO Vᵀ
    gemm(false, true, rows, cols, dqk, qt.q.data(), dqk, k.data, k.ld, 0.0f, w.block.s.data(),
         kTileK);
    gemm(false, true, rows, cols, dv, qt.dout.data(), dv, v.data, v.ld, 0.0f,
         w.block.dp.data(), kTileK);
    probabilities_and_grads(sm, mask, qt, q0, rows, k0, cols, w.block);
    // dQ += dS K
    gemm(false, false, rows, dqk, cols, w.block.dp.data(), kTileK, k.data, k.ld, 1.0f,
         w.dq.data(), dqk);
  });

  store_rows(w.dq.data(), rows, dqk, sm.scale,
             static_cast<T*>(t.dq.data) + q_offset(t.dq, span, q0, task.head), t.dq.seq_stride);
}

// ---------------------------------------------------------------------------------------------
// Pass 2: dK and dV of one key tile, over the query heads of its group and the query tiles that
// see it.

struct Pass2Scratch {
  Pass2Scratch(int64_t dim_qk, int64_t dim_v)
      : query(dim_qk, dim_v), k(kTileK * dim_qk), v(kTileK * dim_v), dk(kTileK * dim_qk),
        dv(kTileK * dim_v) {}
  QueryTile query;
  ScoreTile block;
  std::vector<float> k;   // [kTileK][dqk]: converted keys (fp32 keys are read in place)
  std::vector<float> v;   // [kTileK][dv]
  std::vector<float> dk;  // [kTileK][dqk]
  std::vector<float> dv;  // [kTileK][dv]
};

// The key count of sequence b before seqused_k shortens it: dK / dV rows up to here are written.
int64_t stored_keys(const Problem& p, int64_t b) {
  return p.is_varlen() ? int64_t(p.varlen.cu_seqlens_k[b + 1]) - p.varlen.cu_seqlens_k[b]
                       : p.seqlen_k;
}

template <typename T>
void dkdv_task(const Problem& p, const BackwardTensors& t, const ScoreMod& sm, const float* d_all,
               const Task& task, Pass2Scratch& w) {
  const SeqSpan span = seq_span(p, task.batch);
  const BandMask mask = band_mask(p, span);
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t k0 = task.row0;
  // The tile's rows in the tensor, and how many of them are used keys; the others (at or beyond
  // seqused_k) keep zero gradients.
  const int64_t tile_rows = std::min(kTileK, stored_keys(p, task.batch) - k0);
  const int64_t keys = std::clamp<int64_t>(span.seqlen_k - k0, 0, tile_rows);
  QueryTile& qt = w.query;

  std::fill(w.dk.begin(), w.dk.end(), 0.0f);
  std::fill(w.dv.begin(), w.dv.end(), 0.0f);
  if (keys > 0) {
    const Rows k = fp32_rows(element<T>(t.k, k_offset(t.k, span, k0, task.head)),
                             t.k.seq_stride, keys, dqk, w.k.data());
    const Rows v = fp32_rows(element<T>(t.v, k_offset(t.v, span, k0, task.head)),
                             t.v.seq_stride, keys, dv, w.v.data());
    for (int64_t h = task.head * group; h < (task.head + 1) * group; ++h) {
      for (int64_t q0 = 0; q0 < span.seqlen_q; q0 += kTileQ) {
        const int64_t rows = std::min(kTileQ, span.seqlen_q - q0);
        const KeyRange seen = visible_keys(mask, q0, rows);
        if (std::max(seen.begin, k0) >= std::min(seen.end, k0 + keys)) continue;
        qt.load<T>(p, t, d_all, span, h, q0, rows);
        // S = Q Kᵀ and dP = dO Vᵀ, then P and dS
        gemm(false, true, rows, keys, dqk, qt.q.data(), dqk, k.data, k.ld, 0.0f,
             w.block.s.data(), kTileK);
        gemm(false, true, rows, keys, dv, qt.dout.data(), dv, v.data, v.ld, 0.0f,
             w.block.dp.data(), kTileK);
        probabilities_and_grads(sm, mask, qt, q0, rows, k0, keys, w.block);
        // dV += Pᵀ dO and dK += dSᵀ Q (scale applied at the store)
        gemm(true, false, keys, dv, rows, w.block.s.data(), kTileK, qt.dout.data(), dv, 1.0f,
             w.dv.data(), dv);
        gemm(true, false, keys, dqk, rows, w.block.dp.data(), kTileK, qt.q.data(), dqk, 1.0f,
             w.dk.data(), dqk);
      }
    }
  }

  store_rows(w.dk.data(), tile_rows, dqk, sm.scale,
             static_cast<T*>(t.dk.data) + k_offset(t.dk, span, k0, task.head), t.dk.seq_stride);
  store_rows(w.dv.data(), tile_rows, dv, 1.0f,
             static_cast<T*>(t.dv.data) + k_offset(t.dv, span, k0, task.head), t.dv.seq_stride);
}

}  // namespace

size_t workspace_size(const Problem& problem, Pass pass) {
  if (pass != Pass::kBackward) return 0;
  const int64_t rows = problem.is_varlen() ? problem.varlen.total_q
                                           : problem.batch * problem.seqlen_q;
  return size_t(rows) * size_t(problem.heads_q) * sizeof(float);
}

Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                int threads) {
  const Problem& p = problem;
  const ScoreMod sm = ScoreMod::of(p);
  float* d_all = static_cast<float*>(workspace.data);
  const auto queries = [&](int64_t b) { return seq_span(p, b).seqlen_q; };
  const auto keys = [&](int64_t b) { return stored_keys(p, b); };
  const std::vector<Task> q_tasks = make_tasks(p, p.heads_q, kTileQ, queries);
  const std::vector<Task> k_tasks = make_tasks(p, p.heads_kv, kTileK, keys);

  std::vector<Pass1Scratch> pass1 = make_scratch<Pass1Scratch>(q_tasks, p, threads);
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
      dkdv_task<T>(p, tensors, sm, d_all, task, w);
    });
  });
  return Status::success();
}

}  // namespace fa4::cpu
