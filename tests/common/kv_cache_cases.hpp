// The KV cache (Problem::kv_cache) test cases and their checks, shared by the CPU backend's tests
// (tests/cpu/test_kv_cache.cpp) and the sm90 backend's (tests/gpu/test_sm90_kv_cache.cpp), so that
// both backends run the same cases against the same reference. The reference is assembled here
// independently of the library's cache code: pages (sizes 1 to 256, shuffled, shared between
// sequences, NHD and HND layouts), cache rows picked by batch_idx, left pads, appends of 1, 3 and
// 200 rows (fixed and varlen) with and without a rotary embedding of either form, queries from one
// row (decode) to chunks, fixed-length and varlen, under every mask.
//   - The appends: each appended row holds k_new rotated at its position (to within the dtype's
//     rounding of the exact rotation) and v_new; every other element of the cache is unchanged.
//   - The attention: each sequence's keys gathered from the cache the call left (through this
//     file's own page arithmetic) into a plain varlen problem, and O and LSE checked against the
//     double reference on it by the accuracy rule (docs/testing.md), the queries rotated by the
//     reference itself.
// The checks return their results rather than assert, so that this library needs no GoogleTest
// (fa4-bench links it too).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "fa4/attention.hpp"

namespace fa4::test {

struct CacheCase {
  std::string name;  // a valid GoogleTest name, unique among the cases; it seeds the inputs
  DType dtype = DType::kBF16;
  int64_t batch = 3, heads_q = 4, heads_kv = 2, dim = 64;
  int64_t page_size = 0;     // 0: not paged
  bool head_major = false;   // the cache laid out (pages, heads, rows, dim)
  bool shared_pages = false; // neighbouring sequences share their first pages
  bool batch_idx = false;    // cache rows picked by a permutation of a larger cache
  bool leftpad = false;
  int64_t append = 0;        // rows appended per sequence
  bool varlen_append = false;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  int64_t seqlen_q = 1;      // rows per sequence (fixed), or the longest (varlen)
  bool varlen_q = false;
  int64_t capacity = 300;    // keys per cache row
  bool causal = false;
  Window window{};
  float softcap = 0.0f;
  // e4m3 (dtype kE4M3): Q and the cache hold values about 16 times their true size, with descales
  // of 1/32 to 1/16 per (batch, kv head); the output and the rotary tables are bf16. Appended rows
  // are e4m3 as given, or bf16 quantised on write (Fp8::quantize_appends).
  bool quantize_appends = false;
  // Score variants (the matrix's Case has the same two): sinks, ALiBi per head or per batch entry.
  bool sinks = false;
  Case::Alibi alibi = Case::Alibi::kNone;
};

std::string describe(const CacheCase& c);  // the case in words, for failure messages
// How GoogleTest prints a CacheCase parameter (its name, not its bytes).
void PrintTo(const CacheCase& c, std::ostream* os);

// A case made concrete: host arrays, host tensors and the problem pointing at them.
struct CacheSetup {
  Problem p;
  std::vector<int32_t> cache_len, leftpad, batch_idx, page_table, cu_new, cu_q;
  std::vector<int64_t> new_rows, q_rows;
  HostTensor q, k, v, k_new, v_new, out, cos, sin;
  HostLse lse;
  std::vector<float> q_descale, k_descale, v_descale;  // e4m3: (batch, heads_kv), dense
  std::vector<float> sinks, alibi_slopes;               // the score variants', when on
  int64_t cache_rows = 0;
  std::vector<double> k_initial, v_initial;  // the cache as drawn, before any call wrote it
};

// Draws the case's arrays and tensors from rng (make_rng(c.name) in the tests, so that the backends
// see the same inputs for the same seed), keeps the cache as drawn and poisons the outputs. A
// fresh setup per call: appends write the cache.
std::unique_ptr<CacheSetup> make_cache_setup(const CacheCase& c, std::mt19937_64& rng);

// The forward's tensors over the setup's host tensors.
ForwardTensors tensors_of(const CacheSetup& s);

// Dense index of (cache position pos, head h, dim c) of sequence b's cache row, by this file's own
// page arithmetic.
int64_t cache_index(const CacheSetup& s, int64_t b, int64_t pos, int64_t h, int64_t c);

// The rotation of one row in double at `pos`, and each element's error bound in a computation in
// fp32: the products' and the difference's rounding, which scales with the terms (a result that
// cancels keeps their absolute error). The rounding to the cache's dtype comes on top.
struct Rotated {
  std::vector<double> value, bound;
};
Rotated rotated(const CacheSetup& s, const std::vector<double>& x, int64_t pos);

// The cache the call left (s.k, s.v) against the one drawn (k_initial, v_initial) with the appends
// made here: one result for k, one for v.
std::vector<CheckResult> check_appends(const CacheSetup& s);

// O and LSE (s.out, s.lse) against the reference on a plain varlen problem: each sequence's keys
// gathered from the cache the call left. One result for out, one for lse. `lse_ulps` widens LSE's
// atol by that many fp32 ulps of the largest |LSE|, for a backend that reaches LSE through fp32
// roundings the lp reference does not share (docs/testing.md, GPU forward LSE); 0: the plain
// rule. `fp8_mma`: the backend multiplies e4m3 on Hopper's FP8 tensor cores, whose sums are
// shorter than fp32's; an e4m3 problem's LSE may then be kFp8ScoreShare of its row's score_abs
// farther from the reference than the rule allows (as in the FP8 forward's fp8_lse_bound).
std::vector<CheckResult> check_attention(const CacheSetup& s, double lse_ulps = 0.0,
                                         bool fp8_mma = false);

// Every case both backends run.
std::vector<CacheCase> cache_cases();

}  // namespace fa4::test
