// Softcap on the GPU: capped = cap·tanh(scale·qk / cap) (common/mask.hpp's Softcap on the scaled
// score). The kernel keeps tanh(scale·qk / cap) as its score and folds the outer ·cap into the exp2
// scale of the softmax, so capping costs one multiply and one tanh per score.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/mask.hpp"

namespace fa4::sm90 {

struct SoftcapScores {
  float prescale = 0.0f;  // scale / cap; 0 = softcap off

  static SoftcapScores make(Softcap cap, float scale) {
    return {cap.cap > 0.0f ? scale / cap.cap : 0.0f};
  }
  CUTE_HOST_DEVICE bool enabled() const { return prescale != 0.0f; }

  // tanhf, not tanh.approx: its 2^-11 relative error, times cap, would move logits by more than
  // bf16 rounding of P does.
  template <class Scores>
  CUTE_DEVICE void apply(Scores& scores) const {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(scores); ++i) scores(i) = tanhf(scores(i) * prescale);
  }
};

}  // namespace fa4::sm90
