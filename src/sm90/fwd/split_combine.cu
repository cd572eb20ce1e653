// The split-KV combine (split_kv.cuh): one warp per (query row, head), its lanes along the head
// dim, or up to FA4_SM90_COMBINE_WARPS (8) where a row has many splits.
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/numeric_types.h>

#include "common/mask.hpp"
#include "common/math_constants.hpp"
#include "sm90/host/launch.cuh"
#include "sm90/fwd/split_kv.cuh"

// The most warps per (query row, head) (warps_per_row). 8 measured against 1 on the H200 (decode,
// 64k keys): one sequence with one kv head, 948 -> 1,394 GB/s (35 -> 24 µs); batches of 128 and
// 8 kv heads level. A compile-time variant, so that 1 can still be built for an A/B.
#ifndef FA4_SM90_COMBINE_WARPS
#define FA4_SM90_COMBINE_WARPS 8
#endif

// A/B switch: 1 loads each warp's first splits' O before it combines the row's LSEs (O's
// addresses do not depend on the LSE: the loads then fly during the LSE round trip rather than
// after it) and finds the warp's (position, head) in 32 bits. Measured on an H100 (decode, d128,
// two runs): GQA 8/1 one sequence up to 7 % faster (0.1-1.1 µs), but GQA 32/8 four sequences
// over 4k keys 4-6 % slower (1.4-2.1 µs) and one over 16k 2.7 % slower; 0 until that loss is
// explained. That form held d256's two columns of O per lane at every head dim (128 and 74
// registers against 62 and 48); the kernels now take the head dim's (kCols: 80 and 62 at d128).
#ifndef FA4_SM90_COMBINE_PREFETCH
#define FA4_SM90_COMBINE_PREFETCH 0
#endif

#if defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "griddepcontrol is compiled out: build with -DCUTLASS_ENABLE_GDC_FOR_SM90"
#endif

namespace fa4::sm90 {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxRowWarps = FA4_SM90_COMBINE_WARPS;
static_assert(kMaxRowWarps == 1 || kMaxRowWarps == 2 || kMaxRowWarps == 4 || kMaxRowWarps == 8,
              "a power of two up to kWarps");
constexpr int kMaxHeadDim = 256;
#if FA4_SM90_COMBINE_PREFETCH
// Splits whose O a warp loads ahead. The one-warp kernel runs below 8 splits (warps_per_row), so
// it loads them all; the wide kernel the first 4 of each warp's share (every warp there has at
// least 4).
constexpr int kAheadSplits = 8;
constexpr int kWideAheadSplits = 4;
// The split path runs only where the partials hold at most kSplitRowBudget rows over all heads
// (split_row_cap), so a sequence's positions × heads fit an int, and the division is the
// hardware's rather than the 64-bit routine's.
static_assert(kSplitRowBudget < (int64_t(1) << 30), "(position, head) pairs fit an int");

// Split `split`'s four elements of the row's O from column c (o: the row's O of split 0).
__device__ float4 split_o(float const* o, int64_t split_stride, int split, int c) {
  return *reinterpret_cast<const float4*>(o + split * split_stride + c);
}
#endif

__device__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    // max.NaN: a NaN partial (NaN inputs) keeps the row NaN, as the unsplit kernel does.
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(x) : "f"(x), "f"(y));
  }
  return x;
}

__device__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// A split's LSE in the combine's terms: a split that saw no key of the row weighs nothing.
__device__ float split_lse(CombineParams const& p, int64_t row, int split) {
  const float l = p.partials.lse[row + int64_t(split) * p.partials.heads * p.partials.rows];
  return l == INFINITY ? -INFINITY : l;
}

// acc += w · x, per component.
__device__ void add_weighted(float4& acc, float w, float4 x) {
  acc.x += w * x.x;
  acc.y += w * x.y;
  acc.z += w * x.z;
  acc.w += w * x.w;
}

// Four consecutive elements of O.
template <class Element>
__device__ void store4(Element* out, float4 v) {
  out[0] = Element(v.x);
  out[1] = Element(v.y);
  out[2] = Element(v.z);
  out[3] = Element(v.w);
}

