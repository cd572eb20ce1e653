// The e4m3 forward's shared-memory transpose of V (src/sm90/fp8/transpose_v.cuh), run on the host
// thread by thread: the device's own per-thread steps (TransposeV::run, its addresses, its PRMT
// selectors, PRMT emulated per PTX) over a byte array standing for shared memory.
//  - Correctness: every byte of Vᵀ, read through the CuTe layout of its stage, is V's byte at
//    the key that key_slots.hpp's slot order puts there, read through V's CuTe layout; every Vᵀ
//    byte is written once, nothing else is written, and loads stay inside V.
//  - Bank conflicts: for each warp-wide access of the routine, the shared-memory wavefronts as the
//    hardware counts them (32 banks of 4 bytes; a 32-bit access takes the warp at once, a 64-bit
//    one each half-warp, a 128-bit one each quarter-warp; a phase takes as many wavefronts as the
//    most distinct 4-byte words any one bank gets) must be the minimum, bytes per lane / 4, for
//    all five (D, N) configs, with 64 and 128 threads, 32- and 64-bit stores. Two mappings that
//    lack the lane orders are counted too and must conflict, so that the counter can fail:
//      naive: lane ℓ builds one slot word's four dims 4ℓ … 4ℓ + 3 (the warp across 128 dims; at
//        d64, lanes 16 … 31 on the next slot word);
//      unpermuted: the routine's mapping with m = f = 0 (keys in slot order, dims in order).
//    What they give, wavefronts of the worst load / store instruction (the routine: 1 / 1 with
//    32-bit stores, 1 / 2 with 64-bit ones, everywhere):
//      config      naive     unpermuted, 32-bit stores   unpermuted, 64-bit stores
//      d64  N160   2 / 8     2 / 4                       2 / 8
//      d128 N128   1 / 16    1 / 4                       1 / 8
//      d128 N224   1 / 16    1 / 4                       1 / 8
//      d128 N192   1 / 16    1 / 4                       1 / 8
//      d256 N128   1 / 16    1 / 4                       1 / 8
//    (the test prints them).
//  - Cost (SASS of sm_90a builds; see the header): a warp step is 4 LDS, 8 PRMT and 4 STS with
//    32-bit stores (512 bytes), 8 LDS, 16 PRMT and 4 STS.64 with 64-bit ones (1 KB), and nothing
//    else; some 45–60 instructions of set-up per call. d128 N=224 by four warps: 14 steps of 16
//    instructions, about 280 with the set-up, a warp.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/float8.h>

#include "sm90/common/smem_atom.cuh"
#include "sm90/fp8/key_slots.hpp"
#include "sm90/fp8/transpose_v.cuh"

namespace {

using namespace cute;
using fa4::sm90::SmemAtom;
using fa4::sm90::fp8::byte_perm;
using fa4::sm90::fp8::key_of_slot;
using fa4::sm90::fp8::TransposeV;
using fa4::sm90::fp8::transpose_v_warps_g;
using E4m3 = cutlass::float_e4m3_t;

// Both stages inside one byte array, each 1024-byte aligned as the kernel's are.
constexpr uint32_t kVBase = 0;
constexpr uint32_t kVtBase = 64 * 1024;
constexpr uint32_t kSmemBytes = 128 * 1024;

struct Access {
  uint32_t addr;
  int bytes;
  bool store;
};

// Shared memory as TransposeV::run sees it, logging each thread's accesses in order.
struct HostSmem {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kSmemBytes, 0);
  std::vector<int> writes = std::vector<int>(kSmemBytes, 0);
  std::vector<Access>* log = nullptr;

  uint32_t load32(uint32_t addr) {
    log->push_back({addr, 4, false});
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= uint32_t(bytes.at(addr + k)) << (8 * k);
    return v;
  }
  void put(uint32_t addr, uint32_t v) {
    for (int k = 0; k < 4; ++k) {
      bytes.at(addr + k) = uint8_t(v >> (8 * k));
      ++writes.at(addr + k);
    }
  }
  void store32(uint32_t addr, uint32_t v) {
    log->push_back({addr, 4, true});
    put(addr, v);
  }
  void store64(uint32_t addr, uint32_t lo, uint32_t hi) {
    log->push_back({addr, 8, true});
    put(addr, lo);
    put(addr + 4, hi);
  }
};

