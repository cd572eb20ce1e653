// The split-KV combine (split_kv.cuh): a warp per (query row, head), its lanes along the head dim.
#include <cutlass/numeric_types.h>

#include "common/mask.hpp"
#include "common/math_constants.hpp"
#include "sm90/host/launch.cuh"
#include "sm90/fwd/split_kv.cuh"

namespace fa4::sm90 {
namespace {

constexpr int kWarps = 8;

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

// blocks_per_sequence CTAs per batch entry, one after another (a 1-D grid: no 65535 limit).
template <class Element>
__global__ void __launch_bounds__(kWarps * 32)
    combine_splits(CombineParams p, int blocks_per_sequence) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int b = int(blockIdx.x) / blocks_per_sequence;
  const Sequence seq = load_sequence(p.sequences, b);
  if (!seq.valid) return;
  const int64_t t = int64_t(blockIdx.x % blocks_per_sequence) * kWarps + warp;
  if (t >= int64_t(seq.len_q) * p.partials.heads) return;
  const int64_t position = t / p.partials.heads;
  const int head = int(t % p.partials.heads);
  const int64_t row = p.partials.row(0, head, seq, position);

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
  // below, e^(lse_s − lse), then take its share.
  if (p.sinks != nullptr) Sink{p.sinks[head]}.fold(m, sum);
  const bool empty = m == -INFINITY;
  const float lse = empty ? INFINITY : m + logf(sum);

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
        acc.x += w * x.x;
        acc.y += w * x.y;
        acc.z += w * x.z;
        acc.w += w * x.w;
      }
    out[c] = Element(acc.x);
    out[c + 1] = Element(acc.y);
    out[c + 2] = Element(acc.z);
    out[c + 3] = Element(acc.w);
  }
  if (p.lse != nullptr && lane == 0)
    p.lse[seq.batch * p.lse_batch_stride + head * p.lse_head_stride +
          (seq.start_q + position) * p.lse_seq_stride] = lse;
}

}  // namespace

cudaError_t launch_combine_splits(CombineParams const& p, DType dtype, int64_t batch,
                                  int64_t max_q, void* stream) {
  // The split path runs only where the partials fit kSplitRowBudget rows: the grid is small.
  const int per_sequence = int((max_q * p.partials.heads + kWarps - 1) / kWarps);
  const dim3 grid{unsigned(per_sequence * batch)};
  const dim3 block{unsigned(kWarps * 32)};
  return dtype == DType::kFP16
             ? launch_kernel(combine_splits<cutlass::half_t>, grid, block, 0, stream, p,
                             per_sequence)
             : launch_kernel(combine_splits<cutlass::bfloat16_t>, grid, block, 0, stream, p,
                             per_sequence);
}

}  // namespace fa4::sm90
