// fa4cpp public C++ API.
//
// Exact scaled-dot-product attention. The caller describes the problem (shapes, dtype, masking,
// scale, variable-length layout) in a `Problem`, hands tensors as raw pointers plus int64 strides,
// provides any workspace the library asks for, and a stream. Nothing is allocated on the device,
// nothing synchronises the host, and every entry point returns a `Status`. On any error nothing is
// written to an output.
//
// Semantics follow flash_attn (see docs/semantics.md for the full contract):
//   S = softmax_scale · Q Kᵀ; if softcap > 0: S = softcap · tanh(S / softcap); then masking;
//   P = softmax(S) over the keys a query may see; O = P V; LSE = log Σ exp(S) (natural log, fp32).
//   Causal and window masks are aligned bottom-right: query i sees key j when
//   i + sk − sq − window.left ≤ j ≤ i + sk − sq + window.right (causal ⇒ right = 0).
//   A query row that sees no key outputs 0 and its LSE is +inf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fa4/export.h"

namespace fa4 {

enum class StatusCode : int {
  kSuccess = 0,
  kInvalidArgument = 1,    // the input is wrong: bad shape, null pointer, inconsistent strides...
  kNotSupported = 2,       // a valid input that this backend does not implement
  kWorkspaceTooSmall = 3,  // workspace_bytes < workspace_size(...)
  kBackendUnavailable = 4, // e.g. sm90 asked for in a CPU-only build or with no Hopper GPU present
  kDeviceError = 5,        // a CUDA call failed
  kInternalError = 6,
};

FA4_API const char* to_string(StatusCode code);

struct Status {
  StatusCode code = StatusCode::kSuccess;
  std::string message;  // empty on success; otherwise one human-readable sentence

  bool ok() const { return code == StatusCode::kSuccess; }
  static Status success() { return {}; }
};

enum class DType : int {
  kBF16 = 0,
  kFP16 = 1,
  kFP32 = 2,  // CPU backend only
  // FP8 e4m3 (torch.float8_e4m3fn: no infinities, largest finite value 448) for Q, K and V of the
  // forward, each with a descale per (batch entry, kv head) (ForwardTensors) and an output in
  // Problem::fp8.out_dtype. Forward only.
  kE4M3 = 3,
};

enum class Backend : int {
  // By where Q lives: device memory -> GPU backend, host memory -> CPU backend. Asked of the CUDA
  // driver without creating a context: a process that never used CUDA is not made to.
  kAuto = 0,
  kCpu = 1,
  kSm90 = 2,  // NVIDIA Hopper (H100/H200), sm_90a
};

enum class Pass : int { kForward = 0, kBackward = 1 };

// Sliding window in keys, relative to the (bottom-right aligned) diagonal. -1 = unbounded.
struct Window {
  int64_t left = -1;
  int64_t right = -1;
};

// Variable-length batches: sequences packed along one token axis, tensors laid out (total, heads, dim).
// cu_seqlens_q/k hold batch+1 int32 offsets starting at 0 (non-decreasing). seqused_k, optional,
// holds per-sequence key counts that are used (≤ the sequence's length in cu_seqlens_k).
// The arrays live where the backend computes: host memory for the CPU backend, device memory for GPU.
struct VarLen {
  const int32_t* cu_seqlens_q = nullptr;  // non-null ⇒ varlen mode (cu_seqlens_k required too)
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0;  // rows of the packed Q / O tensors
  int64_t total_k = 0;  // rows of the packed K / V tensors
};

// A KV cache as an inference engine keeps it (FlashAttention's flash_attn_with_kvcache). With a
// cache, `k` and `v` are the cache: cache_batch rows of seqlen_k keys, (cache_batch, seqlen_k,
// heads_kv, dim), or, paged, num_pages pages of page_size keys, (num_pages, page_size, heads_kv,
// dim), their batch_stride then being the page stride. seqused_k holds each cache row's current
// length (absolute rows, leftpad included; null: seqlen_k, a full cache). Queries are fixed-length
// or varlen (cu_seqlens_q, with cu_seqlens_k null: the cache is not packed). Forward only.
//
// Sequence b reads cache row c = batch_idx[b] (b without batch_idx). Its keys are the cache rows
// [leftpad[b], seqused_k[b] + n_b), n_b new rows appended first: k_new / v_new (ForwardTensors)
// are written at rows seqused_k[b] … seqused_k[b] + n_b − 1 of cache row c — rotated, with a
// rotary embedding — and then attended to with the rest. The causal / window alignment is over
// those seqused_k[b] − leftpad[b] + n_b keys. Appending to one cache row (or one page) from two
// batch entries leaves which write wins unspecified.
struct KvCache {
  // Paged: row r of cache row c is row r % page_size of page page_table[c·page_table_stride +
  // r / page_size]; seqlen_k must be pages_per_seq · page_size. Pages may be shared between
  // cache rows and appear in any order.
  const int32_t* page_table = nullptr;  // non-null ⇒ paged: cache_batch rows of pages_per_seq
  int64_t page_table_stride = 0;        // entries between two rows of the table (≥ pages_per_seq)
  int64_t pages_per_seq = 0;
  int64_t num_pages = 0;                // pages in k / v
  int64_t page_size = 0;                // keys per page, ≥ 1
  const int32_t* batch_idx = nullptr;   // the cache row of each batch entry; null: its own
  int64_t cache_batch = 0;              // cache rows (page-table rows when paged); ≥ batch
  const int32_t* leftpad = nullptr;     // each sequence's first valid cache row; null: 0
  // Appended rows per sequence: seqlen_new, or cu_seqlens_new[b + 1] − cu_seqlens_new[b] when
  // cu_seqlens_new is set (k_new / v_new then (total_new, heads_kv, dim)).
  int64_t seqlen_new = 0;
  const int32_t* cu_seqlens_new = nullptr;
  int64_t total_new = 0;
  // Rotary embedding, with tables cos / sin of (rotary_seqlen, rotary_dim / 2) in the problem's
  // dtype (ForwardTensors::rotary): the first rotary_dim dims of each new key at position
  // seqused_k[b] + j, and of each query at seqused_k[b] + i under a causal or window mask, at
  // seqused_k[b] otherwise. Interleaved (GPT-J) rotates the pairs (2i, 2i + 1); otherwise
  // (GPT-NeoX) the pairs (i, i + rotary_dim / 2). Needs appended rows.
  int64_t rotary_dim = 0;  // 0: none; even, ≤ head_dim_qk
  bool rotary_interleaved = false;
  int64_t rotary_seqlen = 0;

