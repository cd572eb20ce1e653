/* fa4cpp C ABI: exact scaled-dot-product attention for engines and other languages.
 *
 * Every struct starts with `struct_size`; fill it with sizeof(the struct) — the fa4_*_init functions
 * do that and set every default — so that later versions can append fields without breaking callers:
 * a struct_size of an earlier ABI version is accepted, the fields it lacks taking their defaults.
 * Every function returns an fa4_status; on failure fa4_last_error_message() (per thread) says why and
 * nothing was written to any output. Semantics are those of the C++ API (include/fa4/attention.hpp). */
#ifndef FA4_FA4_H_
#define FA4_FA4_H_

#include <stddef.h>
#include <stdint.h>

#include "fa4/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 2: fa4_problem gained the KV cache and num_splits, fa4_forward_tensors the appended rows and
 * rotary tables. 3: FP8 — the e4m3 dtype, fa4_problem's out_dtype and quantize_appends,
 * fa4_forward_tensors' descales; score variants — fa4_problem's ALiBi slopes and attention sinks,
 * fa4_backward_tensors' dsinks. 4: fa4_overrides' narrow. 5: fa4_overrides' unmasked. Structs of
 * earlier versions are still accepted. */
#define FA4_ABI_VERSION 5

typedef enum fa4_status {
  FA4_SUCCESS = 0,
  FA4_ERROR_INVALID_ARGUMENT = 1,
  FA4_ERROR_NOT_SUPPORTED = 2,
  FA4_ERROR_WORKSPACE_TOO_SMALL = 3,
  FA4_ERROR_BACKEND_UNAVAILABLE = 4,
  FA4_ERROR_DEVICE = 5,
  FA4_ERROR_INTERNAL = 6
} fa4_status;

/* E4M3: FP8 inputs of the forward (attention.hpp's DType::kE4M3), with descales and an output in
 * fa4_problem's out_dtype. */
typedef enum fa4_dtype {
  FA4_DTYPE_BF16 = 0,
  FA4_DTYPE_FP16 = 1,
  FA4_DTYPE_FP32 = 2,
  FA4_DTYPE_E4M3 = 3
} fa4_dtype;

typedef enum fa4_backend {
  FA4_BACKEND_AUTO = 0,
  FA4_BACKEND_CPU = 1,
  FA4_BACKEND_SM90 = 2
} fa4_backend;

typedef enum fa4_pass { FA4_PASS_FORWARD = 0, FA4_PASS_BACKWARD = 1 } fa4_pass;

typedef struct fa4_problem {
  uint32_t struct_size;
  int64_t batch, seqlen_q, seqlen_k; /* varlen: batch = #sequences, seqlen_* = max lengths */
  int64_t heads_q, heads_kv;
  int64_t head_dim_qk, head_dim_v;
  int32_t dtype;              /* fa4_dtype */
  int32_t causal;             /* 0 / 1 */
  int64_t window_left;        /* -1 = unbounded */
  int64_t window_right;       /* -1 = unbounded */
  float softcap;              /* 0 = off */
  float softmax_scale;        /* 0 = 1/sqrt(head_dim_qk) */
  const int32_t* cu_seqlens_q; /* non-null = varlen mode */
  const int32_t* cu_seqlens_k;
  int64_t total_q, total_k;   /* varlen: rows of the packed tensors */
  const int32_t* seqused_k;   /* optional */
  int32_t return_lse;
  int32_t deterministic;
  /* ABI version 2. The KV cache (attention.hpp's KvCache): paged k / v (page_table non-null),
   * the cache row of each batch entry, left pads, appended rows and their rotary embedding. */
  const int32_t* page_table;  /* (cache_batch, pages_per_seq), rows page_table_stride apart */
  int64_t page_table_stride, pages_per_seq, num_pages, page_size;
  const int32_t* cache_batch_idx; /* null: entry b uses cache row b */
  int64_t cache_batch;            /* 0: batch */
  const int32_t* cache_leftpad;   /* null: 0 */
  int64_t seqlen_new;             /* appended rows per sequence (the most, with cu_seqlens_new) */
  const int32_t* cu_seqlens_new;
  int64_t total_new;
  int64_t rotary_dim;             /* 0: none */
  int32_t rotary_interleaved;     /* 1: GPT-J pairs; 0: GPT-NeoX halves */
  int32_t reserved;               /* 0 */
  int64_t rotary_seqlen;
  int64_t num_splits;             /* 0: the library's choice, 1: none, n: at most n */
  /* ABI version 3. e4m3 inputs only (attention.hpp's Fp8): the output's dtype (BF16 or FP16, the
   * rotary tables' too), and whether appended rows come in that dtype, quantised on write. */
  int32_t out_dtype;        /* fa4_dtype; default BF16 */
  int32_t quantize_appends; /* 0 / 1 */
  /* ABI version 3, score variants (attention.hpp's AlibiSlopes and sinks): ALiBi slopes, fp32
   * (batch, heads_q) with these strides (null: none); attention sinks, fp32 (heads_q) (null:
   * none). */
  const float* alibi_slopes;
  int64_t alibi_batch_stride, alibi_head_stride;
  const float* sinks;
} fa4_problem;

/* A (batch, seq, head, dim) view — (total, head, dim) in varlen mode; strides in elements. */
typedef struct fa4_tensor {
  void* data;
  int64_t batch_stride, seq_stride, head_stride, dim_stride;
} fa4_tensor;

