// The derivatives of the forward ops, in C++ so that a training step's calls never enter Python:
// fwd's backward is bwd, varlen_fwd's is varlen_bwd; lse is not differentiable. Each calls the
// ops through the dispatcher, so that tracing (torch.compile) reaches their fake kernels. And the
// version counters of the KV cache the KV-cache op writes.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "run.hpp"

namespace fa4cpp_torch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

void save_scores(AutogradContext* ctx, double softmax_scale, bool causal, int64_t window_left,
                 int64_t window_right, double softcap, bool deterministic) {
  ctx->saved_data["softmax_scale"] = softmax_scale;
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["window_left"] = window_left;
  ctx->saved_data["window_right"] = window_right;
  ctx->saved_data["softcap"] = softcap;
  ctx->saved_data["deterministic"] = deterministic;
}

// A saved optional tensor: an undefined tensor saves its absence.
at::Tensor saved_optional(const OptionalTensor& t) { return t.value_or(at::Tensor()); }
OptionalTensor unsaved_optional(const at::Tensor& t) {
  return t.defined() ? OptionalTensor(t) : OptionalTensor();
}

// The score variants of a forward call, for its backward: whether the sinks' gradient is wanted
// (the sinks require grad), as saved_data.
void save_variants(AutogradContext* ctx, const OptionalTensor& sinks) {
  ctx->saved_data["dsinks"] = sinks.has_value() && sinks->requires_grad();
}

// A fresh buffer for the sinks' gradient when the forward asked for one.
OptionalTensor sinks_gradient(AutogradContext* ctx, const at::Tensor& sinks) {
  if (!ctx->saved_data["dsinks"].toBool()) return std::nullopt;
  return at::empty({sinks.size(0)}, at::TensorOptions().dtype(at::kFloat).device(sinks.device()));
}

struct SavedScores {
  double softmax_scale;
  bool causal;
  int64_t window_left, window_right;
  double softcap;
  bool deterministic;

  explicit SavedScores(AutogradContext* ctx)
      : softmax_scale(ctx->saved_data["softmax_scale"].toDouble()),
        causal(ctx->saved_data["causal"].toBool()),
        window_left(ctx->saved_data["window_left"].toInt()),
        window_right(ctx->saved_data["window_right"].toInt()),
        softcap(ctx->saved_data["softcap"].toDouble()),
        deterministic(ctx->saved_data["deterministic"].toBool()) {}
};

// The forward ops' arguments: the FP8 descales, then the score variants, last.
#define FA4CPP_TRAILING_TYPES                                                                   \
  const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,  \
      const OptionalTensor&
#define FA4CPP_TRAILING_PARAMS                                                                  \
  const OptionalTensor &q_descale, const OptionalTensor &k_descale,                            \
      const OptionalTensor &v_descale, const OptionalTensor &alibi_slopes,                     \
      const OptionalTensor &sinks
#define FA4CPP_TRAILING_ARGS q_descale, k_descale, v_descale, alibi_slopes, sinks
// The backward ops' score variants: the slopes, the sinks, the sinks' gradient (written).
#define FA4CPP_BWD_VARIANT_TYPES const OptionalTensor&, const OptionalTensor&, const OptionalTensor&

using FwdSignature = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
                          int64_t, int64_t, double, bool, FA4CPP_TRAILING_TYPES);
using BwdSignature = Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
                            int64_t, int64_t, double, bool, FA4CPP_BWD_VARIANT_TYPES);

// Where fwd's sinks sit among its arguments (their gradient's place in backward's result), and
// how many arguments it has.
constexpr size_t kFwdSinks = 13;
constexpr size_t kFwdArguments = 14;

struct Forward : torch::autograd::Function<Forward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, double softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap,
                               bool deterministic, FA4CPP_TRAILING_PARAMS) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto fwd = op<FwdSignature>("fa4cpp::fwd");
    auto [out, lse] = fwd.call(q, k, v, softmax_scale, causal, window_left, window_right,
                               softcap, deterministic, FA4CPP_TRAILING_ARGS);
    ctx->save_for_backward(
        {q, k, v, out, lse, saved_optional(alibi_slopes), saved_optional(sinks)});
    save_scores(ctx, softmax_scale, causal, window_left, window_right, softcap, deterministic);
    save_variants(ctx, sinks);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  // FP8 inputs: bwd refuses them with its error. The descales and the ALiBi slopes have no
  // gradient; the sinks' comes from bwd's dsinks.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const SavedScores s(ctx);
    const OptionalTensor dsinks = sinks_gradient(ctx, saved[6]);
    static const auto bwd = op<BwdSignature>("fa4cpp::bwd");
    auto [dq, dk, dv] = bwd.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                 s.softmax_scale, s.causal, s.window_left, s.window_right,
                                 s.softcap, s.deterministic, unsaved_optional(saved[5]),
                                 unsaved_optional(saved[6]), dsinks);
    variable_list result(kFwdArguments);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    result[kFwdSinks] = saved_optional(dsinks);
    return result;
  }
};

