// The Hopper (sm_90a) backend as dispatch sees it: availability, the TMA alignment rules the kernels
// rely on, which problems have a kernel (the table cmake/fa4_sm90.cmake generates), and each
// call's launch plan (fwd_plan.hpp, bwd_plan.hpp) handed to its kernel's launcher.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.hpp"
#include "common/math_constants.hpp"
#include "common/numeric.hpp"
#include "dispatch/backend.hpp"
#include "dispatch/pointer_memory.hpp"

#if defined(FA4_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif
#include "sm90/bwd/bwd_tile_shape.hpp"
#include "sm90/cache/page_tiles.hpp"
#include "sm90/fwd/fwd_tile_shape.hpp"
#include "sm90/host/bwd_plan.hpp"
#include "sm90/host/fwd_plan.hpp"
#include "sm90/fwd/tile_order.hpp"
#include "sm90/host/kernels.hpp"
#include "sm90/common/row_space.hpp"

namespace fa4::detail {
namespace {

// TMA (cp.async.bulk.tensor) needs 16-byte aligned base addresses and strides, and strides below
// 2^40 bytes; a stride of 0 is representable only for a mode of extent 1 (the launcher replaces it).
constexpr int64_t kTmaAlignBytes = 16;
constexpr int64_t kTmaMaxStrideBytes = int64_t(1) << 40;

// The extents of a view as the kernel's TMA descriptors see it (sm90/common/gmem_layout.cuh): batch
// entries (1 for packed varlen rows), rows per entry, heads; and the rows its base is moved back.
struct ViewExtents {
  int64_t batch, rows, heads, rows_before;
};

ViewExtents view_extents(const Problem& p, bool keys) {
  const int64_t longest = keys ? p.seqlen_k : p.seqlen_q;
  if (p.is_varlen() && !(keys && p.kv_cache.enabled()))
    return {1, keys ? p.varlen.total_k : p.varlen.total_q, keys ? p.heads_kv : p.heads_q, longest};
  if (keys && p.kv_cache.enabled()) {
    const sm90::RowSpace r = sm90::key_rows(p);
    return {r.batch, r.max_rows, p.heads_kv, r.max_rows};
  }
  return {p.batch, longest, keys ? p.heads_kv : p.heads_q, longest};
}

Status check_tma_view(const char* name, const TensorView& t, const Problem& p, bool keys,
                      DType dtype) {
  if (t.data == nullptr) return Status::success();  // an empty view; generic checks handled it
  const ViewExtents e = view_extents(p, keys);
  // A tensor without rows is never read or written: its strides do not matter.
  if (e.rows == 0 || e.batch == 0 || p.batch == 0) return Status::success();
  const int64_t elem = int64_t(dtype_size(dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % kTmaAlignBytes != 0)
    return invalid("%s.data is not %lld-byte aligned, which the sm90 backend needs (TMA loads)",
                   name, (long long)kTmaAlignBytes);
  const struct {
    const char* what;
    int64_t stride;
    int64_t extent;
  } strides[] = {{"batch_stride", e.batch > 1 ? t.batch_stride : 0, e.batch},
                 {"seq_stride", t.seq_stride, e.rows},
                 {"head_stride", t.head_stride, e.heads}};
  for (const auto& s : strides) {
    if ((s.stride * elem) % kTmaAlignBytes != 0)
      return invalid("%s.%s (%lld elements) is not a multiple of %lld bytes, which the sm90 backend "
                     "needs (TMA loads)",
                     name, s.what, (long long)s.stride, (long long)kTmaAlignBytes);
    if (s.stride == 0 && s.extent > 1)
      return not_supported("%s.%s is 0 over %lld elements (a broadcast view); the sm90 backend's "
                           "TMA loads need distinct rows",
                           name, s.what, (long long)s.extent);
    if (s.stride >= kTmaMaxStrideBytes / elem)
      return not_supported("%s.%s (%lld elements) exceeds the 2^40-byte stride limit of TMA", name,
                           s.what, (long long)s.stride);
  }
  // The kernel addresses rows from a base R rows before the data (sm90/common/gmem_layout.cuh), R the
  // longest sequence (a page's rows, for a paged cache): it must not wrap below address 0.
  if (t.seq_stride > 0 &&
      reinterpret_cast<uintptr_t>(t.data) / uintptr_t(t.seq_stride * elem) < uintptr_t(e.rows_before))
    return not_supported("%s.data lies below %lld rows of %lld bytes from address 0, which the sm90 "
                         "kernel's row addressing needs",
                         name, (long long)e.rows_before, (long long)(t.seq_stride * elem));
  return Status::success();
}

Status check_tensors(const Problem& p, const ForwardTensors* f, const BackwardTensors* b) {
  const struct {
    const char* name;
    const TensorView* view;
    bool keys;  // rows are keys (seqlen_k, heads_kv)
  } views[] = {{"q", f ? &f->q : &b->q, false},        {"k", f ? &f->k : &b->k, true},
               {"v", f ? &f->v : &b->v, true},         {"out", f ? &f->out : &b->out, false},
               {"dout", b ? &b->dout : nullptr, false}, {"dq", b ? &b->dq : nullptr, false},
               {"dk", b ? &b->dk : nullptr, true},     {"dv", b ? &b->dv : nullptr, true}};
  for (const auto& v : views) {
    if (v.view == nullptr) continue;
    Status s = check_tma_view(v.name, *v.view, p, v.keys,
                              f != nullptr && v.view == &f->out ? output_dtype(p) : p.dtype);
    if (!s.ok()) return s;
  }
  return Status::success();
}

// One kernel of this build's table (cmake/fa4_sm90.cmake): its forward and its backward launcher
// (null for a forward-only entry: e4m3); an end marker with null launchers closes the table.
struct Kernel {
  int64_t head_dim_qk;
  int64_t head_dim_v;
  DType dtype;
  Status (*forward)(const sm90::FwdPlan&, const Problem&, const ForwardTensors&, Workspace, void*);
  Status (*backward)(const sm90::BwdPlan&, const Problem&, const BackwardTensors&, Workspace,
                     void*);
};

constexpr Kernel kKernels[] = {
#if defined(FA4_WITH_CUDA)
#define FA4_SM90_KERNEL(qk, v, dtype)                                                 \
  {qk, v, DType::dtype, &sm90::run_forward<qk, v, DType::dtype>,                    \
   &sm90::run_backward<qk, v, DType::dtype>},
#define FA4_SM90_FORWARD_KERNEL(qk, v, dtype) \
  {qk, v, DType::dtype, &sm90::run_forward<qk, v, DType::dtype>, nullptr},
#include "sm90/sm90_kernels.inc"
#undef FA4_SM90_KERNEL
#undef FA4_SM90_FORWARD_KERNEL
#endif
    {0, 0, DType::kBF16, nullptr, nullptr}};

const Kernel* find_kernel(const Problem& p) {
  for (const Kernel& k : kKernels)
    if (k.forward != nullptr && k.head_dim_qk == p.head_dim_qk && k.head_dim_v == p.head_dim_v &&
        k.dtype == p.dtype)
      return &k;
  return nullptr;
}

// kNotSupported naming the problem's head dims and dtype and what this build has.
Status no_kernel(const char* pass, const Problem& p) {
  std::string built;
  for (const Kernel& k : kKernels) {
    if (k.forward == nullptr) continue;
    if (!built.empty()) built += ", ";
    built += std::to_string(k.head_dim_qk);
    if (k.head_dim_v != k.head_dim_qk) built += "x" + std::to_string(k.head_dim_v);
    built += ":";
    built += dtype_name(k.dtype);
  }
  return not_supported("the sm90 backend has no %s kernel for head dims %lld / %lld (qk / v) "
                       "with %s in this build (built: %s; see FA4_SM90_KERNELS)",
                       pass, (long long)p.head_dim_qk, (long long)p.head_dim_v,
                       dtype_name(p.dtype),
                       built.empty() ? "none" : built.c_str());
}

// Indices inside the kernel are 32-bit (rows, heads, tiles); TMA extents are too.
constexpr int64_t kMaxExtent = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxTiles = int64_t(1) << 30;
// No forward tile has fewer rows (fwd/tile_order.hpp): the tile count below is an upper bound.
constexpr int64_t kQueryTileRows = sm90::kMinQueryTileRows;
// The y / z extent of a CUDA grid (the backward's row kernels).
constexpr int64_t kMaxGridYZ = 65535;

// The backward's own limits, after the checks both passes share.
Status can_implement_backward(const Problem& p) {
  const Kernel* kernel = find_kernel(p);
  if (kernel == nullptr || kernel->backward == nullptr) return no_kernel("backward", p);
  // Row kernels: heads and batch entries are grid dimensions; the main grid is one CTA per key
  // tile (bwd_block_n keys: 64 above head dim 128) x query head x batch entry.
  const int64_t key_tile = sm90::bwd_block_n(int(p.head_dim_qk));
  const int64_t n_tiles = (p.seqlen_k + key_tile - 1) / key_tile;
  if (p.seqlen_q >= kMaxExtent || p.seqlen_k >= kMaxExtent || p.varlen.total_q >= kMaxExtent ||
      p.varlen.total_k >= kMaxExtent || p.heads_q > kMaxGridYZ || p.batch > kMaxGridYZ ||
      n_tiles * p.heads_q > kMaxExtent / (p.batch > 0 ? p.batch : 1))
    return not_supported("the sm90 backward takes fewer than 2^31 - 1 rows, at most %lld heads "
                         "and batch entries, and fewer than 2^31 - 1 CTAs (key tiles x heads x "
                         "batch)",
                         (long long)kMaxGridYZ);
  return Status::success();
}

Status can_implement(const Problem& p, Pass pass) {
  if (p.dtype == DType::kFP32)
    return not_supported("the sm90 backend takes bf16 or fp16 inputs; fp32 runs on the CPU backend");
  // The kernels index the slopes in 32 bits.
  if (p.alibi.data != nullptr &&
      (p.batch - 1) * p.alibi.batch_stride + (p.heads_q - 1) * p.alibi.head_stride >= kMaxExtent)
    return not_supported("alibi's strides reach past 2^31 - 1 slopes, which the sm90 kernels "
                         "index in 32 bits");
  if (p.dtype == DType::kE4M3) {
    // Each of these needs its own piece in the e4m3 kernels (ALiBi's slopes and the sinks in the
    // descaled score units; gathered key rows, where the producer's third and fourth warps
    // transpose V instead), which they do not have yet: the CPU backend computes all of them.
    const sm90::FwdTileShape tile =
        sm90::fwd_tile_shape(int(p.head_dim_qk), int(p.head_dim_v), true);
    if (p.kv_cache.enabled() && tile.block_n > 0 &&
        sm90::key_load_of(p, tile.block_n, tile.kv_pieces) == sm90::KeyLoad::kGather)
      return not_supported("the sm90 e4m3 (FP8) forward reads a paged KV cache only where pages "
                           "hold whole 16-key pieces (page_size a multiple of 16, no left pads); "
                           "the CPU backend takes any");
    if (p.alibi.data != nullptr || p.sinks != nullptr)
      return not_supported("the sm90 e4m3 (FP8) forward takes no ALiBi slopes or sinks yet; the "
                           "CPU backend does");
  }
  // The kernel keeps the running max of raw scores and scales afterwards: right only when the
  // scale is positive (with softcap the factor applied after the max is the cap itself).
  if (p.softcap == 0.0f && p.scale() < 0.0f)
    return not_supported("the sm90 kernels need softmax_scale > 0 without softcap (got %g)",
                         double(p.softmax_scale));
  if (p.softcap > 0.0f &&
      (!std::isfinite(p.scale() / p.softcap) || !std::isfinite(p.softcap * kLog2e)))
    return not_supported("softcap %g is outside the range the sm90 kernels can scale by "
                         "(scale / softcap and softcap·log2(e) must be finite)",
                         double(p.softcap));
#if !defined(FA4_WITH_CUDA)
  return make_status(StatusCode::kBackendUnavailable,
                     "this build of fa4cpp has no CUDA support (configure with FA4_WITH_CUDA=ON)");
#endif
  if (pass == Pass::kBackward) return can_implement_backward(p);
  if (find_kernel(p) == nullptr) return no_kernel("forward", p);
  // Every extent below is one TMA dimension or one 32-bit index; the views' shift mode spans one
  // row more than the tensor has (gmem_layout.cuh).
  // Tiles are counted in 32 bits, one grid stride past the last included (tile_scheduler.cuh).
  const int64_t m_tiles = (p.seqlen_q + kQueryTileRows - 1) / kQueryTileRows;
  if (p.seqlen_q >= kMaxExtent || p.seqlen_k >= kMaxExtent || p.varlen.total_q >= kMaxExtent ||
      p.varlen.total_k >= kMaxExtent || p.batch > kMaxExtent || p.heads_q > kMaxExtent ||
      m_tiles * p.heads_q > kMaxTiles / (p.batch > 0 ? p.batch : 1))
    return not_supported("the sm90 forward kernel takes fewer than 2^31 - 1 rows, heads and batch "
                         "entries, and at most 2^30 query tiles (64 rows x heads x batch)");
  // A KV cache's sizes are 32-bit in the prepare kernel and in the TMA views, whose grid has a
  // CTA per 16 rows (appended or query) per sequence.
  const KvCache& c = p.kv_cache;
  const int64_t prepare_rows = std::max(c.seqlen_new, p.seqlen_q) / 16 + 1;
  if (c.enabled() &&
      (c.num_pages >= kMaxExtent || c.cache_batch >= kMaxExtent || c.total_new >= kMaxExtent ||
       c.seqlen_new >= kMaxExtent || c.rotary_seqlen >= kMaxExtent ||
       prepare_rows > kMaxExtent / (p.batch > 0 ? p.batch : 1)))
    return not_supported("the sm90 KV cache takes fewer than 2^31 - 1 pages, cache rows, appended "
                         "rows and rotary positions, and at most 2^31 prepare CTAs (16 rows x "
                         "batch)");
  return Status::success();
}

size_t workspace_size(const Problem& p, Pass pass, const Overrides& overrides) {
  return pass == Pass::kBackward ? sm90::BwdWorkspace::layout(p).bytes
                                 : sm90::FwdWorkspace::of(p, overrides).bytes;
}

// The current device's facts for the launch plans, asked of the runtime once per device: they do
// not change while the process runs. A failed query fails the call, and is asked again by the
// next one; the plans never guess.
Status device_facts(sm90::DeviceFacts* facts) {
#if defined(FA4_WITH_CUDA)
  static std::mutex mutex;
  static std::vector<std::pair<int, sm90::DeviceFacts>> known;  // (device, its facts)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& [d, f] : known)
        if (d == device) {
          *facts = f;
          return Status::success();
        }
    }
    sm90::DeviceFacts f;
    err = cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, device);
    if (err == cudaSuccess) {
      std::lock_guard<std::mutex> lock(mutex);
      known.emplace_back(device, f);
      *facts = f;
      return Status::success();
    }
  }
  cudaGetLastError();  // the failed query's error is this call's, not the caller's next one's
  return make_status(StatusCode::kDeviceError,
                     "querying the device's SM count and L2 size failed: %s",
                     cudaGetErrorString(err));
#else
  *facts = {};
  return make_status(StatusCode::kBackendUnavailable,
                     "this build of fa4cpp has no CUDA support (configure with FA4_WITH_CUDA=ON)");
#endif
}

