// fa4cpp's torch ops, registered from C++ (namespace "fa4cpp"): the schemas, the CPU and CUDA
// kernels (run.hpp; calls they do not run go to the Python implementation, delegate.hpp) and the
// no-autograd markers of the ops without a derivative. autograd.cpp holds the forward ops'
// derivatives and the KV-cache op's version counters; fa4cpp/ops.py registers the fake (shape)
// kernels.
#include <torch/library.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "delegate.hpp"
#include "run.hpp"

namespace fa4cpp_torch {
namespace {

Pair pair_of(const std::vector<c10::IValue>& r) { return {r[0].toTensor(), r[1].toTensor()}; }

Triple triple_of(const std::vector<c10::IValue>& r) {
  return {r[0].toTensor(), r[1].toTensor(), r[2].toTensor()};
}

}  // namespace

using OptionalTensor = std::optional<at::Tensor>;

Pair fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale,
         bool causal, int64_t window_left, int64_t window_right, double softcap,
         bool deterministic, const OptionalTensor& q_descale, const OptionalTensor& k_descale,
         const OptionalTensor& v_descale, const OptionalTensor& alibi_slopes,
         const OptionalTensor& sinks) {
  std::string why;
  if (!python_path_on()) {
    const Scores s{softmax_scale, causal, window_left, window_right, softcap, deterministic};
    if (auto r = try_forward(q, k, v, s, nullptr, {q_descale, k_descale, v_descale},
                             {alibi_slopes, sinks}, &why))
      return std::move(*r);
  }
  return pair_of(call_python_path("fwd", {q, k, v, softmax_scale, causal, window_left,
                                          window_right, softcap, deterministic, q_descale,
                                          k_descale, v_descale, alibi_slopes, sinks},
                                  why));
}

Triple bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
           int64_t window_left, int64_t window_right, double softcap, bool deterministic,
           const OptionalTensor& alibi_slopes, const OptionalTensor& sinks,
           const OptionalTensor& dsinks) {
  std::string why;
  if (!python_path_on()) {
    const Scores s{softmax_scale, causal, window_left, window_right, softcap, deterministic};
    if (auto r = try_backward(dout, q, k, v, out, lse, s, nullptr, {alibi_slopes, sinks}, dsinks,
                              &why))
      return std::move(*r);
  }
  return triple_of(call_python_path("bwd", {dout, q, k, v, out, lse, softmax_scale, causal,
                                            window_left, window_right, softcap, deterministic,
                                            alibi_slopes, sinks, dsinks},
                                    why));
}

Pair varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                int64_t max_seqlen_q, int64_t max_seqlen_k, const OptionalTensor& seqused_k,
                double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                double softcap, bool deterministic, const OptionalTensor& q_descale,
                const OptionalTensor& k_descale, const OptionalTensor& v_descale,
                const OptionalTensor& alibi_slopes, const OptionalTensor& sinks) {
  std::string why;
  if (!python_path_on()) {
    const Scores s{softmax_scale, causal, window_left, window_right, softcap, deterministic};
    const VarLenArgs varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k};
    if (auto r = try_forward(q, k, v, s, &varlen, {q_descale, k_descale, v_descale},
                             {alibi_slopes, sinks}, &why))
      return std::move(*r);
  }
  return pair_of(call_python_path(
      "varlen_fwd", {q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                     softmax_scale, causal, window_left, window_right, softcap, deterministic,
                     q_descale, k_descale, v_descale, alibi_slopes, sinks},
      why));
}

Triple varlen_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                  int64_t max_seqlen_q, int64_t max_seqlen_k, const OptionalTensor& seqused_k,
                  double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                  double softcap, bool deterministic, const OptionalTensor& alibi_slopes,
                  const OptionalTensor& sinks, const OptionalTensor& dsinks) {
  std::string why;
  if (!python_path_on()) {
    const Scores s{softmax_scale, causal, window_left, window_right, softcap, deterministic};
    const VarLenArgs varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k};
    if (auto r = try_backward(dout, q, k, v, out, lse, s, &varlen, {alibi_slopes, sinks}, dsinks,
                              &why))
      return std::move(*r);
  }
  return triple_of(call_python_path(
      "varlen_bwd", {dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, seqused_k, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic, alibi_slopes, sinks, dsinks},
      why));
}

namespace {

// The KV-cache ops' arguments after the caches, in schema order.
#define FA4CPP_KVCACHE_PARAMS                                                                     \
  const OptionalTensor &k_new, const OptionalTensor &v_new, const OptionalTensor &rotary_cos,   \
      const OptionalTensor &rotary_sin, const OptionalTensor &cache_seqlens,                     \
      const OptionalTensor &cache_batch_idx, const OptionalTensor &cache_leftpad,                \
      const OptionalTensor &page_table, const OptionalTensor &cu_seqlens_q,                      \
      const OptionalTensor &cu_seqlens_k_new, int64_t max_seqlen_q, double softmax_scale,        \
      bool causal, int64_t window_left, int64_t window_right, double softcap,                    \
      bool rotary_interleaved, int64_t num_splits
#define FA4CPP_KVCACHE_ARGS                                                                     \
  k_new, v_new, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,          \
      page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal,          \
      window_left, window_right, softcap, rotary_interleaved, num_splits
// The descales and the score variants, last in both KV-cache schemas (after fwd_kvcache_out's
// out).
#define FA4CPP_DESCALE_PARAMS                                                                   \
  const OptionalTensor &q_descale, const OptionalTensor &k_descale,                            \
      const OptionalTensor &v_descale, const OptionalTensor &alibi_slopes,                     \
      const OptionalTensor &sinks
#define FA4CPP_DESCALE_ARGS q_descale, k_descale, v_descale, alibi_slopes, sinks

std::optional<Pair> try_kvcache(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, FA4CPP_KVCACHE_PARAMS,
                                FA4CPP_DESCALE_PARAMS, const at::Tensor* into, std::string* why) {
  if (python_path_on()) return std::nullopt;
  const Scores s{softmax_scale, causal, window_left, window_right, softcap, false};
  const KvCacheArgs kv{k_new,         v_new,          rotary_cos,   rotary_sin,
                       cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                       cu_seqlens_q,  cu_seqlens_k_new, max_seqlen_q, rotary_interleaved,
                       num_splits};
  return try_forward_kvcache(q, k_cache, v_cache, kv, s, {q_descale, k_descale, v_descale},
                             {alibi_slopes, sinks}, into, why);
}

Pair fwd_kvcache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 FA4CPP_KVCACHE_PARAMS, FA4CPP_DESCALE_PARAMS) {
  std::string why;
  if (auto r = try_kvcache(q, k_cache, v_cache, FA4CPP_KVCACHE_ARGS, FA4CPP_DESCALE_ARGS, nullptr,
                           &why))
    return std::move(*r);
  return pair_of(call_python_path(
      "fwd_kvcache", {q, k_cache, v_cache, FA4CPP_KVCACHE_ARGS, FA4CPP_DESCALE_ARGS}, why));
}

