// Vᵀ for the e4m3 P·V: one ring stage of V, (N keys × D dims) with dims contiguous as TMA writes
// it, rewritten in shared memory as (D dims × N keys) with keys contiguous, the K-major B operand
// of the RS wgmma, keys in key_slots.hpp's slot order: Vt(d, 16g + s) = V(16g + key_of_slot(s), d).
//
// Both tiles are tile_to_shape(SmemAtom<e4m3, row width>, shape): V's rows are D bytes (SW64 at
// d64, SW128 above), Vᵀ's are N bytes (SW128 at 128, SW64 at 192, SW32 at 160 and 224). A 32-bit
// word of Vᵀ is one dim of four consecutive slots 4t … 4t + 3 of a 16-key group, which hold keys
// 2t, 2t + 1, 2t + 8, 2t + 9: a thread that loads those four key rows at four dims (one 32-bit
// word each) has four output words after a 4×4 byte transpose of eight PRMTs.
//
// The mapping (kSlotWords = W ∈ {1, 2}: slot words per thread, the width of its stores in words):
// a warp step covers one 16-key group × 32W dims. Lane = c + 4 (u + (4 / W) qq): c < 4 picks dims
// 4c … 4c + 3 of the 16-dim chunk qq < 2W, u < 4 / W the slot words Wu … Wu + W − 1. Load i
// (32-bit, i < 4W) takes the key row of slot 4Wu + (i ^ m); store j (32- or 64-bit, j < 4) writes
// dim 4c + (j ^ f) of the W slot words. Two lane-dependent orders keep every warp-wide access at
// the minimum wavefronts for all five (D, N) configs (tests/cpu/test_fp8_transpose_v.cpp counts
// them):
//  - loads, m = u & 1: odd-u lanes take keys 2t and 2t + 1 (2t + 8 and 2t + 9) in swapped order.
//    SW128 V XORs a row's 16-byte chunk with key % 8, which u and qq already spread over all
//    eight chunks; SW64 V puts two key rows in a 128-byte bank line (key bit 0) and XORs the chunk
//    with (key / 2) % 4: the lanes whose chunks coincide there differ in u & 1, so m gives them
//    rows of different key bit 0, in different halves of the bank line;
//  - stores, f = c / 2 + 2 (qq & 1): the eight lanes of a store phase with the same u then hold
//    eight different dims mod 8 (c & 1 is dim bit 2, f the two below), which every Vᵀ swizzle at
//    one key column sends to eight different 16-byte bank chunks (chunk ^= dim % 8 at SW128; the
//    bank row dim % 4 and chunk ^= dim bit 2 at SW32; both halves at SW64); the lanes of other u
//    fill the chunks' other words.
// Both orders fold into the thread's four PRMT selectors; nothing else in a step depends on them.
//
// Addresses: each access is (thread's base) ^ (compile-time bits 0–9) + (compile-time multiple of
// 1024). The swizzles read bits 7–9 of the linear offset and XOR them into bits 4–6, linearly over
// XOR, and the thread's coordinates and the step's occupy disjoint bits of the linear offset (the
// thread's key bit 0 and dim bits 0–1 XOR with the load's and store's by design), so the offset
// of the whole coordinate is the thread's offset XOR the step's low ten bits plus its high bits.
// Both stages must be 1024-byte aligned (the SW128 atom's period, which TMA wants anyway).
//
// Cost, from the SASS of sm_90a builds (nvcc 13.0): a warp step is exactly 4 LDS.32, 8 PRMT and
// 4 STS.32 at W = 1 (512 bytes), 8 LDS.32, 16 PRMT and 4 STS.64 at W = 2 (1 KB), with no address
// arithmetic: the per-thread bases (a few per access kind, more where a warp's steps change the
// swizzled bits) and the 4 selectors stay in registers, set up by some 45–60 instructions per
// call. At d128 N=224, four warps: 14 steps of W = 1 (about 280 instructions a warp with the
// set-up) or 7 of W = 2 (about 250). W = 1 takes 30–32 registers uncapped and fits a
// 24-register cap without spills except at d256 N128; W = 2 takes 38–40 and spills under 24 (and
// at N=128 a little under 32). The shared-memory pipe, 128 bytes a cycle, takes 448 cycles per
// stage for the 28 KB read and 28 KB written, whatever the mapping: the floor that the
// conflict-free accesses reach, and a share of the bandwidth that the wgmmas' operand reads also
// use.
//
// The caller waits for V's TMA before and, after, makes the generic-proxy stores visible to the
// wgmma (fence.proxy.async.shared::cta) before it signals the consumers.
#pragma once

