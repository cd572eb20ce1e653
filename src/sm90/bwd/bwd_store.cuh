// Where the backward kernel writes its gradients (dQ goes to its fp32 accumulator through
// bwd_dq_reduce.cuh):
//   - dK, dV once per CTA: rounded and written to the outputs (through shared memory, 16 bytes per
//     store), or, with GQA, added to the fp32 accumulators of the kv head (its query heads run in
//     different CTAs).
// Only rows inside the sequence are touched.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "sm90/bwd/bwd_turns.cuh"
#include "sm90/common/fragment.cuh"
#include "sm90/common/named_barriers.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/common/smem_atom.cuh"
#include "sm90/common/wgmma.cuh"

namespace fa4::sm90 {

using namespace cute;

// Fire-and-forget fp32 adds to global memory. atomicAdd through a generic pointer returns the old
// value and, for a scalar float, checks the address space per value (shared / local fallbacks in
// the SASS); `red.global` states the space and returns nothing.
CUTE_DEVICE void red_add_global(float* p, float a) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "f"(a) : "memory");
}
CUTE_DEVICE void red_add_global(float* p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(__cvta_generic_to_global(p)), "f"(a),
               "f"(b)
               : "memory");
}

template <class Config>
struct BwdStore {
  using Element = typename Config::Element;
  using BlockM = typename Config::BlockM;
  using BlockN = typename Config::BlockN;
  // Values of a thread's accumulator that are adjacent in memory (GQA's adds): pairs along the
  // head dim in dK / dV (BwdConfig), none in the wide kernel's dKᵀ / dVᵀ (pairs along the keys).
  static constexpr int kRun = Config::kWide ? 1 : 2;

  struct Output {  // dK or dV: (batch, seq, head, dim) element strides; varlen: batch unused
    Element* data;
    int64_t batch_stride, seq_stride, head_stride;
  };

  struct Params {
    Output dk, dv;
    float* dk_accum;        // GQA: [heads_kv][key rows][dim]; null without GQA
    float* dv_accum;
    int64_t k_rows;
    int32_t k_rows_per_batch;
    int head_group;  // query heads per kv head
    float dk_scale;  // the softmax scale (dS is the gradient of the scaled score)
    // Deterministic mode (bwd_turns.cuh), else null: [batch][heads_q][m_tiles][2] and
    // [batch][heads_kv][n_tiles].
    int32_t* dq_turns;
    int32_t* dkv_turns;
    int32_t m_tiles, n_tiles, heads_q;
  };

  // The counter of query tile m's dQ half `wg` (deterministic mode).
  CUTE_DEVICE static int32_t* dq_counter(Params const& p, int batch, int head, int m, int wg) {
    return p.dq_turns + ((int64_t(batch) * p.heads_q + head) * p.m_tiles + m) * 2 + wg;
  }


  // (key, dim) of each value of a thread's dK / dV accumulator of head dim kDim.
  template <int kDim, class ThrMma>
  CUTE_DEVICE static auto key_dim_coords(ThrMma const& thr) {
    if constexpr (Config::kWide) {
      const auto c = thr.partition_C(make_identity_tensor(Shape<Int<kDim>, BlockN>{}));
      return [c](int k) { return make_coord(get<1>(c(k)), get<0>(c(k))); };
    } else {
      const auto c = thr.partition_C(make_identity_tensor(Shape<BlockN, Int<kDim>>{}));
      return [c](int k) { return c(k); };
    }
  }

  // Adds an accumulator's values, kRun adjacent ones at a time, to rows[key · kDim + dim], for
  // keys below `len` (GQA's dK / dV, once per CTA). Each address is this thread's first element's
  // plus a compile-time offset; the base goes through an empty asm so that the compiler computes
  // the addresses here rather than precomputing one 64-bit pointer per pair (32 registers, which
  // spill where the kernel holds much else).
  template <int kDim, class Acc, class Coords>
  CUTE_DEVICE static void add_values(Acc const& acc, Coords const& coords, int len, float* rows) {
    static_assert(decltype(size(acc))::value % kRun == 0);
    const int row0 = get<0>(coords(0)), col0 = get<1>(coords(0));
    float* base = rows + row0 * kDim + col0;
    asm volatile("" : "+l"(base));
    CUTE_UNROLL
    for (int k = 0; k < size(acc); k += kRun) {
      const int row = get<0>(coords(k));
      const int offset = (row - row0) * kDim + (get<1>(coords(k)) - col0);
      if (row < len) {
        if constexpr (kRun == 2)
          red_add_global(base + offset, acc(k), acc(k + 1));
        else
          red_add_global(base + offset, acc(k));
      }
    }
  }

