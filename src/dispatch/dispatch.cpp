#include "dispatch/backend.hpp"

namespace fa4::detail {

Backend resolve(Backend requested, const void* q_data) {
  if (requested != Backend::kAuto) return requested;
  if (q_data != nullptr) return is_device_pointer(q_data) ? Backend::kSm90 : Backend::kCpu;
  // No tensor to look at (can_implement, workspace_size): the GPU when this process has one.
  return sm90_backend().available().ok() ? Backend::kSm90 : Backend::kCpu;
}

const BackendOps& backend_ops(Backend resolved) {
  return resolved == Backend::kSm90 ? sm90_backend() : cpu_backend();
}

}  // namespace fa4::detail
