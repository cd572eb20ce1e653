// The library calls behind the native ops. Each try_* checks the tensors the way the package's
// Python implementation does, prepares them as the library takes them (a contiguous last
// dimension, TMA-aligned on CUDA), describes the problem, takes workspace from torch's allocator
// and runs on torch's current stream. When it cannot run the call as given (an input the Python
// implementation would reject, or a status other than success) it returns std::nullopt with the
// reason in *why, having written nothing: the op then hands the call to the Python
// implementation, which raises the package's error or runs the fallback.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace fa4cpp_torch {

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The scalar arguments the ops share, as the schemas carry them.
struct Scores {
  double softmax_scale = 0.0;  // 0: 1/sqrt(head_dim)
  bool causal = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;
  bool deterministic = false;
};

// The descales of float8_e4m3fn inputs: fp32 (batch, heads_kv), any strides; absent: 1.
struct Descales {
  const std::optional<at::Tensor>& q;
  const std::optional<at::Tensor>& k;
  const std::optional<at::Tensor>& v;

  bool any() const { return q.has_value() || k.has_value() || v.has_value(); }
};

// The score variants (docs/semantics.md): ALiBi slopes, fp32 (heads_q) or (batch, heads_q) with
// any strides; attention sinks, fp32 (heads_q). Absent: off.
struct Variants {
  const std::optional<at::Tensor>& alibi_slopes;
  const std::optional<at::Tensor>& sinks;
};

struct VarLenArgs {
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
  const std::optional<at::Tensor>& seqused_k;
};

struct KvCacheArgs {
  const std::optional<at::Tensor>& k_new;
  const std::optional<at::Tensor>& v_new;
  const std::optional<at::Tensor>& rotary_cos;
  const std::optional<at::Tensor>& rotary_sin;
  const std::optional<at::Tensor>& cache_seqlens;
  const std::optional<at::Tensor>& cache_batch_idx;
  const std::optional<at::Tensor>& cache_leftpad;
  const std::optional<at::Tensor>& page_table;
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& cu_seqlens_k_new;
  int64_t max_seqlen_q;
  bool rotary_interleaved;
  int64_t num_splits;
};

// varlen null: fixed-length (batch, seq, heads, dim) tensors. float8_e4m3fn inputs give a
// bfloat16 output.
std::optional<Pair> try_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const Scores& scores, const VarLenArgs* varlen,
                                const Descales& descales, const Variants& variants,
                                std::string* why);
// dsinks, when given (fp32 (heads_q), a problem with sinks), receives the sinks' gradient.
std::optional<Triple> try_backward(const at::Tensor& dout, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse,
                                   const Scores& scores, const VarLenArgs* varlen,
                                   const Variants& variants,
                                   const std::optional<at::Tensor>& dsinks, std::string* why);
// k_cache and v_cache are written by the appends. `into`, when given, receives the output (any
// strides; through a copy when its last dimension is not contiguous) and is returned as it. An
// e4m3 cache's output is bfloat16, or the appended rows' dtype when they are 16-bit (quantised on
// write).
std::optional<Pair> try_forward_kvcache(const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const KvCacheArgs& kv,
                                        const Scores& scores, const Descales& descales,
                                        const Variants& variants, const at::Tensor* into,
                                        std::string* why);

}  // namespace fa4cpp_torch
