// 16-byte cp.async with a 32-bit shared-memory address: the gathers that compute their
// destinations in a buffer's swizzled layout add offsets to the buffer's shared address, rather
// than swizzling 64-bit generic pointers and converting them per copy.
#pragma once

#include <cstdint>

#include <cute/config.hpp>

namespace fa4::sm90 {

// 16 bytes from global `src` to shared address `dst` (L2 only); zeros when `!read`, and then
// `src` is not read (it must still be a valid address).
CUTE_DEVICE void cp_async_zfill_16(uint32_t dst, void const* src, bool read) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(read ? 16 : 0));
}

}  // namespace fa4::sm90
