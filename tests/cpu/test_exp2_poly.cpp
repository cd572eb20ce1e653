// The software exp2 (src/common/exp2_poly.hpp), host path, on dense grids. The device path is
// checked bit for bit against this one in tests/gpu/test_exp2_poly.cu.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/exp2_poly.hpp"

namespace fa4 {
namespace {

// The bound; the fit's own maximum is 8.6e-5.
constexpr double kMaxRelError = 1e-4;

double rel_error(float x) {
  const double want = std::exp2(double(x));
  return std::fabs(double(exp2_poly(x)) - want) / want;
}

TEST(Exp2Poly, RelativeErrorOverTheNormalRange) {
  double worst = 0.0;
  float worst_x = 0.0f;
  for (int64_t i = -126 * 4096; i <= 127 * 4096; ++i) {  // step 2^-12 over [-126, 127]
    const float x = float(i) / 4096.0f;
    const double e = rel_error(x);
    if (!(e <= worst)) {
      worst = e;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, kMaxRelError) << "at x = " << worst_x;
  EXPECT_GT(worst, 1e-5) << "the polynomial cannot be this exact: is exp2_poly calling exp2?";
}

TEST(Exp2Poly, EveryFractionOfOneUnit) {
  // All floats of [-1, 0) at 2^-23 spacing: the softmax's inputs (x - max <= 0) live here and below.
  double worst = 0.0;
  for (int32_t i = 1; i <= (1 << 23); ++i) {
    const float x = -float(i) * 0x1p-23f;
    worst = std::fmax(worst, rel_error(x));
  }
  EXPECT_LE(worst, kMaxRelError);
}

TEST(Exp2Poly, IntegersAreExact) {
  for (int k = -126; k <= 127; ++k)
    EXPECT_EQ(exp2_poly(float(k)), std::ldexp(1.0f, k)) << "k = " << k;
}

TEST(Exp2Poly, BelowTheRangeIsTinyAndNonNegative) {
  const float tiny = std::numeric_limits<float>::min();  // 2^-126
  for (float x : {-127.0f, -126.5f, -128.0f, -1000.0f, -std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::max()}) {
    const float r = exp2_poly(x);
    EXPECT_GE(r, 0.0f) << "x = " << x;
    EXPECT_LT(r, tiny) << "x = " << x;
  }
  EXPECT_EQ(exp2_poly(-std::numeric_limits<float>::infinity()), 0.0f);
}

}  // namespace
}  // namespace fa4