Status available() {
#if defined(FA4_WITH_CUDA)
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky-free error so the caller's next CUDA call is unaffected
    return make_status(StatusCode::kBackendUnavailable, "no CUDA device is present");
  }
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0)
    return make_status(StatusCode::kBackendUnavailable,
                       "the sm90 backend needs a Hopper GPU (compute capability 9.0); device %d "
                       "is %d.%d",
                       device, major, minor);
  return Status::success();
#else
  return make_status(StatusCode::kBackendUnavailable,
                     "this build of fa4cpp has no CUDA support (configure with FA4_WITH_CUDA=ON)");
#endif
}

struct NamedPointer {
  const char* name;
  const void* data;
};

// The kernels read and write through TMA descriptors and plain loads: host memory would fault on
// the device.
template <size_t kCount>
Status check_device_memory(const NamedPointer (&views)[kCount]) {
  int current = 0;
#if defined(FA4_WITH_CUDA)
  cudaGetDevice(&current);
#endif
  for (const auto& v : views) {
    if (v.data == nullptr) continue;
    int device = current;
    const Memory memory = memory_of(v.data, &device);
    if (memory == Memory::kHost)
      return invalid("%s is not device memory, which the sm90 backend needs", v.name);
    // Another device's memory would fault the context (a sticky error) rather than fail.
    if (memory == Memory::kDevice && device != current)
      return invalid("%s is memory of device %d, but device %d is current (the kernel runs "
                     "on the current device)",
                     v.name, device, current);
  }
  return Status::success();
}

