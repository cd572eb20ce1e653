#include "run.hpp"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <array>
#include <vector>

#include "fa4/overrides.hpp"
#include "inputs.hpp"

namespace fa4cpp_torch {
namespace {

// sm90 loads with TMA: 16-byte aligned base addresses and strides, no broadcast (0) strides.
constexpr int64_t kTmaAlignBytes = 16;
// The library's Workspace contract: 256-byte aligned memory of the backend.
constexpr int64_t kWorkspaceAlignment = 256;

// The launch-plan overrides named by the environment, read once (the library's one reader), as
// the Python path applies them; null when a variable is invalid (the Python path reports it).
const fa4::Overrides* overrides(std::string* why) {
  static const std::pair<fa4::Status, fa4::Overrides> loaded = [] {
    fa4::Overrides o;
    fa4::Status status = fa4::overrides_from_env(&o);
    return std::make_pair(std::move(status), o);
  }();
  if (!loaded.first.ok()) {
    *why = loaded.first.message;
    return nullptr;
  }
  return &loaded.second;
}

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// t itself when TMA can load it, else a fresh contiguous copy (which the allocator aligns;
// contiguous() would return a contiguous tensor at a misaligned offset as it is).
at::Tensor tma_ready(const at::Tensor& t) {
  if (t.numel() == 0) return t;
  const int64_t elem = static_cast<int64_t>(t.element_size());
  bool misaligned = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % kTmaAlignBytes != 0;
  for (int64_t d = 0; d + 1 < t.dim() && !misaligned; ++d)
    misaligned = (t.stride(d) * elem) % kTmaAlignBytes != 0 || (t.stride(d) == 0 && t.size(d) > 1);
  if (!misaligned) return t;
  return at::empty(t.sizes(), t.options()).copy_(t);
}

// What the backend takes: a contiguous last dimension, and on sm90 TMA alignment.
at::Tensor prepared(const at::Tensor& t, fa4::Backend backend) {
  at::Tensor c = last_dim_contiguous(t);
  return backend == fa4::Backend::kSm90 ? tma_ready(c) : c;
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

const int32_t* ints(const std::optional<at::Tensor>& t) {
  return t.has_value() ? static_cast<const int32_t*>(t->const_data_ptr()) : nullptr;
}

void* address(const at::Tensor& t, bool written) {
  if (t.numel() == 0) return nullptr;
  return written ? t.data_ptr() : const_cast<void*>(t.const_data_ptr());
}

// t's strides padded with leading 0s to `rank`; a last dimension of one element reports 1.
std::array<int64_t, 4> strides(const at::Tensor& t, int64_t rank) {
  std::array<int64_t, 4> s{0, 0, 0, 0};
  const int64_t pad = rank - t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) s[pad + d] = t.stride(d);
  if (t.size(-1) == 1) s[rank - 1] = 1;
  return s;
}

// A (batch, seq, heads, dim) tensor, or (total, heads, dim) in varlen mode.
fa4::TensorView view(const at::Tensor& t, bool written = false) {
  const auto s = strides(t, 4);
  fa4::TensorView v;
  v.data = address(t, written);
  v.batch_stride = s[0];
  v.seq_stride = s[1];
  v.head_stride = s[2];
  v.dim_stride = s[3];
  return v;
}

// (batch, heads, seq) fp32, or (heads, total) in varlen mode.
fa4::LseView lse_view(const at::Tensor& t, bool written) {
  const auto s = strides(t, 3);
  fa4::LseView v;
  v.data = static_cast<float*>(address(t, written));
  v.batch_stride = s[0];
  v.head_stride = s[1];
  v.seq_stride = s[2];
  return v;
}

// An fp32 (batch, heads_kv) descale, or none (null: 1).
fa4::DescaleView descale_view(const std::optional<at::Tensor>& t) {
  fa4::DescaleView d;
  if (!t.has_value() || t->numel() == 0) return d;
  d.data = static_cast<const float*>(t->const_data_ptr());
  d.batch_stride = t->stride(0);
  d.head_stride = t->stride(1);
  return d;
}

void put_descales(fa4::ForwardTensors* t, const Descales& d) {
  t->q_descale = descale_view(d.q);
  t->k_descale = descale_view(d.k);
  t->v_descale = descale_view(d.v);
}

// An e4m3 problem's output dtype (the rotary tables' too) and whether its appended rows are
// quantised on write (they come in that 16-bit dtype).
void put_fp8(fa4::Problem* p, at::ScalarType out, bool quantize_appends) {
  if (p->dtype != fa4::DType::kE4M3) return;
  p->fp8.out_dtype = out == at::kHalf ? fa4::DType::kFP16 : fa4::DType::kBF16;
  p->fp8.quantize_appends = quantize_appends;
}

// The score variants' fields of the problem: ALiBi's slopes with their strides (a (heads_q)
// tensor has batch stride 0), and the sinks, which the library reads as a plain array (a strided
// tensor goes through a contiguous copy, kept alive in *sinks).
void put_variants(fa4::Problem* p, const Variants& v, at::Tensor* sinks) {
  if (v.alibi_slopes.has_value() && v.alibi_slopes->numel() > 0) {
    const at::Tensor& a = *v.alibi_slopes;
    p->alibi.data = static_cast<const float*>(a.const_data_ptr());
    p->alibi.batch_stride = a.dim() == 2 ? a.stride(0) : 0;
    p->alibi.head_stride = a.stride(-1);
  }
  if (v.sinks.has_value() && v.sinks->numel() > 0) {
    *sinks = v.sinks->contiguous();
    p->sinks = static_cast<const float*>(sinks->const_data_ptr());
  }
}

fa4::Problem base_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          fa4::DType dtype, const Scores& s) {
  fa4::Problem p;
  p.heads_q = q.size(-2);
  p.heads_kv = k.size(-2);
  p.head_dim_qk = q.size(-1);
  p.head_dim_v = v.size(-1);
  p.dtype = dtype;
  p.causal = s.causal;
  p.window = {s.window_left, s.window_right};
  p.softcap = static_cast<float>(s.softcap);
  p.softmax_scale = static_cast<float>(s.softmax_scale);
  p.return_lse = true;
  p.deterministic = s.deterministic;
  return p;
}

std::vector<int64_t> out_shape(const at::Tensor& q, const at::Tensor& v) {
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = v.size(-1);
  return shape;
}

std::vector<int64_t> lse_shape(const at::Tensor& q, bool varlen) {
  if (varlen) return {q.size(1), q.size(0)};
  return {q.size(0), q.size(2), q.size(1)};
}

// One library call: the tensors' device made current, workspace from torch's allocator (kept
// alive by the caching allocator for the work queued on the stream), torch's current stream.
template <typename Tensors>
bool run(fa4::Pass pass, const fa4::Problem& problem, const Tensors& tensors,
         const at::Tensor& like, fa4::Backend backend, std::string* why) {
  const fa4::Overrides* from_env = overrides(why);
  if (from_env == nullptr) return false;
  fa4::Overrides o = *from_env;
  // The CPU backend's threads: torch's intra-op thread count (torch.set_num_threads), as torch's
  // own CPU ops use, unless the environment's overrides name a count.
  if (backend == fa4::Backend::kCpu && o.cpu_threads == 0) o.cpu_threads = at::get_num_threads();
  c10::OptionalDeviceGuard guard;
  void* stream = nullptr;
  if (backend == fa4::Backend::kSm90) {
    guard.reset_device(like.device());
    stream = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA)
                 .getStream(like.device())
                 .native_handle();
  }
  size_t bytes = 0;
  fa4::Status status = fa4::workspace_size(problem, backend, pass, o, &bytes);
  at::Tensor buffer;
  fa4::Workspace workspace;
  if (status.ok() && bytes > 0) {
    buffer = at::empty({static_cast<int64_t>(bytes) + kWorkspaceAlignment},
                       like.options().dtype(at::kByte));
    const auto base = reinterpret_cast<uintptr_t>(buffer.data_ptr());
    workspace.data = reinterpret_cast<void*>((base + kWorkspaceAlignment - 1) /
                                             kWorkspaceAlignment * kWorkspaceAlignment);
    workspace.bytes = bytes;
  }
  if (status.ok()) {
    if constexpr (std::is_same_v<Tensors, fa4::ForwardTensors>)
      status = fa4::forward(problem, tensors, workspace, stream, backend, o);
    else
      status = fa4::backward(problem, tensors, workspace, stream, backend, o);
  }
  if (!status.ok()) *why = status.message;
  return status.ok();
}

