// The bf16 / fp16 / e4m3 conversions of src/common/numeric.hpp against oracles built another way:
// formats decoded from their fields with ldexp, and rounding by searching the sorted table of a
// format's values for the nearest one (ties to the even significand). Checked on every pattern, on
// every rounding boundary (midpoints and their float neighbours), and on a dense sweep of floats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"

namespace fa4 {
namespace {

struct Format {
  const char* name;
  int exp_bits, man_bits;
  uint16_t (*from)(float);  // the library's conversion under test
  float (*to)(uint16_t);    // the library's decoding under test
};

const Format kBF16{"bf16", 8, 7, [](float f) { return to_bf16(f).bits; },
                   [](uint16_t b) { return to_float(bf16_t{b}); }};
const Format kFP16{"fp16", 5, 10, [](float f) { return to_fp16(f).bits; },
                   [](uint16_t b) { return to_float(fp16_t{b}); }};

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The value a bit pattern encodes, from its sign, exponent and significand fields.
double decode(const Format& f, uint32_t bits) {
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  const uint32_t man = bits & ((1u << f.man_bits) - 1);
  const uint32_t exp = (bits >> f.man_bits) & exp_all_ones;
  const bool negative = (bits >> (f.exp_bits + f.man_bits)) & 1u;
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  double magnitude;
  if (exp == exp_all_ones)
    magnitude = man != 0 ? kNaN : kInf;
  else if (exp == 0)
    magnitude = std::ldexp(double(man), 1 - bias - f.man_bits);  // subnormal
  else
    magnitude = std::ldexp(double(man | (1u << f.man_bits)), int(exp) - bias - f.man_bits);
  return negative ? -magnitude : magnitude;
}

uint32_t sign_bit(const Format& f) { return 1u << (f.exp_bits + f.man_bits); }
uint32_t inf_bits(const Format& f) { return ((1u << f.exp_bits) - 1) << f.man_bits; }

// Every non-negative finite value of a format in increasing order (its bit patterns are too),
// followed by the value one ulp above the largest, 2^(emax+1): rounding to it means overflow.
struct Table {
  std::vector<double> values;
  std::vector<uint32_t> bits;
};

Table table(const Format& f) {
  Table t;
  for (uint32_t b = 0; b < inf_bits(f); ++b) {
    t.values.push_back(decode(f, b));
    t.bits.push_back(b);
  }
  const int emax = (1 << (f.exp_bits - 1)) - 1;
  t.values.push_back(std::ldexp(1.0, emax + 1));
  t.bits.push_back(inf_bits(f));  // even significand (0): ties at the top go to infinity
  return t;
}

// Round to nearest, ties to even, by search: the expected bit pattern for x.
uint32_t nearest(const Format& f, const Table& t, float x) {
  const uint32_t sign = std::signbit(x) ? sign_bit(f) : 0u;
  const double a = std::fabs(double(x));
  if (std::isinf(a)) return sign | inf_bits(f);
  if (a >= t.values.back()) return sign | inf_bits(f);
  const size_t hi =
      size_t(std::upper_bound(t.values.begin(), t.values.end(), a) - t.values.begin());
  // values[lo] ≤ a < values[hi]; the distances are exact in double.
  const size_t lo = hi - 1;
  const double below = a - t.values[lo], above = t.values[hi] - a;
  size_t pick;
  if (below < above)
    pick = lo;
  else if (above < below)
    pick = hi;
  else
    pick = (t.bits[lo] & 1u) == 0 ? lo : hi;
  return sign | t.bits[pick];
}

bool same_value(double x, double y) {
  if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
  return x == y && std::signbit(x) == std::signbit(y);
}

void expect_decodes_every_pattern(const Format& f) {
  int64_t mismatches = 0;
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const double want = decode(f, b), got = f.to(uint16_t(b));
    if (!same_value(want, got) && mismatches++ < 5)
      ADD_FAILURE() << f.name << " 0x" << std::hex << b << std::dec << " decodes to " << got
                    << ", expected " << want;
  }
  EXPECT_EQ(mismatches, 0) << f.name;
}

// Converting x must give the nearest value, ties to even; NaN gives some NaN of either sign.
int64_t count_rounding_errors(const Format& f, const Table& t, const std::vector<float>& inputs) {
  int64_t errors = 0;
  for (float x : inputs) {
    const uint32_t got = f.from(x);
    bool ok;
    uint32_t want = 0;
    if (std::isnan(x)) {
      ok = std::isnan(decode(f, got));
    } else {
      want = nearest(f, t, x);
      ok = got == want;
    }
    if (!ok && errors++ < 5)
      ADD_FAILURE() << f.name << ": " << x << " (float bits 0x" << std::hex << float_bits(x)
                    << ") converts to 0x" << got << ", expected 0x" << want << std::dec;
  }
  return errors;
}

// Floats at and next to every rounding boundary of the format: each value, the midpoint between it
// and the next (a tie), one float ulp on either side of both, for both signs.
std::vector<float> boundary_inputs(const Table& t) {
  std::vector<float> in;
  for (size_t i = 0; i + 1 < t.values.size(); ++i) {
    const float v = float(t.values[i]);
    const float mid = float((t.values[i] + t.values[i + 1]) / 2);  // exact: one more bit
    for (float x : {v, mid}) {
      const float around[] = {x, std::nextafter(x, 0.0f),
                              std::nextafter(x, std::numeric_limits<float>::infinity())};
      for (float y : around) {
        in.push_back(y);
        in.push_back(-y);
      }
    }
  }
  return in;
}

// A float every `stride` bit patterns over the whole 32-bit space (NaNs and infinities included),
// plus the float subnormals' edges and the largest float.
std::vector<float> sweep_inputs() {
  constexpr uint64_t kStride = 251;  // prime: the sweep meets every low-bit pattern
  std::vector<float> in;
  for (uint64_t b = 0; b <= 0xffffffffull; b += kStride) in.push_back(bits_float(uint32_t(b)));
  for (uint32_t b : {0x00000001u, 0x007fffffu, 0x00800000u, 0x7f7fffffu, 0x7f800000u, 0x7f800001u,
                     0x7fc00000u, 0x7fffffffu})
    for (uint32_t s : {0u, 0x80000000u}) in.push_back(bits_float(b | s));
  return in;
}

TEST(Numeric, Bf16DecodesEveryPattern) { expect_decodes_every_pattern(kBF16); }
TEST(Numeric, Fp16DecodesEveryPattern) { expect_decodes_every_pattern(kFP16); }

TEST(Numeric, Bf16RoundsEveryBoundaryToNearestEven) {
  const Table t = table(kBF16);
  EXPECT_EQ(count_rounding_errors(kBF16, t, boundary_inputs(t)), 0);
}

TEST(Numeric, Fp16RoundsEveryBoundaryToNearestEven) {
  const Table t = table(kFP16);
  EXPECT_EQ(count_rounding_errors(kFP16, t, boundary_inputs(t)), 0);
}

TEST(Numeric, Bf16RoundsDenseSweep) {
  EXPECT_EQ(count_rounding_errors(kBF16, table(kBF16), sweep_inputs()), 0);
}

TEST(Numeric, Fp16RoundsDenseSweep) {
  EXPECT_EQ(count_rounding_errors(kFP16, table(kFP16), sweep_inputs()), 0);
}

TEST(Numeric, EveryPatternRoundTrips) {
  for (const Format* f : {&kBF16, &kFP16}) {
    int64_t failures = 0;
    for (uint32_t b = 0; b <= 0xffffu; ++b) {
      const float x = f->to(uint16_t(b));
      const uint32_t back = f->from(x);
      const bool ok = std::isnan(x) ? std::isnan(decode(*f, back)) : back == b;
      if (!ok && failures++ < 5)
        ADD_FAILURE() << f->name << " 0x" << std::hex << b << " -> " << x << " -> 0x" << back;
    }
    EXPECT_EQ(failures, 0) << f->name;
  }
}

// The edges spelled out, so that a failure names the case plainly.
TEST(Numeric, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(to_fp16(65504.0f).bits, 0x7bffu);   // largest finite
  EXPECT_EQ(to_fp16(65519.99f).bits, 0x7bffu);  // just below the tie
  EXPECT_EQ(to_fp16(65520.0f).bits, 0x7c00u);   // the tie overflows (even)
  EXPECT_EQ(to_fp16(1e6f).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(-1e6f).bits, 0xfc00u);
  EXPECT_EQ(to_fp16(inf).bits, 0x7c00u);
  EXPECT_EQ(to_fp16(std::ldexp(1.0f, -24)).bits, 0x0001u);  // smallest subnormal
  EXPECT_EQ(to_fp16(std::ldexp(1.0f, -25)).bits, 0x0000u);  // its half: tie to even 0
  EXPECT_EQ(to_fp16(std::ldexp(1.5f, -25)).bits, 0x0001u);
  EXPECT_EQ(to_fp16(std::ldexp(3.0f, -25)).bits, 0x0002u);  // 1.5 ulp: tie to even 2
  EXPECT_EQ(to_fp16(-0.0f).bits, 0x8000u);
  EXPECT_EQ(to_fp16(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00u);      // tie at 1: down to even
  EXPECT_EQ(to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02u);  // tie: up to even
  EXPECT_TRUE(std::isnan(to_float(to_fp16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(to_float(to_fp16(bits_float(0x7f800001u)))));  // signalling: not inf

  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);  // overflows to inf
  EXPECT_EQ(to_bf16(bits_float(0x7f7f7fffu)).bits, 0x7f7fu);            // below the top tie
  EXPECT_EQ(to_bf16(bits_float(0x7f7f8000u)).bits, 0x7f80u);            // the tie overflows
  EXPECT_EQ(to_bf16(-inf).bits, 0xff80u);
  EXPECT_EQ(to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80u);        // tie: down to even
  EXPECT_EQ(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82u);    // tie: up to even
  EXPECT_EQ(to_bf16(bits_float(0x00000001u)).bits, 0x0000u);            // float subnormal → 0
  EXPECT_EQ(to_bf16(bits_float(0x00008000u)).bits, 0x0000u);            // tie to even 0
  EXPECT_EQ(to_bf16(bits_float(0x00018000u)).bits, 0x0002u);            // tie to even 2
  EXPECT_EQ(to_bf16(bits_float(0x80000001u)).bits, 0x8000u);            // keeps the sign
  EXPECT_TRUE(std::isnan(to_float(to_bf16(bits_float(0x7f800001u)))));  // would carry into inf
  EXPECT_TRUE(std::isnan(to_float(to_bf16(bits_float(0xffffffffu)))));
}

TEST(Numeric, RoundToMatchesTheConversions) {
  SCOPED_TRACE(test::seed_note());
  std::mt19937_64 rng = test::make_rng("Numeric.RoundToMatchesTheConversions");
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int n = 0; n < 100000; ++n) {
    const float x = normal(rng);
    ASSERT_EQ(float_bits(round_to(DType::kBF16, x)), float_bits(to_float(to_bf16(x)))) << x;
    ASSERT_EQ(float_bits(round_to(DType::kFP16, x)), float_bits(to_float(to_fp16(x)))) << x;
    ASSERT_EQ(float_bits(round_to(DType::kFP32, x)), float_bits(x)) << x;
  }
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP32), 4u);
  EXPECT_EQ(dtype_size(DType::kE4M3), 1u);
}

