// One warpgroup MMA over the whole K extent of a tile, issued asynchronously. The caller decides
// when to wait (warpgroup_wait<N>), which is what lets QKᵀ of one tile overlap the softmax of
// another.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace fa4::sm90 {

using namespace cute;

// C (=|+=) A·B with A and B as partitioned by the tiled MMA; returns once the wgmma are issued.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTE_DEVICE void wgmma_issue(TiledMma& mma, TensorA const& a, TensorB const& b, TensorC& c) {
  // An A fragment of the element type lives in registers (P); otherwise it holds smem descriptors.
  constexpr bool kAFromRegisters =
      is_same_v<typename TensorA::value_type, typename TiledMma::ValTypeA>;
  if constexpr (kAFromRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kAFromRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
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
// hoisted out of a tile loop, they would hold registers the loop needs.
template <class StoreOp, class TiledMma, class Frag, class SmemTensor>
CUTE_DEVICE void store_accumulator(int thread, Frag const& frag, SmemTensor&& dst) {
  asm volatile("" : "+r"(thread));
  using Store = decltype(make_tiled_copy_C(
      Copy_Atom<StoreOp, typename std::decay_t<Frag>::value_type>{}, TiledMma{}));
  auto slice = Store{}.get_thread_slice(thread);
  copy(Store{}, slice.retile_S(frag), slice.partition_D(dst));
}

}  // namespace fa4::sm90
