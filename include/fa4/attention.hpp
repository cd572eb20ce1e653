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
  DType dtype = DType::kBF16;

  bool causal = false;
  Window window{};
  float softcap = 0.0f;        // 0 = off; otherwise > 0
  float softmax_scale = 0.0f;  // 0 = default 1/sqrt(head_dim_qk); otherwise finite

  VarLen varlen{};
  const int32_t* seqused_k = nullptr;  // optional, batch entries, in varlen and fixed-length mode

  bool return_lse = false;
  bool deterministic = false;  // backward: bitwise-reproducible gradients

  bool is_varlen() const { return varlen.cu_seqlens_q != nullptr; }
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

struct ForwardTensors {
  TensorView q, k, v;  // inputs
  TensorView out;      // output, dtype of the problem, head_dim_v wide
  LseView lse;         // output, required when problem.return_lse
};

struct BackwardTensors {
  TensorView q, k, v, out, dout;  // inputs (out and lse as the forward pass wrote them)
  LseView lse;                    // input, required
  TensorView dq, dk, dv;          // outputs, dtype of the problem
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
