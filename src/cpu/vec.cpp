// Highway kernels of vec.hpp, compiled once per target by foreach_target.h (this file includes
// itself per target); the dispatch at the end picks a target by the processor's features. Each
// loop runs whole vectors and finishes the row's tail in scalar code, which computes the same
// function (std::exp, std::tanh) to within the vector versions' 1–4 ulp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/vec.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/vec.hpp"

HWY_BEFORE_NAMESPACE();
namespace fa4::cpu::vec {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

HWY_INLINE int64_t whole(const DF& d, int64_t n) {
  const int64_t lanes = int64_t(hn::Lanes(d));
  return n - n % lanes;
}

// exp(t), NaN staying NaN (Exp gives 0 below its range, which a NaN compares as).
template <typename V>
HWY_INLINE V ExpKeepNaN(const DF& d, V t) {
  return hn::IfThenElse(hn::IsNaN(t), t, hn::Exp(d, t));
}

void ExpRow(float* x, int64_t n, float scale, float sub) {
  const DF d;
  const int64_t end = whole(d, n);
  const auto vscale = hn::Set(d, scale);
  const auto vsub = hn::Set(d, sub);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d)))
    hn::StoreU(ExpKeepNaN(d, hn::MulSub(hn::LoadU(d, x + j), vscale, vsub)), d, x + j);
  for (int64_t j = end; j < n; ++j) x[j] = std::exp(scale * x[j] - sub);
}

void Scale(float* x, int64_t n, float a) {
  const DF d;
  const int64_t end = whole(d, n);
  const auto va = hn::Set(d, a);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d)))
    hn::StoreU(hn::Mul(hn::LoadU(d, x + j), va), d, x + j);
  for (int64_t j = end; j < n; ++j) x[j] *= a;
}

void Softcap(float* x, int64_t n, float scale, float cap, float* dcap) {
  const DF d;
  const int64_t end = whole(d, n);
  const float inner = scale / cap;
  const auto vinner = hn::Set(d, inner);
  const auto vcap = hn::Set(d, cap);
  const auto one = hn::Set(d, 1.0f);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d))) {
    const auto t = hn::Tanh(d, hn::Mul(hn::LoadU(d, x + j), vinner));
    if (dcap != nullptr) hn::StoreU(hn::NegMulAdd(t, t, one), d, dcap + j);
    hn::StoreU(hn::Mul(vcap, t), d, x + j);
  }
  for (int64_t j = end; j < n; ++j) {
    const float t = std::tanh(x[j] * inner);
    if (dcap != nullptr) dcap[j] = 1.0f - t * t;
    x[j] = cap * t;
  }
}

void ScoreGrad(const float* p, const float* dp, float dval, const float* dcap, float* ds,
               int64_t n) {
  const DF d;
  const int64_t end = whole(d, n);
  const auto vd = hn::Set(d, dval);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d))) {
    auto g = hn::Mul(hn::LoadU(d, p + j), hn::Sub(hn::LoadU(d, dp + j), vd));
    if (dcap != nullptr) g = hn::Mul(g, hn::LoadU(d, dcap + j));
    hn::StoreU(g, d, ds + j);
  }
  for (int64_t j = end; j < n; ++j) {
    const float g = p[j] * (dp[j] - dval);
    ds[j] = dcap != nullptr ? g * dcap[j] : g;
  }
}

void ColMax(const float* x, int64_t rows, int64_t cols, int64_t ld, float* m) {
  const DF d;
  const int64_t lanes = int64_t(hn::Lanes(d)), end = whole(d, cols);
  for (int64_t c = 0; c < end; c += lanes) {
    auto vm = hn::LoadU(d, m + c);
    auto nan = hn::IfThenElseZero(hn::IsNaN(vm), vm);  // Max does not propagate NaN
    for (int64_t r = 0; r < rows; ++r) {
      const auto v = hn::LoadU(d, x + r * ld + c);
      vm = hn::Max(vm, v);
      nan = hn::Or(nan, hn::IfThenElseZero(hn::IsNaN(v), v));
    }
    hn::StoreU(hn::IfThenElse(hn::IsNaN(nan), nan, vm), d, m + c);
  }
  for (int64_t c = end; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const float v = x[r * ld + c];
      m[c] = std::isnan(m[c]) ? m[c] : std::isnan(v) ? v : std::max(m[c], v);
    }
}

