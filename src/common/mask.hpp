// The score variants: which keys a query row may see (BandMask), how a score is transformed before
// the softmax (Softcap, then Alibi), and what else joins the softmax (Sink). One functor each,
// shared by the CPU backend and the CUDA kernels so that both implement one definition.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.hpp"

namespace fa4 {

// Bottom-right aligned band: query i (of sq) sees key j (of sk) iff
//   i + sk − sq − left ≤ j ≤ i + sk − sq + right, with −1 meaning unbounded on that side.
// Causal is the band with right = 0. No mask is the band with both sides unbounded.
struct BandMask {
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t left = -1;
  int64_t right = -1;

  FA4_HD static BandMask make(int64_t sq, int64_t sk, bool causal, int64_t left, int64_t right) {
    // A side at least sq + sk wide cannot exclude any key (left ≥ sk and right ≥ sq suffice):
    // make it unbounded, so that the bounds below never overflow for a caller's "huge" value.
    if (left >= sq + sk) left = -1;
    if (right >= sq + sk) right = -1;
    BandMask m{sq, sk, left, right};
    if (causal) m.right = 0;
    return m;
  }

  // Whether a side is bounded, so that the band may cut tiles (causal included).
  FA4_HD bool banded() const { return left >= 0 || right >= 0; }

  // First key row i may see (may be ≤ 0: clamp with max(0, ·)).
  FA4_HD int64_t key_begin(int64_t i) const {
    return left < 0 ? 0 : i + seqlen_k - seqlen_q - left;
  }
  // One past the last key row i may see (may exceed seqlen_k: clamp with min(seqlen_k, ·)).
  FA4_HD int64_t key_end(int64_t i) const {
    return right < 0 ? seqlen_k : i + seqlen_k - seqlen_q + right + 1;
  }
  // Keys [lo, hi) of row i, clamped to the sequence; empty when lo ≥ hi.
  FA4_HD void key_range(int64_t i, int64_t* lo, int64_t* hi) const {
    const int64_t b = key_begin(i), e = key_end(i);
    *lo = b < 0 ? 0 : b;
    *hi = e > seqlen_k ? seqlen_k : e;
  }
  // The same band seen from key j (the backward walks keys): first query row that sees j (may be
  // ≤ 0) and one past the last (may exceed seqlen_q); clamp as above.
  FA4_HD int64_t query_begin(int64_t j) const {
    return right < 0 ? 0 : j - (seqlen_k - seqlen_q) - right;
  }
  FA4_HD int64_t query_end(int64_t j) const {
    return left < 0 ? seqlen_q : j - (seqlen_k - seqlen_q) + left + 1;
  }
  FA4_HD bool visible(int64_t i, int64_t j) const {
    return j >= 0 && j < seqlen_k && j >= key_begin(i) && j < key_end(i);
  }
};

// score = cap · tanh(score / cap) on the already scaled score; identity when cap = 0.
struct Softcap {
  float cap = 0.0f;

  FA4_HD float operator()(float scaled_score) const {
    return cap > 0.0f ? cap * tanhf(scaled_score / cap) : scaled_score;
  }
  // d(capped)/d(scaled) expressed through the capped value: 1 − (capped / cap)².
  FA4_HD float derivative_from_capped(float capped) const {
    if (!(cap > 0.0f)) return 1.0f;
    const float t = capped / cap;
    return 1.0f - t * t;
  }
};

// ALiBi (flash_attn's definition): the score of query i and key j, in a sequence of sq queries and
// sk keys, gains −slope · |i + sk − sq − j| after softcap. The bias is linear in j on each side of
// the diagonal, and constant in q and k: it leaves dS as it is.
struct Alibi {
  float slope = 0.0f;  // 0: off
  int64_t offset = 0;  // sk − sq: query i's diagonal key

  FA4_HD bool enabled() const { return slope != 0.0f; }
  FA4_HD float bias(int64_t i, int64_t j) const {
    const int64_t d = i + offset - j;
    return -slope * float(d < 0 ? -d : d);
  }
};

// A learnable attention sink (gpt-oss): one logit per query head that joins every row's softmax
// denominator and has no value. Folded in once a row's running max m and sum l over its keys are
// known; a row with no key keeps O = 0 and gets LSE = logit.
struct Sink {
  float logit = -INFINITY;  // −inf: off (exp(−inf) adds nothing)

  FA4_HD bool enabled() const { return logit != -INFINITY; }
  // The row's max and sum with the sink included: m' = max(m, logit), l' = l·e^(m − m') +
  // e^(logit − m'); returns e^(m − m'), the factor the row's O accumulator takes.
  FA4_HD float fold(float& m, float& l) const {
    if (!enabled()) return 1.0f;
    if (m == -INFINITY) {
      m = logit;
      l = 1.0f;
      return 0.0f;
    }
    const float m_new = m > logit ? m : logit;
    const float alpha = expf(m - m_new);
    l = l * alpha + expf(logit - m_new);
    m = m_new;
    return alpha;
  }
};

}  // namespace fa4