struct Prepared {
  fa4::DType dtype;
  fa4::Backend backend;
};

bool library_takes(const at::Tensor& q, Prepared* p, std::string* why) {
  return library_dtype(q, &p->dtype, why) && library_backend(q, &p->backend, why);
}

// The varlen fields of the problem; the index arrays are kept alive by the caller.
struct VarLenArrays {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  std::optional<at::Tensor> seqused_k;

  void fill(fa4::Problem* p, const VarLenArgs& args, const at::Tensor& q, const at::Tensor& k) {
    cu_seqlens_q = args.cu_seqlens_q.contiguous();
    cu_seqlens_k = args.cu_seqlens_k.contiguous();
    seqused_k = contiguous(args.seqused_k);
    p->batch = cu_seqlens_q.size(0) - 1;
    p->seqlen_q = args.max_seqlen_q;
    p->seqlen_k = args.max_seqlen_k;
    p->varlen.cu_seqlens_q = ints(cu_seqlens_q);
    p->varlen.cu_seqlens_k = ints(cu_seqlens_k);
    p->varlen.total_q = q.size(0);
    p->varlen.total_k = k.size(0);
    p->seqused_k = ints(seqused_k);
  }
};

fa4::Problem attention_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               fa4::DType dtype, const Scores& s, const VarLenArgs* varlen,
                               VarLenArrays* arrays) {
  fa4::Problem p = base_problem(q, k, v, dtype, s);
  if (varlen != nullptr) {
    arrays->fill(&p, *varlen, q, k);
  } else {
    p.batch = q.size(0);
    p.seqlen_q = q.size(1);
    p.seqlen_k = k.size(1);
  }
  return p;
}

}  // namespace