// Wavefronts of one warp-wide access: lanes in phases of 128 bytes (32 / (bytes / 4) lanes), each
// phase as many as the most distinct words one bank gets (equal words broadcast).
int wavefronts(const std::vector<uint32_t>& lane_addr, int bytes) {
  const int lanes_per_phase = 32 / (bytes / 4);
  int total = 0;
  for (int first = 0; first < 32; first += lanes_per_phase) {
    std::map<int, std::set<uint32_t>> words_of_bank;
    for (int lane = first; lane < first + lanes_per_phase; ++lane)
      for (int w = 0; w < bytes / 4; ++w) {
        const uint32_t word = lane_addr[lane] / 4 + w;
        words_of_bank[word % 32].insert(word);
      }
    int most = 0;
    for (const auto& [bank, words] : words_of_bank) most = std::max(most, int(words.size()));
    total += most;
  }
  return total;
}

struct Worst {
  int load = 0;
  int store = 0;
};

// The worst wavefronts over the load and the store instructions of per-thread access logs (the
// threads of a warp run the same sequence: checked).
Worst worst_wavefronts(const std::vector<std::vector<Access>>& logs) {
  Worst worst;
  for (size_t warp = 0; warp * 32 < logs.size(); ++warp) {
    const auto& first = logs[warp * 32];
    for (size_t n = 0; n < first.size(); ++n) {
      std::vector<uint32_t> addr(32);
      for (int lane = 0; lane < 32; ++lane) {
        const Access& a = logs[warp * 32 + lane].at(n);
        EXPECT_EQ(a.bytes, first[n].bytes);
        EXPECT_EQ(a.store, first[n].store);
        EXPECT_EQ(a.addr % a.bytes, 0u) << "misaligned access";
        addr[lane] = a.addr;
      }
      const int wf = wavefronts(addr, first[n].bytes);
      int& w = first[n].store ? worst.store : worst.load;
      w = std::max(w, wf);
    }
  }
  return worst;
}

template <int kD, int kN>
struct Layouts {
  using VLayout = decltype(tile_to_shape(SmemAtom<E4m3, kD>{}, Shape<Int<kN>, Int<kD>>{}));
  using VtLayout = decltype(tile_to_shape(SmemAtom<E4m3, kN>{}, Shape<Int<kD>, Int<kN>>{}));
  static uint32_t v(int key, int dim) { return uint32_t(VLayout{}(key, dim)); }
  static uint32_t vt(int dim, int slot) { return uint32_t(VtLayout{}(dim, slot)); }
};

