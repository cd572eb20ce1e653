// The longest-first tile order's kernel (tile_order.cuh): one CTA, the sequences sorted by a
// counting sort over key-count bins in shared memory.
#include <cub/block/block_scan.cuh>
#include <cutlass/arch/grid_dependency_control.h>

#include "sm90/host/launch.cuh"
#include "sm90/fwd/tile_order.cuh"

#if defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "griddepcontrol is compiled out: build with -DCUTLASS_ENABLE_GDC_FOR_SM90"
#endif

namespace fa4::sm90 {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
// Key counts are binned to this resolution (of the longest declared sequence): sequences within
// one bin keep an arbitrary order among themselves.
constexpr int kBins = 4096;

using BlockScan = cub::BlockScan<int32_t, kThreads>;

// Exclusive prefix sum of a[0, n) in place; returns the total.
__device__ int32_t exclusive_scan(int32_t* a, int n, BlockScan::TempStorage& temp) {
  int32_t carry = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + int(threadIdx.x);
    int32_t x = 0, sum = 0;
    BlockScan(temp).ExclusiveSum(i < n ? a[i] : 0, x, sum);
    if (i < n) a[i] = carry + x;
    carry += sum;
    __syncthreads();  // temp is reused, a[] is read next
  }
  return carry;
}

__global__ void __launch_bounds__(kThreads, 1) order_tiles(TileOrderParams p) {
  // The forward kernel may start its prologue now; it reads this order only after
  // griddepcontrol.wait, which waits for this grid to finish.
  cutlass::arch::launch_dependent_grids();
  __shared__ BlockScan::TempStorage temp;
  extern __shared__ int32_t smem[];
  const int batch = p.batch;
  int32_t* bin_first = smem;              // kBins: sequences per bin, then the bin's first slot
  int32_t* slot_of = bin_first + kBins;   // batch: the sequence's bin, then its slot
  int32_t* tiles_of = slot_of + batch;    // batch: the sequence's query tiles per tile head
  int32_t* seq_at = tiles_of + batch;     // batch: the sequence in each slot
  int32_t* first_tile = seq_at + batch;   // batch: each slot's first query tile per tile head
  const int tid = int(threadIdx.x);

  for (int i = tid; i < kBins; i += kThreads) bin_first[i] = 0;
  __syncthreads();
  const int64_t max_k = p.sequences.max_k > 0 ? p.sequences.max_k : 1;
  for (int b = tid; b < batch; b += kThreads) {
    // The forward kernel's own reading of the sequence (find_work): invalid entries give no tiles.
    const Sequence s = load_sequence(p.sequences, b);
    const int64_t rows = s.valid ? p.rows.count(s.len_q) : 0;
    tiles_of[b] = int32_t((rows + p.block_m - 1) / p.block_m);
    // Bin 0 holds the most keys.
    const int64_t keys = s.valid ? s.len_k : 0;
    const int bin = kBins - 1 - int(keys * (kBins - 1) / max_k);
    slot_of[b] = bin;
    atomicAdd(&bin_first[bin], 1);
  }
  __syncthreads();
  exclusive_scan(bin_first, kBins, temp);
  for (int b = tid; b < batch; b += kThreads) {
    const int slot = atomicAdd(&bin_first[slot_of[b]], 1);
    slot_of[b] = slot;
    seq_at[slot] = b;
  }
  __syncthreads();
  for (int s = tid; s < batch; s += kThreads) first_tile[s] = tiles_of[seq_at[s]];
  __syncthreads();
  const int64_t total = exclusive_scan(first_tile, batch, temp);

  // A warp per sequence, its lanes along the sequence's tiles (heads, then query tiles). Entries
  // past the grid are dropped: only sequences that overlap in cu_seqlens (invalid arrays, whose
  // outputs are unspecified, docs/semantics.md) can sum to more tiles than the grid has.
  const TileScheduler::Params& sched = p.scheduler;
  const int64_t entries = p.entries;
  const int warp = tid / 32, lane = tid % 32;
  for (int s = warp; s < batch; s += kWarps) {
    const int b = seq_at[s];
    const int n = tiles_of[b];
    const int64_t first = int64_t(first_tile[s]) * sched.heads;
    for (int64_t j = lane; j < int64_t(n) * sched.heads && first + j < entries; j += 32) {
      const int head = int(j / n);
      const int i = int(j % n);  // i-th in the dispatch order, heaviest first when causal
      // TileScheduler::coord reverses query tiles (heavy_last_rows) over the longest sequence's
      // num_m_blocks: the code that decodes to query tile n − 1 − i.
      const int m = sched.heavy_last_rows ? sched.num_m_blocks - n + i : i;
      sched.order[first + j] = (b * sched.heads + head) * sched.num_m_blocks + m;
    }
  }
  for (int64_t e = total * sched.heads + tid; e < entries; e += kThreads) sched.order[e] = -1;
}

}  // namespace

cudaError_t launch_order_tiles(TileOrderParams const& p, void* stream) {
  const size_t smem = sizeof(int32_t) * (size_t(kBins) + 4 * size_t(p.batch));
  // The limit for the largest batch, the same on every call: host threads launching at once
  // would otherwise lower it under one another's launch.
  cudaError_t err = cudaFuncSetAttribute(order_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(sizeof(int32_t) * (kBins + 4 * kMaxOrderedBatch)));
  if (err == cudaSuccess) err = launch_kernel(order_tiles, dim3(1), dim3(kThreads), smem, stream, p);
  return err;
}

}  // namespace fa4::sm90