Status run_forward(const Problem& p, const ForwardTensors& t, Workspace workspace, void* stream,
                   const Overrides& overrides) {
  Status s = can_implement(p, Pass::kForward);
  // The workspace holds the varlen tile order and split-KV's partials, where the problem may use
  // them; otherwise it is not used.
  const void* used = workspace_size(p, Pass::kForward, overrides) > 0 ? workspace.data : nullptr;
  // The kernel reads the sequence arrays too: a host array would fault the context.
  const NamedPointer views[] = {{"q.data", t.q.data},
                                {"k.data", t.k.data},
                                {"v.data", t.v.data},
                                {"out.data", t.out.data},
                                {"lse.data", p.return_lse ? t.lse.data : nullptr},
                                {"varlen.cu_seqlens_q", p.varlen.cu_seqlens_q},
                                {"varlen.cu_seqlens_k", p.varlen.cu_seqlens_k},
                                {"seqused_k", p.seqused_k},
                                {"workspace.data", used},
                                {"k_new.data", t.k_new.data},
                                {"v_new.data", t.v_new.data},
                                {"rotary.cos", t.rotary.cos},
                                {"rotary.sin", t.rotary.sin},
                                {"kv_cache.page_table", p.kv_cache.page_table},
                                {"kv_cache.batch_idx", p.kv_cache.batch_idx},
                                {"kv_cache.leftpad", p.kv_cache.leftpad},
                                {"kv_cache.cu_seqlens_new", p.kv_cache.cu_seqlens_new},
                                {"alibi.data", p.alibi.data},
                                {"sinks", p.sinks},
                                {"q_descale.data", t.q_descale.data},
                                {"k_descale.data", t.k_descale.data},
                                {"v_descale.data", t.v_descale.data}};
  if (s.ok()) s = check_device_memory(views);
  if (s.ok() && reinterpret_cast<uintptr_t>(used) % 256 != 0)
    s = invalid("workspace.data is not 256-byte aligned");
  sm90::DeviceFacts facts;
  if (s.ok()) s = device_facts(&facts);
  if (!s.ok()) return s;
  const sm90::FwdPlan plan = sm90::plan_forward(p, facts, overrides);
  return find_kernel(p)->forward(plan, p, t, workspace, stream);
}