// The routine on every thread for one config; `worst` takes its worst wavefronts.
template <int kD, int kN, int kThreads, int kSlotWords>
void check_routine(std::mt19937& rng, Worst& worst) {
  using T = TransposeV<kD, kN, kThreads, kSlotWords>;
  using L = Layouts<kD, kN>;
  constexpr int kStage = kD * kN;

  // The tiles' arithmetic against CuTe's layouts, everywhere.
  for (int key = 0; key < kN; ++key)
    for (int d = 0; d < kD; ++d) {
      EXPECT_EQ(T::V::offset(key, d), L::v(key, d)) << "V key " << key << " dim " << d;
      EXPECT_EQ(T::Vt::offset(d, key), L::vt(d, key)) << "Vt dim " << d << " slot " << key;
    }
  // Base ^ low + high against the whole coordinate, for every access of every thread.
  for (int thread = 0; thread < kThreads; ++thread)
    for (int s = 0; s < T::kSteps; ++s) {
      for (int i = 0; i < T::kLoads; ++i)
        EXPECT_EQ(T::address(T::load_offset(thread, 0, 0), T::load_offset(0, s, i)),
                  T::load_offset(thread, s, i))
            << "thread " << thread << " step " << s << " load " << i;
      for (int j = 0; j < 4; ++j)
        EXPECT_EQ(T::address(T::store_offset(thread, 0, 0), T::store_offset(0, s, j)),
                  T::store_offset(thread, s, j))
            << "thread " << thread << " step " << s << " store " << j;
    }

  // Three fills: the low and high bytes of each V byte's index (together they name its source)
  // and random bytes.
  for (int fill = 0; fill < 3; ++fill) {
    HostSmem smem;
    for (int key = 0; key < kN; ++key)
      for (int d = 0; d < kD; ++d) {
        const uint32_t id = uint32_t(key * kD + d);
        const uint8_t byte = fill == 2 ? uint8_t(rng()) : uint8_t(id >> (8 * fill));
        smem.bytes[kVBase + L::v(key, d)] = byte;
      }
    std::vector<std::vector<Access>> logs(kThreads);
    for (int thread = 0; thread < kThreads; ++thread) {
      smem.log = &logs[thread];
      T::run(smem, kVBase, kVtBase, thread);
    }
    for (int dim = 0; dim < kD; ++dim)
      for (int slot = 0; slot < kN; ++slot) {
        const int key = fa4::sm90::fp8::kKeyGroup * (slot / 16) + key_of_slot(slot % 16);
        ASSERT_EQ(smem.bytes[kVtBase + L::vt(dim, slot)], smem.bytes[kVBase + L::v(key, dim)])
            << "D " << kD << " N " << kN << " fill " << fill << " dim " << dim << " slot "
            << slot;
      }
    for (uint32_t a = 0; a < kSmemBytes; ++a) {
      const bool in_vt = a >= kVtBase && a < kVtBase + kStage;
      ASSERT_EQ(smem.writes[a], in_vt ? 1 : 0) << "byte " << a << " written wrongly";
    }
    for (const auto& log : logs)
      for (const Access& a : log)
        if (!a.store) ASSERT_LT(a.addr - kVBase + a.bytes, uint32_t(kStage) + 1);
    if (fill == 0) worst = worst_wavefronts(logs);
  }
}

// Naive: lane ℓ builds dims 4ℓ′ … 4ℓ′ + 3 (ℓ′ = ℓ mod D/4, lanes past D/4 on the next slot word)
// of one slot word: loads the word's four key rows there, stores its four dims.
template <int kD, int kN>
Worst naive_wavefronts() {
  using L = Layouts<kD, kN>;
  constexpr int kLanesPerWord = kD >= 128 ? 32 : kD / 4;
  constexpr int kWordsPerStep = 32 / kLanesPerWord;
  std::vector<std::vector<Access>> logs(32);
  for (int word0 = 0; word0 < kN / 4; word0 += kWordsPerStep)
    for (int block = 0; block < kD / (4 * kLanesPerWord); ++block)
      for (int lane = 0; lane < 32; ++lane) {
        const int word = word0 + lane / kLanesPerWord;  // slot word: slots 4·word … 4·word + 3
        const int dim = 4 * kLanesPerWord * block + 4 * (lane % kLanesPerWord);
        for (int j = 0; j < 4; ++j) {
          const int slot = 4 * word + j;
          const int key = 16 * (slot / 16) + key_of_slot(slot % 16);
          logs[lane].push_back({L::v(key, dim), 4, false});
        }
        for (int j = 0; j < 4; ++j) logs[lane].push_back({L::vt(dim + j, 4 * word), 4, true});
      }
  return worst_wavefronts(logs);
}

// The routine's lanes without its orders (m = f = 0), addresses only.
template <int kD, int kN, int kThreads, int kSlotWords>
Worst unpermuted_wavefronts() {
  using T = TransposeV<kD, kN, kThreads, kSlotWords>;
  std::vector<std::vector<Access>> logs(kThreads);
  for (int thread = 0; thread < kThreads; ++thread) {
    const auto l = T::lane_of(thread);
    for (int s = 0; s < T::kSteps; ++s) {
      const int group = l.wg + T::kWarpsG * T::step_g(s);
      const int block = l.wq + T::kWarpsQ * T::step_q(s);
      const int dim = T::kStepDims * block + 16 * l.qq + 4 * l.c;
      for (int i = 0; i < T::kLoads; ++i) {
        const int key = 16 * group + key_of_slot(4 * kSlotWords * l.u + i);
        logs[thread].push_back({T::V::offset(key, dim), 4, false});
      }
      for (int j = 0; j < 4; ++j)
        logs[thread].push_back(
            {T::Vt::offset(dim + j, 16 * group + 4 * kSlotWords * l.u), 4 * kSlotWords, true});
    }
  }
  return worst_wavefronts(logs);
}

