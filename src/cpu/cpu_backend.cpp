// The CPU backend as dispatch sees it: always available, every dtype (e4m3 forward only), any head
// dim up to 256, every mask / softcap / varlen / GQA / variant feature the Problem can express.
#include "cpu/cpu_backend.hpp"

#include <cstdint>

#include "common/status.hpp"
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

// Plain host loads and stores: every pointer must be host-readable. Device memory (a CUDA build
// handed cudaMalloc'd buffers, or kAuto seeing a host q beside device k/v) would crash, not fail.
Status check_host(const char* name, const void* data) {
  if (data != nullptr && is_device_only_pointer(data))
    return invalid("%s is device memory, which the cpu backend cannot read or write", name);
  return Status::success();
}

Status check_tensors(const Problem& p, const ForwardTensors* f, const BackwardTensors* b) {
  const struct {
    const char* name;
    const void* data;
  } pointers[] = {{"q.data", f ? f->q.data : b->q.data},
                  {"k.data", f ? f->k.data : b->k.data},
                  {"v.data", f ? f->v.data : b->v.data},
                  {"out.data", f ? f->out.data : b->out.data},
                  {"lse.data", f ? (p.return_lse ? f->lse.data : nullptr) : b->lse.data},
                  {"dout.data", b ? b->dout.data : nullptr},
                  {"dq.data", b ? b->dq.data : nullptr},
                  {"dk.data", b ? b->dk.data : nullptr},
                  {"dv.data", b ? b->dv.data : nullptr},
                  {"varlen.cu_seqlens_q", p.varlen.cu_seqlens_q},
                  {"varlen.cu_seqlens_k", p.varlen.cu_seqlens_k},
                  {"seqused_k", p.seqused_k},
                  {"k_new.data", f ? f->k_new.data : nullptr},
                  {"v_new.data", f ? f->v_new.data : nullptr},
                  {"rotary.cos", f ? f->rotary.cos : nullptr},
                  {"rotary.sin", f ? f->rotary.sin : nullptr},
                  {"kv_cache.page_table", p.kv_cache.page_table},
                  {"kv_cache.batch_idx", p.kv_cache.batch_idx},
                  {"kv_cache.leftpad", p.kv_cache.leftpad},
                  {"kv_cache.cu_seqlens_new", p.kv_cache.cu_seqlens_new},
                  {"q_descale.data", f ? f->q_descale.data : nullptr},
                  {"k_descale.data", f ? f->k_descale.data : nullptr},
                  {"v_descale.data", f ? f->v_descale.data : nullptr},
                  {"alibi.data", p.alibi.data},
                  {"sinks", p.sinks},
                  {"dsinks", b ? b->dsinks : nullptr}};
  for (const auto& ptr : pointers) {
    Status s = check_host(ptr.name, ptr.data);
    if (!s.ok()) return s;
  }
  return Status::success();
}

Status available() { return Status::success(); }

Status forward(const Problem& p, const ForwardTensors& t, Workspace ws, void* /*stream*/,
               const Overrides& overrides) {
  Status s = check_host("workspace.data", ws.data);
  return s.ok() ? cpu::forward(p, t, ws, overrides.cpu_threads) : s;
}

Status backward(const Problem& p, const BackwardTensors& t, Workspace ws, void* /*stream*/,
                const Overrides& overrides) {
  Status s = check_host("workspace.data", ws.data);
  return s.ok() ? cpu::backward(p, t, ws, overrides.cpu_threads) : s;
}

size_t workspace_size(const Problem& p, Pass pass, const Overrides& overrides) {
  return cpu::workspace_size(p, pass, overrides.cpu_threads);
}

}  // namespace

const BackendOps& cpu_backend() {
  static const BackendOps ops{"cpu",     can_implement, check_tensors, workspace_size,
                              available, forward,       backward};
  return ops;
}

}  // namespace fa4::detail
