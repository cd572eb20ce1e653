// FA4's software exp2: 2^x on the FMA pipe, to relieve the MUFU unit (16 ex2/clk/SM on Hopper,
// against 128 FMA/clk/SM). x is split exactly into floor(x) and a fraction f in [0, 1); 2^f comes
// from a degree-3 polynomial (Horner, 3 FMAs) and 2^floor(x) is added to the result's exponent
// field with one integer add. Max relative error 8.6e-5 over the normal range (tests/cpu and
// tests/gpu check it on a dense grid), far below a bf16/fp16 P's rounding (2^-9 / 2^-12).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/host_device.hpp"

namespace fa4 {

// Minimax (relative error) fit of 2^f on [0, 1] with the constant term fixed at 1: 2^0 is then
// exact, and the clamp below lands on exactly +0.0 instead of a wrapped exponent.
struct Exp2Poly {
  static constexpr float c1 = 0.6951167583465576f;
  static constexpr float c2 = 0.22764499485492706f;
  static constexpr float c3 = 0.07706703990697861f;
  // Below this the exponent field of the result would underflow: results are then denormal-sized
  // (< 2^-126), positive, and 0 at the clamp — all that a softmax needs of them.
  static constexpr float kMinInput = -127.0f;
};

FA4_HD int32_t float_as_int(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
#endif
}

FA4_HD float int_as_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
#endif
}

FA4_HD float exp2_poly(float x) {
  x = fmaxf(x, Exp2Poly::kMinInput);  // also maps −inf (masked scores) to the clamp: 2^x = +0
#if defined(__CUDA_ARCH__)
  // floor on the FMA pipe: adding 1.5·2^23 with round-down leaves floor(x) in the low mantissa
  // bits (|x| < 2^22), and subtracting it back is exact.
  constexpr float kRoundShift = 12582912.0f;  // 2^23 + 2^22
  const float shifted = __fadd_rd(x, kRoundShift);
  const float whole = shifted - kRoundShift;
  const int32_t exponent = float_as_int(shifted) - float_as_int(kRoundShift);
#else
  const float whole = std::floor(x);
  const int32_t exponent = int32_t(whole);
#endif
  const float frac = x - whole;  // exact, in [0, 1)
  const float p = fmaf(fmaf(fmaf(Exp2Poly::c3, frac, Exp2Poly::c2), frac, Exp2Poly::c1), frac, 1.0f);
  // Unsigned arithmetic: a negative exponent wraps (mod 2^32) to the same bits, without UB.
  return int_as_float(int32_t(uint32_t(float_as_int(p)) + (uint32_t(exponent) << 23)));
}

}  // namespace fa4
