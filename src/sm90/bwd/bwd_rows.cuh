// The backward's row-wise kernels, before and after the main one: kLanes lanes per row of one head
// (row_lanes), each moving 16 bytes of every input row per access: one row per warp with
// per-element loads would leave these kernels at 1–2.6 TB/s, 7–11 % of a d64–d128 backward
// (ncu).
//   prepare:  D = rowsum(dO ∘ O), LSE·log2e (+inf for a row that saw no key), dQ accumulator = 0;
//             each sequence's stat pad (bwd_workspace.hpp): D = 0, LSE +inf, and in fragment
//             order its dQ accumulator = 0 too
//   finish_q: dQ = scale · accumulator (in fragment order, DqFragments, or its columns in the
//             staging's order, dq_accum_flip),
//             rounded to the output dtype; without a band, each (batch entry, head) as soon as
//             the main kernel's CTAs of that pair are done with dQ (dq_done), while its other
//             CTAs still run
//   finish_kv (GQA): dK, dV = their accumulators (dK already scaled), rounded
//   sink_grads (with attention sinks): d(sinks) from the prepare kernel's LSE and D
// Rows are walked per sequence (cu_seqlens, checked as the main kernel checks them): rows outside
// every sequence are never touched, but for each sequence's stat pad (the prepare kernel's writes,
// and in fragment order the main kernel's dQ adds of zeros).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/config.hpp>
#include <cutlass/arch/grid_dependency_control.h>

#include "common/math_constants.hpp"
#include "sm90/bwd/bwd_turns.cuh"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/common/sequence.cuh"

namespace fa4::sm90 {

constexpr int kRowWarps = 8;  // warps per block of the row-wise kernels

// Lanes per row for rows of `dim` elements: one 8-element (16-byte) vector each, a power of two so
// that a row's lanes are a shuffle group, at most a warp (wider rows loop).
constexpr int row_lanes(int dim) {
  int lanes = 1;
  while (lanes < 32 && lanes * 8 < dim) lanes *= 2;
  return lanes;
}
template <int kLanes>
constexpr int kRowsPerBlock = kRowWarps * (32 / kLanes);

template <class Element>
struct RowTensor {  // (batch, seq, head, dim) element strides; varlen: batch unused
  Element* data;
  int64_t batch_stride, seq_stride, head_stride;

