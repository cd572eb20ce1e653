// A wgmma accumulator fragment seen as (rows, cols) (fragment.cuh): layout code alone, so that
// host code (the CPU tests) can view the kernel's own partitions the way the kernel does.
#pragma once

#include <cute/tensor.hpp>

namespace fa4::sm90 {

// ((2, 2, V), M, N) → ((2, M), (2, V, N)): mode 0 indexes the thread's rows, mode 1 its columns.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol_layout(Layout acc) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3, "expects a wgmma accumulator");
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)),
                     make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

template <class Tensor>
CUTE_HOST_DEVICE auto rowcol_view(Tensor&& t) {
  return cute::make_tensor(t.data(), rowcol_layout(t.layout()));
}

}  // namespace fa4::sm90