// The row's LSE over its splits (its sink joined once), computed by every lane of the calling
// warp; INFINITY where no split saw a key of the row.
__device__ float combined_lse(CombineParams const& p, int64_t row, int head, int lane) {
  float m = -INFINITY;
  for (int s = lane; s < p.splits; s += 32) {
    const float l = split_lse(p, row, s);
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(m), "f"(l));
  }
  m = warp_max(m);
  float sum = 0.0f;
  if (m != -INFINITY)
    for (int s = lane; s < p.splits; s += 32) sum += expf(split_lse(p, row, s) - m);
  sum = warp_sum(sum);
  // The row's sink joins the denominator once, here (the splits leave it out): the weights
  // e^(lse_s − lse) then take its share.
  if (p.sinks != nullptr) Sink{p.sinks[head]}.fold(m, sum);
  return m == -INFINITY ? INFINITY : m + logf(sum);
}

// Warps per (query row, head): with many splits and few rows (decode of a few sequences) one warp
// walking every split's partial O in turn waits on each load; the splits are shared out among up
// to kMaxRowWarps warps instead, at least 4 splits each, whose sums meet in shared memory.
int warps_per_row(int splits) {
  int w = 1;
  while (w < kMaxRowWarps && splits >= 8 * w) w *= 2;
  return w;
}

// A warp per (query row, head); blocks_per_sequence CTAs per batch entry, one after another (a 1-D
// grid: no 65535 limit). Launched dependent on the forward kernel (its launch overlaps the
// forward's tail), it waits for it before reading anything.
// kCols: float4 columns of O per lane, one up to d128 and two up to kMaxHeadDim; only the
// prefetching form holds them in registers (its `ahead`), so only it is built with one.
template <class Element, int kCols>
__global__ void __launch_bounds__(kWarps * 32)
    combine_splits(CombineParams p, int blocks_per_sequence) {
  cutlass::arch::wait_on_dependent_grids();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int b = int(blockIdx.x) / blocks_per_sequence;
  const Sequence seq = load_sequence(p.sequences, b);
  if (!seq.valid) return;
#if FA4_SM90_COMBINE_PREFETCH
  const int t = int(blockIdx.x % blocks_per_sequence) * kWarps + warp;
  if (t >= seq.len_q * p.partials.heads) return;
  const int position = t / p.partials.heads;
  const int head = t % p.partials.heads;
  const int64_t row = p.partials.row(0, head, seq, position);
  const int64_t split_stride = int64_t(p.partials.heads) * p.partials.rows * p.head_dim_v;
  const float* o = p.partials.o + row * p.head_dim_v;
  float4 ahead[kCols][kAheadSplits];
  CUTE_UNROLL
  for (int k = 0; k < kCols; ++k)
    CUTE_UNROLL
    for (int s = 0; s < kAheadSplits; ++s)
      if (lane * 4 + k * 128 < p.head_dim_v && s < p.splits)
        ahead[k][s] = split_o(o, split_stride, s, lane * 4 + k * 128);

  const float lse = combined_lse(p, row, head, lane);
  const bool empty = lse == INFINITY;

  Element* out = static_cast<Element*>(p.out) + seq.batch * p.out_batch_stride +
                 (seq.start_q + position) * p.out_row_stride + head * p.out_head_stride;
  CUTE_UNROLL
  for (int k = 0; k < kCols; ++k) {
    const int c = lane * 4 + k * 128;
    if (c >= p.head_dim_v) break;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // A split without keys wrote O = 0 (its row sum was 0): w = 0 then, and 0 · 0 adds 0.
    if (!empty) {
      CUTE_UNROLL
      for (int s = 0; s < kAheadSplits; ++s)
        if (s < p.splits) add_weighted(acc, expf(split_lse(p, row, s) - lse), ahead[k][s]);
      for (int s = kAheadSplits; s < p.splits; ++s)
        add_weighted(acc, expf(split_lse(p, row, s) - lse), split_o(o, split_stride, s, c));
    }
    store4(out + c, acc);
  }
#else
  const int64_t t = int64_t(blockIdx.x % blocks_per_sequence) * kWarps + warp;
  if (t >= int64_t(seq.len_q) * p.partials.heads) return;
  const int64_t position = t / p.partials.heads;
  const int head = int(t % p.partials.heads);
  const int64_t row = p.partials.row(0, head, seq, position);

  const float lse = combined_lse(p, row, head, lane);
  const bool empty = lse == INFINITY;

  Element* out = static_cast<Element*>(p.out) + seq.batch * p.out_batch_stride +
                 (seq.start_q + position) * p.out_row_stride + head * p.out_head_stride;
  const int64_t split_stride = int64_t(p.partials.heads) * p.partials.rows * p.head_dim_v;
  const float* o = p.partials.o + row * p.head_dim_v;
  for (int c = lane * 4; c < p.head_dim_v; c += 128) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (!empty)
      for (int s = 0; s < p.splits; ++s) {
        const float w = expf(split_lse(p, row, s) - lse);
        const float4 x = *reinterpret_cast<const float4*>(o + s * split_stride + c);
        // A split without keys wrote O = 0 (its row sum was 0): w = 0 then, and 0 · 0 adds 0.
        add_weighted(acc, w, x);
      }
    store4(out + c, acc);
  }