at::Tensor fwd_kvcache_out(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, FA4CPP_KVCACHE_PARAMS,
                           const at::Tensor& out, FA4CPP_DESCALE_PARAMS) {
  std::string why;
  if (auto r = try_kvcache(q, k_cache, v_cache, FA4CPP_KVCACHE_ARGS, FA4CPP_DESCALE_ARGS, &out,
                           &why))
    return std::get<1>(*r);
  return call_python_path("fwd_kvcache_out",
                          {q, k_cache, v_cache, FA4CPP_KVCACHE_ARGS, out, FA4CPP_DESCALE_ARGS},
                          why)[0]
      .toTensor();
}

}  // namespace
}  // namespace fa4cpp_torch

TORCH_LIBRARY(fa4cpp, m) {
  // The fake kernels live in Python: torch imports this module for them when it needs them.
  m.set_python_module("fa4cpp.ops");
  // Arguments a later version adds come last, with defaults, so that earlier calls (and graphs
  // that recorded them) stay valid: deterministic, then the FP8 descales, then the score
  // variants (ALiBi slopes, attention sinks; the backward's dsinks, written when given).
#define FA4CPP_VARIANT_SCHEMA "Tensor? alibi_slopes=None, Tensor? sinks=None"
#define FA4CPP_DESCALE_SCHEMA \
  "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, " FA4CPP_VARIANT_SCHEMA
#define FA4CPP_BWD_VARIANT_SCHEMA FA4CPP_VARIANT_SCHEMA ", Tensor(a!)? dsinks=None"
  m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_left, "
        "int window_right, float softcap, bool deterministic=False, " FA4CPP_DESCALE_SCHEMA
        ") -> (Tensor, Tensor)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic, " FA4CPP_BWD_VARIANT_SCHEMA ") -> (Tensor, Tensor, Tensor)");
  m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, Tensor? seqused_k, float softmax_scale, "
        "bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic=False, " FA4CPP_DESCALE_SCHEMA ") -> (Tensor, Tensor)");
  m.def("varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "Tensor? seqused_k, float softmax_scale, bool causal, int window_left, "
        "int window_right, float softcap, bool deterministic, " FA4CPP_BWD_VARIANT_SCHEMA
        ") -> (Tensor, Tensor, Tensor)");
#define FA4CPP_KVCACHE_SCHEMA                                                                   \
  "Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_new, Tensor? v_new, "             \
  "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, Tensor? cache_batch_idx, "     \
  "Tensor? cache_leftpad, Tensor? page_table, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k_new, "  \
  "int max_seqlen_q, float softmax_scale, bool causal, int window_left, int window_right, "      \
  "float softcap, bool rotary_interleaved, int num_splits"
  m.def("fwd_kvcache(" FA4CPP_KVCACHE_SCHEMA ", " FA4CPP_DESCALE_SCHEMA ") -> (Tensor, Tensor)");
  m.def("fwd_kvcache_out(" FA4CPP_KVCACHE_SCHEMA ", Tensor(c!) out, " FA4CPP_DESCALE_SCHEMA
        ") -> Tensor");
}

// One kernel per op serves CPU and CUDA tensors: the backend follows the tensors' device.
#define FA4CPP_TORCH_KERNELS(m)                                \
  m.impl("fwd", &fa4cpp_torch::fwd);                           \
  m.impl("bwd", &fa4cpp_torch::bwd);                           \
  m.impl("varlen_fwd", &fa4cpp_torch::varlen_fwd);             \
  m.impl("varlen_bwd", &fa4cpp_torch::varlen_bwd);             \
  m.impl("fwd_kvcache", &fa4cpp_torch::fwd_kvcache);           \
  m.impl("fwd_kvcache_out", &fa4cpp_torch::fwd_kvcache_out)

TORCH_LIBRARY_IMPL(fa4cpp, CPU, m) { FA4CPP_TORCH_KERNELS(m); }
TORCH_LIBRARY_IMPL(fa4cpp, CUDA, m) { FA4CPP_TORCH_KERNELS(m); }

// The backward ops have no derivative: asking for one is an error.
TORCH_LIBRARY_IMPL(fa4cpp, Autograd, m) {
  m.impl("bwd", torch::autograd::autogradNotImplementedFallback());
  m.impl("varlen_bwd", torch::autograd::autogradNotImplementedFallback());
}