  CUTE_DEVICE Element* row(Sequence const& s, int64_t i, int head) const {
    return data + int64_t(s.batch) * batch_stride + (s.start_q + i) * seq_stride +
           int64_t(head) * head_stride;
  }
};

// Eight elements, 16 bytes: the sm90 backend's tensors have 16-byte aligned rows (its TMA checks),
// the workspace's rows are 32-byte multiples from a 256-byte aligned base.
template <class T>
struct alignas(16) Vec8 {
  T v[8];
};
template <class T>
CUTE_DEVICE Vec8<T> load8(const T* at) {
  return *reinterpret_cast<const Vec8<T>*>(at);
}
template <class T>
CUTE_DEVICE void store8(T* at, Vec8<T> const& x) {
  *reinterpret_cast<Vec8<T>*>(at) = x;
}

// The rows of one head of one sequence these lanes handle; false when there is none.
struct RowWork {
  Sequence seq;
  int64_t row;  // within the sequence
  int head;
  int lane;     // among the row's lanes
};
template <int kLanes>
CUTE_DEVICE bool find_row(SequenceParams const& sequences, bool keys, RowWork& w) {
  w.lane = int(threadIdx.x) % kLanes;
  w.head = int(blockIdx.y);
  w.row = int64_t(blockIdx.x) * kRowsPerBlock<kLanes> + int(threadIdx.x) / kLanes;
  w.seq = load_sequence(sequences, int(blockIdx.z));
  if (!w.seq.valid) return false;
  if (keys) {  // walk key rows: the sequence's key rows stand in for its query rows, all of them
    w.seq.start_q = w.seq.start_k;
    w.seq.len_q = stored_keys(sequences, int(blockIdx.z));
  }
  return w.row < w.seq.len_q;
}

// The lanes of this thread's row, for shuffles among them.
template <int kLanes>
CUTE_DEVICE unsigned row_mask() {
  if constexpr (kLanes == 32) {
    return 0xffffffffu;
  } else {
    return ((1u << kLanes) - 1) << (int(threadIdx.x) % 32 / kLanes * kLanes);
  }
}

struct PrepareParams {
  SequenceParams sequences;
  const float* lse;  // the forward's LSE
  int64_t lse_batch_stride, lse_head_stride, lse_seq_stride;
  float* lse_log2;  // workspace, [heads_q][stat rows]
  float* dpsum;
  float* dq_accum;  // [heads_q][stat rows][dim], in the order `fragments` says (bwd_workspace.hpp)
  int32_t* dq_done;  // [batch][heads_q]
  int64_t q_rows;   // query rows per head in the workspace
  int64_t stat_rows;
  DqFragments fragments;
  int32_t q_rows_per_batch;
  int dim, dim_v;
};

template <class Element, int kLanes>
__global__ void __launch_bounds__(32 * kRowWarps)
    bwd_prepare_kernel(const PrepareParams p, const RowTensor<const Element> out,
                       const RowTensor<const Element> dout) {
  // The main kernel counts up from 0 in every call: its threads add after their wait for this
  // kernel (a dependent launch), and the dQ kernel reads the counts only after the main kernel
  // has triggered it, after that wait: by then this clearing has landed in L2, where GPU-scope
  // acquire loads read, so the previous call's counts are never read.
  if (blockIdx.x == 0 && threadIdx.x == 0) p.dq_done[blockIdx.z * gridDim.y + blockIdx.y] = 0;
  RowWork w;
  const bool is_row = find_row<kLanes>(p.sequences, false, w);
  if (!w.seq.valid) return;
  const int64_t start = w.seq.start_q + int64_t(w.seq.batch) * p.q_rows_per_batch;
  const int64_t stat_row =
      bwd_stat_slot(int64_t(w.head) * p.stat_rows + bwd_stat_row(start, blockIdx.z) + w.row);
  // dQ's accumulator cleared: in fragment order a tile's block, pad rows included (a row's values
  // lie all over its tile's block), else the row.
  auto clear_dq = [&](int64_t row) {
    float* dq = p.dq_accum + row * p.dim;
    for (int c = w.lane * 8; c < p.dim; c += kLanes * 8) store8(dq + c, Vec8<float>{});
  };
  if (!is_row) {
    // The sequence's pad (bwd_workspace.hpp): what its last tile reads past its end.
    if (w.row < bwd_padded_stat_rows(w.seq.len_q)) {
      if (w.lane == 0) {
        p.dpsum[stat_row] = 0.0f;
        p.lse_log2[stat_row] = INFINITY;
      }
      if (p.fragments.enabled())
        clear_dq(int64_t(w.head) * p.stat_rows + bwd_stat_row(start, blockIdx.z) + w.row);
    }
    return;
  }
  const Element* o = out.row(w.seq, w.row, w.head);
  const Element* d = dout.row(w.seq, w.row, w.head);
  float sum = 0.0f;
  for (int c = w.lane * 8; c < p.dim_v; c += kLanes * 8) {
    const Vec8<Element> a = load8(o + c), b = load8(d + c);
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) sum += float(a.v[j]) * float(b.v[j]);
  }
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(row_mask<kLanes>(), sum, offset, kLanes);
  clear_dq(p.fragments.enabled()
               ? int64_t(w.head) * p.stat_rows + bwd_stat_row(start, blockIdx.z) + w.row
               : int64_t(w.head) * p.q_rows + start + w.row);
  if (w.lane == 0) {
    p.dpsum[stat_row] = sum;
    const float lse = p.lse[int64_t(w.seq.batch) * p.lse_batch_stride +
                            int64_t(w.head) * p.lse_head_stride +
                            (w.seq.start_q + w.row) * p.lse_seq_stride];
    // −inf cannot come from the forward (a row that sees no key has +inf); read it the same way,
    // so that no probability becomes exp2(+inf).
    p.lse_log2[stat_row] = lse == -INFINITY ? INFINITY : lse * float(kLog2e);
  }
}

// d(sinks) from the prepare kernel's stats: dsinks[h] = −Σ exp(sinks[h] − LSE) · D over the rows
// of every sequence (docs/semantics.md). One block per query head; each thread sums its rows in a
// fixed order and the block adds the threads' sums in a fixed tree: the same bits on every run.
constexpr int kSinkThreads = 256;
struct SinkGradParams {
  SequenceParams sequences;
  const float* sinks;
  float* dsinks;
  const float* lse_log2;  // the prepare kernel's, [heads_q][stat rows]
  const float* dpsum;
  int64_t stat_rows;
  int32_t q_rows_per_batch;
  int batch;
};