#endif
  if (p.lse != nullptr && lane == 0)
    p.lse[seq.batch * p.lse_batch_stride + head * p.lse_head_stride +
          (seq.start_q + position) * p.lse_seq_stride] = lse;
}

// kWarps / row_warps (query row, head) pairs per CTA, row_warps warps each (warps_per_row > 1),
// the splits shared out among them (s ≡ part mod row_warps), their sums meeting in shared memory;
// blocks_per_sequence CTAs per batch entry. Launched dependent on the forward kernel, as
// combine_splits, it waits for it before reading anything.
template <class Element, int kCols>
__global__ void __launch_bounds__(kWarps * 32)
    combine_splits_wide(CombineParams p, int blocks_per_sequence, int row_warps) {
  __shared__ float4 sums[kWarps][kMaxHeadDim / 4];  // each warp's weighted sum of its splits' O
  cutlass::arch::wait_on_dependent_grids();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int part = warp % row_warps;
  const int b = int(blockIdx.x) / blocks_per_sequence;
  const Sequence seq = load_sequence(p.sequences, b);
  if (!seq.valid) return;  // the whole CTA
#if FA4_SM90_COMBINE_PREFETCH
  const int t = int(blockIdx.x % blocks_per_sequence) * (kWarps / row_warps) + warp / row_warps;
  const bool exists = t < seq.len_q * p.partials.heads;  // no return: __syncthreads
  const int position = t / p.partials.heads;
  const int head = t % p.partials.heads;
  // A warp past the rows reads row 0's partials (allocated) and combines nothing.
  const int64_t row = exists ? p.partials.row(0, head, seq, position) : 0;
  const int64_t split_stride = int64_t(p.partials.heads) * p.partials.rows * p.head_dim_v;
  const float* o = p.partials.o + row * p.head_dim_v;
  float4 ahead[kCols][kWideAheadSplits];  // splits part, part + row_warps, ...
  CUTE_UNROLL
  for (int k = 0; k < kCols; ++k)
    CUTE_UNROLL
    for (int i = 0; i < kWideAheadSplits; ++i)
      if (lane * 4 + k * 128 < p.head_dim_v)
        ahead[k][i] = split_o(o, split_stride, part + i * row_warps, lane * 4 + k * 128);
  const float lse = exists ? combined_lse(p, row, head, lane) : INFINITY;

  CUTE_UNROLL
  for (int k = 0; k < kCols; ++k) {
    const int c = lane * 4 + k * 128;
    if (c >= p.head_dim_v) break;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (lse != INFINITY) {
      CUTE_UNROLL
      for (int i = 0; i < kWideAheadSplits; ++i)
        add_weighted(acc, expf(split_lse(p, row, part + i * row_warps) - lse), ahead[k][i]);
#pragma unroll 4
      for (int s = part + kWideAheadSplits * row_warps; s < p.splits; s += row_warps)
        add_weighted(acc, expf(split_lse(p, row, s) - lse), split_o(o, split_stride, s, c));
    }
    sums[warp][c / 4] = acc;
  }
#else
  const int64_t t =
      int64_t(blockIdx.x % blocks_per_sequence) * (kWarps / row_warps) + warp / row_warps;
  const bool exists = t < int64_t(seq.len_q) * p.partials.heads;  // no return: __syncthreads
  const int64_t position = t / p.partials.heads;
  const int head = int(t % p.partials.heads);
  const int64_t row = exists ? p.partials.row(0, head, seq, position) : 0;
  const float lse = exists ? combined_lse(p, row, head, lane) : INFINITY;

  const int64_t split_stride = int64_t(p.partials.heads) * p.partials.rows * p.head_dim_v;
  const float* o = p.partials.o + row * p.head_dim_v;
  for (int c = lane * 4; c < p.head_dim_v; c += 128) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (lse != INFINITY) {
#pragma unroll 4
      for (int s = part; s < p.splits; s += row_warps) {
        const float w = expf(split_lse(p, row, s) - lse);
        add_weighted(acc, w, *reinterpret_cast<const float4*>(o + s * split_stride + c));
      }
    }
    sums[warp][c / 4] = acc;
  }
