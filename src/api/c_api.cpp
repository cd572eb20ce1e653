// The C ABI: versioned structs converted to the C++ API, statuses and a per-thread error message.
#include "fa4/fa4.h"

#include <cstddef>
#include <cstring>
#include <string>

#include "api/override_fields.hpp"
#include "common/status.hpp"
#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"

namespace {

thread_local std::string g_last_error;

fa4_status record(const fa4::Status& s) {
  g_last_error = s.message;
  return static_cast<fa4_status>(s.code);
}

fa4_status fail(const char* message) {
  g_last_error = message;
  return FA4_ERROR_INVALID_ARGUMENT;
}

// The struct sizes of earlier ABI versions: each ended where the next version's fields begin. A
// struct that has not grown lists its own size.
template <typename T>
constexpr size_t kEarlierSizes[] = {sizeof(T)};
template <>
constexpr size_t kEarlierSizes<fa4_problem>[] = {offsetof(fa4_problem, page_table),   // 1
                                                 offsetof(fa4_problem, out_dtype)};   // 2
template <>
constexpr size_t kEarlierSizes<fa4_backward_tensors>[] = {offsetof(fa4_backward_tensors,
                                                                    dsinks)};  // 1 and 2
template <>
constexpr size_t kEarlierSizes<fa4_overrides>[] = {offsetof(fa4_overrides, narrow),     // 1 to 3
                                                   offsetof(fa4_overrides, unmasked)};  // 4
template <>
constexpr size_t kEarlierSizes<fa4_forward_tensors>[] = {
    offsetof(fa4_forward_tensors, k_new),       // 1
    offsetof(fa4_forward_tensors, q_descale)};  // 2

// A struct of this ABI version or of an earlier one; any other struct_size is a caller's mistake
// (or a later version's struct), rejected rather than read past what is there.
template <typename T>
const char* check_struct(const T* s, const char* name) {
  if (s == nullptr) return name;
  if (s->struct_size == sizeof(T)) return nullptr;
  for (size_t size : kEarlierSizes<T>)
    if (s->struct_size == size) return nullptr;
  return name;
}

// The caller's struct as this version's: the fields an earlier version lacks at their defaults.
template <typename T>
T current(const T& s, void (*init)(T*)) {
  T full;
  init(&full);
  std::memcpy(&full, &s, s.struct_size);
  full.struct_size = sizeof(T);
  return full;
}

fa4::Problem to_cpp(const fa4_problem& given) {
  const fa4_problem c = current(given, fa4_problem_init);
  fa4::Problem p;
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim_qk = c.head_dim_qk;
  p.head_dim_v = c.head_dim_v;
  p.dtype = static_cast<fa4::DType>(c.dtype);
  p.causal = c.causal != 0;
  p.window = {c.window_left, c.window_right};
  p.softcap = c.softcap;
  p.softmax_scale = c.softmax_scale;
  p.varlen.cu_seqlens_q = c.cu_seqlens_q;
  p.varlen.cu_seqlens_k = c.cu_seqlens_k;
  p.varlen.total_q = c.total_q;
  p.varlen.total_k = c.total_k;
  p.seqused_k = c.seqused_k;
  p.return_lse = c.return_lse != 0;
  p.deterministic = c.deterministic != 0;
  fa4::KvCache& kc = p.kv_cache;
  kc.page_table = c.page_table;
  kc.page_table_stride = c.page_table_stride;
  kc.pages_per_seq = c.pages_per_seq;
  kc.num_pages = c.num_pages;
  kc.page_size = c.page_size;
  kc.batch_idx = c.cache_batch_idx;
  kc.cache_batch = c.cache_batch;
  kc.leftpad = c.cache_leftpad;
  kc.seqlen_new = c.seqlen_new;
  kc.cu_seqlens_new = c.cu_seqlens_new;
  kc.total_new = c.total_new;
  kc.rotary_dim = c.rotary_dim;
  kc.rotary_interleaved = c.rotary_interleaved != 0;
  kc.rotary_seqlen = c.rotary_seqlen;
  p.num_splits = c.num_splits;
  p.fp8.out_dtype = static_cast<fa4::DType>(c.out_dtype);
  p.fp8.quantize_appends = c.quantize_appends != 0;
  p.alibi = {c.alibi_slopes, c.alibi_batch_stride, c.alibi_head_stride};
  p.sinks = c.sinks;
  return p;
}

fa4::TensorView to_cpp(const fa4_tensor& t) {
  return {t.data, t.batch_stride, t.seq_stride, t.head_stride, t.dim_stride};
}

fa4::LseView to_cpp(const fa4_lse& t) {
  return {t.data, t.batch_stride, t.head_stride, t.seq_stride};
}

fa4::DescaleView to_cpp(const fa4_descale& d) { return {d.data, d.batch_stride, d.head_stride}; }

// Null: every choice the library's. A choice outside -1 / 0 / 1 is refused here, before the C++
// enum could wrap it.
fa4::Status to_cpp(const fa4_overrides* given, fa4::Overrides* o) {
  *o = fa4::Overrides{};
  if (given == nullptr) return fa4::Status::success();
  const fa4_overrides full = current(*given, fa4_overrides_init);
  const fa4_overrides* c = &full;
  for (const fa4::detail::ChoiceField& f : fa4::detail::kChoiceFields) {
    const int32_t v = c->*f.c_member;
    if (v < -1 || v > 1)
      return fa4::detail::invalid("fa4_overrides.%s is %d; it must be -1, 0 or 1", f.name, v);
    o->*f.member = static_cast<fa4::Choice>(v);
  }
  for (const fa4::detail::CountField& f : fa4::detail::kCountFields) o->*f.member = c->*f.c_member;
  return fa4::Status::success();
}

void to_c(const fa4::Overrides& o, fa4_overrides* c) {
  for (const fa4::detail::ChoiceField& f : fa4::detail::kChoiceFields)
    c->*f.c_member = int32_t(o.*f.member);
  for (const fa4::detail::CountField& f : fa4::detail::kCountFields) c->*f.c_member = o.*f.member;
}

#define FA4_CHECK_STRUCT(ptr, name)                                                     \
  do {                                                                                  \
    if (check_struct(ptr, name))                                                        \
      return fail(name " is null or its struct_size is not sizeof(" name ") of this "   \
                       "library's ABI version or an earlier one (use " name "_init)"); \
  } while (0)

// An optional struct: null is allowed, a wrong struct_size is not.
#define FA4_CHECK_OPTIONAL_STRUCT(ptr, name)                                            \
  do {                                                                                  \
    if ((ptr) != nullptr && check_struct(ptr, name))                                    \
      return fail(name " has a struct_size that is not sizeof(" name ") of this "       \
                       "library's ABI version (use " name "_init)");                    \
  } while (0)

// The overrides in *o, or the failure's status recorded and returned.
#define FA4_OVERRIDES(c_overrides, o)                                                   \
  FA4_CHECK_OPTIONAL_STRUCT(c_overrides, "fa4_overrides");                              \
  fa4::Overrides o;                                                                     \
  if (fa4::Status converted = to_cpp(c_overrides, &o); !converted.ok()) return record(converted)

}  // namespace

