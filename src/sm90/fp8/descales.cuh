// The descales of an e4m3 forward as the kernel applies them: the stored values times their
// descales are the true ones, so a tile of (batch entry b, kv head h) scores q_descale · k_descale
// · (Q Kᵀ) and outputs v_descale · softmax(S) V. Both are per-tile constants: q·k's folds into the
// score scale (softcap: into its prescale, ahead of the tanh), v's into O's final normalisation.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

#include "fa4/attention.hpp"

namespace fa4::sm90::fp8 {

// The descale of (batch, kv_head) in the problem's view of it (DescaleView: data[b·batch_stride +
// h·head_stride], fp32 in device memory); null data: 1.
CUTE_DEVICE float descale_at(DescaleView const& d, int batch, int kv_head) {
  return d.data == nullptr ? 1.0f
                           : __ldg(d.data + batch * d.batch_stride + kv_head * d.head_stride);
}

struct Descales {
  DescaleView q, k, v;
};

// One tile's factors.
struct TileDescales {
  float qk = 1.0f;  // q_descale · k_descale: multiplies the scores' scale
  float v = 1.0f;   // multiplies O

  CUTE_DEVICE static TileDescales of(Descales const& d, int batch, int kv_head) {
    return {descale_at(d.q, batch, kv_head) * descale_at(d.k, batch, kv_head),
            descale_at(d.v, batch, kv_head)};
  }
};

}  // namespace fa4::sm90::fp8
