// Online softmax over the rows of one thread's score fragment, in base 2, with FA4's two savings.
//
// The caller's scores are "raw" (qk, or tanh(...) with softcap); probabilities are
// exp2(raw·scale_log2 − held·scale_log2) with scale_log2 = softmax scale·log2(e) (or cap·log2(e)):
// one FFMA and one exp2 per score. The running row sum stays per thread (each row is spread over
// the 4 threads of a quad) and is reduced once, at the end.
//
// Software exp2: of every kPolyDen consecutive columns of a thread's row, kPolyNum take exp2 on
// the FMA pipe (common/exp2_poly.hpp) instead of MUFU.EX2, whose 16/clk/SM bound the hdim-64
// forward. The split is per column index, fixed at compile time: no branch in the loop.
//
// Adaptive rescale: the row max used for the exponent (the "held" max) only moves when a new tile
// raises it by more than kRescaleThresholdLog2 in log2 units, or when it is still −inf. Otherwise
// probabilities may reach 2^threshold — harmless for fp32 sums and bf16/fp16 P — and O keeps its
// scale. The check is per warp: if any row of the warp needs a move, every row of the warp moves to
// its true max, so that the O rescale is one warp-uniform branch. Threshold 0 is the exact online
// softmax (the held max is the running max); by default it rescales O on every tile without a
// vote, as at d64 the vote and the branch it guards cost more than the multiplies they save (5-8 %,
// measured). kVoteExact keeps the vote at threshold 0 — O is rescaled only when
// a row of the warp has a new max, still exact — for wide O, where the multiplies are many (dv/2
// per thread and tile). finish() is exact whatever the held max is.
//
// Chains: a row's max and sum over a thread's columns are kChains independent chains, combined at
// the end. One chain is a dependency chain of N/4 FMNMX (and FADD) per row, whose latency the two
// consumer warps of a scheduler cannot hide at d128; at d64, where MUFU bounds the loop, the extra
// registers and instructions of more chains cost more than they save (both measured).
//
// P offset (kPLog2Offset, e4m3 P): probabilities come out as 2^offset · p, an exponent moved by
// the offset at no cost. The row sums and O carry the factor; finish() divides O by the row sum as
// carried and takes the offset out of the sum exactly (a power of two) for LSE and the sinks.
//
// NaN: a NaN score (only NaN inputs make one) makes its row's max NaN (the max propagates NaN), the
// row then always moves, its factor and row sum become NaN, and finish() leaves O and LSE NaN —
// also on software-exp2 columns, whose clamp alone would turn a NaN into 0.
//
// Shifted scores: update_max and exponentiate also take a tile's scores less a per-thread, per-row
// shift (row_shift.hpp: the true score is the given one plus shift.c[i]; ALiBi's linear form, in
// fwd/alibi_linear.hpp, leaves its per-row term out of the scores). The held max stays in true units:
// each thread adds its shift to its own tile max before the quad's reduction (the four threads of
// a row hold different shifts), and subtracts it from the held max in the exponent. NoRowShift is
// the plain path, compiled as without a shift.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "common/exp2_poly.hpp"
#include "common/math_constants.hpp"
#include "sm90/common/rescale_stats.cuh"
#include "sm90/common/row_shift.hpp"

namespace fa4::sm90 {

constexpr unsigned kFullWarp = 0xffffffffu;

CUTE_DEVICE float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// fmaxf drops a NaN operand; this keeps it, at the same cost (FMNMX.NAN).
CUTE_DEVICE float max_keep_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// The 4 threads of a quad hold one row of a wgmma accumulator.
template <class Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(kFullWarp, x, 1));
  return op(x, __shfl_xor_sync(kFullWarp, x, 2));
}

// Which exp2 column j of a thread's row takes: the last kNum of every kDen consecutive columns go
// to the FMA pipe, spread along the row so that both pipes are fed throughout the loop.
template <int kNum, int kDen>
struct Exp2Split {
  static_assert(kDen > 0 && 0 <= kNum && kNum <= kDen, "kPolyNum of every kPolyDen columns");
  static constexpr bool on_fma_pipe(int j) { return j % kDen >= kDen - kNum; }
};

// SumOf: the type whose values the row sums add up (FwdConfig::kRoundedRowSum): float, or P's
// element type, each probability then rounded to it before it is summed and handed to P·V.
template <int kRows, int kPolyNum = 0, int kPolyDen = 1, int kRescaleThresholdLog2 = 0,
          int kChains = 1, bool kVoteExact = false, class SumOf = float, int kPLog2Offset = 0>
