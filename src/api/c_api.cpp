// The C ABI: versioned structs converted to the C++ API, statuses and a per-thread error message.
#include "fa4/fa4.h"

#include <string>

#include "fa4/attention.hpp"

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

// A struct whose struct_size differs from this library's comes from another ABI version: reject it
// rather than read fields that are not there (or ignore fields we do not know).
template <typename T>
const char* check_struct(const T* s, const char* name) {
  if (s == nullptr) return name;
  if (s->struct_size != sizeof(T)) return name;
  return nullptr;
}

fa4::Problem to_cpp(const fa4_problem& c) {
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
  return p;
}

fa4::TensorView to_cpp(const fa4_tensor& t) {
  return {t.data, t.batch_stride, t.seq_stride, t.head_stride, t.dim_stride};
}

fa4::LseView to_cpp(const fa4_lse& t) {
  return {t.data, t.batch_stride, t.head_stride, t.seq_stride};
}

#define FA4_CHECK_STRUCT(ptr, name)                                                     \
  do {                                                                                  \
    if (check_struct(ptr, name))                                                        \
      return fail(name " is null or its struct_size is not sizeof(" name ") of this "   \
                       "library's ABI version (use " name "_init)");                    \
  } while (0)

}  // namespace

extern "C" {

void fa4_problem_init(fa4_problem* p) {
  if (p == nullptr) return;
  *p = fa4_problem{};
  p->struct_size = sizeof(fa4_problem);
  p->dtype = FA4_DTYPE_BF16;
  p->window_left = -1;
  p->window_right = -1;
}

static fa4_tensor empty_tensor() { return fa4_tensor{nullptr, 0, 0, 0, 1}; }
static fa4_lse empty_lse() { return fa4_lse{nullptr, 0, 0, 1}; }

void fa4_forward_tensors_init(fa4_forward_tensors* t) {
  if (t == nullptr) return;
  t->struct_size = sizeof(fa4_forward_tensors);
  t->q = t->k = t->v = t->out = empty_tensor();
  t->lse = empty_lse();
}

void fa4_backward_tensors_init(fa4_backward_tensors* t) {
  if (t == nullptr) return;
  t->struct_size = sizeof(fa4_backward_tensors);
  t->q = t->k = t->v = t->out = t->dout = t->dq = t->dk = t->dv = empty_tensor();
  t->lse = empty_lse();
}

fa4_status fa4_can_implement(const fa4_problem* problem, fa4_backend backend, fa4_pass pass) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  return record(fa4::can_implement(to_cpp(*problem), static_cast<fa4::Backend>(backend),
                                   static_cast<fa4::Pass>(pass)));
}

fa4_status fa4_workspace_size(const fa4_problem* problem, fa4_backend backend, fa4_pass pass,
                              size_t* bytes) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  return record(fa4::workspace_size(to_cpp(*problem), static_cast<fa4::Backend>(backend),
                                    static_cast<fa4::Pass>(pass), bytes));
}

fa4_status fa4_forward(const fa4_problem* problem, const fa4_forward_tensors* tensors,
                       void* workspace, size_t workspace_bytes, void* stream, fa4_backend backend) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  FA4_CHECK_STRUCT(tensors, "fa4_forward_tensors");
  fa4::ForwardTensors t;
  t.q = to_cpp(tensors->q);
  t.k = to_cpp(tensors->k);
  t.v = to_cpp(tensors->v);
  t.out = to_cpp(tensors->out);
  t.lse = to_cpp(tensors->lse);
  return record(fa4::forward(to_cpp(*problem), t, {workspace, workspace_bytes}, stream,
                             static_cast<fa4::Backend>(backend)));
}

fa4_status fa4_backward(const fa4_problem* problem, const fa4_backward_tensors* tensors,
                        void* workspace, size_t workspace_bytes, void* stream,
                        fa4_backend backend) {
  FA4_CHECK_STRUCT(problem, "fa4_problem");
  FA4_CHECK_STRUCT(tensors, "fa4_backward_tensors");
  fa4::BackwardTensors t;
  t.q = to_cpp(tensors->q);
  t.k = to_cpp(tensors->k);
  t.v = to_cpp(tensors->v);
  t.out = to_cpp(tensors->out);
  t.dout = to_cpp(tensors->dout);
  t.lse = to_cpp(tensors->lse);
  t.dq = to_cpp(tensors->dq);
  t.dk = to_cpp(tensors->dk);
  t.dv = to_cpp(tensors->dv);
  return record(fa4::backward(to_cpp(*problem), t, {workspace, workspace_bytes}, stream,
                              static_cast<fa4::Backend>(backend)));
}

const char* fa4_last_error_message(void) { return g_last_error.c_str(); }

const char* fa4_status_string(fa4_status status) {
  return fa4::to_string(static_cast<fa4::StatusCode>(status));
}

int fa4_abi_version(void) { return FA4_ABI_VERSION; }

const char* fa4_version(void) { return fa4::version(); }

}  // extern "C"
