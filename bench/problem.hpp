// The fa4::Problem fa4-bench runs, built from the command line, and the work it represents.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fa4/attention.hpp"
#include "options.hpp"

namespace fa4::bench {

// Host copies of the per-sequence arrays a varlen / seqused_k problem points to. The Problem built
// by make_problem points into this storage, so it must outlive the Problem.
struct SequenceArrays {
  std::vector<int32_t> cu_seqlens_q;
  std::vector<int32_t> cu_seqlens_k;
  std::vector<int32_t> seqused_k;
};

// Builds the problem (its arrays, if any, in `arrays`). Returns an empty string on success, else
// why the command line describes no valid problem (checks the library cannot make without reading
// the arrays, which it only does once tensors are handed over).
std::string make_problem(const Options& options, SequenceArrays& arrays, Problem* problem);

// Rows of the packed (varlen) or per-batch (fixed) query / key axis.
int64_t query_rows(const Problem& problem);
int64_t key_rows(const Problem& problem);

// Queries and keys of sequence b as the kernels see them (key count after seqused_k).
int64_t sequence_queries(const Problem& problem, int64_t b);
int64_t sequence_keys(const Problem& problem, int64_t b);

// Σ over sequences and query rows of the keys the mask lets the row see, for one head.
int64_t visible_pairs(const Problem& problem);

// Score elements the full (unmasked) score matrices hold: Σ_b heads_q · sq_b · sk_b.
int64_t score_elements(const Problem& problem);

// FLOPs of the two forward GEMMs over the visible pairs (docs/benchmarks.md: 4·b·h·sq·sk·d
// without a mask, halved by a causal mask with sq = sk); backward counts 2.5 × forward.
double forward_flops(const Problem& problem);
double backward_flops(const Problem& problem);

// One line, e.g. "bf16 b=2 sq=1024 sk=1024 hq=16 hkv=16 d=128 dv=128 causal".
std::string describe(const Problem& problem);

}  // namespace fa4::bench
