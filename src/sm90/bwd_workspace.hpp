// The sm90 backward's workspace (caller-owned device memory, workspace_size bytes), shared by the
// host launcher and the kernels. fp32 throughout, rows numbered like the packed query / key rows:
//   dq_accum  [heads_q][query rows][dim]     dQ / scale, summed over key tiles by atomics
//   lse_log2  [heads_q][query rows]          LSE·log2(e), +inf for a row that sees no key
//   dpsum     [heads_q][query rows]          D = rowsum(dO ∘ O)
//   dk_accum, dv_accum [heads_kv][key rows][dim]   GQA only: summed over a group's query heads
// Query rows are batch·seqlen_q (fixed length; sequence b starts at b·seqlen_q) or total_q
// (varlen; sequence b starts at cu_seqlens_q[b]); key rows likewise.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

constexpr int kBwdBlockM = 64;  // query rows per step of the backward kernel (BwdConfig)

struct BwdWorkspace {
  size_t dq_accum = 0, lse_log2 = 0, dpsum = 0, dk_accum = 0, dv_accum = 0;  // byte offsets
  size_t bytes = 0;
  bool gqa = false;

  static BwdWorkspace layout(const Problem& p) {
    constexpr size_t kAlign = 256;
    auto round = [](size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    const size_t q_rows = size_t(p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q);
    const size_t k_rows = size_t(p.is_varlen() ? p.varlen.total_k : p.batch * p.seqlen_k);
    const size_t f = sizeof(float);
    BwdWorkspace w;
    w.gqa = p.heads_q != p.heads_kv;
    size_t at = 0;
    w.dq_accum = at;
    at = round(at + size_t(p.heads_q) * q_rows * size_t(p.head_dim_qk) * f);
    w.lse_log2 = at;
    at = round(at + size_t(p.heads_q) * q_rows * f);
    w.dpsum = at;
    at = round(at + size_t(p.heads_q) * q_rows * f);
    if (w.gqa) {
      w.dk_accum = at;
      at = round(at + size_t(p.heads_kv) * k_rows * size_t(p.head_dim_qk) * f);
      w.dv_accum = at;
      at = round(at + size_t(p.heads_kv) * k_rows * size_t(p.head_dim_v) * f);
    }
    w.bytes = at;
    return w;
  }
};

}  // namespace fa4::sm90
