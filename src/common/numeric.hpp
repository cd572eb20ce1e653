// Storage types of the problem's dtypes and their conversions to and from fp32 on the host.
// Conversions round to nearest even and keep NaN / Inf, matching the GPU's cvt.rn instructions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fa4/attention.hpp"

namespace fa4 {

struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bits_float(uint32_t(x.bits) << 16); }
inline float to_float(fp16_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  const uint32_t man = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man · 2^-24
  const float mag = std::ldexp(float(man), -24);
  return sign ? -mag : mag;
}

inline bf16_t to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}

inline fp16_t to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16_t{uint16_t(sign | 0x7e00u)};
  if (abs >= 0x477ff000u) return fp16_t{uint16_t(sign | 0x7c00u)};  // rounds to ≥ 65520: inf
  if (abs >= 0x38800000u) {                                          // normal half
    uint32_t v = abs - (112u << 23);
    v += 0xfffu + ((v >> 13) & 1u);
    return fp16_t{uint16_t(sign | (v >> 13))};
  }
  // subnormal half (or zero): round |f| / 2^-24 to an integer, ties to even
  const float scaled = bits_float(abs) * 16777216.0f;  // exact: a power-of-two scale
  return fp16_t{uint16_t(sign | uint16_t(std::nearbyint(scaled)))};
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16_t from_float<bf16_t>(float f) { return to_bf16(f); }
template <>
inline fp16_t from_float<fp16_t>(float f) { return to_fp16(f); }

// Rounds f to the precision of dtype and back (the value a tensor of that dtype would hold).
inline float round_to(DType dtype, float f) {
  switch (dtype) {
    case DType::kBF16: return to_float(to_bf16(f));
    case DType::kFP16: return to_float(to_fp16(f));
    default: return f;
  }
}

inline size_t dtype_size(DType dtype) { return dtype == DType::kFP32 ? 4 : 2; }

// Calls fn with a value of the storage type of dtype: fn(float{}), fn(bf16_t{}) or fn(fp16_t{}).
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: return fn(bf16_t{});
    case DType::kFP16: return fn(fp16_t{});
    default: return fn(float{});
  }
}

}  // namespace fa4