#include <cassert>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/float8.h>

#include "sm90/common/smem_atom.cuh"
#include "sm90/fp8/key_slots.hpp"

namespace fa4::sm90::fp8 {

// A (kRows × kCols) e4m3 tile in shared memory as tile_to_shape(SmemAtom<e4m3, kCols>, (kRows,
// kCols)) lays it out, as plain arithmetic: atoms of 8 rows × kAtomBytes stack down the rows first,
// then the kCols / kAtomBytes column blocks follow each other, and Swizzle<B, 4, 3> XORs bits
// 7 … 6 + B of that linear offset into bits 4 … 3 + B (one byte per element, so element offsets
// are byte offsets). tests/cpu/test_fp8_transpose_v.cpp checks it against the CuTe layout.
template <int kRows, int kCols>
struct E4m3SmemTile {
  using Atom = SmemAtom<cutlass::float_e4m3_t, kCols>;
  static constexpr int kAtomBytes = decltype(cute::size<1>(Atom{}))::value;
  static_assert(kAtomBytes == 32 || kAtomBytes == 64 || kAtomBytes == 128);
  static_assert(kRows % 8 == 0 && kCols % kAtomBytes == 0);
  static constexpr uint32_t kSwizzleMask = uint32_t(kAtomBytes / 16 - 1) << 4;

  CUTE_HOST_DEVICE static constexpr uint32_t linear(uint32_t row, uint32_t col) {
    return (col / kAtomBytes) * (kRows * kAtomBytes) + row * kAtomBytes + col % kAtomBytes;
  }
  CUTE_HOST_DEVICE static constexpr uint32_t swizzle(uint32_t offset) {
    return offset ^ ((offset >> 3) & kSwizzleMask);
  }
  CUTE_HOST_DEVICE static constexpr uint32_t offset(uint32_t row, uint32_t col) {
    return swizzle(linear(row, col));
  }
};

// PTX prmt.b32 in its default mode: byte k of the result is byte sel[4k + 2 : 4k] of {b, a}
// (a = bytes 0–3), replaced by its sign bit spread over the byte when sel[4k + 3] is set. CUDA
// documents __byte_perm with bits 2:0 of each nibble only; the selectors here never set bit 3.
// The host side emulates it exactly so that the test runs the device's steps.
CUTE_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t bytes = uint64_t(b) << 32 | a;
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t nibble = (sel >> (4 * k)) & 0xf;
    uint32_t byte = uint32_t(bytes >> (8 * (nibble & 7))) & 0xff;
    if (nibble & 8) byte = (byte & 0x80) ? 0xff : 0x00;
    out |= byte << (8 * k);
  }
  return out;
#endif
}

// Warps split a stage's (N / 16) groups kWarpsG ways and its D / (32·kSlotWords) dim blocks
// kThreads / 32 / kWarpsG ways, powers of two so that a warp's share of each (w + kWarpsG·k) keeps
// its own bits, which the per-thread base absorbs; 0 where no split is even.
constexpr int transpose_v_warps_g(int d, int n, int threads, int slot_words) {
  const int warps = threads / 32, groups = n / kKeyGroup, blocks = d / (32 * slot_words);
  if (warps < 1 || (warps & (warps - 1)) != 0 || d % (32 * slot_words) != 0) return 0;
  for (int wg = warps; wg >= 1; wg /= 2)
    if (groups % wg == 0 && blocks % (warps / wg) == 0) return wg;
  return 0;
}

template <int kD_, int kN_, int kThreads_, int kSlotWords_ = 1>
struct TransposeV {
  static constexpr int kD = kD_;                // dims per key row
  static constexpr int kN = kN_;                // keys per stage
  static constexpr int kThreads = kThreads_;    // threads running the routine, whole warps
  static constexpr int kSlotWords = kSlotWords_;  // 32-bit words per store: 1 or 2
  static_assert(kSlotWords == 1 || kSlotWords == 2);
  static_assert(kThreads % 32 == 0 && kN % kKeyGroup == 0);

  using V = E4m3SmemTile<kN, kD>;   // (keys, dims)
  using Vt = E4m3SmemTile<kD, kN>;  // (dims, keys)

  static constexpr int kWarps = kThreads / 32;
  static constexpr int kLoads = 4 * kSlotWords;      // key rows a thread loads per step
  static constexpr int kSlotLanes = 4 / kSlotWords;  // lanes along a group's slot words (u)
  static constexpr int kStepDims = 32 * kSlotWords;  // dims per warp step (16 per qq)
  static constexpr int kGroups = kN / kKeyGroup;
  static constexpr int kDimBlocks = kD / kStepDims;
  static_assert(kD % kStepDims == 0);