struct OnlineSoftmax {
  using RowVector = cute::array<float, kRows>;
  using Split = Exp2Split<kPolyNum, kPolyDen>;
  static_assert(kRescaleThresholdLog2 >= 0 && kRescaleThresholdLog2 <= 15,
                "P may reach 2^threshold, and fp16 P overflows at 2^16");
  static_assert(kChains >= 1);

  float scale;       // natural-log logit per raw score unit (softmax scale, or cap with softcap)
  float scale_log2;  // scale·log2(e)
  RowVector row_max;  // the held max, raw units; −inf until the row has seen a key
  RowVector row_sum;  // this thread's share of Σ exp2(·), relative to the held max
#if FA4_SM90_RESCALE_STATS
  RowVector true_max;  // the running max a threshold-0 softmax would hold
  RescaleTally tally;
#endif

  CUTE_DEVICE OnlineSoftmax(float scale_, float scale_log2_)
      : scale(scale_), scale_log2(scale_log2_) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.0f;
#if FA4_SM90_RESCALE_STATS
      true_max[i] = -INFINITY;
#endif
    }
  }

  // Moves the held max where the rule above says so (row sums rescaled here). Returns, uniformly
  // over the warp, whether O must be rescaled: then O(i, ·) *= factor[i]; otherwise `factor` is
  // not to be used (always true at threshold 0, a compile-time constant once inlined). Call
  // before exponentiate(); the scores stay untouched. All 32 lanes must call.
  template <class Scores, class Shift = NoRowShift>
  CUTE_DEVICE bool update_max(Scores const& scores, RowVector& factor, Shift const& shift = {}) {
    static_assert(decltype(cute::size<0>(scores))::value == kRows);
    RowVector new_max;
    bool must_move = false;  // a row of this thread is past the threshold (or NaN, or first keys)
    bool would_scale_o = false;  // moving would change the scale of a row whose O is not 0
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      cute::array<float, kChains> chain;
      chain[0] = kShifted<Shift> ? -INFINITY : row_max[i];
      CUTE_UNROLL
      for (int c = 1; c < kChains; ++c) chain[c] = -INFINITY;
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(scores); ++j)
        chain[j % kChains] = max_keep_nan(chain[j % kChains], scores(i, j));
      float m = combine(chain, [](float a, float b) { return max_keep_nan(a, b); });
      if constexpr (kShifted<Shift>) m = max_keep_nan(row_max[i], m + shift.c[i]);
      m = quad_allreduce(m, [](float a, float b) { return max_keep_nan(a, b); });
      new_max[i] = m;
      const float held = row_max[i];
      // A row with no key so far and none in this tile gives (−inf − −inf) = NaN: no move.
      must_move |= (m - held) * scale_log2 > float(kRescaleThresholdLog2) || m != m;
      // O of a row still at −inf is 0 whatever its factor; m ≥ held, so != means it grew.
      would_scale_o |= held != -INFINITY && !(m == held);
    }
#if FA4_SM90_RESCALE_STATS
    count_tile(new_max);
#endif
    constexpr bool kAlways = kRescaleThresholdLog2 == 0 && !kVoteExact;  // no vote
    if (!kAlways && !__any_sync(kFullWarp, must_move)) return false;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      // exp2(−inf) = 0 covers a row that saw no key before; a row that still sees none keeps O = 0.
      factor[i] = exp2_approx((row_max[i] - max_or_zero(new_max[i])) * scale_log2);
      row_max[i] = new_max[i];
      row_sum[i] *= factor[i];
    }
    const bool scale_o = kAlways || __any_sync(kFullWarp, would_scale_o);
#if FA4_SM90_RESCALE_STATS
    tally.adaptive_rescales += scale_o ? 1 : 0;