/* fp32 log-sum-exp: (batch, heads_q, seqlen_q), or (heads_q, total_q) in varlen mode. */
typedef struct fa4_lse {
  float* data;
  int64_t batch_stride, head_stride, seq_stride;
} fa4_lse;

/* fp32 descales of e4m3 inputs, (batch, heads_kv); null data: 1. */
typedef struct fa4_descale {
  const float* data;
  int64_t batch_stride, head_stride;
} fa4_descale;

typedef struct fa4_forward_tensors {
  uint32_t struct_size;
  fa4_tensor q, k, v, out;
  fa4_lse lse;
  /* ABI version 2: the KV cache's appended rows and rotary tables ((rotary_seqlen, rotary_dim / 2)
   * in the problem's dtype, rows rotary_stride elements apart). */
  fa4_tensor k_new, v_new;
  const void* rotary_cos;
  const void* rotary_sin;
  int64_t rotary_stride;
  /* ABI version 3: descales of e4m3 q, k, v. */
  fa4_descale q_descale, k_descale, v_descale;
} fa4_forward_tensors;

typedef struct fa4_backward_tensors {
  uint32_t struct_size;
  fa4_tensor q, k, v, out, dout;
  fa4_lse lse;
  fa4_tensor dq, dk, dv;
  /* ABI version 3: the sinks' gradient, fp32 (heads_q); null: not computed. */
  float* dsinks;
} fa4_backward_tensors;

FA4_API void fa4_problem_init(fa4_problem* problem);
FA4_API void fa4_forward_tensors_init(fa4_forward_tensors* tensors);
FA4_API void fa4_backward_tensors_init(fa4_backward_tensors* tensors);

FA4_API fa4_status fa4_can_implement(const fa4_problem* problem, fa4_backend backend, fa4_pass pass);
FA4_API fa4_status fa4_workspace_size(const fa4_problem* problem, fa4_backend backend, fa4_pass pass,
                                      size_t* bytes);
/* stream: a cudaStream_t for the GPU backend, ignored by the CPU backend. */
FA4_API fa4_status fa4_forward(const fa4_problem* problem, const fa4_forward_tensors* tensors,
                               void* workspace, size_t workspace_bytes, void* stream,
                               fa4_backend backend);
FA4_API fa4_status fa4_backward(const fa4_problem* problem, const fa4_backward_tensors* tensors,
                                void* workspace, size_t workspace_bytes, void* stream,
                                fa4_backend backend);

/* Launch-plan overrides, for tools and tests (include/fa4/overrides.hpp is the C++ form): each
 * field at its fa4_overrides_init default leaves that choice to the library. Choices are -1 (the
 * library's), 0 (off) or 1 (on); counts 0 are the library's. A null overrides pointer is the
 * defaults. Nothing in the library reads the environment but fa4_overrides_from_env. */
typedef struct fa4_overrides {
  uint32_t struct_size;
  int32_t persistent;      /* sm90 forward: persistent CTAs (1) or one CTA per tile (0) */
  int32_t persistent_ctas; /* > 0: that many persistent CTAs */
  int32_t zigzag_group;    /* > 0: the persistent zig-zag numbered in groups of this many pairs */
  int32_t pack_gqa;        /* the query heads of a kv head share a query tile */
  int32_t splits;          /* > 0: each tile's keys split this many ways (1: never split) */
  int32_t longest_first;   /* a varlen batch's tiles ordered longest-first */
  int32_t chunked_kv;      /* the chunked kernel, where the head dims have one */
  int32_t bwd_group;       /* sm90 backward: > 0, CTAs of this many (head, batch) pairs together */
  int32_t bwd_rotate;      /* 0: key tiles walk the query tiles from the first */
  int32_t bwd_pairs;       /* 0: no key-tile pairs */
  int32_t cpu_threads;     /* CPU backend: > 0, this many threads */
  int32_t narrow;          /* version 4: the narrow (one consumer warpgroup) forward kernel */
  int32_t unmasked;        /* version 5: the unmasked (wider key tiles) forward kernel */
} fa4_overrides;

FA4_API void fa4_overrides_init(fa4_overrides* overrides);
/* The FA4_SM90_* / FA4_CPU_THREADS environment variables as overrides (see overrides.hpp). */
FA4_API fa4_status fa4_overrides_from_env(fa4_overrides* overrides);
FA4_API fa4_status fa4_workspace_size_with_overrides(const fa4_problem* problem,
                                                     fa4_backend backend, fa4_pass pass,
                                                     const fa4_overrides* overrides,
                                                     size_t* bytes);
FA4_API fa4_status fa4_forward_with_overrides(const fa4_problem* problem,
                                              const fa4_forward_tensors* tensors, void* workspace,
                                              size_t workspace_bytes, void* stream,
                                              fa4_backend backend, const fa4_overrides* overrides);
FA4_API fa4_status fa4_backward_with_overrides(const fa4_problem* problem,
                                               const fa4_backward_tensors* tensors,
                                               void* workspace, size_t workspace_bytes,
                                               void* stream, fa4_backend backend,
                                               const fa4_overrides* overrides);

/* The message of this thread's last failed call ("" when the last call succeeded). */
FA4_API const char* fa4_last_error_message(void);
FA4_API const char* fa4_status_string(fa4_status status);
FA4_API int fa4_abi_version(void);
FA4_API const char* fa4_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FA4_FA4_H_ */
