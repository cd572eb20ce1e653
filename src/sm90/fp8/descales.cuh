// The descales of an e4m3 forward as the kernel applies them: the stored values times their
// descales are the true ones, so a tile of (batch entry b, kv head h) scores q_descale · k_descale
// · (Q Kᵀ) and outputs v_descale · softmax(S) V. Both are per-tile constants: q·k's folds into the
// score scale (softcap: into its prescale, ahead of the tanh), v's into O's final normalisation.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace fa4::sm90::fp8 {

// One descale tensor, fp32 (batch, heads_kv): data[b·batch_stride + h·head_stride]; null: 1.
struct DescaleTensor {
  const float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;

  CUTE_DEVICE float at(int batch, int kv_head) const {
    return data == nullptr ? 1.0f : __ldg(data + batch * batch_stride + kv_head * head_stride);
  }
};

struct Descales {
  DescaleTensor q, k, v;
};

// One tile's factors.
struct TileDescales {
  float qk = 1.0f;  // q_descale · k_descale: multiplies the scores' scale
  float v = 1.0f;   // multiplies O

  CUTE_DEVICE static TileDescales of(Descales const& d, int batch, int kv_head) {
    return {d.q.at(batch, kv_head) * d.k.at(batch, kv_head), d.v.at(batch, kv_head)};
  }
};

}  // namespace fa4::sm90::fp8
