// The rotary embedding (RoPE) as the KV cache's appends apply it: the first `dim` elements of a row
// rotated in pairs by the angle of its position. Interleaved (GPT-J) pairs elements (2i, 2i + 1);
// otherwise (GPT-NeoX) (i, i + dim / 2). cos / sin are the tables' rows for the position, dim / 2
// values each. Shared by the CPU backend and the kernels.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"

namespace fa4 {

FA4_HD void rotate_row(float* x, int64_t dim, const float* cos, const float* sin,
                       bool interleaved) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t lo = interleaved ? 2 * i : i;
    const int64_t hi = interleaved ? 2 * i + 1 : i + half;
    const float a = x[lo], b = x[hi];
    x[lo] = a * cos[i] - b * sin[i];
    x[hi] = a * sin[i] + b * cos[i];
  }
}

}  // namespace fa4
