// The e4m3 P operand of the FP8 forward's P·V (src/sm90/fp8/p_operand.cuh) against CuTe's own
// partitions, on every thread of a warpgroup: the QKᵀ accumulator's (row, key) of each value and
// the k32 A operand's (row, k slot) of each byte. Each A byte must take the value of its row whose
// key is the one key_slots.hpp puts in its slot; the identity slot order, and the inverse
// permutation taken by mistake, must not. Then pack_p_e4m3 itself (its host branch, the same
// mapping) end to end, and the e4m3 conversion it relies on against an exhaustive nearest-value
// search: round to nearest even, subnormals, ±448 for anything larger (±inf too), NaN kept.
//
// The S tiles of 160 and 224 keys are single n160 / n224 atoms only with the kernels' extended
// wgmma shapes (cmake/fa4_sm90.cmake); without them CuTe tiles n32 atoms and the accumulator's
// register order changes, which the static_asserts below would catch.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include "sm90/fp8/key_slots.hpp"
#include "sm90/fp8/p_operand.cuh"

namespace {

using namespace cute;
using cutlass::float_e4m3_t;
using fa4::sm90::fp8::key_of_slot;
using fa4::sm90::fp8::p_acc_index;
using fa4::sm90::fp8::pack_e4m3x4;
using fa4::sm90::fp8::pack_p_e4m3;
using fa4::sm90::fp8::slot_of_key;

constexpr int kThreads = 128;  // one warpgroup

// The key a PV k slot holds under a slot order (slot within a 16-key group → key).
using SlotOrder = std::function<int(int)>;
int key_in_slot(int k, SlotOrder const& order) { return 16 * (k / 16) + order(k % 16); }

template <int N, int D>
struct Mmas {
  using E4M3 = float_e4m3_t;
  static auto qk() {
    return make_tiled_mma(GMMA::ss_op_selector<E4M3, E4M3, float, Shape<_64, Int<N>, Int<D>>>());
  }
  static auto pv() {
    return make_tiled_mma(GMMA::rs_op_selector<E4M3, E4M3, float, Shape<_64, Int<D>, Int<N>>,
                                               GMMA::Major::K, GMMA::Major::K>());
  }
};

struct MapCounts {
  long bytes = 0;       // A bytes compared, all threads
  long mismatches = 0;  // bytes whose selected value has another row or key
};

// For every thread and A byte: the accumulator value p_acc_index selects against the (row, key)
// the byte needs under `order`. With `check_bijection`, also that the selection takes each of the
// thread's values exactly once.
template <int N, int D>
MapCounts map_against(SlotOrder const& order, bool check_bijection) {
  auto qk = Mmas<N, D>::qk();
  auto pv = Mmas<N, D>::pv();
  MapCounts counts;
  for (int thread = 0; thread < kThreads; ++thread) {
    Tensor acc = qk.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<_64, Int<N>>{}));
    Tensor a = pv.get_thread_slice(thread).partition_A(make_identity_tensor(Shape<_64, Int<N>>{}));
    static_assert(decltype(size<0, 2>(acc))::value == N / 8 && decltype(size<1>(acc))::value == 1 &&
                      decltype(size<2>(acc))::value == 1,
                  "the QKᵀ accumulator is one 64×N atom: ((2, 2, N/8), 1, 1)");
    static_assert(decltype(size<0>(a))::value == 16 && decltype(size<1>(a))::value == 1 &&
                      decltype(size<2>(a))::value == N / 32,
                  "the P·V A operand is ((4, 2, 2), 1, N/32)");
    static_assert(decltype(size(a))::value == decltype(size(acc))::value);
    std::vector<int> taken(size(acc), 0);
    for (int i = 0; i < size(a); ++i) {
      const int reg = i / 4, byte = i % 4;
      const int j = p_acc_index(reg, byte);
      if (j < 0 || j >= size(acc)) {
        ++counts.mismatches;
        continue;
      }
      ++taken[j];
      const int row_a = get<0>(a(i)), slot = get<1>(a(i));
      const int row_c = get<0>(acc(j)), key_c = get<1>(acc(j));
      ++counts.bytes;
      if (row_c != row_a || key_c != key_in_slot(slot, order)) ++counts.mismatches;
    }
    if (check_bijection)
      for (int j = 0; j < size(acc); ++j)
        EXPECT_EQ(taken[j], 1) << "thread " << thread << " accumulator value " << j;
  }
  return counts;
}

