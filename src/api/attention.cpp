// The C++ entry points: validate, pick the backend, check what it needs, run. Nothing is written to
// an output before every check has passed.
#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"

#include <cmath>
#include <exception>
#include <new>

#include "api/validate.hpp"
#include "dispatch/backend.hpp"

namespace fa4 {

using detail::BackendOps;

const char* to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kSuccess: return "success";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotSupported: return "not supported";
    case StatusCode::kWorkspaceTooSmall: return "workspace too small";
    case StatusCode::kBackendUnavailable: return "backend unavailable";
    case StatusCode::kDeviceError: return "device error";
    case StatusCode::kInternalError: return "internal error";
  }
  return "unknown status";
}

float Problem::scale() const {
  return softmax_scale != 0.0f ? softmax_scale : 1.0f / std::sqrt(float(head_dim_qk));
}

const char* version() { return FA4_VERSION_STRING; }

Backend resolve_backend(Backend requested, const void* q_data) {
  return detail::resolve(requested, q_data);
}

namespace {

// Runs fn, turning exceptions (allocation failures in host-side helpers) into statuses.
template <typename Fn>
Status guarded(Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return detail::make_status(StatusCode::kInternalError, "out of host memory");
  } catch (const std::exception& e) {
    return detail::make_status(StatusCode::kInternalError, "internal error: %s", e.what());
  } catch (...) {
    return detail::make_status(StatusCode::kInternalError, "internal error: unknown exception");
  }
}

#define FA4_RETURN_IF_ERROR(expr)   \
  do {                              \
    Status status_ = (expr);        \
    if (!status_.ok()) return status_; \
  } while (0)

// Problem-level checks shared by every entry point; returns the backend to use in *ops. Whether the
// backend can run the problem is asked after the tensors are checked, so that a bad tensor is
// reported as such whatever the backend supports.
Status select(const Problem& p, Backend requested, const void* q_data, Pass pass,
              const BackendOps** ops) {
  FA4_RETURN_IF_ERROR(detail::validate_problem(p));
  if (requested != Backend::kAuto && requested != Backend::kCpu && requested != Backend::kSm90)
    return detail::invalid("backend %d is not a backend (auto = 0, cpu = 1, sm90 = 2)",
                           int(requested));
  if (pass != Pass::kForward && pass != Pass::kBackward)
    return detail::invalid("pass %d is not a pass (forward = 0, backward = 1)", int(pass));
  if (pass == Pass::kBackward && p.dtype == DType::kE4M3)
    return detail::not_supported("e4m3 inputs are forward-only: the backward takes bf16, fp16 or "
                                 "fp32 tensors (and the forward's output of that dtype)");
  if (pass == Pass::kBackward && p.kv_cache.enabled())
    return detail::not_supported("a KV cache (kv_cache: pages, cache rows, appends, rotary) is "
                                 "forward-only: the backward takes keys and values as tensors");
  *ops = &detail::backend_ops(detail::resolve(requested, q_data));
  return Status::success();
}

Status check_workspace(const BackendOps& ops, const Problem& p, Pass pass, Workspace ws,
                       const Overrides& overrides) {
  const size_t need = ops.workspace_size(p, pass, overrides);
  if (ws.bytes < need)
    return detail::make_status(StatusCode::kWorkspaceTooSmall,
                               "workspace has %zu bytes; the %s backend needs %zu for this problem",
                               ws.bytes, ops.name, need);
  if (need > 0 && ws.data == nullptr)
    return detail::invalid("workspace.data is null but %zu bytes are needed", need);
  return Status::success();
}

// Checks that read memory (sequence arrays) only where the arrays are host memory.
Status check_contents(const BackendOps& ops, const Problem& p) {
  if (&ops == &detail::cpu_backend()) return detail::validate_sequence_arrays(p);
  return Status::success();
}

}  // namespace

Status can_implement(const Problem& problem, Backend backend, Pass pass) {
  return guarded([&] {
    const BackendOps* ops = nullptr;
    FA4_RETURN_IF_ERROR(select(problem, backend, nullptr, pass, &ops));
    FA4_RETURN_IF_ERROR(ops->can_implement(problem, pass));
    return ops->available();
  });
}

Status workspace_size(const Problem& problem, Backend backend, Pass pass,
                      const Overrides& overrides, size_t* bytes) {
  return guarded([&] {
    if (bytes == nullptr) return detail::invalid("bytes (the result pointer) is null");
    const BackendOps* ops = nullptr;
    FA4_RETURN_IF_ERROR(select(problem, backend, nullptr, pass, &ops));
    FA4_RETURN_IF_ERROR(detail::validate_overrides(overrides));
    FA4_RETURN_IF_ERROR(ops->can_implement(problem, pass));
    *bytes = ops->workspace_size(problem, pass, overrides);
    return Status::success();
  });
}

Status workspace_size(const Problem& problem, Backend backend, Pass pass, size_t* bytes) {
  return workspace_size(problem, backend, pass, Overrides{}, bytes);
}

Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
               void* stream, Backend backend, const Overrides& overrides) {
  return guarded([&] {
    const BackendOps* ops = nullptr;
    FA4_RETURN_IF_ERROR(select(problem, backend, tensors.q.data, Pass::kForward, &ops));
    FA4_RETURN_IF_ERROR(detail::validate_overrides(overrides));
    FA4_RETURN_IF_ERROR(detail::validate_forward_tensors(problem, tensors));
    FA4_RETURN_IF_ERROR(ops->check_tensors(problem, &tensors, nullptr));
    FA4_RETURN_IF_ERROR(ops->can_implement(problem, Pass::kForward));
    FA4_RETURN_IF_ERROR(ops->available());
    FA4_RETURN_IF_ERROR(check_contents(*ops, problem));
    FA4_RETURN_IF_ERROR(check_workspace(*ops, problem, Pass::kForward, workspace, overrides));
    return ops->forward(problem, tensors, workspace, stream, overrides);
  });
}

Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
               void* stream, Backend backend) {
  return forward(problem, tensors, workspace, stream, backend, Overrides{});
}

Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                void* stream, Backend backend, const Overrides& overrides) {
  return guarded([&] {
    const BackendOps* ops = nullptr;
    FA4_RETURN_IF_ERROR(select(problem, backend, tensors.q.data, Pass::kBackward, &ops));
    FA4_RETURN_IF_ERROR(detail::validate_overrides(overrides));
    FA4_RETURN_IF_ERROR(detail::validate_backward_tensors(problem, tensors));
    FA4_RETURN_IF_ERROR(ops->check_tensors(problem, nullptr, &tensors));
    FA4_RETURN_IF_ERROR(ops->can_implement(problem, Pass::kBackward));
    FA4_RETURN_IF_ERROR(ops->available());
    FA4_RETURN_IF_ERROR(check_contents(*ops, problem));
    FA4_RETURN_IF_ERROR(check_workspace(*ops, problem, Pass::kBackward, workspace, overrides));
    return ops->backward(problem, tensors, workspace, stream, overrides);
  });
}

Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                void* stream, Backend backend) {
  return backward(problem, tensors, workspace, stream, backend, Overrides{});
}

}  // namespace fa4
