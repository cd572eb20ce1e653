// What the backward's two tile loops (bwd_kernel.cuh on Sᵀ, bwd_mma_wide.cuh on S) do alike with a
// score tile: the query rows' statistics from shared memory, the probabilities from the forward's
// LSE, ALiBi's bias, dS's factors, and the loop compiled once per (softcap, ALiBi) setting.
#pragma once

#include <cmath>

#include <cute/config.hpp>
#include <cute/numeric/integral_constant.hpp>

#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/score_variants.cuh"
#include "sm90/common/softmax.cuh"

namespace fa4::sm90 {

// The LSE·log2e or D values of a ring stage's query tile. The offset is made opaque so that the
// loads, issued after the wait that makes the stage valid, are not hoisted above it.
template <int kBlockM>
CUTE_DEVICE const float* stage_stats(const float* stats, int stage) {
  int offset = stage * kBlockM;
  asm volatile("" : "+r"(offset));
  return stats + offset;
}

// The stats of a thread's four columns c, c + 1, c + 8, c + 9 of 16-column block k, in that
// order, with one 16-byte load: the stats are stored in that order (bwd_stat_slot). `first`: the
// thread's first column, c of block 0 (2·(thread mod 4) in an m64nN accumulator); block k's c is
// first + 16·k, so one address serves every block. No bounds check: a tile past its sequence's end
// reads the workspace's pad (bwd_workspace.hpp).
// `stats` points into shared memory. The load is written out: from a float4 dereference the
// compiler narrows the loads to what each use reads and pairs them again, as 8-byte ones.
CUTE_DEVICE float4 stat_quad(const float* stats, int first, int k) {
  const uint32_t at = uint32_t(__cvta_generic_to_shared(stats + bwd_stat_slot(first) + 16 * k));
  float4 v;
  asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "r"(at));
  return v;
}

// Component i of a quad (i known at compile time where the loops are unrolled).
CUTE_DEVICE float quad_value(float4 quad, int i) {
  return i == 0 ? quad.x : i == 1 ? quad.y : i == 2 ? quad.z : quad.w;
}

// P of raw score t (softcap: its tanh) from the row's LSE·log2e.
CUTE_DEVICE float bwd_probability(float t, float score_scale_log2, float lse_log2) {
  return exp2_approx(fmaf(t, score_scale_log2, -lse_log2));
}

// P's factor in dS = factor · (dP − D): P, or with softcap P · (1 − t²), d tanh / d(its argument)
// (a masked t = −inf has P = 0).
template <bool kSoftcap>
CUTE_DEVICE float ds_factor(float prob, float t) {
  return kSoftcap && prob != 0.0f ? prob * (1.0f - t * t) : prob;
}

// tiles(softcap_tag, alibi_tag): the tile loop compiled once per (softcap, ALiBi) setting, so that
// each path holds only its own registers.
template <class Tiles>
CUTE_DEVICE void run_by_variant(bool softcap, bool alibi, Tiles&& tiles) {
  if (softcap) {
    if (alibi)
      tiles(cute::true_type{}, cute::true_type{});
    else
      tiles(cute::true_type{}, cute::false_type{});
  } else {
    if (alibi)
      tiles(cute::false_type{}, cute::true_type{});
    else
      tiles(cute::false_type{}, cute::false_type{});
  }
}

}  // namespace fa4::sm90