  // `batch`: the sequence's index (also in varlen mode, where seq.batch is 0). Rows up to
  // stored_k are written: those past seqused_k (seq.len_k) hold 0, since their keys were masked.
  // stage_k, stage_v: the kernel's Q and dO buffers, free once every MMA thread is past the tile
  // loop, where dK and dV go on their way to the outputs (without GQA).
  template <bool kDeterministic, class ThrMma, class AccK, class AccV>
  CUTE_DEVICE static void store_dkv(Params const& p, int batch, int head, int n_block,
                                    Sequence const& seq, int stored_k, ThrMma const& thr, AccK& dk,
                                    AccV const& dv, Element* stage_k, Element* stage_v) {
    CUTE_UNROLL
    for (int k = 0; k < size(dk); ++k) dk(k) *= p.dk_scale;
    const auto coords_k = key_dim_coords<Config::kHeadDim>(thr);
    const auto coords_v = key_dim_coords<Config::kHeadDimV>(thr);
    const int len = stored_k - n_block * Config::kBlockN;  // rows of this tile that exist
    const int64_t first_key = int64_t(n_block) * Config::kBlockN;
    if (p.dk_accum != nullptr) {
      const int64_t first = int64_t(head / p.head_group) * p.k_rows + seq.start_k +
                            int64_t(seq.batch) * p.k_rows_per_batch + first_key;
      // Deterministic: the query heads of the kv head add in head order.
      int32_t* counter = nullptr;
      const bool leader = threadIdx.x == 128;  // the first MMA thread
      if constexpr (kDeterministic) {
        const int kv_head = head / p.head_group;
        counter = p.dkv_turns +
                  (int64_t(batch) * (p.heads_q / p.head_group) + kv_head) * p.n_tiles + n_block;
        Turns::wait(counter, head - kv_head * p.head_group, leader, Config::kMmaThreads,
                    kBwdTurnBoth);
      }
      add_values<Config::kHeadDim>(dk, coords_k, len, p.dk_accum + first * Config::kHeadDim);
      add_values<Config::kHeadDimV>(dv, coords_v, len, p.dv_accum + first * Config::kHeadDimV);
      if constexpr (kDeterministic) Turns::pass(counter, leader, Config::kMmaThreads, kBwdTurnBoth);
      return;
    }
    // Through shared memory, so that each output row goes out in 16-byte pieces: the wide
    // kernel's dKᵀ / dVᵀ values are adjacent along the keys (one 2-byte store per value when
    // written directly: ~4 % of the d256 kernel's MMA time at 4k, twice that causal), the
    // narrow kernel's come in pairs (4-byte stores).
    const int thread = int(threadIdx.x) - 128;
    // Every MMA thread's last wgmmas, which read the Q / dO buffers, are done.
    cutlass::arch::NamedBarrier::sync(Config::kMmaThreads, kBwdDsReadyBarrier);
    stage<Config::kHeadDim>(dk, stage_k, thread);
    stage<Config::kHeadDimV>(dv, stage_v, thread);
    cutlass::arch::NamedBarrier::sync(Config::kMmaThreads, kBwdDsReadyBarrier);
    store_rows<Config::kHeadDim>(p.dk, stage_k, len, seq, head, first_key, thread);
    store_rows<Config::kHeadDimV>(p.dv, stage_v, len, seq, head, first_key, thread);
  }

  // dK or dV staged in shared memory: the key tile's rows, kDim wide (a Q / dO buffer holds
  // them: static_assert in BwdKernel).
  template <int kDim>
  using StagingLayout =
      decltype(tile_to_shape(SmemAtom<Element, kDim>{}, Shape<BlockN, Int<kDim>>{}));

 private:
  // An accumulator of head dim kDim, rounded, into the staging layout by stmatrix: (key, dim) as
  // computed by the narrow kernel, (dim, key) transposed from the wide kernel's dKᵀ / dVᵀ.
  template <int kDim, class Acc>
  CUTE_DEVICE static void stage(Acc const& acc, Element* buffer, int thread) {
    Tensor rounded = make_tensor<Element>(acc.layout());
    convert_fragment(acc, rounded);
    if constexpr (Config::kWide) {
      using Transposed = decltype(composition(
          StagingLayout<kDim>{}, make_ordered_layout(Shape<Int<kDim>, BlockN>{}, Step<_2, _1>{})));
      store_accumulator<SM90_U16x8_STSM_T, typename Config::TiledMmaKV>(
          thread, rounded, make_tensor(make_smem_ptr(buffer), Transposed{}));
    } else {
      store_accumulator<SM90_U32x4_STSM_N, typename Config::TiledMmaKV>(
          thread, rounded, make_tensor(make_smem_ptr(buffer), StagingLayout<kDim>{}));
    }
  }

  // The staged rows below `len` to the output, 16 bytes per store (the sm90 backend's views are
  // 16-byte aligned: backend.cpp), consecutive threads along a row.
  template <int kDim>
  CUTE_DEVICE static void store_rows(Output const& o, Element const* buffer, int len,
                                     Sequence const& seq, int head, int64_t first_key,
                                     int thread) {
    constexpr int kPerChunk = 16 / int(sizeof(Element));
    constexpr int kChunks = kDim / kPerChunk;  // per row
    static_assert((Config::kBlockN * kChunks) % Config::kMmaThreads == 0);
    Tensor staged = make_tensor(make_smem_ptr(buffer), StagingLayout<kDim>{});
    Element* base = o.data + int64_t(seq.batch) * o.batch_stride +
                    (seq.start_k + first_key) * o.seq_stride + int64_t(head) * o.head_stride;
    CUTE_UNROLL
    for (int i = 0; i < Config::kBlockN * kChunks / Config::kMmaThreads; ++i) {
      const int chunk = thread + i * Config::kMmaThreads;
      const int row = chunk / kChunks, col = chunk % kChunks * kPerChunk;
      if (row < len)
        *reinterpret_cast<uint128_t*>(base + row * o.seq_stride + col) =
            *reinterpret_cast<const uint128_t*>(raw_pointer_cast(&staged(row, col)));
    }
  }
};

}  // namespace fa4::sm90