// ---- e4m3: no infinities, NaN only as S.1111.111, and conversions that saturate at ±448.

// The value of an e4m3 pattern from its fields (bias 7; exponent 0 subnormal).
double decode_e4m3(uint32_t bits) {
  const uint32_t exp = (bits >> 3) & 0xfu, man = bits & 0x7u;
  double magnitude;
  if (exp == 0xf && man == 0x7)
    magnitude = kNaN;
  else if (exp == 0)
    magnitude = std::ldexp(double(man), -9);
  else
    magnitude = std::ldexp(double(man | 8u), int(exp) - 10);
  return (bits & 0x80u) ? -magnitude : magnitude;
}

TEST(Numeric, E4m3DecodesEveryPattern) {
  for (uint32_t b = 0; b < 256; ++b)
    EXPECT_TRUE(same_value(to_float(e4m3_t{uint8_t(b)}), decode_e4m3(b))) << "0x" << std::hex << b;
  EXPECT_EQ(decode_e4m3(0x7e), 448.0);
  EXPECT_EQ(decode_e4m3(0x01), std::ldexp(1.0, -9));
}

// The nearest finite e4m3 value, ties to the even significand, by search; beyond ±448 (and ±inf)
// the largest (saturation); NaN to NaN.
uint32_t nearest_e4m3(float x) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (uint32_t b = 0; b <= 0x7e; ++b) v.push_back(decode_e4m3(b));
    return v;
  }();
  const uint32_t sign = std::signbit(x) ? 0x80u : 0u;
  const double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7eu;
  const size_t hi = size_t(std::upper_bound(values.begin(), values.end(), a) - values.begin());
  const size_t lo = hi - 1;
  const double below = a - values[lo], above = values[hi] - a;
  const size_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | uint32_t(pick);
}

