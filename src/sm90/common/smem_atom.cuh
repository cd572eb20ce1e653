// The shared-memory swizzle atom of a K-major wgmma operand tile, shared by the kernels' configs.
#pragma once

#include <type_traits>

#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace fa4::sm90 {

// The widest swizzle whose atom divides a row of kElements (128 bytes for multiples of 64 bf16 /
// fp16 elements, 64 bytes for 32, else 32): conflict-free for wgmma and a legal TMA box. A tile
// read transposed (MN-major) must also start its operand on an atom boundary, so the caller passes
// the width of the narrowest such slice.
template <class Element, int kElements>
using SmemAtom = std::conditional_t<
    (kElements * sizeof(Element)) % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
    std::conditional_t<(kElements * sizeof(Element)) % 64 == 0,
                       cute::GMMA::Layout_K_SW64_Atom<Element>,
                       cute::GMMA::Layout_K_SW32_Atom<Element>>>;

}  // namespace fa4::sm90