// Does some thread lack, among all its accumulator values, the (row, key) an A byte needs? Then no
// in-register mapping can serve that slot order.
template <int N, int D>
long bytes_without_a_source(SlotOrder const& order) {
  auto qk = Mmas<N, D>::qk();
  auto pv = Mmas<N, D>::pv();
  long missing = 0;
  for (int thread = 0; thread < kThreads; ++thread) {
    Tensor acc = qk.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<_64, Int<N>>{}));
    Tensor a = pv.get_thread_slice(thread).partition_A(make_identity_tensor(Shape<_64, Int<N>>{}));
    for (int i = 0; i < size(a); ++i) {
      const int row = get<0>(a(i)), key = key_in_slot(get<1>(a(i)), order);
      bool found = false;
      for (int j = 0; j < size(acc) && !found; ++j)
        found = get<0>(acc(j)) == row && get<1>(acc(j)) == key;
      missing += found ? 0 : 1;
    }
  }
  return missing;
}

// pack_p_e4m3 on the real fragments: P drawn per (row, key); every A byte must be e4m3 of P at
// its row and its slot's key.
template <int N, int D>
void pack_end_to_end(std::mt19937& rng, long& bytes) {
  auto qk = Mmas<N, D>::qk();
  auto pv = Mmas<N, D>::pv();
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> p(64 * N);
  for (float& v : p) v = unit(rng) < 0.2f ? 500.0f * unit(rng) : unit(rng);  // P, some of it scaled
  // A K-major 64×N e4m3 tile for partition_fragment_A to take the fragment's layout from.
  std::vector<float_e4m3_t> tile(64 * N);
  Tensor a_tile = make_tensor(tile.data(), make_layout(Shape<_64, Int<N>>{}, LayoutRight{}));
  for (int thread = 0; thread < kThreads; ++thread) {
    auto qk_thr = qk.get_thread_slice(thread);
    auto pv_thr = pv.get_thread_slice(thread);
    Tensor acc_rc = qk_thr.partition_C(make_identity_tensor(Shape<_64, Int<N>>{}));
    Tensor a_rc = pv_thr.partition_A(make_identity_tensor(Shape<_64, Int<N>>{}));
    Tensor acc = partition_fragment_C(qk, Shape<_64, Int<N>>{});
    Tensor a_frag = pv_thr.partition_fragment_A(a_tile);
    // Register r of the wgmma is bytes 4r … 4r + 3 of the fragment.
    for (int i = 0; i < size(a_frag); ++i) ASSERT_EQ(int(a_frag.layout()(i)), i);
    for (int j = 0; j < size(acc); ++j) acc(j) = p[get<0>(acc_rc(j)) * N + get<1>(acc_rc(j))];
    pack_p_e4m3(acc, a_frag);
    for (int i = 0; i < size(a_frag); ++i) {
      const int row = get<0>(a_rc(i)), key = key_in_slot(get<1>(a_rc(i)), key_of_slot);
      ASSERT_EQ(int(a_frag(i).storage), int(float_e4m3_t::from_float(p[row * N + key]).storage))
          << "thread " << thread << " byte " << i << " row " << row << " key " << key;
      ++bytes;
    }
  }
}

template <int N, int D>
void check_shape() {
  const MapCounts permuted = map_against<N, D>(key_of_slot, true);
  EXPECT_EQ(permuted.bytes, long(kThreads) * 64 * N / 128) << "every byte of every thread";
  EXPECT_EQ(permuted.mismatches, 0);
  // The test can fail: the identity slot order, or slot_of_key taken for key_of_slot, is not what
  // the A operand needs from these registers, and the identity order cannot be served in-register
  // at all (lane t holds keys 2t, 2t + 1, 8 + 2t, 9 + 2t of a 16-key group, its A bytes slots
  // 4t … 4t + 3: only lanes 0 and 3 hold two of theirs).
  const auto identity = [](int s) { return s; };
  const MapCounts plain = map_against<N, D>(identity, false);
  const MapCounts inverse = map_against<N, D>(slot_of_key, false);
  EXPECT_GT(plain.mismatches, 0);
  EXPECT_GT(inverse.mismatches, 0);
  EXPECT_EQ((bytes_without_a_source<N, D>(key_of_slot)), 0);
  EXPECT_EQ((bytes_without_a_source<N, D>(identity)), long(kThreads) * 64 * N / 128 * 3 / 4);
  std::mt19937 rng(N * 1000 + D);
  long packed = 0;
  pack_end_to_end<N, D>(rng, packed);
  std::printf("[ fp8 P ] N=%d D=%d: %ld bytes mapped (%ld / %ld mismatched under identity / "
              "inverse order), %ld bytes packed\n",
              N, D, permuted.bytes, plain.mismatches, inverse.mismatches, packed);
}

