// The CUTLASS element type of a problem's dtype, for the launchers that instantiate kernels.
#pragma once

#include <cutlass/numeric_types.h>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

template <DType kDType>
struct CutlassElement;
template <>
struct CutlassElement<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<DType::kFP16> {
  using type = cutlass::half_t;
};
template <>
struct CutlassElement<DType::kE4M3> {
  using type = cutlass::float_e4m3_t;
};

}  // namespace fa4::sm90
