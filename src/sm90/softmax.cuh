// Online softmax over the rows of one thread's score fragment, in base 2.
//
// The caller's scores are "raw" (qk, or tanh(...) with softcap); probabilities are
// exp2(raw·scale_log2 − max·scale_log2) with scale_log2 = softmax scale·log2(e) (or cap·log2(e)):
// one FFMA and one MUFU.EX2 per score. The running row sum stays per thread (each row is spread over
// the 4 threads of a quad) and is reduced once, at the end.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/math_constants.hpp"

namespace fa4::sm90 {

CUTE_DEVICE float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The 4 threads of a quad hold one row of a wgmma accumulator.
template <class Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return op(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

template <int kRows>
struct OnlineSoftmax {
  using RowVector = cute::array<float, kRows>;

  float scale;       // natural-log logit per raw score unit (softmax scale, or cap with softcap)
  float scale_log2;  // scale·log2(e)
  RowVector row_max;  // raw units; −inf until the row has seen a key
  RowVector row_sum;  // this thread's share of Σ exp2(·)

  CUTE_DEVICE OnlineSoftmax(float scale_, float scale_log2_)
      : scale(scale_), scale_log2(scale_log2_) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.0f;
    }
  }

  // Updates the row max, and returns per row the factor that rescales what was accumulated so far
  // (O and the row sum). Call before exponentiate(); the scores stay untouched.
  template <class Scores>
  CUTE_DEVICE RowVector update_max(Scores const& scores) {
    static_assert(decltype(cute::size<0>(scores))::value == kRows);
    RowVector rescale;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float m = row_max[i];
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(scores); ++j) m = fmaxf(m, scores(i, j));
      m = quad_allreduce(m, [](float a, float b) { return fmaxf(a, b); });
      // exp2(−inf) = 0 covers a row that saw no key before; a row that still sees none keeps O = 0.
      rescale[i] = exp2_approx((row_max[i] - max_or_zero(m)) * scale_log2);
      row_max[i] = m;
      row_sum[i] *= rescale[i];
    }
    return rescale;
  }

  // scores ← exp2(scores·scale_log2 − max·scale_log2), accumulated into the row sums.
  template <class Scores>
  CUTE_DEVICE void exponentiate(Scores& scores) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float max_scaled = max_or_zero(row_max[i]) * scale_log2;
      float sum = 0.0f;
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(scores); ++j) {
        scores(i, j) = exp2_approx(fmaf(scores(i, j), scale_log2, -max_scaled));
        sum += scores(i, j);
      }
      row_sum[i] += sum;
    }
  }

  // Per row: the factor that normalizes O (0 for a row that saw no key, whose O is 0) and the
  // natural-log LSE (+inf for such a row).
  CUTE_DEVICE void finish(RowVector& o_scale, RowVector& lse) const {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float sum = quad_allreduce(row_sum[i], [](float a, float b) { return a + b; });
      const bool empty = !(sum > 0.0f);
      o_scale[i] = empty ? 0.0f : 1.0f / sum;
      // In natural units directly: going through base 2 and back costs two more roundings of a
      // value that can reach ~100 (spiky logits), where fp32 ulps are ~1e-5.
      lse[i] = empty ? INFINITY : fmaf(row_max[i], scale, logf(sum));
    }
  }

 private:
  // A row whose max is still −inf subtracts 0 instead, so that −inf − (−inf) never makes a NaN.
  CUTE_DEVICE static float max_or_zero(float m) { return m == -INFINITY ? 0.0f : m; }
};

// O(i, ·) *= factor[i], on a (rows, cols) view of the O accumulator.
template <class Acc, class RowVector>
CUTE_DEVICE void scale_rows(Acc& acc, RowVector const& factor) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size<0>(acc); ++i) {
    CUTE_UNROLL
    for (int j = 0; j < cute::size<1>(acc); ++j) acc(i, j) *= factor[i];
  }
}

}  // namespace fa4::sm90
