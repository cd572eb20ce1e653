// A per-row shift of a thread's tile of scores: the true score of row i is the given one plus
// c[i] (ALiBi's linear form, fwd/alibi_linear.hpp, leaves its per-row term out of the scores).
// The softmax (softmax.cuh) adds it to each thread's tile max before the quad's reduction and
// takes it out of the exponent; NoRowShift is the plain path, compiled as without a shift.
#pragma once

#include <type_traits>

#include <cute/container/array.hpp>

namespace fa4::sm90 {

struct NoRowShift {};

template <int kRows>
struct RowShift {
  cute::array<float, kRows> c;
};

template <class Shift>
inline constexpr bool kShifted = !std::is_same_v<Shift, NoRowShift>;

}  // namespace fa4::sm90