template <int kD, int kN, int kThreads, int kSlotWords>
void check_config(std::mt19937& rng) {
  if constexpr (transpose_v_warps_g(kD, kN, kThreads, kSlotWords) == 0) {
    std::printf("d%-3d N%-3d %3d threads, %d-bit stores: no even split of the steps\n", kD, kN,
                kThreads, 32 * kSlotWords);
  } else {
    Worst got{-1, -1};
    check_routine<kD, kN, kThreads, kSlotWords>(rng, got);
    const Worst plain = unpermuted_wavefronts<kD, kN, kThreads, kSlotWords>();
    const Worst naive = naive_wavefronts<kD, kN>();
    std::printf(
        "d%-3d N%-3d %3d threads, %d-bit stores: wavefronts load %d store %d (min 1 / %d); "
        "unpermuted %d / %d; naive %d / %d\n",
        kD, kN, kThreads, 32 * kSlotWords, got.load, got.store, kSlotWords, plain.load,
        plain.store, naive.load, naive.store);
    EXPECT_EQ(got.load, 1) << "d" << kD << " N" << kN;
    EXPECT_EQ(got.store, kSlotWords) << "d" << kD << " N" << kN;
    // The counter sees conflicts where there are some.
    EXPECT_GT(naive.store, 1);
    EXPECT_GT(std::max(plain.load, plain.store - (kSlotWords - 1)), 1);
  }
}

template <int kD, int kN>
void check_all_variants(uint32_t seed) {
  std::mt19937 rng(seed);
  check_config<kD, kN, 64, 1>(rng);
  check_config<kD, kN, 128, 1>(rng);
  check_config<kD, kN, 64, 2>(rng);
  check_config<kD, kN, 128, 2>(rng);
}

TEST(Fp8TransposeV, BytePermMatchesPrmt) {
  // PTX ISA's prmt examples and the sign-replicating mode.
  EXPECT_EQ(byte_perm(0x33221100u, 0x77665544u, 0x3210u), 0x33221100u);
  EXPECT_EQ(byte_perm(0x33221100u, 0x77665544u, 0x7654u), 0x77665544u);
  EXPECT_EQ(byte_perm(0x33221100u, 0x77665544u, 0x5140u), 0x55114400u);
  EXPECT_EQ(byte_perm(0x33221100u, 0x77665544u, 0x0123u), 0x00112233u);
  EXPECT_EQ(byte_perm(0x80008000u, 0x00000000u, 0x8989u), 0x00ff00ffu);
}

TEST(Fp8TransposeV, D64N160) { check_all_variants<64, 160>(1); }
TEST(Fp8TransposeV, D128N128) { check_all_variants<128, 128>(2); }
TEST(Fp8TransposeV, D128N224) { check_all_variants<128, 224>(3); }
TEST(Fp8TransposeV, D128N192) { check_all_variants<128, 192>(4); }
TEST(Fp8TransposeV, D256N128) { check_all_variants<256, 128>(5); }
// The e4m3 kernels' own tiles (fwd_tile_shape.hpp: d64 × 128, d128 × 160, d256 × 96 keys), whose
// two transposing warps must split every stage evenly.
TEST(Fp8TransposeV, D64N128) { check_all_variants<64, 128>(6); }
TEST(Fp8TransposeV, D128N160) { check_all_variants<128, 160>(7); }
TEST(Fp8TransposeV, D256N96) { check_all_variants<256, 96>(8); }
// Head dims the e4m3 table may take next: d192's V rows (192 bytes, SW64) and 96-key tiles.
TEST(Fp8TransposeV, D192N96) { check_all_variants<192, 96>(10); }
TEST(Fp8TransposeV, D128N96) { check_all_variants<128, 96>(11); }
TEST(Fp8TransposeV, KernelTilesSplitOverTwoWarps) {
  EXPECT_NE(transpose_v_warps_g(64, 128, 64, 1), 0);
  EXPECT_NE(transpose_v_warps_g(128, 160, 64, 1), 0);
  EXPECT_NE(transpose_v_warps_g(256, 96, 64, 1), 0);
}

}  // namespace