void ColExp(float* x, int64_t rows, int64_t cols, int64_t ld, float scale, const float* sub,
            float* sum) {
  const DF d;
  const int64_t lanes = int64_t(hn::Lanes(d)), end = whole(d, cols);
  const auto vscale = hn::Set(d, scale);
  for (int64_t c = 0; c < end; c += lanes) {
    const auto vs = hn::LoadU(d, sub + c);
    auto acc = hn::Zero(d);
    for (int64_t r = 0; r < rows; ++r) {
      const auto e = ExpKeepNaN(d, hn::MulSub(hn::LoadU(d, x + r * ld + c), vscale, vs));
      hn::StoreU(e, d, x + r * ld + c);
      acc = hn::Add(acc, e);
    }
    if (sum != nullptr) hn::StoreU(hn::Add(hn::LoadU(d, sum + c), acc), d, sum + c);
  }
  for (int64_t c = end; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      float& v = x[r * ld + c];
      v = std::exp(scale * v - sub[c]);
      if (sum != nullptr) sum[c] += v;
    }
}

void ColScoreGrad(const float* p, const float* dp, int64_t rows, int64_t cols, int64_t ld,
                  const float* dval, const float* dcap, float* ds) {
  const DF d;
  const int64_t lanes = int64_t(hn::Lanes(d)), end = whole(d, cols);
  for (int64_t c = 0; c < end; c += lanes) {
    const auto vd = hn::LoadU(d, dval + c);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t e = r * ld + c;
      auto g = hn::Mul(hn::LoadU(d, p + e), hn::Sub(hn::LoadU(d, dp + e), vd));
      if (dcap != nullptr) g = hn::Mul(g, hn::LoadU(d, dcap + e));
      hn::StoreU(g, d, ds + e);
    }
  }
  for (int64_t c = end; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t e = r * ld + c;
      const float g = p[e] * (dp[e] - dval[c]);
      ds[e] = dcap != nullptr ? g * dcap[e] : g;
    }
}

float Dot(const float* a, const float* b, int64_t n) {
  const DF d;
  const int64_t end = whole(d, n);
  auto sum = hn::Zero(d);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d)))
    sum = hn::MulAdd(hn::LoadU(d, a + j), hn::LoadU(d, b + j), sum);
  float total = hn::GetLane(hn::SumOfLanes(d, sum));
  for (int64_t j = end; j < n; ++j) total += a[j] * b[j];
  return total;
}

void Bf16ToFloat(const uint16_t* src, float* dst, int64_t n) {
  const DF d;
  const hn::RebindToUnsigned<DF> du32;
  const hn::Rebind<uint16_t, DF> du16;
  const int64_t end = whole(d, n);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d))) {
    const auto bits = hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, src + j)));
    hn::StoreU(hn::BitCast(d, bits), d, dst + j);
  }
  for (int64_t j = end; j < n; ++j) dst[j] = fa4::to_float(bf16_t{src[j]});
}

