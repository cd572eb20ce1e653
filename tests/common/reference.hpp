// Naive attention in double precision, used only by tests and by fa4-bench's sample check.
// Written independently of the library's kernels (no shared mask or layout code) so that it can
// catch their mistakes. Inputs are read through the same TensorView / LseView structs the API
// takes.
#pragma once

#include <cstdint>
#include <vector>

#include "fa4/attention.hpp"

namespace fa4::ref {

enum class Precision {
  kExact,        // double everywhere (the "ref" of the correctness rule)
  kLowPrecision  // the kernel's way: S and the softmax in fp32, P rounded to the problem's dtype
                 // before P·V, the output rounded to its dtype (the "lp" of the correctness rule)
};

// Dense results, laid out contiguously:
//   out: [batch][seqlen_q][heads_q][head_dim_v] (varlen: [total_q][heads_q][head_dim_v])
//   lse: [batch][heads_q][seqlen_q]             (varlen: [heads_q][total_q]), natural log, +inf
//        for rows that see no key.
// Elements that are not computed (rows left out by a sample, varlen rows outside every sequence)
// hold NaN.
struct ForwardResult {
  std::vector<double> out;
  std::vector<double> lse;
  // Exact mode only (empty otherwise): the scales that rounding errors of a computation of this
  // problem grow with, for tolerances.
  //   out_abs:   like out, Σ_j P_ij·|V_jc| — what the P·V sums add up in absolute value;
  //   score_abs: like lse, max over visible keys of |scale|·Σ_c |Q_ic·K_jc| (+ |ALiBi's bias|)
  //              — the size of the terms a score adds up (0 for a row that sees no key).
  std::vector<double> out_abs;
  std::vector<double> score_abs;
};

// Gradients in the layouts of q / k / v ([batch][seq][heads][dim] or [total][heads][dim]).
// Key rows at or beyond seqused_k hold 0; varlen rows outside every sequence hold NaN.
struct BackwardResult {
  std::vector<double> dq, dk, dv;
  // Exact mode only (empty / 0 otherwise), for tolerances:
  //   d*_abs:    the gradient computed with every term replaced by its absolute value (and
  //              |O| by Σ_j P_ij·|V_j|), the scale its rounding errors grow with;
  //   d*_ds_abs: dQ / dK with |dS| (times softcap's error weight) and |K| / |Q| in place of dS
  //              and K / Q: the scale of the errors made in P and dS themselves (exp, its
  //              argument, the scores), much smaller than d*_abs where dP − D cancels;
  //   d*_via_d:  the part of dq_abs / dk_abs that flows through D = rowsum(dO ∘ O): an error in
  //              the O a backward pass is given (e.g. O rounded to bf16) enters only through it;
  //              zero when `out` was given (D then uses the very O the backward pass is given);
  //   d*_tiny:   Σ over the gradient's terms of (the weight an absolute error of P or dS gets
//              in it, + 1): P and dS underflow to fp32 subnormals for far keys (ALiBi, long
//              rows), where each rounding is off by up to half the smallest subnormal whatever
//              the value, an error the relative scales above cannot express;
//   score_abs_max: the largest |scale|·Σ_c |Q_ic·K_jc| over visible (query, key) pairs.
  std::vector<double> dq_abs, dk_abs, dv_abs;
  std::vector<double> dq_ds_abs, dk_ds_abs;
  std::vector<double> dq_via_d, dk_via_d;
  std::vector<double> dq_tiny, dk_tiny, dv_tiny;
  double score_abs_max = 0.0;
  // With Problem::sinks: d(sinks) (heads_q), and in exact mode Σ exp(sink − LSE)·|dO|·Σ_j P|V|,
  // the scale of its rounding errors.
  std::vector<double> dsinks, dsinks_abs;
};

// The problem must be valid (the reference does not validate); only the listed inputs are read.
// Rows are restricted to those selected by `rows` when it is non-empty: a list of (batch, head_q,
// row) triples, `row` counted within sequence `batch` (0 ≤ row < its length) — only those rows of
// `out` / `lse` are computed (the rest stay NaN). fa4-bench uses this to check a sample of a large
// problem.
struct RowSample {
  int64_t batch, head, row;
};

// A rotary embedding of the queries (a KV cache's, Problem::kv_cache), applied to each query row
// before its scores: in double (exact mode), or in fp32 and rounded to the problem's dtype
// (low-precision mode: a kernel holds the rotated Q in its dtype). The tables hold `dim` / 2
// values per position, in the problem's dtype; interleaved pairs (2i, 2i + 1), else (i, i + dim/2).
struct QueryRotary {
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t row_stride = 0;
  int64_t dim = 0;
  bool interleaved = false;
  std::vector<int64_t> position;  // per batch entry: the position of its query 0
  bool per_row = false;           // query i at position[b] + i; else every query at position[b]
};

// The descales of e4m3 inputs (Problem::dtype kE4M3; ForwardTensors' q/k/v_descale): the scores
// of batch entry b, kv head h scaled by q_descale·k_descale, its output by v_descale — in double
// (exact mode), or as the kernels do, the three products in fp32 (low-precision mode, where P is
// rounded to e4m3 before P·V and O to fp8.out_dtype).
struct Descales {
  DescaleView q, k, v;
};

ForwardResult forward(const Problem& problem, const TensorView& q, const TensorView& k,
                      const TensorView& v, Precision precision = Precision::kExact,
                      const std::vector<RowSample>& rows = {},
                      const QueryRotary* rotary = nullptr, const Descales* descales = nullptr);

// Gradients of sum(out ∘ dout) w.r.t. q, k, v (and the sinks, with Problem::sinks). ALiBi and the
// sinks are computed as docs/semantics.md defines them, written out here again. Exact mode: in
// double, from the given inputs (O is recomputed exactly, so the result is the true gradient of
// the function the inputs define).
// Low-precision mode: the kernel's way — S, P = exp(S − LSE), dP and D in fp32 with LSE and O
// from the low-precision forward (O rounded to the dtype), P and dS rounded to the dtype before
// the GEMMs they feed, fp32 accumulation, gradients rounded to the dtype.
// `out`, when given (dtype of the problem, layout of dout), is the O that D = rowsum(dO ∘ O) is
// computed from, as a backward pass is handed it: the result is then what that pass computes in
// exact arithmetic (no longer the true gradient when `out` carries rounding errors).
BackwardResult backward(const Problem& problem, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& dout,
                        Precision precision = Precision::kExact, const TensorView* out = nullptr);

}  // namespace fa4::ref
