// P·V's two operands in the forward kernel, by the operands' type: the one place where the e4m3
// forward's tile loop differs from the 16-bit one.
//   16-bit: P is the QKᵀ accumulator converted in its own layout (the k16 A operand), and B is read
//           MN-major from V's TMA ring, which the consumers read and release.
//   e4m3:   P is packed into the k32 A operand (fp8/p_operand.cuh), and B comes K-major from a
//           Vᵀ ring (FP8 wgmma takes no other B) that the producer's transposing warps fill from
//           V's TMA ring (fp8/transpose_v.cuh): they read and release V's ring, the consumers Vᵀ's.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "sm90/common/fragment.cuh"
#include "sm90/common/ring_release.cuh"
#include "sm90/fp8/p_operand.cuh"
#include "sm90/fp8/transpose_v.cuh"

namespace fa4::sm90 {

// A ring as its readers see it: wait for a stage, release it (ring_release.cuh).
template <class P>
struct RingReader {
  P& pipeline;
  typename P::SharedStorage& storage;
  CUTE_DEVICE void wait(typename P::PipelineState const& s) { pipeline.consumer_wait(s); }
  CUTE_DEVICE void release(typename P::PipelineState const& s) {
    release_stage(storage, pipeline, s);
  }
};

template <class Config>
struct FwdValues {
  using Element = typename Config::Element;
  static constexpr bool kFp8 = Config::kFp8;
  using VPipeline = cutlass::PipelineTmaAsync<Config::kStages>;  // V's TMA ring
  // e4m3: the Vᵀ ring; every transposing thread arrives on a stage's full barrier.
  using VtPipeline = cutlass::PipelineAsync<Config::kStages>;
  using PipelineState = typename VPipeline::PipelineState;
  static_assert(std::is_same_v<typename VtPipeline::PipelineState, PipelineState>);
  // The ring the consumers read B from, and its reader.
  using Pipeline = std::conditional_t<kFp8, VtPipeline, VPipeline>;
  using Reader = RingReader<Pipeline>;

  static constexpr int kTransposeThreads = 32 * Config::kTransposeWarps;
  // The threads that read V's ring (its pipeline's consumer count).
  static constexpr int kVReaders = kFp8 ? kTransposeThreads : 128 * Config::kConsumerWarpgroups;

  // B's stages: V's ring, or Vᵀ's.
  template <class Rings>
  CUTE_DEVICE static Element* operand(Rings& kv) {
    if constexpr (kFp8)
      return kv.vt.data();
    else
      return kv.v.data();
  }

  // P's register fragment for thr_pv's thread: the accumulator's layout in 16 bits; e4m3's k32 A
  // fragment (partition_fragment_A reads only the tile's shape and its K-major order).
  template <class ThrPV>
  CUTE_DEVICE static auto p_fragment(ThrPV const& thr_pv) {
    using BlockM = typename Config::BlockM;
    using BlockN = typename Config::BlockN;
    if constexpr (kFp8) {
      return thr_pv.partition_fragment_A(
          cute::make_tensor(cute::make_smem_ptr(static_cast<Element*>(nullptr)),
                            cute::make_layout(cute::Shape<BlockM, BlockN>{}, cute::LayoutRight{})));
    } else {
      using ScoreFrag = decltype(cute::partition_fragment_C(typename Config::TiledMmaQK{},
                                                            cute::Shape<BlockM, BlockN>{}));
      return cute::make_tensor<Element>(acc_to_operand_a_layout(ScoreFrag{}.layout()));
    }
  }

  // P from the softmax's probabilities (the QKᵀ accumulator's registers).
  template <class Scores, class P>
  CUTE_DEVICE static void to_p(Scores const& scores, P& p) {
    if constexpr (kFp8)
      fp8::pack_p_e4m3(scores, p);
    else
      convert_fragment(scores, p);
  }

  // The Vᵀ ring's pipeline (e4m3; its full barrier counts the transposing threads, its empty one
  // the consumers' release_stage arrivals), else nothing.
  struct NoVtRing {};
  template <class Rings>
  CUTE_DEVICE static auto make_vt_pipeline(Rings& kv, int warpgroup) {
    if constexpr (kFp8) {
      typename VtPipeline::Params params;
      params.role = warpgroup == 0 ? VtPipeline::ThreadCategory::Producer
                                   : VtPipeline::ThreadCategory::Consumer;
      params.producer_arv_count = kTransposeThreads;
      params.consumer_arv_count = ring_arrivals<128 * Config::kConsumerWarpgroups>();
      return VtPipeline(kv.pipeline_vt, params);
    } else {
      return NoVtRing{};
    }
  }

  // The consumers' reader of B's ring.
  template <class Rings, class VtRing>
  CUTE_DEVICE static Reader reader(Rings& kv, VPipeline& pipeline_v, VtRing& pipeline_vt) {
    if constexpr (kFp8)
      return {pipeline_vt, kv.pipeline_vt};
    else
      return {pipeline_v, kv.pipeline_v};
  }

  // Whether this warp of the producer warpgroup transposes V (e4m3).
  CUTE_DEVICE static bool transposes(int warp) {
    return kFp8 && warp >= Config::kFirstTransposeWarp &&
           warp < Config::kFirstTransposeWarp + Config::kTransposeWarps;
  }

  // The transposing warps' loop (e4m3): each V stage, once its TMA has landed, into the Vᵀ ring,
  // in the order the load thread fills V's ring; `for_each_tile(f)` calls f(key tiles) for each
  // tile the load thread loads, in its order. The Vᵀ stage's generic-proxy stores are made
  // visible to the wgmmas' async proxy before its full barrier is arrived on, and V's stage is
  // released once read. O staged across V's and Vᵀ's rings (d256) needs no wait here: the next
  // tile's first V, which this waits for, is loaded only once that O has left (o_free).
  template <class Rings, class ForEachTile>
  CUTE_DEVICE static void transpose(Rings& kv, VPipeline& pipeline_v, VtPipeline& pipeline_vt,
                                    ForEachTile&& for_each_tile) {
    constexpr int kStageBytes = Config::kBytesV;
    const int thread = int(threadIdx.x) - 32 * Config::kFirstTransposeWarp;
    const auto* v = reinterpret_cast<const uint8_t*>(kv.v.data());
    auto* vt = reinterpret_cast<uint8_t*>(kv.vt.data());
    PipelineState read_v;
    PipelineState write_vt = cutlass::make_producer_start_state<VtPipeline>();
    for_each_tile([&](int key_tiles) {
      CUTE_NO_UNROLL
      for (int n = 0; n < key_tiles; ++n) {
        pipeline_v.consumer_wait(read_v);
        pipeline_vt.producer_acquire(write_vt);
        fp8::transpose_v<Config::kHeadDimV, Config::kBlockN, kTransposeThreads>(
            v + read_v.index() * kStageBytes, vt + write_vt.index() * kStageBytes, thread);
        cutlass::arch::fence_view_async_shared();
        pipeline_vt.producer_commit(write_vt);
        release_stage(kv.pipeline_v, pipeline_v, read_v);
        ++read_v;
        ++write_vt;
      }
    });
  }
};

}  // namespace fa4::sm90
