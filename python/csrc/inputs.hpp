// The native ops' input checks: the same conditions as the package's Python checks
// (fa4cpp/ops.py), so that the native path runs exactly the calls the Python path would run.
// Each returns false, with the reason in *why, where the Python path raises or refuses; the op
// then hands the call to the Python path for the package's own error.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "fa4/attention.hpp"
#include "run.hpp"

namespace fa4cpp_torch {

bool scores_ok(const Scores& scores, std::string* why);
// q, k, v of one dtype and device, as (batch, seq, heads, dim) or, with varlen, (total, heads,
// dim); the index arrays int32 and of the batch's length.
bool attention_inputs_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const VarLenArgs* varlen, std::string* why);
// dout and out shaped like the forward's output, lse like its log-sum-exp.
bool gradient_inputs_ok(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                        const at::Tensor& q, const at::Tensor& v, bool varlen, std::string* why);
// A caller's output tensor: q's shape with v's head dim, the output's dtype (output_dtype) and
// q's device.
bool output_ok(const at::Tensor& out, const at::Tensor& q, const at::Tensor& v,
               const std::optional<at::Tensor>& k_new, std::string* why);
bool kvcache_inputs_ok(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const KvCacheArgs& kv, std::string* why);
// Descales only with float8_e4m3fn inputs, each fp32 (batch, heads_kv) on q's device.
bool descales_ok(const at::Tensor& q, const Descales& descales, int64_t batch, int64_t heads_kv,
                 std::string* why);
// ALiBi slopes fp32 (heads_q) or (batch, heads_q), sinks fp32 (heads_q), on q's device.
bool variants_ok(const at::Tensor& q, const Variants& variants, int64_t batch, std::string* why);
// The backward's dsinks: fp32 (heads_q) on q's device, for a problem with sinks.
bool dsinks_ok(const at::Tensor& q, const Variants& variants,
               const std::optional<at::Tensor>& dsinks, std::string* why);
// The backward refuses float8_e4m3fn inputs (FP8 is forward-only).
bool backward_dtype_ok(const at::Tensor& q, std::string* why);

bool is_fp8(const at::Tensor& t);
// The output's dtype: q's, or for float8_e4m3fn inputs bfloat16 (FlashAttention-3's rule), or the
// dtype of a KV cache's 16-bit appended rows (quantised on write).
at::ScalarType output_dtype(const at::Tensor& q, const std::optional<at::Tensor>& k_new);

// The library's dtype and backend for the tensors; false for ones it does not take.
bool library_dtype(const at::Tensor& t, fa4::DType* dtype, std::string* why);
bool library_backend(const at::Tensor& t, fa4::Backend* backend, std::string* why);

}  // namespace fa4cpp_torch
