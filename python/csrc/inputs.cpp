#include "inputs.hpp"

#include <cmath>

namespace fa4cpp_torch {
namespace {

bool fail(std::string* why, std::string message) {
  *why = "fa4cpp: " + std::move(message);
  return false;
}

bool index_ok(const char* name, const at::Tensor& t, int64_t length, const at::Device& device,
              std::string* why) {
  if (t.scalar_type() != at::kInt || t.dim() != 1 || t.size(0) != length || t.device() != device)
    return fail(why, std::string(name) + " must be a 1-D int32 tensor of " +
                         std::to_string(length) + " entries on the tensors' device");
  return true;
}

bool optional_index_ok(const char* name, const std::optional<at::Tensor>& t, int64_t length,
                       const at::Device& device, std::string* why) {
  return !t.has_value() || index_ok(name, *t, length, device, why);
}

bool like_q(const at::Tensor& t, const at::Tensor& q) {
  return t.scalar_type() == q.scalar_type() && t.device() == q.device();
}

// The 16-bit dtypes of an FP8 call's output (and of appended rows quantised on write).
bool fp8_output_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

bool is_fp8(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn; }

at::ScalarType output_dtype(const at::Tensor& q, const std::optional<at::Tensor>& k_new) {
  if (!is_fp8(q)) return q.scalar_type();
  if (k_new.has_value() && fp8_output_dtype(k_new->scalar_type())) return k_new->scalar_type();
  return at::kBFloat16;
}

bool descales_ok(const at::Tensor& q, const Descales& d, int64_t batch, int64_t heads_kv,
                 std::string* why) {
  if (!d.any()) return true;
  if (!is_fp8(q)) return fail(why, "descales scale float8_e4m3fn inputs only");
  for (const std::optional<at::Tensor>* t : {&d.q, &d.k, &d.v}) {
    if (!t->has_value()) continue;
    const at::Tensor& x = **t;
    if (x.scalar_type() != at::kFloat || x.dim() != 2 || x.size(0) != batch ||
        x.size(1) != heads_kv || x.device() != q.device())
      return fail(why, "descales must be float32 tensors of shape (batch, heads_kv) on q's device");
  }
  return true;
}

bool variants_ok(const at::Tensor& q, const Variants& v, int64_t batch, std::string* why) {
  const int64_t heads = q.size(-2);
  if (v.alibi_slopes.has_value()) {
    const at::Tensor& a = *v.alibi_slopes;
    const bool shape_ok = (a.dim() == 1 && a.size(0) == heads) ||
                          (a.dim() == 2 && a.size(0) == batch && a.size(1) == heads);
    if (a.scalar_type() != at::kFloat || !shape_ok || a.device() != q.device())
      return fail(why, "alibi_slopes must be a float32 tensor of shape (heads_q) or (batch, "
                       "heads_q) on q's device");
  }
  if (v.sinks.has_value()) {
    const at::Tensor& s = *v.sinks;
    if (s.scalar_type() != at::kFloat || s.dim() != 1 || s.size(0) != heads ||
        s.device() != q.device())
      return fail(why, "the sinks must be a float32 tensor of shape (heads_q) on q's device");
  }
  return true;
}

bool dsinks_ok(const at::Tensor& q, const Variants& v, const std::optional<at::Tensor>& dsinks,
               std::string* why) {
  if (!dsinks.has_value()) return true;
  if (!v.sinks.has_value()) return fail(why, "dsinks is given, but the problem has no sinks");
  const at::Tensor& d = *dsinks;
  if (d.scalar_type() != at::kFloat || d.dim() != 1 || d.size(0) != q.size(-2) ||
      d.device() != q.device())
    return fail(why, "dsinks must be a float32 tensor of shape (heads_q) on q's device");
  return true;
}

bool backward_dtype_ok(const at::Tensor& q, std::string* why) {
  if (!is_fp8(q)) return true;
  return fail(why, "the backward of float8_e4m3fn (FP8) inputs is not supported: FP8 attention "
                   "is forward-only (run it under torch.no_grad(), or compute gradients from "
                   "bfloat16 / float16 inputs)");
}

bool scores_ok(const Scores& s, std::string* why) {
  if (s.window_left < -1 || s.window_right < -1)
    return fail(why, "window sides must be >= 0, or -1 for unbounded");
  if (!std::isfinite(s.softcap) || s.softcap < 0)
    return fail(why, "softcap must be 0 (off) or a finite positive number");
  if (!std::isfinite(s.softmax_scale)) return fail(why, "softmax_scale must be finite");
  // The library holds the scale in fp32: one that rounds to 0 there would read as the default.
  const float scale32 = static_cast<float>(s.softmax_scale);
  if (s.softmax_scale != 0 && (scale32 == 0 || !std::isfinite(scale32)))
    return fail(why, "softmax_scale is not a finite non-zero fp32 value");
  return true;
}

bool attention_inputs_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const VarLenArgs* varlen, std::string* why) {
  const int64_t rank = varlen ? 3 : 4;
  if (q.dim() != rank || k.dim() != rank || v.dim() != rank)
    return fail(why, varlen ? "q, k and v must be (total, heads, head_dim)"
                            : "q, k and v must be (batch, seqlen, heads, head_dim)");
  if (!like_q(k, q) || !like_q(v, q))
    return fail(why, "q, k and v must have one dtype and one device");
  if (k.size(-2) != v.size(-2) || k.size(-3) != v.size(-3))
    return fail(why, "k and v must have the same key rows and heads");
  if (q.size(-1) != k.size(-1)) return fail(why, "q and k must have one head dim");
  if (k.size(-2) < 1 || q.size(-2) % k.size(-2) != 0)
    return fail(why, "q's heads must be a multiple of k's and v's heads");
  if (q.size(-1) < 1 || v.size(-1) < 1) return fail(why, "head dims must be >= 1");
  if (!varlen) {
    if (q.size(0) != k.size(0) || q.size(0) != v.size(0))
      return fail(why, "q, k and v must have one batch size");
    return true;
  }
  if (varlen->cu_seqlens_q.dim() != 1 || varlen->cu_seqlens_q.size(0) < 1)
    return fail(why, "cu_seqlens_q must be 1-D with batch + 1 entries");
  const int64_t batch = varlen->cu_seqlens_q.size(0) - 1;
  const at::Device device = q.device();
  if (!index_ok("cu_seqlens_q", varlen->cu_seqlens_q, batch + 1, device, why) ||
      !index_ok("cu_seqlens_k", varlen->cu_seqlens_k, batch + 1, device, why) ||
      !optional_index_ok("seqused_k", varlen->seqused_k, batch, device, why))
    return false;
  if (varlen->max_seqlen_q < 0 || varlen->max_seqlen_k < 0)
    return fail(why, "max_seqlen_q and max_seqlen_k must be >= 0");
  return true;
}

bool output_ok(const at::Tensor& out, const at::Tensor& q, const at::Tensor& v,
               const std::optional<at::Tensor>& k_new, std::string* why) {
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = v.size(-1);
  if (out.sizes() != at::IntArrayRef(shape) || out.scalar_type() != output_dtype(q, k_new) ||
      out.device() != q.device())
    return fail(why, "out must have q's shape with the values' head dim, the output's dtype and "
                     "q's device");
  return true;
}

bool gradient_inputs_ok(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                        const at::Tensor& q, const at::Tensor& v, bool varlen,
                        std::string* why) {
  if (!output_ok(dout, q, v, std::nullopt, why) || !output_ok(out, q, v, std::nullopt, why))
    return fail(why, "dout and out must have the forward output's shape, dtype and device");
  const std::vector<int64_t> lse_shape =
      varlen ? std::vector<int64_t>{q.size(1), q.size(0)}
             : std::vector<int64_t>{q.size(0), q.size(2), q.size(1)};
  if (lse.sizes() != at::IntArrayRef(lse_shape) || lse.scalar_type() != at::kFloat ||
      lse.device() != q.device())
    return fail(why, "lse must be the forward's float32 log-sum-exp");
  return true;
}

bool kvcache_inputs_ok(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const KvCacheArgs& kv, std::string* why) {
  const bool varlen = kv.cu_seqlens_q.has_value();
  if (q.dim() != (varlen ? 3 : 4)) return fail(why, "q has the wrong rank");
  for (const at::Tensor* cache : {&k_cache, &v_cache}) {
    if (cache->dim() != 4 || !like_q(*cache, q))
      return fail(why, "k_cache and v_cache must be 4-D, of q's dtype and device");
    if (cache->size(-1) > 1 && cache->stride(-1) != 1)
      return fail(why, "the caches' last dimension must be contiguous");
  }
  for (int d = 0; d < 3; ++d)
    if (k_cache.size(d) != v_cache.size(d))
      return fail(why, "k_cache and v_cache must have the same rows and heads");
  if (q.size(-1) != k_cache.size(-1) || k_cache.size(-2) < 1 ||
      q.size(-2) % k_cache.size(-2) != 0)
    return fail(why, "q and k_cache: one head dim, and q's heads a multiple of the cache's");
  if (varlen && (kv.cu_seqlens_q->dim() != 1 || kv.cu_seqlens_q->size(0) < 1))
    return fail(why, "cu_seqlens_q must be 1-D with batch + 1 entries");
  const int64_t batch = varlen ? kv.cu_seqlens_q->size(0) - 1 : q.size(0);
  if (kv.k_new.has_value() != kv.v_new.has_value())
    return fail(why, "k and v (the new rows) go together");
  if (kv.k_new.has_value()) {
    const int64_t rank = kv.cu_seqlens_k_new.has_value() ? 3 : 4;
    // An e4m3 cache also takes 16-bit rows (both of one dtype), quantised on write.
    const at::ScalarType new_dtype =
        is_fp8(q) && fp8_output_dtype(kv.k_new->scalar_type()) ? kv.k_new->scalar_type()
                                                                : q.scalar_type();
    for (const auto* pair : {&kv.k_new, &kv.v_new}) {
      const at::Tensor& t = **pair;
      const at::Tensor& cache = pair == &kv.k_new ? k_cache : v_cache;
      if (t.dim() != rank || t.size(-1) != cache.size(-1) || t.size(-2) != cache.size(-2) ||
          t.scalar_type() != new_dtype || t.device() != q.device() ||
          (rank == 4 && t.size(0) != batch))
        return fail(why, "k and v (the new rows) have the wrong shape, dtype or device");
    }
  } else if (kv.cu_seqlens_k_new.has_value()) {
    return fail(why, "cu_seqlens_k_new is given without k and v");
  }
  if (kv.rotary_cos.has_value() != kv.rotary_sin.has_value())
    return fail(why, "rotary_cos and rotary_sin go together");
  if (kv.rotary_cos.has_value()) {
    if (!kv.k_new.has_value()) return fail(why, "rotary_cos / rotary_sin need k and v");
    // The tables are in the output's dtype (q's, unless FP8).
    const at::ScalarType table_dtype = output_dtype(q, kv.k_new);
    for (const at::Tensor* t : {&*kv.rotary_cos, &*kv.rotary_sin})
      if (t->dim() != 2 || t->sizes() != kv.rotary_cos->sizes() ||
          t->scalar_type() != table_dtype || t->device() != q.device())
        return fail(why, "rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) tensors "
                         "of the output's dtype on q's device");
  }
  const at::Device device = q.device();
  if (!optional_index_ok("cache_seqlens", kv.cache_seqlens, batch, device, why) ||
      !optional_index_ok("cache_batch_idx", kv.cache_batch_idx, batch, device, why) ||
      !optional_index_ok("cache_leftpad", kv.cache_leftpad, batch, device, why) ||
      !optional_index_ok("cu_seqlens_q", kv.cu_seqlens_q, batch + 1, device, why) ||
      !optional_index_ok("cu_seqlens_k_new", kv.cu_seqlens_k_new, batch + 1, device, why))
    return false;
  if (kv.page_table.has_value() &&
      (kv.page_table->dim() != 2 || kv.page_table->scalar_type() != at::kInt ||
       kv.page_table->device() != device))
    return fail(why, "page_table must be a 2-D int32 tensor on the tensors' device");
  if (varlen && kv.max_seqlen_q < 0) return fail(why, "max_seqlen_q must be >= 0");
  return true;
}

bool library_dtype(const at::Tensor& t, fa4::DType* dtype, std::string* why) {
  switch (t.scalar_type()) {
    case at::kBFloat16: *dtype = fa4::DType::kBF16; return true;
    case at::kHalf: *dtype = fa4::DType::kFP16; return true;
    case at::kFloat: *dtype = fa4::DType::kFP32; return true;
    case at::kFloat8_e4m3fn: *dtype = fa4::DType::kE4M3; return true;
    default:
      return fail(why, "the library takes bfloat16, float16, float32 or float8_e4m3fn tensors");
  }
}

bool library_backend(const at::Tensor& t, fa4::Backend* backend, std::string* why) {
  if (t.device().is_cuda()) {
    *backend = fa4::Backend::kSm90;
    return true;
  }
  if (t.device().is_cpu()) {
    *backend = fa4::Backend::kCpu;
    return true;
  }
  return fail(why, "the library runs on cpu and cuda tensors");
}

}  // namespace fa4cpp_torch