using VarlenFwdSignature = Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                const OptionalTensor&, double, bool, int64_t, int64_t, double,
                                bool, FA4CPP_TRAILING_TYPES);
using VarlenBwdSignature = Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                  const OptionalTensor&, double, bool, int64_t, int64_t, double,
                                  bool, FA4CPP_BWD_VARIANT_TYPES);

constexpr size_t kVarlenFwdSinks = 18;
constexpr size_t kVarlenFwdArguments = 19;

struct VarlenForward : torch::autograd::Function<VarlenForward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const OptionalTensor& seqused_k,
                               double softmax_scale, bool causal, int64_t window_left,
                               int64_t window_right, double softcap, bool deterministic,
                               FA4CPP_TRAILING_PARAMS) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto fwd = op<VarlenFwdSignature>("fa4cpp::varlen_fwd");
    auto [out, lse] = fwd.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_k, softmax_scale, causal, window_left, window_right,
                               softcap, deterministic, FA4CPP_TRAILING_ARGS);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                            saved_optional(seqused_k), saved_optional(alibi_slopes),
                            saved_optional(sinks)});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    save_scores(ctx, softmax_scale, causal, window_left, window_right, softcap, deterministic);
    save_variants(ctx, sinks);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const SavedScores s(ctx);
    const OptionalTensor dsinks = sinks_gradient(ctx, saved[9]);
    static const auto bwd = op<VarlenBwdSignature>("fa4cpp::varlen_bwd");
    auto [dq, dk, dv] = bwd.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                 saved[5], saved[6], ctx->saved_data["max_seqlen_q"].toInt(),
                                 ctx->saved_data["max_seqlen_k"].toInt(),
                                 unsaved_optional(saved[7]), s.softmax_scale, s.causal,
                                 s.window_left, s.window_right, s.softcap, s.deterministic,
                                 unsaved_optional(saved[8]), unsaved_optional(saved[9]), dsinks);
    variable_list result(kVarlenFwdArguments);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    result[kVarlenFwdSinks] = saved_optional(dsinks);
    return result;
  }
};

Pair fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                  double softcap, bool deterministic, FA4CPP_TRAILING_PARAMS) {
  auto r = Forward::apply(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                          deterministic, FA4CPP_TRAILING_ARGS);
  return {r[0], r[1]};
}

Pair varlen_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                         int64_t max_seqlen_q, int64_t max_seqlen_k,
                         const OptionalTensor& seqused_k, double softmax_scale, bool causal,
                         int64_t window_left, int64_t window_right, double softcap,
                         bool deterministic, FA4CPP_TRAILING_PARAMS) {
  auto r = VarlenForward::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                seqused_k, softmax_scale, causal, window_left, window_right,
                                softcap, deterministic, FA4CPP_TRAILING_ARGS);
  return {r[0], r[1]};
}

// The autograd kernel of an op without a derivative that writes arguments in place (the
// schema's Tensor(a!)): a call that would need a gradient is an error; the written arguments'
// version counters move, so that autograd notices a saved tensor changed under it.
void written_in_place_without_derivative(const c10::OperatorHandle& op,
                                         c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    TORCH_CHECK(!at::GradMode::is_enabled() || !value.toTensor().requires_grad(),
                op.schema().name(), " has no derivative, and ", arguments[i].name(),
                " requires grad (call it under torch.no_grad() or detach it)");
    const auto* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite())
      torch::autograd::impl::bump_version(value.toTensor());
  }
  at::AutoDispatchBelowADInplaceOrView below;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace
}  // namespace fa4cpp_torch

TORCH_LIBRARY_IMPL(fa4cpp, Autograd, m) {
  m.impl("fwd", &fa4cpp_torch::fwd_autograd);
  m.impl("varlen_fwd", &fa4cpp_torch::varlen_fwd_autograd);
  for (const char* name : {"fwd_kvcache", "fwd_kvcache_out"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &fa4cpp_torch::written_in_place_without_derivative>());
}
