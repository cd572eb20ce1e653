// The CPU backend as dispatch sees it: always available, every dtype, any head dim up to 256, every
// mask / softcap / varlen / GQA feature the Problem can express.
#include "cpu/cpu_backend.hpp"

#include <cstdint>

#include "api/validate.hpp"
#include "dispatch/backend.hpp"

namespace fa4::detail {

namespace {

// The largest head dim of the GPU kernels; the CPU backend matches it so that a problem the library
// accepts runs on either backend.
constexpr int64_t kMaxHeadDim = 256;

Status can_implement(const Problem& p, Pass) {
  if (p.head_dim_qk > kMaxHeadDim)
    return not_supported("head_dim_qk is %lld; the cpu backend supports 1 to %lld",
                         (long long)p.head_dim_qk, (long long)kMaxHeadDim);
  if (p.head_dim_v > kMaxHeadDim)
    return not_supported("head_dim_v is %lld; the cpu backend supports 1 to %lld",
                         (long long)p.head_dim_v, (long long)kMaxHeadDim);
  return Status::success();
}

Status check_tensors(const Problem&, const ForwardTensors*, const BackwardTensors*) {
  return Status::success();  // plain host loads and stores: any validated view will do
}

Status available() { return Status::success(); }

Status forward(const Problem& p, const ForwardTensors& t, Workspace ws, void* /*stream*/) {
  return cpu::forward(p, t, ws);
}

Status backward(const Problem& p, const BackwardTensors& t, Workspace ws, void* /*stream*/) {
  return cpu::backward(p, t, ws);
}

}  // namespace

const BackendOps& cpu_backend() {
  static const BackendOps ops{"cpu",     can_implement, check_tensors, cpu::workspace_size,
                              available, forward,       backward};
  return ops;
}

}  // namespace fa4::detail