  bool enabled() const {
    return page_table != nullptr || batch_idx != nullptr || leftpad != nullptr ||
           seqlen_new > 0 || cu_seqlens_new != nullptr || rotary_dim > 0;
  }
  bool paged() const { return page_table != nullptr; }
  bool appends() const { return seqlen_new > 0 || cu_seqlens_new != nullptr; }
};

// FP8 inputs (Problem::dtype kE4M3); read only then. Q, K and V hold e4m3 values whose true values
// are the stored ones times their descales (ForwardTensors::q/k/v_descale), so that
//   S = softmax_scale · q_descale · k_descale · (Q Kᵀ) (then softcap and masking as always),
//   O = v_descale · softmax(S) V, LSE of those S,
// with the descales of the row's batch entry and kv head. A rotary embedding (KvCache) rotates the
// queries in fp32 and rounds them back to e4m3 (the tensor cores take e4m3 operands).
struct Fp8 {
  DType out_dtype = DType::kBF16;  // O's dtype, kBF16 or kFP16; the rotary tables' too
  // KV cache appends: false, k_new / v_new are e4m3 and written as given (rotated keys are rounded
  // back to e4m3); true, they are in out_dtype (as a model computes them) and quantised on write:
  // each element (rotated first, in fp32) divided by its k / v descale and rounded to the nearest
  // e4m3, ties to even, saturating at ±448.
  bool quantize_appends = false;
};

// ALiBi slopes (flash_attn's definition): fp32, one per (batch entry, query head) at
// data[b·batch_stride + h·head_stride] (batch_stride 0: one per head, shape (heads_q)). Memory of
// the backend, as the sequence arrays.
struct AlibiSlopes {
  const float* data = nullptr;  // null: no ALiBi
  int64_t batch_stride = 0;
  int64_t head_stride = 1;
};

// The user's problem. In varlen mode `batch` is the number of sequences and seqlen_q / seqlen_k are
// the maximum sequence lengths (upper bounds the GPU uses to size its grid).
struct Problem {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;  // heads_q % heads_kv == 0 (GQA / MQA)
  int64_t head_dim_qk = 0;
  int64_t head_dim_v = 0;  // may differ from head_dim_qk (e.g. 192 / 128)
  DType dtype = DType::kBF16;  // of Q, K, V (and a KV cache); of O too unless e4m3
  Fp8 fp8{};                   // e4m3 inputs only

