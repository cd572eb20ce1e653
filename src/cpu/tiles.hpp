// The tile machinery the CPU forward and backward passes share: tile sizes, work lists, fp32 tile
// loads, the key tiles a query tile visits, and the score step (how a raw dot product becomes a
// score: scale or softcap, ALiBi, the mask). The last is here and not in each pass because the
// backward recomputes P from the forward's LSE, so both must score a dot product exactly alike.
// The products themselves are OpenBLAS's (blas.hpp), the row operations Highway's (vec.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/mask.hpp"
#include "common/numeric.hpp"
#include "common/seq_layout.hpp"
#include "cpu/parallel.hpp"
#include "cpu/vec.hpp"
#include "fa4/attention.hpp"

namespace fa4::cpu {

// Internal linkage: each pass gets its own copies, which the compiler inlines and specialises.
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

// One row of `dim` elements in fp32.
inline void load_row(const float* src, int64_t dim, float* dst) {
  std::copy(src, src + dim, dst);
}
inline void load_row(const bf16_t* src, int64_t dim, float* dst) { vec::to_float(src, dst, dim); }
inline void load_row(const fp16_t* src, int64_t dim, float* dst) { vec::to_float(src, dst, dim); }
inline void load_row(const e4m3_t* src, int64_t dim, float* dst) { vec::to_float(src, dst, dim); }

// dst[r][c] (rows `dim` apart) = src row r, element c, for `rows` rows `row_stride` elements apart.
template <typename T>
void load_rows(const T* src, int64_t row_stride, int64_t rows, int64_t dim, float* dst) {
  for (int64_t r = 0; r < rows; ++r) load_row(src + r * row_stride, dim, dst + r * dim);
}

// Rows of fp32 a product reads: the tensor's own rows when they are fp32 already, else `buffer`
// filled with the converted rows.
struct Rows {
  const float* data;
  int64_t ld;
};
template <typename T>
Rows fp32_rows(const T* src, int64_t row_stride, int64_t rows, int64_t dim, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return {src, row_stride};
  } else {
    load_rows(src, row_stride, rows, dim, buffer);
    return {buffer, dim};
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

// Dot products q·k → scores in natural units: scale · q·k, or softcap · tanh(scale · q·k / softcap).
struct ScoreMod {
  float scale;
  float cap;  // 0: no softcap

  static ScoreMod of(const Problem& p) { return {p.scale(), p.softcap}; }

  // Whether the scores are scale · q·k with scale > 0: then the max of the dot products times
  // scale is the max of the scores, and a pass can leave the multiply to the exponential.
  bool linear() const { return cap == 0.0f && scale > 0.0f; }

  // s[0, n) from dot products to scores, in place; with softcap and a dcap, dcap[0, n) receives
  // 1 − tanh², the factor dS picks up in the backward (dcap is left alone without softcap).
  void apply(float* s, int64_t n, float* dcap = nullptr) const {
    if (cap > 0.0f) {
      vec::softcap(s, n, scale, cap, dcap);
    } else {
      vec::scale(s, n, scale);
    }
  }
};

// Does every row of [q0, q0 + rows) see every key of [k0, k0 + cols)? Then no element needs a test.
bool fully_visible(const BandMask& mask, int64_t q0, int64_t rows, int64_t k0, int64_t cols) {
  return mask.key_begin(q0 + rows - 1) <= k0 && mask.key_end(q0) >= k0 + cols;
}

// The slope of batch entry b, query head h (0 without ALiBi).
inline float alibi_slope(const Problem& p, int64_t b, int64_t h) {
  const AlibiSlopes& a = p.alibi;
  return a.data != nullptr ? a.data[b * a.batch_stride + h * a.head_stride] : 0.0f;
}

// The score step of one (batch entry, query head): dot products → scores (ScoreMod), ALiBi's bias,
// the band's mask. Every pass runs its tiles through this one piece, in either orientation: a
// transposed tile's row holds one key against query rows [q0, q0 + n), a plain tile's row one
// query against keys [k0, k0 + n). With a linear score the scale is left to the exponentials
// (exp_scale), so the bias is added in dot-product units (bias / scale).
struct ScoreStep {
  ScoreMod mod;
  BandMask mask;
  Alibi alibi;

  static ScoreStep of(const Problem& p, const ScoreMod& mod, const BandMask& mask, int64_t batch,
                      int64_t head) {
    return {mod, mask, Alibi{alibi_slope(p, batch, head), mask.seqlen_k - mask.seqlen_q}};
  }

  float exp_scale() const { return mod.linear() ? mod.scale : 1.0f; }

  // Key j's row of a transposed tile: query rows [q0, q0 + n); `whole`: the tile needs no mask.
  void key_row(int64_t j, int64_t q0, float* s, int64_t n, bool whole,
               float* dcap = nullptr) const {
    if (!mod.linear()) mod.apply(s, n, dcap);
    if (alibi.enabled()) {
      const float unit = mod.linear() ? 1.0f / mod.scale : 1.0f;
      for (int64_t r = 0; r < n; ++r) s[r] += alibi.bias(q0 + r, j) * unit;
    }
    if (!whole) mask_key_row(mask, j, q0, s, n);
  }

  // Query i's row of a plain tile: keys [k0, k0 + n).
  void query_row(int64_t i, int64_t k0, float* s, int64_t n, bool whole,
                 float* dcap = nullptr) const {
    if (!mod.linear()) mod.apply(s, n, dcap);
    if (alibi.enabled()) {
      const float unit = mod.linear() ? 1.0f / mod.scale : 1.0f;
      for (int64_t c = 0; c < n; ++c) s[c] += alibi.bias(i, k0 + c) * unit;
    }
    if (!whole) mask_query_row(mask, i, k0, s, n);
  }

 private:
  // Scores of query rows key j may not see become −inf.
  static void mask_key_row(const BandMask& mask, int64_t j, int64_t q0, float* s, int64_t n) {
    const int64_t lo = std::clamp<int64_t>(mask.query_begin(j) - q0, 0, n);
    const int64_t hi = std::clamp<int64_t>(mask.query_end(j) - q0, lo, n);
    std::fill(s, s + lo, -kInf);
    std::fill(s + hi, s + n, -kInf);
  }
  // Scores of keys row i may not see become −inf.
  static void mask_query_row(const BandMask& mask, int64_t i, int64_t k0, float* s, int64_t n) {
    int64_t lo, hi;
    mask.key_range(i, &lo, &hi);
    lo = std::clamp<int64_t>(lo - k0, 0, n);
    hi = std::clamp<int64_t>(hi - k0, lo, n);
    std::fill(s, s + lo, -kInf);
    std::fill(s + hi, s + n, -kInf);
  }
};

// The sink of query head h (off without sinks).
inline Sink sink_of(const Problem& p, int64_t h) {
  return p.sinks != nullptr ? Sink{p.sinks[h]} : Sink{};
}

}  // namespace
}  // namespace fa4::cpu