template <int kThreads = kSinkThreads>  // a template: every backward instance includes this file
__global__ void __launch_bounds__(kThreads) bwd_sink_grads_kernel(const SinkGradParams p) {
  __shared__ float partial[kThreads];
  const int h = int(blockIdx.x);
  const float sink_log2 = p.sinks[h] * float(kLog2e);
  float sum = 0.0f;
  for (int b = 0; b < p.batch; ++b) {
    const Sequence seq = load_sequence(p.sequences, b);
    if (!seq.valid) continue;  // the prepare kernel skipped it too
    const int64_t start = seq.start_q + int64_t(seq.batch) * p.q_rows_per_batch;
    const int64_t first = int64_t(h) * p.stat_rows + bwd_stat_row(start, b);
    // A row that saw no key has LSE = +inf (no sink: exp2 gives 0) and D = 0.
    for (int64_t i = threadIdx.x; i < seq.len_q; i += kThreads) {
      const int64_t at = first + bwd_stat_slot(i);  // first: a multiple of 16
      sum += exp2f(sink_log2 - p.lse_log2[at]) * p.dpsum[at];
    }
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (int(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.dsinks[h] = -partial[0];
}

struct FinishParams {
  SequenceParams sequences;
  const float* accum;  // [heads][rows][dim], or for dQ in fragment order (`fragments`)
  int64_t rows;        // rows per head in the workspace
  int32_t rows_per_batch;
  int dim;
  float scale;
  int atom;  // the accumulator's column order (dq_accum_flip): dQ's staging atom, 0 for dK / dV
  // dQ in fragment order (then `rows` is the stat rows per head), or not enabled.
  DqFragments fragments;
  // dQ after a main kernel without a band (bwd_launch.cuh): [batch][heads] counts of its CTAs
  // done with dQ, and their number per (batch entry, head); else null.
  const int32_t* done;
  int32_t done_expected;
};

// Eight floats of an accumulator other SMs added into in L2 (the main kernel's TMA reduce-adds,
// GQA's red.global), for dQ maybe while this kernel ran: read past L1, which is not coherent with
// other SMs' writes.
CUTE_DEVICE Vec8<float> load8_l2(const float* at) {
  Vec8<float> x;
  *reinterpret_cast<float4*>(x.v) = __ldcg(reinterpret_cast<const float4*>(at));
  *reinterpret_cast<float4*>(x.v + 4) = __ldcg(reinterpret_cast<const float4*>(at) + 1);
  return x;
}

// dst = scale · accumulator, rounded; `keys` walks key rows (dK, dV), else query rows (dQ).
template <class Element, int kLanes>
__global__ void __launch_bounds__(32 * kRowWarps)
    bwd_finish_kernel(const FinishParams p, const RowTensor<Element> dst, bool keys) {
  // The accumulator is the main kernel's, which this one may overlap (a dependent launch:
  // bwd_launch.cuh). Without counts every thread waits for that whole kernel. With them (dQ),
  // the main kernel lets this one start as its last CTAs start, and a block waits only for the
  // CTAs of its (batch entry, head): blocks of pairs done earlier run on the SMs the main
  // kernel's last round leaves idle. One block still waits for the whole kernel, so that this
  // grid's end implies that one's (its dK / dV stores).
  if (p.done == nullptr) {
    cutlass::arch::wait_on_dependent_grids();
  } else {
    if (threadIdx.x == 0) Turns::wait_at_least(p.done + blockIdx.z * gridDim.y + blockIdx.y,
                                                p.done_expected);
    __syncthreads();
    if (blockIdx.x + blockIdx.y + blockIdx.z == 0) cutlass::arch::wait_on_dependent_grids();
  }
  RowWork w;
  if (!find_row<kLanes>(p.sequences, keys, w)) return;
  const int64_t start = w.seq.start_q + int64_t(w.seq.batch) * p.rows_per_batch;
  Element* out = dst.row(w.seq, w.row, w.head);
  if (p.fragments.enabled()) {
    // The row's tile's block (DqFragments); the row's 8-column block c is four value pairs, one
    // per lane of a quad, 4 floats apart.
    const int block_m = p.fragments.block_m;
    const float* tile = p.accum + (int64_t(w.head) * p.rows + bwd_stat_row(start, blockIdx.z) +
                                   w.row / block_m * block_m) *
                                      p.dim;
    const int r = int(w.row % block_m);
    for (int c = w.lane * 8; c < p.dim; c += kLanes * 8) {
      const float* at = tile + p.fragments.offset(r, c);
      Vec8<Element> x;
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) {
        const float2 pair = __ldcg(reinterpret_cast<const float2*>(at + 4 * q));
        x.v[2 * q] = Element(pair.x * p.scale);
        x.v[2 * q + 1] = Element(pair.y * p.scale);
      }
      store8(out + c, x);
    }
    return;
  }
  const float* src = p.accum + (int64_t(w.head) * p.rows + start + w.row) * p.dim;
  const int flip = dq_accum_flip(w.row, p.atom);
  for (int c = w.lane * 8; c < p.dim; c += kLanes * 8) {
    const Vec8<float> a = load8_l2(src + (c ^ flip));
    Vec8<Element> x;
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) x.v[j] = Element(a.v[j] * p.scale);
    store8(out + c, x);
  }
}

}  // namespace fa4::sm90