std::optional<Pair> try_forward(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0,
                                const Scores& scores, const VarLenArgs* varlen,
                                const Descales& descales, const Variants& variants,
                                std::string* why) {
  Prepared lib;
  if (!scores_ok(scores, why) || !attention_inputs_ok(q0, k0, v0, varlen, why)) return std::nullopt;
  const int64_t batch = varlen ? varlen->cu_seqlens_q.size(0) - 1 : q0.size(0);
  if (!descales_ok(q0, descales, batch, k0.size(-2), why) ||
      !variants_ok(q0, variants, batch, why) || !library_takes(q0, &lib, why))
    return std::nullopt;
  const at::Tensor q = prepared(q0, lib.backend), k = prepared(k0, lib.backend),
                   v = prepared(v0, lib.backend);
  VarLenArrays arrays;
  fa4::Problem problem = attention_problem(q, k, v, lib.dtype, scores, varlen, &arrays);
  const at::ScalarType out_dtype = output_dtype(q, std::nullopt);
  put_fp8(&problem, out_dtype, false);
  at::Tensor sinks;
  put_variants(&problem, variants, &sinks);
  at::Tensor out = at::empty(out_shape(q, v), q.options().dtype(out_dtype));
  at::Tensor lse = at::empty(lse_shape(q, varlen != nullptr), q.options().dtype(at::kFloat));
  fa4::ForwardTensors t;
  t.q = view(q);
  t.k = view(k);
  t.v = view(v);
  t.out = view(out, true);
  t.lse = lse_view(lse, true);
  put_descales(&t, descales);
  if (!run(fa4::Pass::kForward, problem, t, q, lib.backend, why)) return std::nullopt;
  return Pair{std::move(out), std::move(lse)};
}