void Fp16ToFloat(const hwy::float16_t* src, float* dst, int64_t n) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int64_t end = whole(d, n);
  for (int64_t j = 0; j < end; j += int64_t(hn::Lanes(d)))
    hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, src + j)), d, dst + j);
  for (int64_t j = end; j < n; ++j) {
    fp16_t h;
    std::memcpy(&h, src + j, sizeof h);
    dst[j] = fa4::to_float(h);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fa4::cpu::vec
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fa4::cpu::vec {
namespace {

// One target's functions.
struct Kernels {
  const char* name;
  void (*exp)(float*, int64_t, float, float);
  void (*scale)(float*, int64_t, float);
  void (*softcap)(float*, int64_t, float, float, float*);
  void (*score_grad)(const float*, const float*, float, const float*, float*, int64_t);
  void (*col_max)(const float*, int64_t, int64_t, int64_t, float*);
  void (*col_exp)(float*, int64_t, int64_t, int64_t, float, const float*, float*);
  void (*col_score_grad)(const float*, const float*, int64_t, int64_t, int64_t, const float*,
                         const float*, float*);
  float (*dot)(const float*, const float*, int64_t);
  void (*bf16)(const uint16_t*, float*, int64_t);
  void (*fp16)(const hwy::float16_t*, float*, int64_t);
};

// The table of a target; QUALIFY(F) names F in that target's namespace.
#define FA4_VEC_KERNELS(QUALIFY, NAME)                                                        \
  Kernels {                                                                                   \
    NAME, &QUALIFY(ExpRow), &QUALIFY(Scale), &QUALIFY(Softcap),                               \
        &QUALIFY(ScoreGrad), &QUALIFY(ColMax), &QUALIFY(ColExp), &QUALIFY(ColScoreGrad),      \
        &QUALIFY(Dot), &QUALIFY(Bf16ToFloat), &QUALIFY(Fp16ToFloat)                           \
  }
#define FA4_VEC_AVX3(F) N_AVX3::F
#define FA4_VEC_AVX2(F) N_AVX2::F

Kernels pick() {
#if HWY_ARCH_X86
  __builtin_cpu_init();
#if HWY_TARGETS & HWY_AVX3
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
    return FA4_VEC_KERNELS(FA4_VEC_AVX3, "AVX-512");
#endif
#if HWY_TARGETS & HWY_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
    return FA4_VEC_KERNELS(FA4_VEC_AVX2, "AVX2");
#endif
#endif
  return FA4_VEC_KERNELS(HWY_STATIC_DISPATCH, "baseline");
}

const Kernels& kernels() {
  static const Kernels k = pick();
  return k;
}

}  // namespace

void exp(float* x, int64_t n, float scale, float sub) { kernels().exp(x, n, scale, sub); }
void scale(float* x, int64_t n, float a) { kernels().scale(x, n, a); }
void softcap(float* x, int64_t n, float scale, float cap, float* dcap) {
  kernels().softcap(x, n, scale, cap, dcap);
}
void score_grad(const float* p, const float* dp, float d, const float* dcap, float* ds,
                int64_t n) {
  kernels().score_grad(p, dp, d, dcap, ds, n);
}
void col_max(const float* x, int64_t rows, int64_t cols, int64_t ld, float* m) {
  kernels().col_max(x, rows, cols, ld, m);
}
void col_exp(float* x, int64_t rows, int64_t cols, int64_t ld, float scale, const float* sub,
             float* sum) {
  kernels().col_exp(x, rows, cols, ld, scale, sub, sum);
}
void col_score_grad(const float* p, const float* dp, int64_t rows, int64_t cols, int64_t ld,
                    const float* d, const float* dcap, float* ds) {
  kernels().col_score_grad(p, dp, rows, cols, ld, d, dcap, ds);
}
float dot(const float* a, const float* b, int64_t n) { return kernels().dot(a, b, n); }
void to_float(const bf16_t* src, float* dst, int64_t n) {
  kernels().bf16(reinterpret_cast<const uint16_t*>(src), dst, n);
}
void to_float(const fp16_t* src, float* dst, int64_t n) {
  kernels().fp16(reinterpret_cast<const hwy::float16_t*>(src), dst, n);
}
void to_float(const e4m3_t* src, float* dst, int64_t n) {
  // A table of the 256 values: one load per element, built once.
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[size_t(b)] = fa4::to_float(e4m3_t{uint8_t(b)});
    return t;
  }();
  for (int64_t j = 0; j < n; ++j) dst[j] = table[src[j].bits];
}
const char* isa() { return kernels().name; }

}  // namespace fa4::cpu::vec
#endif  // HWY_ONCE
