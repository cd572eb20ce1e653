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
// FP8 e4m3 ("e4m3fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111
// is NaN, the largest finite value is 448 and the smallest subnormal 2^-9.
struct e4m3_t {
  uint8_t bits;
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

inline float to_float(e4m3_t x) {
  const uint32_t exp = (x.bits >> 3) & 0xfu;
  const uint32_t man = x.bits & 0x7u;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = bits_float(0x7fc00000u);
  } else if (exp != 0) {
    mag = bits_float(((exp + 120u) << 23) | (man << 20));  // exponent rebiased from 7 to 127
  } else {
    mag = float(man) * 0x1p-9f;  // zero or subnormal: man · 2^-9
  }
  return (x.bits & 0x80u) ? -mag : mag;
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

// Round to nearest even, saturating: every finite value beyond ±448 (and ±inf) becomes ±448, as
// the GPU's cvt.rn.satfinite does; NaN stays NaN.
inline e4m3_t to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return e4m3_t{uint8_t(sign | 0x7fu)};
  if (abs >= 0x43e00000u) return e4m3_t{uint8_t(sign | 0x7eu)};  // ≥ 448
  if (abs >= 0x3c800000u) {                                       // ≥ 2^-6: normal
    uint32_t v = abs - (120u << 23);
    v += 0x7ffffu + ((v >> 20) & 1u);
    return e4m3_t{uint8_t(sign | (v >> 20))};  // below 448: the carry stays finite
  }
  // subnormal (or zero): round |f| / 2^-9 to an integer, ties to even; 8 is 2^-6, the smallest
  // normal, whose bits are 8 too
  return e4m3_t{uint8_t(sign | uint8_t(std::nearbyint(bits_float(abs) * 512.0f)))};
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16_t from_float<bf16_t>(float f) { return to_bf16(f); }
template <>
inline fp16_t from_float<fp16_t>(float f) { return to_fp16(f); }
template <>
inline e4m3_t from_float<e4m3_t>(float f) { return to_e4m3(f); }

// Rounds f to the precision of dtype and back (the value a tensor of that dtype would hold).
inline float round_to(DType dtype, float f) {
  switch (dtype) {
    case DType::kBF16: return to_float(to_bf16(f));
    case DType::kFP16: return to_float(to_fp16(f));
    case DType::kE4M3: return to_float(to_e4m3(f));
    default: return f;
  }
}

inline size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFP32: return 4;
    case DType::kE4M3: return 1;
    default: return 2;
  }
}

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kE4M3: return "e4m3";
  }
  return "an unknown dtype";
}

// The dtype of the output (and of the tensors read in the output's precision: appended rows that
// are quantised on write, rotary tables): the problem's, or with e4m3 inputs fp8.out_dtype.
inline DType output_dtype(const Problem& p) {
  return p.dtype == DType::kE4M3 ? p.fp8.out_dtype : p.dtype;
}

// Calls fn with a value of the storage type of dtype: fn(float{}), fn(bf16_t{}), fn(fp16_t{}) or
// fn(e4m3_t{}).
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: return fn(bf16_t{});
    case DType::kFP16: return fn(fp16_t{});
    case DType::kE4M3: return fn(e4m3_t{});
    default: return fn(float{});
  }
}

}  // namespace fa4