  bool causal = false;
  Window window{};
  float softcap = 0.0f;        // 0 = off; otherwise > 0
  float softmax_scale = 0.0f;  // 0 = default 1/sqrt(head_dim_qk); otherwise finite
  // ALiBi: score −= slope · |i + sk − sq − j| (query i, key j of the sequence's sq queries and
  // sk keys), after softcap.
  AlibiSlopes alibi{};
  // Learnable attention sinks (gpt-oss): sinks[h], an fp32 logit per query head (heads_q, memory
  // of the backend), joins every row's softmax denominator without a value:
  // LSE = log(Σ_j exp(s_j) + exp(sinks[h])), O = Σ_j exp(s_j − LSE) v_j. A row that sees no key
  // gets O = 0 and LSE = sinks[h]. The backward's dsinks (BackwardTensors) is its gradient.
  const float* sinks = nullptr;

  VarLen varlen{};
  const int32_t* seqused_k = nullptr;  // optional, batch entries, in varlen and fixed-length mode
  KvCache kv_cache{};

  // Split-KV (each query tile's keys shared out among CTAs, then combined): 0 the library's
  // choice, 1 never, n at most n splits. The workspace holds the most any choice may use.
  int64_t num_splits = 0;

  bool return_lse = false;
  bool deterministic = false;  // backward: bitwise-reproducible gradients

  bool is_varlen() const { return varlen.cu_seqlens_q != nullptr; }
  // Keys and values in packed varlen rows (cu_seqlens_k), not in per-sequence rows or a cache.
  bool is_varlen_k() const { return varlen.cu_seqlens_k != nullptr; }
  float scale() const;  // the effective softmax scale
};

// A (batch, seq, head, dim) view; in varlen mode (total, head, dim) and batch_stride is ignored.
// Strides are in elements. dim_stride must be 1.
struct TensorView {
  void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t seq_stride = 0;
  int64_t head_stride = 0;
  int64_t dim_stride = 1;
};

// Log-sum-exp, fp32: (batch, heads_q, seqlen_q), or (heads_q, total_q) in varlen mode.
// seq_stride must be 1.
struct LseView {
  float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t seq_stride = 1;
};

// Descales of e4m3 inputs, fp32 (batch, heads_kv): the descale of batch entry b and kv head h is
// data[b·batch_stride + h·head_stride] (strides may be 0: one descale shared); null: 1. Memory of
// the backend, as the sequence arrays. In varlen mode b is the sequence; with a KV cache the batch
// entry, not the cache row it reads.
struct DescaleView {
  const float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
};

// Rotary tables: (rotary_seqlen, rotary_dim / 2) in the problem's dtype (with e4m3 inputs,
// fp8.out_dtype), elements contiguous.
struct RotaryView {
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t row_stride = 0;  // elements between positions
};

struct ForwardTensors {
  TensorView q, k, v;  // inputs (with a KV cache, k and v are the cache, written by appends)
  TensorView out;      // output, dtype of the problem (e4m3: fp8.out_dtype), head_dim_v wide
  LseView lse;         // output, required when problem.return_lse
  TensorView k_new, v_new;  // KV cache appends: (batch, seqlen_new, heads_kv, dim) or varlen
  RotaryView rotary;        // KV cache rotary embedding
  DescaleView q_descale, k_descale, v_descale;  // e4m3 inputs only
};

struct BackwardTensors {
  TensorView q, k, v, out, dout;  // inputs (out and lse as the forward pass wrote them)
  LseView lse;                    // input, required
  TensorView dq, dk, dv;          // outputs, dtype of the problem
  // With Problem::sinks: the sinks' gradient, fp32 (heads_q), overwritten; null: not computed.
  float* dsinks = nullptr;
};

struct Workspace {
  void* data = nullptr;  // memory of the backend (host for CPU, device for GPU); 256-byte aligned
  size_t bytes = 0;
};

// Can `backend` run `problem` for `pass`? The message says why not.
FA4_API Status can_implement(const Problem& problem, Backend backend, Pass pass = Pass::kForward);

// Bytes of workspace the pass needs (0 is a valid answer). Fails on a problem can_implement rejects.
FA4_API Status workspace_size(const Problem& problem, Backend backend, Pass pass, size_t* bytes);

// `stream` is a cudaStream_t for the GPU backend (nullptr = the legacy default stream); the CPU
// backend runs synchronously on host threads and ignores it.
FA4_API Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
               void* stream = nullptr, Backend backend = Backend::kAuto);

FA4_API Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                void* stream = nullptr, Backend backend = Backend::kAuto);

// Which backend kAuto picks for a pointer (CPU when the library was built without CUDA).
FA4_API Backend resolve_backend(Backend requested, const void* q_data);

FA4_API const char* version();

}  // namespace fa4
