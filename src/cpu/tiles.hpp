// The tile machinery the CPU forward and backward passes share: tile sizes, work lists, fp32 tile
// loads, the one matrix product both are built from, the key tiles a query tile visits, and how a
// raw dot product becomes a score. The last is here and not in each pass because the backward
// recomputes P from the forward's LSE, so both must score a dot product exactly alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/mask.hpp"
#include "common/math_constants.hpp"
#include "common/numeric.hpp"
#include "common/seq_layout.hpp"
#include "cpu/parallel.hpp"
#include "fa4/attention.hpp"

namespace fa4::cpu {

// Internal linkage, as when each pass defined these itself: the compiler inlines and specialises
// them per pass as it did then. Marked `inline` instead, gemm_acc would be inlined at every call.
namespace {

constexpr int64_t kTileQ = 64;  // query rows per tile
constexpr int64_t kTileK = 64;  // key rows per tile
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Work lists.

// A tile of one sequence: rows [row0, row0 + tile size) of head `head`, whose rows are queries or
// keys as the pass that made it decides.
struct Task {
  int64_t batch, head, row0;
};

// Tiles of `rows_of(b)` rows for every batch entry and each of `heads` heads, last tiles first:
// under a causal mask those are the longest, and starting them early shortens the tail.
template <typename RowsOf>
std::vector<Task> make_tasks(const Problem& p, int64_t heads, int64_t tile, RowsOf rows_of) {
  std::vector<Task> tasks;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t tiles = (rows_of(b) + tile - 1) / tile;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = tiles - 1; i >= 0; --i) tasks.push_back({b, h, i * tile});
  }
  return tasks;
}

// One Scratch per worker for `tasks`, allocated before anything is written so that running out of
// memory leaves every output untouched, and so that tasks never allocate.
// `threads`: the caller's thread count (0: every hardware thread).
template <typename Scratch>
std::vector<Scratch> make_scratch(const std::vector<Task>& tasks, const Problem& p, int threads) {
  return std::vector<Scratch>(size_t(worker_count(int64_t(tasks.size()), threads)),
                              Scratch(p.head_dim_qk, p.head_dim_v));
}

template <typename Scratch, typename Body>
void run_tasks(const std::vector<Task>& tasks, std::vector<Scratch>& scratch, Body body) {
  parallel_for(int64_t(tasks.size()), int(scratch.size()), [&](int64_t i, int worker) {
    body(tasks[size_t(i)], scratch[size_t(worker)]);
  });
}

// ---------------------------------------------------------------------------------------------
// Tiles in fp32.

template <typename T>
const T* element(const TensorView& t, int64_t offset) {
  return static_cast<const T*>(t.data) + offset;
}

// dst[r][c] = src row r, element c, for `rows` rows `row_stride` elements apart.
template <typename T>
void load_rows(const T* src, int64_t row_stride, int64_t rows, int64_t dim, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim; ++c) dst[r * dim + c] = to_float(src[r * row_stride + c]);
}

// dst[c][r] (rows `ld` apart) = src row r, element c.
template <typename T>
void load_rows_transposed(const T* src, int64_t row_stride, int64_t rows, int64_t dim, float* dst,
                          int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim; ++c) dst[c * ld + r] = to_float(src[r * row_stride + c]);
}

// c[m×n] += a[m×k] · b[k×n], all row-major with leading dimensions lda / ldb / ldc. The inner
// loop is a contiguous row update, which vectorises without reassociating sums, done for four rows
// of c at once so that each row of b is loaded once per four updates. Zero coefficients of `a`
// (masked probabilities and their dS) are skipped, which halves the work of diagonal tiles.
void gemm_acc(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
              int64_t m, int64_t n, int64_t k) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) {
    float* __restrict c0 = c + i * ldc;
    float* __restrict c1 = c0 + ldc;
    float* __restrict c2 = c1 + ldc;
    float* __restrict c3 = c2 + ldc;
    for (int64_t p = 0; p < k; ++p) {
      const float a0 = a[i * lda + p], a1 = a[(i + 1) * lda + p];
      const float a2 = a[(i + 2) * lda + p], a3 = a[(i + 3) * lda + p];
      if (a0 == 0.0f && a1 == 0.0f && a2 == 0.0f && a3 == 0.0f) continue;
      const float* __restrict brow = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) {
        const float bj = brow[j];
        c0[j] += a0 * bj;
        c1[j] += a1 * bj;
        c2[j] += a2 * bj;
        c3[j] += a3 * bj;
      }
    }
  }
  for (; i < m; ++i) {
    float* __restrict crow = c + i * ldc;
    for (int64_t p = 0; p < k; ++p) {
      const float aip = a[i * lda + p];
      if (aip == 0.0f) continue;
      const float* __restrict brow = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) crow[j] += aip * brow[j];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Masks and key tiles.

BandMask band_mask(const Problem& p, const SeqSpan& span) {
  return BandMask::make(span.seqlen_q, span.seqlen_k, p.causal, p.window.left, p.window.right);
}

struct KeyRange {
  int64_t begin, end;
};
// Keys [begin, end) that some row of [q0, q0 + rows) sees. Row ranges slide by one key per row and
// are at least one key wide, so their union is this one interval (empty when begin ≥ end).
KeyRange visible_keys(const BandMask& mask, int64_t q0, int64_t rows) {
  return {std::max<int64_t>(0, mask.key_begin(q0)),
          std::min(mask.seqlen_k, mask.key_end(q0 + rows - 1))};
}

// Calls body(k0, cols) for the key tiles [k0, k0 + cols) that query rows [q0, q0 + rows) see, in
// order. Tiles lie on the grid of multiples of kTileK whatever the mask, the grid on which pass 2
// of the backward tiles keys too.
template <typename Body>
void for_each_key_tile(const BandMask& mask, int64_t q0, int64_t rows, Body body) {
  const KeyRange keys = visible_keys(mask, q0, rows);
  for (int64_t k0 = keys.begin - keys.begin % kTileK; k0 < keys.end; k0 += kTileK)
    body(k0, std::min(kTileK, mask.seqlen_k - k0));
}

// ---------------------------------------------------------------------------------------------
// Scores.

// Raw dot product q·k → score in log2 units. Without softcap, scale·log2e is one multiply;
// softcap's tanh needs the score in natural units first.
struct ScoreMod {
  float scale_log2;  // scale · log2e
  float scale;
  Softcap softcap;

  static ScoreMod of(const Problem& p) {
    return {p.scale() * kLog2e, p.scale(), Softcap{p.softcap}};
  }

  // Forward: s[0, n) from dot products to scores, in place.
  void apply(float* s, int64_t n) const {
    if (softcap.cap > 0.0f) {
      for (int64_t j = 0; j < n; ++j) s[j] = softcap(s[j] * scale) * kLog2e;
    } else {
      for (int64_t j = 0; j < n; ++j) s[j] *= scale_log2;
    }
  }

  // Backward: P = exp2(score − lse_log2). With softcap also returns, in *dcap, the factor
  // 1 − tanh² that dS picks up; without it *dcap is left alone.
  float probability(float dot, float lse_log2, float* dcap) const {
    if (softcap.cap > 0.0f) {
      const float capped = softcap(dot * scale);
      *dcap = softcap.derivative_from_capped(capped);
      return std::exp2(capped * kLog2e - lse_log2);
    }
    return std::exp2(dot * scale_log2 - lse_log2);
  }
};

}  // namespace
}  // namespace fa4::cpu