#endif
  __syncthreads();
  if (!exists || part != 0) return;
  Element* out = static_cast<Element*>(p.out) + seq.batch * p.out_batch_stride +
                 (seq.start_q + position) * p.out_row_stride + head * p.out_head_stride;
  for (int c = lane * 4; c < p.head_dim_v; c += 128) {
    float4 acc = sums[warp][c / 4];
    for (int w = 1; w < row_warps; ++w) add_weighted(acc, 1.0f, sums[warp + w][c / 4]);
    store4(out + c, acc);
  }
  if (p.lse != nullptr && lane == 0)
    p.lse[seq.batch * p.lse_batch_stride + head * p.lse_head_stride +
          (seq.start_q + position) * p.lse_seq_stride] = lse;
}

template <int kCols>
cudaError_t launch_combine(CombineParams const& p, DType dtype, dim3 grid, int per_sequence,
                           int warps, void* stream) {
  const dim3 block{unsigned(kWarps * 32)};
  if (warps == 1)
    return dtype == DType::kFP16
               ? launch_kernel_dependent(combine_splits<cutlass::half_t, kCols>, grid, block, 0,
                                         stream, p, per_sequence)
               : launch_kernel_dependent(combine_splits<cutlass::bfloat16_t, kCols>, grid, block,
                                         0, stream, p, per_sequence);
  if (p.head_dim_v > kMaxHeadDim) return cudaErrorInvalidValue;
  return dtype == DType::kFP16
             ? launch_kernel_dependent(combine_splits_wide<cutlass::half_t, kCols>, grid, block, 0,
                                       stream, p, per_sequence, warps)
             : launch_kernel_dependent(combine_splits_wide<cutlass::bfloat16_t, kCols>, grid,
                                       block, 0, stream, p, per_sequence, warps);
}

}  // namespace

cudaError_t launch_combine_splits(CombineParams const& p, DType dtype, int64_t batch,
                                  int64_t max_q, void* stream) {
  // The split path runs only where the partials fit kSplitRowBudget rows: the grid is small.
  const int warps = warps_per_row(p.splits);
  const int rows_per_cta = kWarps / warps;
  const int per_sequence = int((max_q * p.partials.heads + rows_per_cta - 1) / rows_per_cta);
  const dim3 grid{unsigned(per_sequence * batch)};
#if FA4_SM90_COMBINE_PREFETCH
  if (p.head_dim_v <= 128) return launch_combine<1>(p, dtype, grid, per_sequence, warps, stream);
#endif
  return launch_combine<kMaxHeadDim / 128>(p, dtype, grid, per_sequence, warps, stream);
}

}  // namespace fa4::sm90
