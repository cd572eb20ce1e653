// The CPU backward pass, deterministic by construction: every output element is owned by exactly
// one task and summed in a fixed order, so there are no atomics and no reductions across threads.
//   preprocess  D = rowsum(dO ∘ O) per query row, into the workspace;
//   pass 1      per (batch, query head, query tile): dQ = scale · Σ_keys dS K;
//   pass 2      per (batch, kv head, key tile): dV = Σ Pᵀ dO and dK = scale · Σ dSᵀ Q over the
//               query heads of the group and the query tiles that see the key tile.
// Both passes recompute P = exp2(S·log2e − LSE·log2e) from the forward's LSE, and
// dS = P ∘ (dP − D) with dP = dO Vᵀ, times 1 − tanh² when softcap is on.
#include <algorithm>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "common/seq_layout.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/tiles.hpp"

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

// The query-side inputs of one tile: Q, dO, LSE in log2 units, D.
struct QueryTile {
  QueryTile(int64_t dim_qk, int64_t dim_v)
      : q(kTileQ * dim_qk), qt(dim_qk * kTileQ), dout(kTileQ * dim_v), doutt(dim_v * kTileQ),
        lse_log2(kTileQ), d(kTileQ) {}
  std::vector<float> q;      // [kTileQ][dqk]
  std::vector<float> qt;     // [dqk][kTileQ]  (pass 2 only)
  std::vector<float> dout;   // [kTileQ][dv]
  std::vector<float> doutt;  // [dv][kTileQ]   (pass 2 only)
  std::vector<float> lse_log2, d;

  template <typename T>
  void load(const Problem& p, const BackwardTensors& t, const float* d_all, const SeqSpan& span,
            int64_t head, int64_t q0, int64_t rows, bool transposed_too) {
    const T* qsrc = element<T>(t.q, q_offset(t.q, span, q0, head));
    const T* dosrc = element<T>(t.dout, q_offset(t.dout, span, q0, head));
    load_rows(qsrc, t.q.seq_stride, rows, p.head_dim_qk, q.data());
    load_rows(dosrc, t.dout.seq_stride, rows, p.head_dim_v, dout.data());
    if (transposed_too) {
      load_rows_transposed(qsrc, t.q.seq_stride, rows, p.head_dim_qk, qt.data(), kTileQ);
      load_rows_transposed(dosrc, t.dout.seq_stride, rows, p.head_dim_v, doutt.data(), kTileQ);
    }
    for (int64_t r = 0; r < rows; ++r) {
      lse_log2[size_t(r)] = t.lse.data[lse_offset(t.lse, span, q0 + r, head)] * kLog2e;
      d[size_t(r)] = d_all[d_offset(p, span, q0 + r, head)];
    }
  }
};

// Scores, probabilities, dP and dS of one (query tile × key tile) block, in whichever orientation
// the pass multiplies with: [kTileQ][kTileK] in pass 1, transposed in pass 2.
struct ScoreTile {
  ScoreTile() : s(kTileQ * kTileK), dp(kTileQ * kTileK) {}
  std::vector<float> s;   // dot products, then dS in pass 1, P in pass 2
  std::vector<float> dp;  // dO·v, then dS in pass 2

  // The products accumulate into the tile, so each block starts from zero.
  void clear() {
    std::fill(s.begin(), s.end(), 0.0f);
    std::fill(dp.begin(), dp.end(), 0.0f);
  }
};

// Does every row of [q0, q0 + rows) see every key of [k0, k0 + cols)? Then no element needs a test.
bool fully_visible(const BandMask& mask, int64_t q0, int64_t rows, int64_t k0, int64_t cols) {
  return mask.key_begin(q0 + rows - 1) <= k0 && mask.key_end(q0) >= k0 + cols;
}

