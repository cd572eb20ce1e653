// One warpgroup MMA over the whole K extent of a tile, issued asynchronously. The caller decides
// when to wait (warpgroup_wait<N>), which is what lets QKᵀ of one tile overlap the softmax of
// another.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace fa4::sm90 {

using namespace cute;

// How a k-loop advances a shared-memory operand's descriptor from one k-block to the next.
// kLowWord: cute's way (a copy whose low word is advanced); ptxas then forms each wgmma's register
// pair anew and writes the constant high word into it again before every HGMMA, two uniform moves
// per k-block of an SS GEMM. kWhole: the offset added to the whole 64-bit descriptor (it never
// carries into the high word: it moves the start address field only); an add with carry then
// replaces the moves. SASS: the backward's loops 16-23 instructions shorter at d64 / d128, the
// d128 forward's 9 longer (its descriptors cost ~2.4 uniform operations per HGMMA either way).
enum class DescAdvance { kLowWord, kWhole };

// Operand k-block k of a partitioned wgmma operand (register operands: sliced as they are).
template <DescAdvance kAdvance, class Tensor>
CUTE_DEVICE auto operand_k_block(Tensor const& t, int k) {
  if constexpr (kAdvance == DescAdvance::kWhole &&
                is_same_v<typename Tensor::value_type, GMMA::DescriptorIterator::value_type>) {
    auto [sliced, offset] = slice_and_offset(make_coord(_, _, k), t.layout());
    GmmaDescriptor desc = *t.data();
    desc.desc_ += uint64_t(offset);
    return make_tensor(GMMA::DescriptorIterator{desc}, sliced);
  } else {
    return t(_, _, k);
  }
}

// The k-blocks of A·B onto C inside an open batch: the first as mma.accumulate_ says, the rest
// adding.
template <DescAdvance kAdvance = DescAdvance::kLowWord, class TiledMma, class TensorA,
          class TensorB, class TensorC>