  static constexpr int kWarpsG = transpose_v_warps_g(kD, kN, kThreads, kSlotWords);
  static_assert(kWarpsG > 0, "the warps must split the stage's steps evenly (d64 N=160 with four "
                             "warps needs kSlotWords = 1)");
  static constexpr int kWarpsQ = kWarps / kWarpsG;
  static constexpr int kStepsG = kGroups / kWarpsG;
  static constexpr int kStepsQ = kDimBlocks / kWarpsQ;
  static constexpr int kSteps = kStepsG * kStepsQ;  // per warp

  struct Lane {
    uint32_t c;   // dims 4c … 4c + 3 of the 16-dim chunk
    uint32_t u;   // slot words kSlotWords·u … of the group
    uint32_t qq;  // 16-dim chunk of the warp step
    uint32_t wg;  // the warp's first group
    uint32_t wq;  // the warp's first dim block
    uint32_t m;   // load order: load i takes slot i ^ m of the thread's slots
    uint32_t f;   // store order: store j writes dim 4c + (j ^ f)
  };
  CUTE_HOST_DEVICE static constexpr Lane lane_of(int thread) {
    const uint32_t lane = uint32_t(thread) % 32, warp = uint32_t(thread) / 32;
    Lane l{};
    l.c = lane % 4;
    l.u = (lane / 4) % kSlotLanes;
    l.qq = lane / (4 * kSlotLanes);
    l.wg = warp % kWarpsG;
    l.wq = warp / kWarpsG;
    l.m = l.u & 1;
    l.f = (l.c >> 1) | ((l.qq & 1) << 1);
    return l;
  }

  // Step s of a warp: group and dim block counters (groups inner).
  CUTE_HOST_DEVICE static constexpr int step_g(int s) { return s % kStepsG; }
  CUTE_HOST_DEVICE static constexpr int step_q(int s) { return s / kStepsG; }

  // The V byte offset of `thread`'s load i at warp step s, and the Vᵀ byte offset of its store j:
  // the whole coordinate through the tiles. Thread 0 sits at the zero coordinate (no lane or warp
  // part, m = f = 0), so its offsets are the steps' constants.
  CUTE_HOST_DEVICE static constexpr uint32_t load_offset(int thread, int s, int i) {
    const Lane l = lane_of(thread);
    const uint32_t group = l.wg + kWarpsG * uint32_t(step_g(s));
    const uint32_t block = l.wq + kWarpsQ * uint32_t(step_q(s));
    const uint32_t slot = 4 * kSlotWords * l.u + (uint32_t(i) ^ l.m);
    const uint32_t key = kKeyGroup * group + uint32_t(key_of_slot(int(slot)));
    const uint32_t dim = kStepDims * block + 16 * l.qq + 4 * l.c;
    return V::offset(key, dim);
  }
  CUTE_HOST_DEVICE static constexpr uint32_t store_offset(int thread, int s, int j) {
    const Lane l = lane_of(thread);
    const uint32_t group = l.wg + kWarpsG * uint32_t(step_g(s));
    const uint32_t block = l.wq + kWarpsQ * uint32_t(step_q(s));
    const uint32_t dim = kStepDims * block + 16 * l.qq + 4 * l.c + (uint32_t(j) ^ l.f);
    const uint32_t slot = kKeyGroup * group + 4 * kSlotWords * l.u;
    return Vt::offset(dim, slot);
  }

  // base ^ low + high: the address of an access whose step constant is `constant`.
  CUTE_HOST_DEVICE static constexpr uint32_t address(uint32_t base, uint32_t constant) {
    return (base ^ (constant & 1023u)) + (constant & ~1023u);
  }

  // The PRMT selectors. Stage 1 pairs rows x = 0, 1 (and 2, 3) of a word block: selector a puts
  // dims 2a' and 2a' + 1 (a' = a ^ f / 2) of both rows in one register, byte 2e + x = row x's dim
  // 2a' + e (0x5140 at a' = 0, 0x7362 at a' = 1). Stage 2 takes output j = 2a + j0 (dim j ^ f)
  // from pair a: byte k = slot k of the word = row k ^ m, at e = j0 ^ f % 2, so nibble k is
  // 4·(k / 2) + 2e + (k % 2 ^ m) (0x5410 at e = m = 0; e adds 2 to each nibble, m flips bit 0).
  struct Selectors {
    uint32_t pair[2];
    uint32_t word[2];
  };
  CUTE_HOST_DEVICE static constexpr Selectors selectors(int thread) {
    const Lane l = lane_of(thread);
    Selectors sel{};
    sel.pair[0] = 0x5140u ^ (0x2222u * (l.f >> 1));
    sel.pair[1] = sel.pair[0] ^ 0x2222u;
    sel.word[0] = 0x5410u ^ (0x2222u * (l.f & 1)) ^ (0x1111u * l.m);
    sel.word[1] = sel.word[0] ^ 0x2222u;
    return sel;
  }