// P and dS = P ∘ (dP − D) [∘ (1 − tanh²)] of one element of a block, the same in both passes
// whatever their orientation. `seen` is false for a masked key and for a row that saw no key in
// the forward (LSE = +inf); such elements get P = dS = 0.
struct ProbGrad {
  float p, ds;
};
ProbGrad p_and_ds(const ScoreMod& sm, bool seen, float dot, float dp, float lse_log2, float d) {
  float dcap = 1.0f;  // stays 1 without softcap, and x · 1 = x exactly
  const float prob = seen ? sm.probability(dot, lse_log2, &dcap) : 0.0f;
  return {prob, prob == 0.0f ? 0.0f : prob * (dp - d) * dcap};
}

// ---------------------------------------------------------------------------------------------
// Preprocess: D = rowsum(dO ∘ O), O as the forward stored it.

template <typename T>
void preprocess_task(const Problem& p, const BackwardTensors& t, float* d_all, const Task& task) {
  const SeqSpan span = seq_span(p, task.batch);
  const int64_t rows = std::min(kTileQ, span.seqlen_q - task.row0);
  for (int64_t r = 0; r < rows; ++r) {
    const T* o = element<T>(t.out, q_offset(t.out, span, task.row0 + r, task.head));
    const T* dout = element<T>(t.dout, q_offset(t.dout, span, task.row0 + r, task.head));
    float sum = 0.0f;
    for (int64_t c = 0; c < p.head_dim_v; ++c) sum += to_float(dout[c]) * to_float(o[c]);
    d_all[d_offset(p, span, task.row0 + r, task.head)] = sum;
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 1: dQ of one query tile, over the key tiles it sees.

struct Pass1Scratch {
  Pass1Scratch(int64_t dim_qk, int64_t dim_v)
      : query(dim_qk, dim_v), k(kTileK * dim_qk), kt(dim_qk * kTileK), vt(dim_v * kTileK),
        dq(kTileQ * dim_qk) {}
  QueryTile query;
  ScoreTile block;
  std::vector<float> k;   // [kTileK][dqk]
  std::vector<float> kt;  // [dqk][kTileK]
  std::vector<float> vt;  // [dv][kTileK]
  std::vector<float> dq;  // [kTileQ][dqk]
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
  float* s = w.block.s.data();
  float* dp = w.block.dp.data();

  qt.load<T>(p, t, d_all, span, task.head, q0, rows, /*transposed_too=*/false);
  std::fill(w.dq.begin(), w.dq.end(), 0.0f);

  for_each_key_tile(mask, q0, rows, [&](int64_t k0, int64_t cols) {
    const T* ksrc = element<T>(t.k, k_offset(t.k, span, k0, kv_head));
    load_rows(ksrc, t.k.seq_stride, cols, dqk, w.k.data());
    load_rows_transposed(ksrc, t.k.seq_stride, cols, dqk, w.kt.data(), kTileK);
    load_rows_transposed(element<T>(t.v, k_offset(t.v, span, k0, kv_head)), t.v.seq_stride, cols,
                         dv, w.vt.data(), kTileK);

    // S = Q Kᵀ and dP = dO Vᵀ
    w.block.clear();
    gemm_acc(qt.q.data(), dqk, w.kt.data(), kTileK, s, kTileK, rows, cols, dqk);
    gemm_acc(qt.dout.data(), dv, w.vt.data(), kTileK, dp, kTileK, rows, cols, dv);

    // dS replaces S
    const bool whole = fully_visible(mask, q0, rows, k0, cols);
    for (int64_t r = 0; r < rows; ++r) {
      const float lse = qt.lse_log2[size_t(r)];
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t e = r * kTileK + j;
        const bool seen = lse != kInf && (whole || mask.visible(q0 + r, k0 + j));
        s[e] = p_and_ds(sm, seen, s[e], dp[e], lse, qt.d[size_t(r)]).ds;
      }
    }

    // dQ += dS K
    gemm_acc(s, kTileK, w.k.data(), dqk, w.dq.data(), dqk, rows, dqk, cols);
  });

  store_rows(w.dq.data(), rows, dqk, sm.scale,
             static_cast<T*>(t.dq.data) + q_offset(t.dq, span, q0, task.head), t.dq.seq_stride);
}

// ---------------------------------------------------------------------------------------------
// Pass 2: dK and dV of one key tile, over the query heads of its group and the query tiles that
// see it. Works in the transposed orientation (keys along rows) so that dV += Pᵀ dO and
// dK += dSᵀ Q are row updates like every other product.

struct Pass2Scratch {
  Pass2Scratch(int64_t dim_qk, int64_t dim_v)
      : query(dim_qk, dim_v), k(kTileK * dim_qk), v(kTileK * dim_v), dk(kTileK * dim_qk),
        dv(kTileK * dim_v) {}
  QueryTile query;
  ScoreTile block;
  std::vector<float> k;   // [kTileK][dqk]
  std::vector<float> v;   // [kTileK][dv]
  std::vector<float> dk;  // [kTileK][dqk]
  std::vector<float> dv;  // [kTileK][dv]
};

// The key count of sequence b before seqused_k shortens it: dK / dV rows up to here are written.
int64_t stored_keys(const Problem& p, int64_t b) {
  return p.is_varlen() ? int64_t(p.varlen.cu_seqlens_k[b + 1]) - p.varlen.cu_seqlens_k[b]
                       : p.seqlen_k;
}

// dV += Pᵀ dO and dK += dSᵀ Q (scale applied at the store) for key rows [k0, k0 + keys), loaded
// in w.k / w.v, against query rows [q0, q0 + rows) of query head h.
template <typename T>
void dkdv_block(const Problem& p, const BackwardTensors& t, const ScoreMod& sm, const float* d_all,
                const SeqSpan& span, const BandMask& mask, int64_t h, int64_t q0, int64_t rows,
                int64_t k0, int64_t keys, Pass2Scratch& w) {
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  QueryTile& qt = w.query;
  float* s = w.block.s.data();
  float* dp = w.block.dp.data();

  qt.load<T>(p, t, d_all, span, h, q0, rows, /*transposed_too=*/true);

  // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
  w.block.clear();
  gemm_acc(w.k.data(), dqk, qt.qt.data(), kTileQ, s, kTileQ, keys, rows, dqk);
  gemm_acc(w.v.data(), dv, qt.doutt.data(), kTileQ, dp, kTileQ, keys, rows, dv);

  // Pᵀ replaces Sᵀ (dV needs it), dSᵀ replaces dPᵀ
  const bool whole = fully_visible(mask, q0, rows, k0, keys);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t e = j * kTileQ + r;
      const float lse = qt.lse_log2[size_t(r)];
      const bool seen = lse != kInf && (whole || mask.visible(q0 + r, k0 + j));
      const ProbGrad g = p_and_ds(sm, seen, s[e], dp[e], lse, qt.d[size_t(r)]);
      s[e] = g.p;
      dp[e] = g.ds;
    }
  }

  gemm_acc(s, kTileQ, qt.dout.data(), dv, w.dv.data(), dv, keys, dv, rows);
  gemm_acc(dp, kTileQ, qt.q.data(), dqk, w.dk.data(), dqk, keys, dqk, rows);
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

  std::fill(w.dk.begin(), w.dk.end(), 0.0f);
  std::fill(w.dv.begin(), w.dv.end(), 0.0f);
  if (keys > 0) {
    load_rows(element<T>(t.k, k_offset(t.k, span, k0, task.head)), t.k.seq_stride, keys, dqk,
              w.k.data());
    load_rows(element<T>(t.v, k_offset(t.v, span, k0, task.head)), t.v.seq_stride, keys, dv,
              w.v.data());
    for (int64_t h = task.head * group; h < (task.head + 1) * group; ++h) {
      for (int64_t q0 = 0; q0 < span.seqlen_q; q0 += kTileQ) {
        const int64_t rows = std::min(kTileQ, span.seqlen_q - q0);
        const KeyRange seen = visible_keys(mask, q0, rows);
        if (std::max(seen.begin, k0) < std::min(seen.end, k0 + keys))
          dkdv_block<T>(p, t, sm, d_all, span, mask, h, q0, rows, k0, keys, w);
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
    run_tasks(q_tasks, pass1, [&](const Task& task, Pass1Scratch&) {
      preprocess_task<T>(p, tensors, d_all, task);
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