CUTE_DEVICE void wgmma_k_blocks(TiledMma& mma, TensorA const& a, TensorB const& b, TensorC& c) {
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, operand_k_block<kAdvance>(a, k), operand_k_block<kAdvance>(b, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

// C (=|+=) A·B with A and B as partitioned by the tiled MMA; returns once the wgmma are issued.
template <bool kZeroInit, DescAdvance kAdvance = DescAdvance::kLowWord, class TiledMma,
          class TensorA, class TensorB, class TensorC>
CUTE_DEVICE void wgmma_issue(TiledMma& mma, TensorA const& a, TensorB const& b, TensorC& c) {
  // An A fragment of the element type lives in registers (P); otherwise it holds smem descriptors.
  constexpr bool kAFromRegisters =
      is_same_v<typename TensorA::value_type, typename TiledMma::ValTypeA>;
  if constexpr (kAFromRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  wgmma_k_blocks<kAdvance>(mma, a, b, c);
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kAFromRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
}

// C (=|+=) A0·B0 + A1·B1: one GEMM whose K extent lies in two pairs of operand tiles (two chunks
// of a ring), issued as one batch. Two batches on one accumulator would make the second wait for
// the first to drain the tensor pipe.
template <bool kZeroInit, class TiledMma, class A0, class B0, class A1, class B1, class TensorC>
CUTE_DEVICE void wgmma_issue_split_k(TiledMma& mma, A0 const& a0, B0 const& b0, A1 const& a1,
                                     B1 const& b1, TensorC& c) {
  static_assert(!is_same_v<typename A0::value_type, typename TiledMma::ValTypeA>,
                "operands from shared memory only");
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  wgmma_k_blocks(mma, a0, b0, c);
  wgmma_k_blocks(mma, a1, b1, c);
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

// A shared-memory tensor whose address the compiler cannot see through, for wgmma operands made
// where each GEMM is issued: otherwise the k-blocks' descriptors of a loop's GEMMs are hoisted out
// of it into registers the accumulators need (FA3 guards its larger GEMMs the same way).
template <class T, class Layout>
CUTE_DEVICE auto opaque_smem_tensor(T* data, Layout layout) {
  asm volatile("" : "+l"(data));
  return make_tensor(make_smem_ptr(data), layout);
}

// The slice of a tiled wgmma that partitions a warpgroup's shared-memory operands. Their
// descriptors depend only on the warpgroup; built from a warp-uniform index (canonical_warp_group_idx
// broadcasts lane 0's) they live in uniform registers, while a slice taken from threadIdx puts
// them in ordinary ones and costs moves into uniform registers before every wgmma (SASS: R2UR,
// UMOV, IMAD.MOV). Accumulators and register operands keep the per-thread slice.
template <class TiledMma>
CUTE_DEVICE auto warpgroup_operand_slice(TiledMma const& mma, int first_mma_warpgroup) {
  const int wg = cutlass::canonical_warp_group_idx() - first_mma_warpgroup;
  return mma.get_slice(wg * cutlass::NumThreadsPerWarpGroup);
}

// A 16-bit accumulator-shaped fragment of `TiledMma` into shared memory by stmatrix, eight values
// per instruction (StoreOp SM90_U32x4_STSM_N for the tile as computed, SM90_U16x8_STSM_T for it
// transposed). Stores through a swizzled pointer would be generic ones, one or two values each.
// The addresses are computed at the call from a thread index the compiler cannot see through:
// hoisted out of a tile loop, they would hold registers the loop needs. AccumulatorStore below
// needs one register and fewer instructions where a tile's layout allows it.
template <class StoreOp, class TiledMma, class Frag, class SmemTensor>
CUTE_DEVICE void store_accumulator(int thread, Frag const& frag, SmemTensor&& dst) {
  asm volatile("" : "+r"(thread));
  using Store = decltype(make_tiled_copy_C(
      Copy_Atom<StoreOp, typename std::decay_t<Frag>::value_type>{}, TiledMma{}));
  auto slice = Store{}.get_thread_slice(thread);
  copy(Store{}, slice.retile_S(frag), slice.partition_D(dst));
}

// store_accumulator with one register held across a tile loop: this thread's first store's offset
// in the tile. Its other stores lie at offsets from it that are the same for every thread, which
// the compiler reads off thread 0's partition as constants. That holds where the stores step by
// whole swizzle atoms (the narrow backward's dS: 128-byte swizzle, stores 2 KB apart), not in
// general (the wide kernel's 64-byte swizzled P and dS break it): a host-side test checks it for
// every thread of each tile this is used for (offsets_shared; in tests/gpu, run by CI too). A
// check in the kernel would cost more than it saves: its branch makes the compiler drop the
// uniform registers of the wgmma descriptors. Computed per store from the thread index instead,
// the swizzled addresses cost about 15 instructions each.
template <class StoreOp, class TiledMma, class Element>
class AccumulatorStore {
  using Store = decltype(make_tiled_copy_C(Copy_Atom<StoreOp, Element>{}, TiledMma{}));

  // (values of one stmatrix, stores): a partition's modes flattened, the first being one
  // instruction's eight values.
  template <class T>
  CUTE_HOST_DEVICE static auto by_store(T&& t) {
    auto flat = make_tensor(t.data(), flatten(t.layout()));
    static_assert(decltype(size<0>(flat))::value == 8, "eight 16-bit values per stmatrix.x4");
    return group_modes<1, rank(flat)>(flat);
  }
  template <class Tile>
  CUTE_HOST_DEVICE static auto stores(int thread, Tile&& tile) {
    return by_store(Store{}.get_thread_slice(thread).partition_D(tile));
  }
  template <class Tile>
  CUTE_DEVICE static const Element* origin(Tile const& tile) {
    return raw_pointer_cast(tile.data());
  }

  int first_;  // elements from the tile's origin

 public:
  template <class Tile>
  CUTE_DEVICE AccumulatorStore(int thread, Tile const& tile)
      : first_(int(&stores(thread, tile)(0, 0) - origin(tile))) {}

  // `tile`: the constructor's, or one at `offset` elements from it (another stage of a ring; a
  // whole number of swizzle atoms away).
  template <class Frag, class Tile>
  CUTE_DEVICE void operator()(Frag const& frag, Tile const& tile, int offset = 0) const {
    auto ref = stores(0, tile);
    auto values = by_store(Store{}.get_thread_slice(0).retile_S(frag));
    static_assert(size<1>(decltype(values){}) == size<1>(decltype(ref){}));
    Element* at = const_cast<Element*>(origin(tile)) + first_ + offset;
    CUTE_UNROLL
    for (int k = 0; k < size<1>(ref); ++k) {
      auto words = recast<uint32_t>(values(_, k));
      static_assert(size(decltype(words){}) == 4, "one stmatrix.x4 per store");
      StoreOp::copy(words(0), words(1), words(2), words(3),
                    *reinterpret_cast<uint128_t*>(at + (&ref(0, k) - &ref(0, 0))));
    }
  }

  // The premise above for one thread and a tile of layout `layout` placed at `base` (on the host:
  // addresses only, nothing is read or written; aligned like the kernels' shared memory, since
  // the swizzle acts on address bits).
  template <class TileLayout>
  static bool offsets_shared(int thread, Element* base, TileLayout const& layout) {
    auto mine = stores(thread, make_tensor(make_smem_ptr(base), layout));
    auto ref = stores(0, make_tensor(make_smem_ptr(base), layout));
    for (int k = 0; k < size<1>(mine); ++k)
      if (&mine(0, k) - &mine(0, 0) != &ref(0, k) - &ref(0, 0)) return false;
    return true;
  }
};

}  // namespace fa4::sm90