#endif
    return scale_o;
  }

  // scores ← exp2(scores·scale_log2 − held·scale_log2), accumulated into the row sums. A masked
  // score (−inf) gives exactly +0 on both pipes (the software exp2 clamps at its −127 floor).
  template <class Scores, class Shift = NoRowShift>
  CUTE_DEVICE void exponentiate(Scores& scores, Shift const& shift = {}) {
    constexpr int kCols = decltype(cute::size<1>(scores))::value;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float held = max_or_zero(row_max[i]);
      if constexpr (kShifted<Shift>) held -= shift.c[i];
      float max_scaled = held * scale_log2;
      if constexpr (kPLog2Offset != 0) max_scaled -= float(kPLog2Offset);
      cute::array<float, kChains> sum;
      CUTE_UNROLL
      for (int c = 0; c < kChains; ++c) sum[c] = 0.0f;
      cute::for_each(cute::make_int_sequence<kCols>{}, [&](auto j) {
        const float x = fmaf(scores(i, j), scale_log2, -max_scaled);
        float p;
        if constexpr (Split::on_fma_pipe(decltype(j)::value)) {
          p = exp2_poly(x);
        } else {
          p = exp2_approx(x);
        }
        if constexpr (!std::is_same_v<SumOf, float>) p = float(SumOf(p));
        scores(i, j) = p;
        sum[decltype(j)::value % kChains] += p;
      });
      row_sum[i] += combine(sum, [](float a, float b) { return a + b; });
    }
  }

  // Per row: the factor that normalizes O (0 for a row that saw no key, whose O is 0) and the
  // natural-log LSE (+inf for such a row; NaN for a row that met a NaN score).
  CUTE_DEVICE void finish(RowVector& o_scale, RowVector& lse) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float sum = quad_allreduce(row_sum[i], [](float a, float b) { return a + b; });
      // A row that saw a key sums to ≥ 1 (its max's own term); only a keyless row sums to 0.
      const bool empty = sum == 0.0f;
      o_scale[i] = empty ? 0.0f : 1.0f / sum;
      // In natural units directly: going through base 2 and back costs two more roundings of a
      // value that can reach ~100 (spiky logits), where fp32 ulps are ~1e-5.
      lse[i] = empty ? INFINITY : fmaf(row_max[i], scale, logf(without_offset(sum)));
    }
#if FA4_SM90_RESCALE_STATS
    tally.flush();
#endif
  }

  // finish() with each row's attention sink (common/mask.hpp's Sink) joining its denominator: O
  // takes e^(m − m') / l' and LSE is m' + log l', m and l the row's max (natural units) and sum
  // before the sink; a row that saw no key gets O = 0 and LSE = the sink's logit.
  template <class Sinks>
  CUTE_DEVICE void finish(RowVector& o_scale, RowVector& lse, Sinks const& sinks) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float sum = without_offset(quad_allreduce(row_sum[i], [](float a, float b) { return a + b; }));
      float m = sum == 0.0f ? -INFINITY : row_max[i] * scale;
      const float alpha = sinks[i].fold(m, sum);
      const bool empty = m == -INFINITY;  // no key and no sink
      o_scale[i] = empty ? 0.0f : without_offset(alpha / sum);
      lse[i] = empty ? INFINITY : m + logf(sum);
    }
#if FA4_SM90_RESCALE_STATS
    tally.flush();
#endif
  }

 private:
  // x · 2^-offset, exact: O and the row sums carry 2^offset.
  CUTE_DEVICE static float without_offset(float x) {
    if constexpr (kPLog2Offset == 0)
      return x;
    else
      return x * (1.0f / float(1 << kPLog2Offset));
  }

  // Pairwise, so that kChains partial results combine in log2(kChains) dependent steps.
  template <class Op>
  CUTE_DEVICE static float combine(cute::array<float, kChains> const& chain, Op op) {
    cute::array<float, kChains> v = chain;
    CUTE_UNROLL
    for (int width = kChains; width > 1; width = (width + 1) / 2) {
      CUTE_UNROLL
      for (int c = 0; c < width / 2; ++c) v[c] = op(v[c], v[width - 1 - c]);
    }
    return v[0];
  }

  // A row whose max is still −inf subtracts 0 instead, so that −inf − (−inf) never makes a NaN.
  CUTE_DEVICE static float max_or_zero(float m) { return m == -INFINITY ? 0.0f : m; }

#if FA4_SM90_RESCALE_STATS
  // A threshold-0 softmax would rescale O on this tile if the running max of a row that already
  // had keys grew.
  CUTE_DEVICE void count_tile(RowVector const& new_max) {
    bool grows = false;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      // new_max is max(held, this tile) and held ≤ true_max: this is max(true_max, this tile).
      const float m = max_keep_nan(true_max[i], new_max[i]);
      grows |= true_max[i] != -INFINITY && !(m == true_max[i]);
      true_max[i] = m;
    }
    tally.tiles += 1;
    tally.exact_rescales += __any_sync(kFullWarp, grows) ? 1 : 0;
  }
#endif
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