Status run_backward(const Problem& p, const BackwardTensors& t, Workspace workspace,
                    void* stream, const Overrides& overrides) {
  Status s = can_implement(p, Pass::kBackward);
  const NamedPointer views[] = {{"q.data", t.q.data},
                                {"k.data", t.k.data},
                                {"v.data", t.v.data},
                                {"out.data", t.out.data},
                                {"dout.data", t.dout.data},
                                {"lse.data", t.lse.data},
                                {"dq.data", t.dq.data},
                                {"dk.data", t.dk.data},
                                {"dv.data", t.dv.data},
                                {"workspace.data", workspace.data},
                                {"varlen.cu_seqlens_q", p.varlen.cu_seqlens_q},
                                {"varlen.cu_seqlens_k", p.varlen.cu_seqlens_k},
                                {"alibi.data", p.alibi.data},
                                {"sinks", p.sinks},
                                {"dsinks", t.dsinks}};
  if (s.ok()) s = check_device_memory(views);
  // The kernels add float pairs into it with 8-byte atomics.
  if (s.ok() && reinterpret_cast<uintptr_t>(workspace.data) % 256 != 0)
    s = invalid("workspace.data is not 256-byte aligned");
  // The dQ accumulator's TMA view starts seqlen_q rows before the workspace (gmem_layout.cuh).
  if (s.ok() && workspace.data != nullptr &&
      reinterpret_cast<uintptr_t>(workspace.data) / uintptr_t(p.head_dim_qk * sizeof(float)) <
          uintptr_t(p.seqlen_q))
    s = not_supported("workspace.data lies below %lld rows of %lld bytes from address 0, which "
                      "the sm90 backward's row addressing needs",
                      (long long)p.seqlen_q, (long long)(p.head_dim_qk * sizeof(float)));
  sm90::DeviceFacts facts;
  if (s.ok()) s = device_facts(&facts);
  if (!s.ok()) return s;
  const sm90::BwdPlan plan = sm90::plan_backward(p, facts, overrides);
  return find_kernel(p)->backward(plan, p, t, workspace, stream);
}

}  // namespace

const BackendOps& sm90_backend() {
  static const BackendOps ops{"sm90",        can_implement, check_tensors, workspace_size,
                              available,     run_forward,   run_backward};
  return ops;
}

}  // namespace fa4::detail
