// P from the QKᵀ accumulator into the e4m3 A operand of the k32 P·V wgmma, in place.
//
// A 64×N fp32 accumulator gives a thread the values ((2, 2, N/8), 1, 1): value i = c + 2h + 4g
// sits at row m + 8h (m = its row, from lane / 4 and the warp) and key 8g + 2t + c (t = lane % 4).
// The k32 e4m3 A fragment holds ((4, 2, 2), 1, N/32): value v = j + 4h + 8q + 16kb, byte j of
// register v / 4, sits at row m + 8h and k slot 32kb + 16q + 4t + j. With the slot order of
// key_slots.hpp (slot 4t + j of a 16-key group holds key 8(j / 2) + 2t + j % 2) both hold the same
// (row, key) pairs per thread, so each A register takes four accumulator values of one row,
// two from each of two adjacent 8-key blocks, and no value leaves its thread.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/float8.h>

#include "sm90/fp8/key_slots.hpp"

namespace fa4::sm90::fp8 {

using namespace cute;

// The accumulator value index that byte `byte` (< 4) of A register `reg` takes. Register
// reg = 4kb + 2q + h covers row half h and k slots 32kb + 16q + 4t + byte; the slot's key is
// 32kb + 16q + key_of_slot(4t + byte), and key_of_slot(4t + j) = key_of_slot(j) + 2t, the
// accumulator's own per-thread key offset, so t drops out. Equal to `reg·4 + byte` with bits 1 and
// 2 swapped.
CUTE_HOST_DEVICE constexpr int p_acc_index(int reg, int byte) {
  const int key = 32 * (reg / 4) + 16 * ((reg / 2) % 2) + key_of_slot(byte);  // lane t = 0's key
  return 4 * (key / 8) + 2 * (reg % 2) + key % 2;
}

// Four floats → one A register: byte j = e4m3(f_j), round to nearest even, saturated to ±448
// (±inf too), NaN → NaN. PTX's `cvt.rn.satfinite.e4m3x2.f32 d, a, b` puts a in d's upper byte and b
// in its lower, hence the swapped operands; `mov.b32 {lo, hi}` places the two halves, and ptxas
// folds it into the second F2FP's merge operand: two instructions per register, no PRMT.
CUTE_HOST_DEVICE uint32_t pack_e4m3x4(float f0, float f1, float f2, float f3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t out;
  asm("{\n"
      ".reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n"
      "}"
      : "=r"(out)
      : "f"(f0), "f"(f1), "f"(f2), "f"(f3));
  return out;
#else
  // CUTLASS's software conversion: the same rounding and saturation (tests/cpu/test_fp8_p_operand
  // checks it against an exhaustive nearest-value search).
  auto byte = [](float f) { return uint32_t(cutlass::float_e4m3_t::from_float(f).storage); };
  return byte(f0) | byte(f1) << 8 | byte(f2) << 16 | byte(f3) << 24;
#endif
}

// acc: the fp32 S/P fragment of one warpgroup's 64×N QKᵀ atom, ((2, 2, N/8), 1, 1).
// a_frag: the e4m3 A fragment of the P·V TiledMma (rs_op_selector, K = N), ((4, 2, 2), 1, N/32),
// as partition_fragment_A makes it (compact, so register r is bytes 4r … 4r + 3).
// Vᵀ must be stored with its keys in key_slots.hpp's slot order.
template <class Acc, class AFrag>
CUTE_HOST_DEVICE void pack_p_e4m3(Acc const& acc, AFrag& a_frag) {
  static_assert(std::is_same_v<typename std::decay_t<Acc>::value_type, float>);
  static_assert(std::is_same_v<typename std::decay_t<AFrag>::value_type, cutlass::float_e4m3_t>);
  static_assert(decltype(size<1>(acc))::value == 1 && decltype(size<2>(acc))::value == 1,
                "the S tile of one warpgroup is a single 64×N atom");
  static_assert(decltype(size<0, 2>(acc))::value % 4 == 0, "N must be a multiple of 32");
  constexpr int kRegs = decltype(size(acc))::value / 4;
  // A k32 fragment, not the k16 layout of a 16-bit P (acc_to_operand_a_layout): same size, other
  // byte order.
  static_assert(decltype(size<0>(a_frag))::value == 16 && decltype(size<1>(a_frag))::value == 1 &&
                    decltype(size<2>(a_frag))::value == kRegs / 4,
                "a_frag is the e4m3 k32 A fragment ((4, 2, 2), 1, N/32)");
  Tensor regs = recast<uint32_t>(a_frag);
  CUTE_UNROLL
  for (int r = 0; r < kRegs; ++r)
    regs(r) = pack_e4m3x4(acc(p_acc_index(r, 0)), acc(p_acc_index(r, 1)),
                          acc(p_acc_index(r, 2)), acc(p_acc_index(r, 3)));
}

}  // namespace fa4::sm90::fp8