extern "C" {

void fa4_problem_init(fa4_problem* p) {
  if (p == nullptr) return;
  *p = fa4_problem{};
  p->struct_size = sizeof(fa4_problem);
  p->dtype = FA4_DTYPE_BF16;
  p->window_left = -1;
  p->window_right = -1;
  p->out_dtype = FA4_DTYPE_BF16;
  p->alibi_head_stride = 1;
}

static fa4_tensor empty_tensor() { return fa4_tensor{nullptr, 0, 0, 0, 1}; }
static fa4_lse empty_lse() { return fa4_lse{nullptr, 0, 0, 1}; }

void fa4_forward_tensors_init(fa4_forward_tensors* t) {
  if (t == nullptr) return;
  *t = fa4_forward_tensors{};
  t->struct_size = sizeof(fa4_forward_tensors);
  t->q = t->k = t->v = t->out = t->k_new = t->v_new = empty_tensor();
  t->lse = empty_lse();
}

void fa4_backward_tensors_init(fa4_backward_tensors* t) {
  if (t == nullptr) return;
  *t = fa4_backward_tensors{};
  t->struct_size = sizeof(fa4_backward_tensors);
  t->q = t->k = t->v = t->out = t->dout = t->dq = t->dk = t->dv = empty_tensor();
  t->lse = empty_lse();
}

fa4_status fa4_can_implement(const fa4_problem* problem, fa4_backend backend, fa4_pass pass) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  return record(fa4::can_implement(to_cpp(*problem), static_cast<fa4::Backend>(backend),
                                   static_cast<fa4::Pass>(pass)));
}

void fa4_overrides_init(fa4_overrides* o) {
  if (o == nullptr) return;
  *o = fa4_overrides{};
  o->struct_size = sizeof(fa4_overrides);
  to_c(fa4::Overrides{}, o);
}

