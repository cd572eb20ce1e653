// ALiBi's bias on a thread's tile of scores in the forward: the full form of one row (the score
// step's, score_variants.cuh), and the linear form, which the kernels launched for calls with
// slopes use where they have registers for it (FwdConfig::kAlibiLinearFits). Host-device code, so
// that the CPU tests check it on the kernel's own accumulator partition
// (tests/cpu/test_alibi_linear.cpp).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "sm90/common/row_shift.hpp"

namespace fa4::sm90 {

// Row i of a thread's (rows, cols) view of its scores plus −slope·|center − key| in full:
// `from_first` is center − the thread's first key of the tile, in float from an int difference
// (exact for any length; each term alone would round past 2^24 keys), and the columns' offsets from
// the thread's first are compile-time constants. One FADD and one FFMA per score.
template <class Scores, class Coords>
CUTE_HOST_DEVICE void add_alibi_row(Scores& scores, Coords const& coords, int i, float slope,
                                    float from_first) {
  CUTE_UNROLL
  for (int j = 0; j < cute::size<1>(scores); ++j) {
    const float col = float(cute::get<1>(coords(0, j)) - cute::get<1>(coords(0, 0)));
    scores(i, j) = fmaf(-slope, fabsf(from_first - col), scores(i, j));
  }
}

// ALiBi's linear form. On a key tile that lies on one side of a row's
// diagonal, −slope·|center − j| is ±slope·(j − key0) ± slope·(key0 − center) for the thread's
// first key key0 of the tile: a compile-time column offset times the slope, one FFMA with an
// immediate per score (add_alibi_row takes an FADD and an FFMA), and a per-row term that the
// softmax adds back to the row's max and subtracts in its exponent (row_shift.hpp), once
// per row and tile. The tile that holds a row's diagonal takes the full form, shift 0. The
// rows' slopes and diagonals are held through the tile loop (AlibiRows: two registers per row),
// which only the kernels with two consumer warpgroups below d256 have room for.
template <int kRows>
struct AlibiRows {
  cute::array<float, kRows> slope;  // in the kernel's score units
  cute::array<int, kRows> center;   // the row's diagonal key, i + sk − sq
};

// The bias of key tile n_block on a thread's (rows, cols) view of its scores, linear where every
// row of the thread lies on one side of the tile's keys up to `last_key` (the sequence's last: the
// mask gives the keys past it −inf whatever their bias); returns the rows' shifts (0 where not
// linear).
template <int kBlockN, int kRows, class Scores, class Coords>
CUTE_HOST_DEVICE RowShift<kRows> apply_alibi_linear(Scores& scores, Coords const& coords,
                                               AlibiRows<kRows> const& a, int n_block,
                                               int last_key) {
  const int tile_first = n_block * kBlockN;
  const int tile_last = cute::min(tile_first + kBlockN - 1, last_key);
  const int key0 = tile_first + cute::get<1>(coords(0, 0));
  bool linear = true;
  cute::array<float, kRows> signed_slope;  // +slope left of the diagonal, −slope right of it
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const bool left = tile_last <= a.center[i];
    linear &= left || tile_first >= a.center[i];
    signed_slope[i] = left ? a.slope[i] : -a.slope[i];
  }
  RowShift<kRows> shift;
  if (linear) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(scores); ++j) {
        const float col = float(cute::get<1>(coords(0, j)) - cute::get<1>(coords(0, 0)));
        scores(i, j) = fmaf(signed_slope[i], col, scores(i, j));
      }
      // The difference in int, then float: exact for any length.
      shift.c[i] = signed_slope[i] * float(key0 - a.center[i]);
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      add_alibi_row(scores, coords, i, a.slope[i], float(a.center[i] - key0));
      shift.c[i] = 0.0f;
    }
  }
  return shift;
}

}  // namespace fa4::sm90
