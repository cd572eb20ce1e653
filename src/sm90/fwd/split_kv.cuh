// Split-KV. With fewer query tiles than SMs (decode: few sequences and kv heads, long contexts)
// most SMs would idle while one CTA per tile walks all of its keys. The launcher then shares each
// tile's key tiles out among `splits` CTAs (TileScheduler: the split is the innermost index of a
// grid entry), each of which computes its share like a whole tile, normalises O by its own row sum
// and writes it with its LSE to the caller's workspace (fp32, from registers) instead of O. A
// second kernel combines the splits of each row: LSE = log Σ exp(LSEₛ), O = Σ exp(LSEₛ − LSE)·Oₛ,
// rounded once to the output dtype. A split whose keys a row does not see holds LSE = +inf (this
// library's mark of a row without keys) and weighs nothing; a row no split saw keeps O = 0,
// LSE = +inf. Masks need nothing of their own: the share is cut from the key tiles the mask leaves.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include <cute/config.hpp>

#include "fa4/attention.hpp"
#include "sm90/common/tile_mask.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/fwd/split_kv.hpp"

namespace fa4::sm90 {

// Where split CTAs write their partial results; o null: the problem is not split.
struct SplitPartials {
  float* o;            // [split][query head][row][head dim v]: O / the split's own row sum
  float* lse;          // [split][query head][row], natural log; +inf: the row saw no key
  int64_t rows;        // rows per head: batch · seqlen_q, or total_q
  int64_t batch_rows;  // rows per batch entry: seqlen_q, or 0 (varlen: start_q places them)
  int heads;           // query heads

  // The layout at `base` (split_workspace_bytes(p, splits) bytes): every split's O, then its LSE.
  static SplitPartials at(void* base, const Problem& p, int splits) {
    SplitPartials sp{};
    sp.o = static_cast<float*>(base);
    sp.rows = split_query_rows(p);
    sp.heads = int(p.heads_q);
    sp.lse = sp.o + int64_t(splits) * sp.heads * sp.rows * p.head_dim_v;
    sp.batch_rows = p.is_varlen() ? 0 : p.seqlen_q;
    return sp;
  }

  CUTE_HOST_DEVICE bool enabled() const { return o != nullptr; }
  CUTE_HOST_DEVICE int64_t row(int split, int head, Sequence const& seq, int64_t position) const {
    return (int64_t(split) * heads + head) * rows + seq.batch * batch_rows + seq.start_q + position;
  }
};

// Key tiles of split `split` of `splits`: an even share of `keys`, in order (possibly none). In
// 32 bits where the products fit: n · splits < 2^32 for n < 2^24 key tiles and splits ≤ 256 (the
// plan takes at most kMaxSplits). A 64-bit division is a called routine of ~100 dependent
// instructions, and every producer warp's tile walk runs it at the head of the tile's critical
// path.
CUTE_HOST_DEVICE KeyTiles split_share(KeyTiles keys, int split, int splits) {
  const int64_t n = keys.empty() ? 0 : keys.count();
  if (n < (int64_t(1) << 24) && splits <= 256) {
    const uint32_t n32 = uint32_t(n), d = uint32_t(splits);
    return {keys.begin + int(n32 * uint32_t(split) / d),
            keys.begin + int(n32 * uint32_t(split + 1) / d)};
  }
  return {keys.begin + int(n * split / splits), keys.begin + int(n * (split + 1) / splits)};
}

struct CombineParams {
  SplitPartials partials;
  int splits;
  int head_dim_v;
  SequenceParams sequences;
  void* out;  // the output dtype's O, strides in elements (batch stride 0 for varlen)
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  float* lse;  // null: not wanted
  int64_t lse_batch_stride, lse_head_stride, lse_seq_stride;
  const float* sinks;  // attention sinks (heads_q), joined here, once per row; null: none
};

// Combines the splits of every row of every valid sequence (the forward kernel's reading of
// cu_seqlens, sequence.cuh) into O and LSE, on `stream` after the forward kernel.
cudaError_t launch_combine_splits(CombineParams const& p, DType dtype, int64_t batch,
                                  int64_t max_q, void* stream);

}  // namespace fa4::sm90