fa4_status fa4_overrides_from_env(fa4_overrides* o) {
  FA4_CHECK_STRUCT(o, "fa4_overrides");
  fa4::Overrides cpp;
  const fa4::Status s = fa4::overrides_from_env(&cpp);
  if (s.ok()) {
    // Written through this version's struct, copied back as far as the caller's reaches.
    const uint32_t size = o->struct_size;
    fa4_overrides full = current(*o, fa4_overrides_init);
    to_c(cpp, &full);
    full.struct_size = size;
    std::memcpy(o, &full, size);
  }
  return record(s);
}

fa4_status fa4_workspace_size_with_overrides(const fa4_problem* problem, fa4_backend backend,
                                             fa4_pass pass, const fa4_overrides* overrides,
                                             size_t* bytes) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  FA4_OVERRIDES(overrides, o);
  return record(fa4::workspace_size(to_cpp(*problem), static_cast<fa4::Backend>(backend),
                                    static_cast<fa4::Pass>(pass), o, bytes));
}

fa4_status fa4_workspace_size(const fa4_problem* problem, fa4_backend backend, fa4_pass pass,
                              size_t* bytes) {
  return fa4_workspace_size_with_overrides(problem, backend, pass, nullptr, bytes);
}

fa4_status fa4_forward_with_overrides(const fa4_problem* problem,
                                      const fa4_forward_tensors* tensors, void* workspace,
                                      size_t workspace_bytes, void* stream, fa4_backend backend,
                                      const fa4_overrides* overrides) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  FA4_CHECK_STRUCT(tensors, "fa4_forward_tensors");
  FA4_OVERRIDES(overrides, o);
  const fa4_forward_tensors c = current(*tensors, fa4_forward_tensors_init);
  fa4::ForwardTensors t;
  t.q = to_cpp(c.q);
  t.k = to_cpp(c.k);
  t.v = to_cpp(c.v);
  t.out = to_cpp(c.out);
  t.lse = to_cpp(c.lse);
  t.k_new = to_cpp(c.k_new);
  t.v_new = to_cpp(c.v_new);
  t.rotary = {c.rotary_cos, c.rotary_sin, c.rotary_stride};
  t.q_descale = to_cpp(c.q_descale);
  t.k_descale = to_cpp(c.k_descale);
  t.v_descale = to_cpp(c.v_descale);
  return record(fa4::forward(to_cpp(*problem), t, {workspace, workspace_bytes}, stream,
                             static_cast<fa4::Backend>(backend), o));
}

fa4_status fa4_forward(const fa4_problem* problem, const fa4_forward_tensors* tensors,
                       void* workspace, size_t workspace_bytes, void* stream, fa4_backend backend) {
  return fa4_forward_with_overrides(problem, tensors, workspace, workspace_bytes, stream, backend,
                                    nullptr);
}

fa4_status fa4_backward_with_overrides(const fa4_problem* problem,
                                       const fa4_backward_tensors* tensors, void* workspace,
                                       size_t workspace_bytes, void* stream, fa4_backend backend,
                                       const fa4_overrides* overrides) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  FA4_CHECK_STRUCT(tensors, "fa4_backward_tensors");
  FA4_OVERRIDES(overrides, o);
  const fa4_backward_tensors c = current(*tensors, fa4_backward_tensors_init);
  fa4::BackwardTensors t;
  t.q = to_cpp(c.q);
  t.k = to_cpp(c.k);
  t.v = to_cpp(c.v);
  t.out = to_cpp(c.out);
  t.dout = to_cpp(c.dout);
  t.lse = to_cpp(c.lse);
  t.dq = to_cpp(c.dq);
  t.dk = to_cpp(c.dk);
  t.dv = to_cpp(c.dv);
  t.dsinks = c.dsinks;
  return record(fa4::backward(to_cpp(*problem), t, {workspace, workspace_bytes}, stream,
                              static_cast<fa4::Backend>(backend), o));
}

fa4_status fa4_backward(const fa4_problem* problem, const fa4_backward_tensors* tensors,
                        void* workspace, size_t workspace_bytes, void* stream,
                        fa4_backend backend) {
  return fa4_backward_with_overrides(problem, tensors, workspace, workspace_bytes, stream,
                                     backend, nullptr);
}

const char* fa4_last_error_message(void) { return g_last_error.c_str(); }

const char* fa4_status_string(fa4_status status) {
  return fa4::to_string(static_cast<fa4::StatusCode>(status));
}

int fa4_abi_version(void) { return FA4_ABI_VERSION; }

const char* fa4_version(void) { return fa4::version(); }

}  // extern "C"