std::optional<Triple> try_backward(const at::Tensor& dout0, const at::Tensor& q0,
                                   const at::Tensor& k0, const at::Tensor& v0,
                                   const at::Tensor& out0, const at::Tensor& lse0,
                                   const Scores& scores, const VarLenArgs* varlen,
                                   const Variants& variants,
                                   const std::optional<at::Tensor>& dsinks, std::string* why) {
  Prepared lib;
  if (!scores_ok(scores, why) || !attention_inputs_ok(q0, k0, v0, varlen, why) ||
      !backward_dtype_ok(q0, why) ||
      !variants_ok(q0, variants, varlen ? varlen->cu_seqlens_q.size(0) - 1 : q0.size(0), why) ||
      !gradient_inputs_ok(dout0, out0, lse0, q0, v0, varlen != nullptr, why) ||
      !dsinks_ok(q0, variants, dsinks, why) || !library_takes(q0, &lib, why))
    return std::nullopt;
  const at::Tensor dout = prepared(dout0, lib.backend), q = prepared(q0, lib.backend),
                   k = prepared(k0, lib.backend), v = prepared(v0, lib.backend),
                   out = prepared(out0, lib.backend), lse = last_dim_contiguous(lse0);
  VarLenArrays arrays;
  fa4::Problem problem = attention_problem(q, k, v, lib.dtype, scores, varlen, &arrays);
  at::Tensor sinks;
  put_variants(&problem, variants, &sinks);
  // Varlen rows outside every sequence are not written by the library: their gradient is 0.
  const auto grad = [&](const at::Tensor& t) {
    return varlen != nullptr ? at::zeros(t.sizes(), t.options()) : at::empty(t.sizes(), t.options());
  };
  at::Tensor dq = grad(q), dk = grad(k), dv = grad(v);
  fa4::BackwardTensors t;
  t.q = view(q);
  t.k = view(k);
  t.v = view(v);
  t.out = view(out);
  t.dout = view(dout);
  t.lse = lse_view(lse, false);
  t.dq = view(dq, true);
  t.dk = view(dk, true);
  t.dv = view(dv, true);
  // The library writes a fresh array, copied into the caller's dsinks once the call succeeded
  // (any strides; nothing written on a failure).
  at::Tensor dsinks_out;
  if (dsinks.has_value() && dsinks->numel() > 0) {
    dsinks_out = at::empty({dsinks->size(0)}, dsinks->options());
    t.dsinks = static_cast<float*>(dsinks_out.data_ptr());
  }
  if (!run(fa4::Pass::kBackward, problem, t, q, lib.backend, why)) return std::nullopt;
  if (dsinks_out.defined()) dsinks->copy_(dsinks_out);
  return Triple{std::move(dq), std::move(dk), std::move(dv)};
}