TEST(Sm90Fp8POperand, SlotOrderIsAPermutationAndItsInverse) {
  int seen[16] = {};
  for (int s = 0; s < 16; ++s) {
    ASSERT_GE(key_of_slot(s), 0);
    ASSERT_LT(key_of_slot(s), 16);
    ++seen[key_of_slot(s)];
    EXPECT_EQ(slot_of_key(key_of_slot(s)), s);
    EXPECT_EQ(key_of_slot(slot_of_key(s)), s);
  }
  for (int k = 0; k < 16; ++k) EXPECT_EQ(seen[k], 1) << "key " << k;
  // The register mapping is the value index with bits 1 and 2 swapped.
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(p_acc_index(i / 4, i % 4), (i & ~6) | ((i >> 1) & 2) | ((i << 1) & 4)) << i;
}

TEST(Sm90Fp8POperand, MapsEveryByteN128) {
  check_shape<128, 64>();
  check_shape<128, 128>();
  check_shape<128, 256>();
}
TEST(Sm90Fp8POperand, MapsEveryByteN160) {
  check_shape<160, 64>();
  check_shape<160, 128>();
  check_shape<160, 256>();
}
TEST(Sm90Fp8POperand, MapsEveryByteN224) {
  check_shape<224, 64>();
  check_shape<224, 128>();
  check_shape<224, 256>();
}

// e4m3 (bias 7, no infinities, S.1111.111 the only NaN), decoded independently of CUTLASS.
double e4m3_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (code & 0x80) ? -mag : mag;
}

// cvt.rn.satfinite.e4m3x2.f32 of one value: the nearest finite e4m3, ties to the even code, and
// ±448 (S.1111.110) for anything of larger magnitude, infinities included; NaN → NaN. Found by
// search over all codes, so it shares nothing with the conversions under test.
int e4m3_reference(float x) {
  if (std::isnan(x)) return 0x7f;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  for (int code = 1; code <= 0x7e; ++code) {
    const double d = std::fabs(e4m3_value(code) - a), b = std::fabs(e4m3_value(best) - a);
    if (d < b || (d == b && (code & 1) == 0)) best = code;
  }
  return sign | best;
}

TEST(Sm90Fp8POperand, ConvertsLikeCvtRnSatfinite) {
  std::vector<float> xs = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::denorm_min(), 1e-30f, -1e-30f,
                           std::ldexp(1.0f, -10),  // half the smallest subnormal: ties to 0
                           std::nextafter(std::ldexp(1.0f, -10), 1.0f), 448.0f, 460.0f, 464.0f,
                           480.0f, 1e6f, std::numeric_limits<float>::max()};
  // Every code's value, the midpoints above it (ties) and their fp32 neighbours.
  for (int code = 0; code <= 0x7e; ++code) {
    const float v = float(e4m3_value(code));
    const float mid = float((e4m3_value(code) + (code == 0x7e ? 480.0 : e4m3_value(code + 1))) / 2);
    for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log2mag(-14.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back((i % 2 ? -1.0f : 1.0f) * std::exp2(log2mag(rng)));
  long checked = 0;
  for (float x : xs) {
    ASSERT_EQ(int(float_e4m3_t::from_float(x).storage), e4m3_reference(x)) << "x = " << x;
    ++checked;
  }
  // NaN stays NaN (the sign of the NaN is not specified).
  EXPECT_EQ(float_e4m3_t::from_float(std::numeric_limits<float>::quiet_NaN()).storage & 0x7f, 0x7f);
  // Register bytes in operand order: byte j of the register is the j-th value.
  EXPECT_EQ(pack_e4m3x4(1.0f, 2.0f, 3.0f, 4.0f), 0x48444038u);
  EXPECT_EQ(pack_e4m3x4(-0.0f, 1e9f, -1e9f, 0.001953125f), 0x01fe7e80u);
  std::printf("[ fp8 P ] %ld conversions checked\n", checked);
}

}  // namespace
