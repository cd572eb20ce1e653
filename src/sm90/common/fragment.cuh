// Register fragments of the warpgroup MMAs seen the way the softmax needs them.
//
// A 64×N wgmma accumulator gives each thread values indexed ((2, 2, N/8), MMA_M, MMA_N): a pair of
// adjacent columns, the row 8 below, and the N/8 column groups. Softmax works on rows, so it views
// the fragment as (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)). The k16 A operand of the PV wgmma
// holds ((2, 2, 2), MMA_M, K/16) per thread — the same registers as the accumulator with column
// groups taken in pairs — so P goes from the QKᵀ accumulator into the PV MMA without a shuffle.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "sm90/common/rowcol.hpp"

namespace fa4::sm90 {

using namespace cute;

// ((2, 2, V), 1, 1) accumulator → ((2, 2, 2), 1, V/2) A-operand layout of a k16 wgmma.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_operand_a_layout(Layout acc) {
  static_assert(size<1>(Layout{}) == 1 && size<2>(Layout{}) == 1,
                "the S tile of one warpgroup is a single 64×N atom");
  static_assert(size<0, 2>(Layout{}) % 2 == 0, "N must be a multiple of 16");
  auto v = get<0>(acc);
  auto groups = logical_divide(get<2>(v), Int<2>{});  // (2, V/2)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(groups)), get<1>(acc),
                     get<1>(groups));
}

// dst ← src rounded to dst's type (packed conversions, round to nearest even). Both fragments
// hold the same number of values in the same register order.
template <class Src, class Dst>
CUTE_DEVICE void convert_fragment(Src const& src, Dst& dst) {
  using From = typename std::decay_t<Src>::value_type;
  using To = typename std::decay_t<Dst>::value_type;
  constexpr int kSize = decltype(size(src))::value;
  static_assert(decltype(size(dst))::value == kSize);
  cutlass::NumericArrayConverter<To, From, kSize> convert;
  *reinterpret_cast<cutlass::Array<To, kSize>*>(raw_pointer_cast(dst.data())) =
      convert(*reinterpret_cast<cutlass::Array<From, kSize> const*>(raw_pointer_cast(src.data())));
}

}  // namespace fa4::sm90