TEST(Numeric, E4m3RoundsToNearestEvenAndSaturates) {
  std::vector<float> in;
  for (uint32_t b = 0; b < 0x7e; ++b) {
    const float v = float(decode_e4m3(b));
    const float mid = float((decode_e4m3(b) + decode_e4m3(b + 1)) / 2);
    for (float x : {v, mid})
      for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, 1e30f)}) {
        in.push_back(y);
        in.push_back(-y);
      }
  }
  for (float x : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, 3.4e38f,
                  std::numeric_limits<float>::infinity(), 1e-30f, 0x1p-10f, 0x1p-11f})
    for (float y : {x, -x}) in.push_back(y);
  SCOPED_TRACE(test::seed_note());
  std::mt19937_64 rng = test::make_rng("Numeric.E4m3Rounds");
  std::normal_distribution<float> normal(0.0f, 64.0f);
  for (int n = 0; n < 200000; ++n) in.push_back(normal(rng));
  int64_t errors = 0;
  for (float x : in) {
    const uint32_t got = to_e4m3(x).bits, want = nearest_e4m3(x);
    if (got != want && errors++ < 5)
      ADD_FAILURE() << x << " converts to 0x" << std::hex << got << ", expected 0x" << want;
    if (got == want)
      EXPECT_EQ(float_bits(round_to(DType::kE4M3, x)), float_bits(to_float(to_e4m3(x))));
  }
  EXPECT_EQ(errors, 0);
  EXPECT_TRUE(std::isnan(to_float(to_e4m3(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(to_e4m3(-1e9f).bits, 0xfeu);
}

}  // namespace
}  // namespace fa4
