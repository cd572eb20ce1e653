// Where sequence b of a (validated) problem lives, for host code: the CPU backend and validation.
// Fixed-length batches address rows as b·batch_stride + s·seq_stride; varlen batches as
// (cu_seqlens[b] + s)·seq_stride. seqused_k shortens the keys a sequence uses (and with it the
// bottom-right alignment of causal / window masks), as in flash_attn.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4 {

struct SeqSpan {
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;  // keys used (after seqused_k)
  int64_t q_row = 0;     // first row in the packed tensor (varlen), else 0
  int64_t k_row = 0;
  int64_t batch = 0;     // batch index for fixed-length addressing, else 0
};

inline SeqSpan seq_span(const Problem& p, int64_t b) {
  SeqSpan s;
  if (p.is_varlen()) {
    s.q_row = p.varlen.cu_seqlens_q[b];
    s.k_row = p.varlen.cu_seqlens_k[b];
    s.seqlen_q = p.varlen.cu_seqlens_q[b + 1] - s.q_row;
    s.seqlen_k = p.varlen.cu_seqlens_k[b + 1] - s.k_row;
  } else {
    s.batch = b;
    s.seqlen_q = p.seqlen_q;
    s.seqlen_k = p.seqlen_k;
  }
  if (p.seqused_k != nullptr) s.seqlen_k = p.seqused_k[b];
  return s;
}

// Element offset of row `row` (within the span), head h, of a (batch, seq, head, dim) view.
inline int64_t q_offset(const TensorView& t, const SeqSpan& s, int64_t row, int64_t h) {
  return s.batch * t.batch_stride + (s.q_row + row) * t.seq_stride + h * t.head_stride;
}
inline int64_t k_offset(const TensorView& t, const SeqSpan& s, int64_t row, int64_t h) {
  return s.batch * t.batch_stride + (s.k_row + row) * t.seq_stride + h * t.head_stride;
}
inline int64_t lse_offset(const LseView& t, const SeqSpan& s, int64_t row, int64_t h) {
  return s.batch * t.batch_stride + h * t.head_stride + (s.q_row + row) * t.seq_stride;
}

}  // namespace fa4
