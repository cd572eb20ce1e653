// Global-memory views of Q, K, V and O as the TMA descriptors see them, one layout for fixed-length
// and varlen batches, in which the rows past a sequence's end are out of bounds.
//
// A TMA box is clipped only at the descriptor's extents, which are the same for every CTA. To clip
// each sequence at its own length L (varlen, or seqused_k), rows are addressed through two modes
// with the same stride s, over a base moved back by R·s (R = the longest sequence):
//   (row r < R, dim, head, shift t, batch) ↦ base + r·s + t·s + ...,   base = data − R·s.
// Row i of a sequence that starts at row `start` and has L rows is at r = R − L + i, t = start + L:
// the address is data + (start + i)·s, and r < R exactly when i < L. Loads of rows past L read
// zeros, stores of them are dropped. A fixed-length batch is the case start = 0, with its own mode.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "fa4/attention.hpp"
#include "sm90/common/row_space.hpp"

namespace fa4::sm90 {

// (row, dim, head, shift, batch)
using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t, int32_t>;
using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t, int64_t>;
using GmemLayout = cute::Layout<GmemShape, GmemStride>;

// TMA needs every stride to be a non-zero multiple of 16 bytes, also that of an extent-1 mode
// (whose stride is never used, and which callers may leave at 0): such a stride becomes one 16-byte
// step. backend.cpp's check_tensors rejects zero strides of longer modes.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t elem_bytes) {
  constexpr int64_t kTmaStrideBytes = 16;
  return (extent <= 1 && stride == 0) ? kTmaStrideBytes / elem_bytes : stride;
}

// A view moved back by R rows, and its layout. With R = 0 (no rows at all) the view still needs a
// valid descriptor, never used: it gets one row.
template <class Element>
struct GmemView {
  Element* base;
  GmemLayout layout;
};

template <class Element>
GmemView<Element> gmem_view(Element* data, const TensorView& t, RowSpace rows, int64_t dim,
                            int64_t heads) {
  const int64_t elem = sizeof(Element);
  const int64_t r = rows.max_rows > 0 ? rows.max_rows : 1;
  // shift_rows − 1 is the number of rows the tensor really has.
  const int64_t seq = tma_stride(t.seq_stride, rows.shift_rows - 1, elem);
  // The base is an address R rows before the tensor: never dereferenced (every in-bounds
  // coordinate lands inside the tensor), only offset. Integer arithmetic keeps that well defined.
  auto* base = reinterpret_cast<Element*>(reinterpret_cast<uintptr_t>(data) -
                                          uintptr_t(r * seq * elem));
  return {base, cute::make_layout(cute::make_shape(int32_t(r), int32_t(dim), int32_t(heads),
                                                   int32_t(rows.shift_rows), int32_t(rows.batch)),
                                  cute::make_stride(seq, cute::_1{},
                                                    tma_stride(t.head_stride, heads, elem), seq,
                                                    tma_stride(t.batch_stride, rows.batch, elem)))};
}

// Where one sequence's rows are, in the coordinates above.
struct SeqRows {
  int32_t offset;  // R − L: the row coordinate of the sequence's row 0
  int32_t shift;   // start + L
  int32_t batch;   // batch entry (fixed-length), else 0
};

// The (rows, dim, tile) tiles of one head of one sequence in a TMA view, rows counted from the
// sequence's row 0.
template <class Tma, class Box>
CUTE_DEVICE auto sequence_tiles(Tma const& tma, GmemShape const& shape, int head, SeqRows rows,
                                Box box) {
  using namespace cute;
  Tensor m = tma.get_tma_tensor(shape)(_, _, head, rows.shift, rows.batch);  // (row, dim)
  return local_tile(domain_offset(make_coord(rows.offset, _0{}), m), box, make_coord(_, _0{}));
}

// The same, with the head dim tiled too: (box rows, box cols, row tile, col tile).
template <class Tma, class Box>
CUTE_DEVICE auto sequence_tiles_2d(Tma const& tma, GmemShape const& shape, int head, SeqRows rows,
                                   Box box) {
  using namespace cute;
  Tensor m = tma.get_tma_tensor(shape)(_, _, head, rows.shift, rows.batch);
  return local_tile(domain_offset(make_coord(rows.offset, _0{}), m), box, make_coord(_, _));
}

}  // namespace fa4::sm90