  // Step s's loads: row i of the thread's slots (slot 4·kSlotWords·u + (i ^ m)) at its four dims.
  template <class Mem>
  CUTE_HOST_DEVICE static void load_step(Mem& mem, uint32_t base, int s, uint32_t (&rows)[kLoads]) {
    CUTE_UNROLL
    for (int i = 0; i < kLoads; ++i) rows[i] = mem.load32(address(base, load_offset(0, s, i)));
  }

  // Step s's transposes and stores: store j writes dim 4c + (j ^ f) of the thread's slot words.
  template <class Mem>
  CUTE_HOST_DEVICE static void store_step(Mem& mem, uint32_t base, int s,
                                          uint32_t const (&rows)[kLoads], Selectors const& sel) {
    uint32_t out[4][kSlotWords];
    CUTE_UNROLL
    for (int w = 0; w < kSlotWords; ++w) {
      uint32_t const* r = rows + 4 * w;
      CUTE_UNROLL
      for (int a = 0; a < 2; ++a) {
        const uint32_t p01 = byte_perm(r[0], r[1], sel.pair[a]);
        const uint32_t p23 = byte_perm(r[2], r[3], sel.pair[a]);
        out[2 * a][w] = byte_perm(p01, p23, sel.word[0]);
        out[2 * a + 1][w] = byte_perm(p01, p23, sel.word[1]);
      }
    }
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const uint32_t addr = address(base, store_offset(0, s, j));
      if constexpr (kSlotWords == 1) mem.store32(addr, out[j][0]);
      else mem.store64(addr, out[j][0], out[j][1]);
    }
  }

  // One thread's share of the stage, software-pipelined by one step: step s + 1's loads issue
  // before step s's transposes and stores, so their latency hides behind that work (the device
  // accesses are volatile asm and keep this order).
  template <class Mem>
  CUTE_HOST_DEVICE static void run(Mem& mem, uint32_t v_base, uint32_t vt_base, int thread) {
    const uint32_t load_base = v_base + load_offset(thread, 0, 0);
    const uint32_t store_base = vt_base + store_offset(thread, 0, 0);
    const Selectors sel = selectors(thread);
    uint32_t rows[2][kLoads];
    load_step(mem, load_base, 0, rows[0]);
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      if (s + 1 < kSteps) load_step(mem, load_base, s + 1, rows[(s + 1) % 2]);
      store_step(mem, store_base, s, rows[s % 2], sel);
    }
  }
};

#if defined(__CUDACC__)
// Shared-memory accesses by 32-bit shared-window address. Volatile, so that they keep the order
// run() gives them and stay after the caller's barrier wait; the memory clobber keeps the
// caller's own C++ accesses to shared memory on their side of the transpose too.
struct SharedMemoryOps {
  CUTE_DEVICE uint32_t load32(uint32_t addr) const {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
  }
  CUTE_DEVICE void store32(uint32_t addr, uint32_t v) const {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
  }
  CUTE_DEVICE void store64(uint32_t addr, uint32_t lo, uint32_t hi) const {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(lo), "r"(hi)
                 : "memory");
  }
};

// Transpose one stage: threads 0 … kThreads − 1 of the group each call it with their index. Both
// pointers 1024-byte aligned: the addresses are bases XOR the swizzle's bits, which a misaligned
// stage would turn into other addresses, not merely another swizzle (checked in debug builds).
template <int kD, int kN, int kThreads, int kSlotWords = 1>
CUTE_DEVICE void transpose_v(const uint8_t* v_stage_smem, uint8_t* vt_stage_smem, int thread) {
  SharedMemoryOps mem;
  const auto v = uint32_t(__cvta_generic_to_shared(v_stage_smem));
  const auto vt = uint32_t(__cvta_generic_to_shared(vt_stage_smem));
  assert(v % 1024 == 0 && vt % 1024 == 0);
  TransposeV<kD, kN, kThreads, kSlotWords>::run(mem, v, vt, thread);
}
#endif  // __CUDACC__: the host (tests) runs TransposeV::run on its own memory

}  // namespace fa4::sm90::fp8
