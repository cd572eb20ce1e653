// Global-memory views of the (batch, seq, head, dim) tensors as the TMA descriptors see them:
// (seq, dim, head, batch) with the dim contiguous, int64 strides in elements.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
using GmemLayout = cute::Layout<GmemShape, GmemStride>;

// TMA needs every stride to be a non-zero multiple of 16 bytes, also that of an extent-1 mode
// (whose stride is never used, and which callers may leave at 0): such a stride becomes one 16-byte
// step. sm90_backend.cpp's check_tensors rejects zero strides of longer modes.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t elem_bytes) {
  constexpr int64_t kTmaStrideBytes = 16;
  return (extent <= 1 && stride == 0) ? kTmaStrideBytes / elem_bytes : stride;
}

// seqlen 0 (no keys) still needs a valid descriptor, never used: it is given one row.
inline GmemLayout gmem_layout(const TensorView& t, int64_t seqlen, int64_t dim, int64_t heads,
                              int64_t batch, int64_t elem_bytes) {
  const int64_t rows = seqlen > 0 ? seqlen : 1;
  return cute::make_layout(
      cute::make_shape(int32_t(rows), int32_t(dim), int32_t(heads), int32_t(batch)),
      cute::make_stride(tma_stride(t.seq_stride, rows, elem_bytes), cute::_1{},
                        tma_stride(t.head_stride, heads, elem_bytes),
                        tma_stride(t.batch_stride, batch, elem_bytes)));
}

}  // namespace fa4::sm90