std::optional<Pair> try_forward_kvcache(const at::Tensor& q0, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const KvCacheArgs& kv,
                                        const Scores& scores, const Descales& descales,
                                        const Variants& variants, const at::Tensor* into,
                                        std::string* why) {
  Prepared lib;
  if (!kvcache_inputs_ok(q0, k_cache, v_cache, kv, why)) return std::nullopt;
  const int64_t batch =
      kv.cu_seqlens_q.has_value() ? kv.cu_seqlens_q->size(0) - 1 : q0.size(0);
  if (!descales_ok(q0, descales, batch, k_cache.size(-2), why) ||
      !variants_ok(q0, variants, batch, why) || !scores_ok(scores, why) ||
      (into != nullptr && !output_ok(*into, q0, v_cache, kv.k_new, why)) ||
      !library_takes(q0, &lib, why))
    return std::nullopt;
  const at::Tensor q = last_dim_contiguous(q0);
  const bool varlen = kv.cu_seqlens_q.has_value();
  const at::ScalarType out_dtype = output_dtype(q0, kv.k_new);
  fa4::Problem p = base_problem(q, k_cache, v_cache, lib.dtype, scores);
  put_fp8(&p, out_dtype, kv.k_new.has_value() && !is_fp8(*kv.k_new));
  at::Tensor sinks;
  put_variants(&p, variants, &sinks);
  p.num_splits = kv.num_splits;
  const std::optional<at::Tensor> cu_seqlens_q = contiguous(kv.cu_seqlens_q),
                                  cache_seqlens = contiguous(kv.cache_seqlens),
                                  batch_idx = contiguous(kv.cache_batch_idx),
                                  leftpad = contiguous(kv.cache_leftpad),
                                  cu_seqlens_new = contiguous(kv.cu_seqlens_k_new);
  if (varlen) {
    p.batch = cu_seqlens_q->size(0) - 1;
    p.seqlen_q = kv.max_seqlen_q;
    p.varlen.cu_seqlens_q = ints(cu_seqlens_q);
    p.varlen.total_q = q.size(0);
  } else {
    p.batch = q.size(0);
    p.seqlen_q = q.size(1);
  }
  p.seqused_k = ints(cache_seqlens);
  fa4::KvCache& c = p.kv_cache;
  c.cache_batch = k_cache.size(0);
  p.seqlen_k = k_cache.size(1);
  std::optional<at::Tensor> page_table;
  if (kv.page_table.has_value()) {
    page_table = last_dim_contiguous(*kv.page_table);
    c.page_table = ints(page_table);
    c.pages_per_seq = page_table->size(1);
    c.page_table_stride = page_table->size(0) > 1 ? page_table->stride(0) : c.pages_per_seq;
    c.num_pages = k_cache.size(0);
    c.page_size = k_cache.size(1);
    c.cache_batch = page_table->size(0);
    p.seqlen_k = c.pages_per_seq * c.page_size;
  }
  c.batch_idx = ints(batch_idx);
  c.leftpad = ints(leftpad);
  c.cu_seqlens_new = ints(cu_seqlens_new);
  fa4::ForwardTensors t;
  at::Tensor k_new, v_new, cos, sin;
  if (kv.k_new.has_value()) {
    k_new = last_dim_contiguous(*kv.k_new);
    v_new = last_dim_contiguous(*kv.v_new);
    // Varlen appends: their total bounds every sequence's rows (no device read for the most).
    c.seqlen_new = cu_seqlens_new.has_value() ? k_new.size(0) : k_new.size(1);
    c.total_new = cu_seqlens_new.has_value() ? k_new.size(0) : 0;
    t.k_new = view(k_new);
    t.v_new = view(v_new);
  }
  if (kv.rotary_cos.has_value()) {
    cos = last_dim_contiguous(*kv.rotary_cos);
    sin = last_dim_contiguous(*kv.rotary_sin);
    if (cos.size(0) > 1 && cos.stride(0) != sin.stride(0)) {  // the library takes one row stride
      cos = cos.contiguous();
      sin = sin.contiguous();
    }
    c.rotary_dim = 2 * cos.size(1);
    c.rotary_seqlen = cos.size(0);
    c.rotary_interleaved = kv.rotary_interleaved;
    t.rotary.cos = cos.const_data_ptr();
    t.rotary.sin = sin.const_data_ptr();
    t.rotary.row_stride = cos.stride(0);
  }
  const bool direct = into != nullptr && (into->size(-1) <= 1 || into->stride(-1) == 1);
  at::Tensor out =
      direct ? *into : at::empty(out_shape(q, v_cache), q.options().dtype(out_dtype));
  at::Tensor lse = at::empty(lse_shape(q, varlen), q.options().dtype(at::kFloat));
  t.q = view(q);
  t.k = view(k_cache, true);
  t.v = view(v_cache, true);
  t.out = view(out, true);
  t.lse = lse_view(lse, true);
  put_descales(&t, descales);
  if (!run(fa4::Pass::kForward, p, t, q, lib.backend, why)) return std::nullopt;
  if (into != nullptr && !direct) {
    into->copy_(out);
    out = *into;
  }
  return Pair{std::move(out), std::move(lse)};
}

}  // namespace fa4cpp_torch
