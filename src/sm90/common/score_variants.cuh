// The score variants on the GPU: ALiBi's bias and the attention sinks (common/mask.hpp's Alibi and
// Sink, the definitions the CPU backend uses too), for the forward and both backward tile loops.
// A bias costs one FADD and one FFMA per score; a sink is folded into its row's max and sum when
// the forward's softmax finishes (or in split-KV's combine).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "common/mask.hpp"
#include "sm90/common/sequence.cuh"
#include "sm90/fwd/alibi_linear.hpp"
#include "sm90/fwd/query_rows.cuh"

namespace fa4::sm90 {

// The problem's variant arrays (device memory): slopes of (batch, heads_q) with strides, sink
// logits of heads_q; null when off.
struct ScoreVariantParams {
  const float* alibi = nullptr;
  int alibi_batch_stride = 0;  // 32 bits: the slopes are (batch, heads_q) floats
  int alibi_head_stride = 0;
  float alibi_unit = 1.0f;     // 1 / score_scale: a slope in the kernel's score units
  const float* sinks = nullptr;

  CUTE_HOST_DEVICE bool any() const { return alibi != nullptr || sinks != nullptr; }
};

// The tile row `tile_row` of tile head `tile_head`: its query head and its diagonal key.
struct VariantRow {
  int head;
  int center;  // i + sk − sq
};
CUTE_DEVICE VariantRow variant_row(QueryRows const& rows, Sequence const& seq, int tile_head,
                                   int tile_row) {
  const QueryRows::Row row = rows.locate(tile_row, tile_head);
  return {row.head, row.position + seq.len_k - seq.len_q};
}

// ALiBi's slope of batch entry `batch`, query head `head`, in the kernel's score units.
CUTE_DEVICE float alibi_slope(ScoreVariantParams const& v, int batch, int head) {
  return v.alibi[batch * v.alibi_batch_stride + head * v.alibi_head_stride] * v.alibi_unit;
}

// The forward: scores(i, j) −= slope_i · |center_i − key_j| on a thread's (rows, cols) view of the
// scores of key tile n_block, in the kernel's units (after softcap). Each row's slope and diagonal
// are made as the row comes: at d256, four values held through the tile loop take registers the
// kernel does not have. `coords`: the same view of the tile's identity tensor; `first_row`: the
// tile's row 0 (TileRows::first); `tile_head`: the tile's head (kv head when packed). Columns are
// relative to the thread's first, as the mask takes them: compile-time offsets.
template <int kBlockN, class Scores, class Coords>
CUTE_DEVICE void apply_alibi(Scores& scores, Coords const& coords, ScoreVariantParams const& v,
                             QueryRows const& rows, Sequence const& seq, int batch,
                             int tile_head, int64_t first_row, int n_block) {
  const int key0 = n_block * kBlockN + cute::get<1>(coords(0, 0));
  CUTE_UNROLL
  for (int i = 0; i < cute::size<0>(scores); ++i) {
    const VariantRow row =
        variant_row(rows, seq, tile_head, int(first_row) + cute::get<0>(coords(i, 0)));
    add_alibi_row(scores, coords, i, alibi_slope(v, batch, row.head), float(row.center - key0));
  }
}

// The rows' slopes and diagonals of ALiBi's linear form (fwd/alibi_linear.hpp).
template <int kRows, class Coords>
CUTE_DEVICE AlibiRows<kRows> alibi_rows(ScoreVariantParams const& v, QueryRows const& rows,
                                        Sequence const& seq, int batch, int tile_head,
                                        int64_t first_row, Coords const& coords) {
  AlibiRows<kRows> a;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const VariantRow row =
        variant_row(rows, seq, tile_head, int(first_row) + cute::get<0>(coords(i, 0)));
    a.slope[i] = alibi_slope(v, batch, row.head);
    a.center[i] = row.center;
  }
  return a;
}

// The sinks of a thread's rows (their heads' logits).
template <int kRows, class Coords>
CUTE_DEVICE cute::array<Sink, kRows> row_sinks(ScoreVariantParams const& v, QueryRows const& rows,
                                               Sequence const& seq, int tile_head,
                                               int64_t first_row, Coords const& coords) {
  cute::array<Sink, kRows> sinks;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const VariantRow row =
        variant_row(rows, seq, tile_head, int(first_row) + cute::get<0>(coords(i, 0)));
    sinks[i] = Sink{v.sinks[row.head]};
  }
  return sinks;
}

// ALiBi's bias in a backward tile (common/mask.hpp's Alibi): −slope·|q + sk − sq − k| for query q
// and key k, in the kernel's score units. A tile's rows and columns are keys and queries (the
// narrow kernel's Sᵀ) or queries and keys (the wide kernel's S); either way the difference is one
// per-tile value plus the element's compile-time offset from the thread's first, so the bias costs
// one FADD and one FFMA and holds two registers (the slope and that value).
struct BwdAlibi {
  float slope = 0.0f;  // slope / score_scale

  // The per-tile value: q − k (+ sk − sq) of the thread's first element, whose row and column are
  // row0 and col0 (absolute: the tile's first row and column included).
  template <bool kRowsAreKeys>
  CUTE_DEVICE static float first(int row0, int col0, int offset) {
    return kRowsAreKeys ? float(col0 - row0 + offset) : float(row0 - col0 + offset);
  }
  // t + bias of the element `di` rows and `dj` columns from the thread's first.
  template <bool kRowsAreKeys>
  CUTE_DEVICE float add(float t, float first_d, int di, int dj) const {
    const float d = first_d + float(kRowsAreKeys ? dj - di : di - dj);
    return fmaf(-slope, fabsf(d), t);
  }
};

}  // namespace fa4::sm90
