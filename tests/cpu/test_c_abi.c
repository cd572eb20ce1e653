/* The C ABI as a C program sees it: struct initialisers, a forward checked against a naive
 * attention, a backward, and the error paths. Prints one line per check and "N passed, M failed"
 * at the end; exits non-zero on any failure. */
#define _POSIX_C_SOURCE 200112L /* setenv, unsetenv */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa4/fa4.h"

enum {
  kBatch = 2,
  kSeqQ = 3,
  kSeqK = 5,
  kHeadsQ = 4,
  kHeadsKV = 2,
  kDimQK = 8,
  kDimV = 6
};

/* fp32 accumulation over at most kSeqK · kDimQK terms of size ≤ 1 stays well inside this. */
static const double kTolerance = 1e-5;
static const unsigned char kPoisonByte = 0xA5;

static int g_passed = 0;
static int g_failed = 0;

static void check(int ok, const char* what) {
  printf("%s: %s\n", ok ? "PASS" : "FAIL", what);
  if (ok)
    ++g_passed;
  else
    ++g_failed;
}

/* Deterministic values in [-1, 1]. */
static void fill(float* x, size_t n, uint32_t seed) {
  size_t i;
  uint32_t state = seed;
  for (i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    x[i] = (float)(state >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
  }
}

static int all_finite(const float* x, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i)
    if (!isfinite(x[i])) return 0;
  return 1;
}

static int all_bytes(const void* p, size_t n, unsigned char byte) {
  const unsigned char* b = (const unsigned char*)p;
  size_t i;
  for (i = 0; i < n; ++i)
    if (b[i] != byte) return 0;
  return 1;
}

/* Contiguous (batch, seq, heads, dim). */
static fa4_tensor view(void* data, int64_t seq, int64_t heads, int64_t dim) {
  fa4_tensor t;
  t.data = data;
  t.dim_stride = 1;
  t.head_stride = dim;
  t.seq_stride = heads * dim;
  t.batch_stride = seq * heads * dim;
  return t;
}

static float q[kBatch * kSeqQ * kHeadsQ * kDimQK];
static float k[kBatch * kSeqK * kHeadsKV * kDimQK];
static float v[kBatch * kSeqK * kHeadsKV * kDimV];
static float out[kBatch * kSeqQ * kHeadsQ * kDimV];
static float lse[kBatch * kHeadsQ * kSeqQ];
static float dout[kBatch * kSeqQ * kHeadsQ * kDimV];
static float dq[kBatch * kSeqQ * kHeadsQ * kDimQK];
static float dk[kBatch * kSeqK * kHeadsKV * kDimQK];
static float dv[kBatch * kSeqK * kHeadsKV * kDimV];

/* Naive causal GQA attention in double, bottom-right aligned (query i sees keys j ≤ i + sk − sq).
 * Returns the largest relative error of out and lse against it (NaN if any is NaN). */
static double naive_attention_error(double scale) {
  double worst = 0.0;
  int b, h, i, j, d;
  const int group = kHeadsQ / kHeadsKV;
  for (b = 0; b < kBatch; ++b)
    for (h = 0; h < kHeadsQ; ++h)
      for (i = 0; i < kSeqQ; ++i) {
        const int kvh = h / group;
        const int last_key = i + kSeqK - kSeqQ;
        const float* qi = &q[((b * kSeqQ + i) * kHeadsQ + h) * kDimQK];
        double s[kSeqK], max_s = -INFINITY, sum = 0.0, o[kDimV] = {0};
        for (j = 0; j <= last_key; ++j) {
          const float* kj = &k[((b * kSeqK + j) * kHeadsKV + kvh) * kDimQK];
          double dot = 0.0;
          for (d = 0; d < kDimQK; ++d) dot += (double)qi[d] * kj[d];
          s[j] = dot * scale;
          if (s[j] > max_s) max_s = s[j];
        }
        for (j = 0; j <= last_key; ++j) {
          const float* vj = &v[((b * kSeqK + j) * kHeadsKV + kvh) * kDimV];
          const double p = exp(s[j] - max_s);
          sum += p;
          for (d = 0; d < kDimV; ++d) o[d] += p * vj[d];
        }
        for (d = 0; d < kDimV; ++d) {
          const double got = out[((b * kSeqQ + i) * kHeadsQ + h) * kDimV + d];
          const double err = fabs(got - o[d] / sum) / (1.0 + fabs(o[d] / sum));
          if (isnan(err)) return err;
          if (err > worst) worst = err;
        }
        {
          const double want = max_s + log(sum);
          const double got = lse[(b * kHeadsQ + h) * kSeqQ + i];
          const double err = fabs(got - want) / (1.0 + fabs(want));
          if (isnan(err)) return err;
          if (err > worst) worst = err;
        }
      }
  return worst;
}

static void small_problem(fa4_problem* p) {
  fa4_problem_init(p);
  p->batch = kBatch;
  p->seqlen_q = kSeqQ;
  p->seqlen_k = kSeqK;
  p->heads_q = kHeadsQ;
  p->heads_kv = kHeadsKV;
  p->head_dim_qk = kDimQK;
  p->head_dim_v = kDimV;
  p->dtype = FA4_DTYPE_FP32;
  p->causal = 1;
  p->return_lse = 1;
}

static void forward_views(fa4_forward_tensors* t) {
  fa4_forward_tensors_init(t);
  t->q = view(q, kSeqQ, kHeadsQ, kDimQK);
  t->k = view(k, kSeqK, kHeadsKV, kDimQK);
  t->v = view(v, kSeqK, kHeadsKV, kDimV);
  t->out = view(out, kSeqQ, kHeadsQ, kDimV);
  t->lse.data = lse;
  t->lse.batch_stride = kHeadsQ * kSeqQ;
  t->lse.head_stride = kSeqQ;
  t->lse.seq_stride = 1;
}

static void test_init_defaults(void) {
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_backward_tensors bw;
  const fa4_tensor* views[8];
  int i, all_empty = 1;

  /* Garbage first, so that only what init sets can pass. */
  memset(&p, 0x5A, sizeof p);
  fa4_problem_init(&p);
  check(p.struct_size == sizeof(fa4_problem), "fa4_problem_init sets struct_size");
  check(p.window_left == -1 && p.window_right == -1, "fa4_problem_init: window -1 / -1");
  check(p.dtype == FA4_DTYPE_BF16, "fa4_problem_init: dtype bf16");
  check(p.batch == 0 && p.seqlen_q == 0 && p.seqlen_k == 0 && p.heads_q == 0 && p.heads_kv == 0 &&
            p.head_dim_qk == 0 && p.head_dim_v == 0,
        "fa4_problem_init: sizes 0");
  check(p.causal == 0 && p.softcap == 0.0f && p.softmax_scale == 0.0f && p.return_lse == 0 &&
            p.deterministic == 0,
        "fa4_problem_init: no causal, softcap off, default scale, no lse, not deterministic");
  check(p.cu_seqlens_q == NULL && p.cu_seqlens_k == NULL && p.seqused_k == NULL && p.total_q == 0 &&
            p.total_k == 0,
        "fa4_problem_init: not varlen, no seqused_k");

  memset(&f, 0x5A, sizeof f);
  fa4_forward_tensors_init(&f);
  check(f.struct_size == sizeof(fa4_forward_tensors), "fa4_forward_tensors_init sets struct_size");
  views[0] = &f.q;
  views[1] = &f.k;
  views[2] = &f.v;
  views[3] = &f.out;
  for (i = 0; i < 4; ++i)
    if (views[i]->data != NULL || views[i]->dim_stride != 1) all_empty = 0;
  check(all_empty && f.lse.data == NULL && f.lse.seq_stride == 1,
        "fa4_forward_tensors_init: null data, dim_stride 1, lse seq_stride 1");

  memset(&bw, 0x5A, sizeof bw);
  fa4_backward_tensors_init(&bw);
  check(bw.struct_size == sizeof(fa4_backward_tensors),
        "fa4_backward_tensors_init sets struct_size");
  views[0] = &bw.q;
  views[1] = &bw.k;
  views[2] = &bw.v;
  views[3] = &bw.out;
  views[4] = &bw.dout;
  views[5] = &bw.dq;
  views[6] = &bw.dk;
  views[7] = &bw.dv;
  all_empty = 1;
  for (i = 0; i < 8; ++i)
    if (views[i]->data != NULL || views[i]->dim_stride != 1) all_empty = 0;
  check(all_empty && bw.lse.data == NULL && bw.lse.seq_stride == 1,
        "fa4_backward_tensors_init: null data, dim_stride 1, lse seq_stride 1");
}

static void test_versions(void) {
  const char* version = fa4_version();
  check(fa4_abi_version() == FA4_ABI_VERSION, "fa4_abi_version() == FA4_ABI_VERSION");
  check(version != NULL && version[0] != '\0', "fa4_version() is a non-empty string");
}

static void test_forward_and_backward(void) {
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_backward_tensors bw;
  fa4_status s;
  size_t bytes = (size_t)-1;
  void* workspace;
  const size_t n_out = sizeof out / sizeof out[0], n_lse = sizeof lse / sizeof lse[0];
  size_t i;

  fill(q, sizeof q / sizeof q[0], 1u);
  fill(k, sizeof k / sizeof k[0], 2u);
  fill(v, sizeof v / sizeof v[0], 3u);
  fill(dout, sizeof dout / sizeof dout[0], 4u);
  for (i = 0; i < n_out; ++i) out[i] = NAN;
  for (i = 0; i < n_lse; ++i) lse[i] = NAN;

  small_problem(&p);
  forward_views(&f);
  check(fa4_can_implement(&p, FA4_BACKEND_CPU, FA4_PASS_FORWARD) == FA4_SUCCESS,
        "fa4_can_implement: fp32 causal GQA forward on the CPU");
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "fa4_forward (fp32, CPU, with lse) succeeds");
  if (s != FA4_SUCCESS) printf("  message: %s\n", fa4_last_error_message());
  check(fa4_last_error_message()[0] == '\0', "fa4_last_error_message() is empty after a success");
  check(all_finite(out, n_out) && all_finite(lse, n_lse),
        "forward wrote every out and lse element");
  {
    const double err = naive_attention_error(1.0 / sqrt((double)kDimQK));
    char line[128];
    snprintf(line, sizeof line, "forward matches the naive attention (max rel. error %.2e)", err);
    check(err <= kTolerance, line);
  }

  s = fa4_workspace_size(&p, FA4_BACKEND_CPU, FA4_PASS_BACKWARD, &bytes);
  check(s == FA4_SUCCESS && bytes != (size_t)-1, "fa4_workspace_size for the backward");
  workspace = malloc(bytes > 0 ? bytes : 1);
  fa4_backward_tensors_init(&bw);
  bw.q = f.q;
  bw.k = f.k;
  bw.v = f.v;
  bw.out = f.out;
  bw.lse = f.lse;
  bw.dout = view(dout, kSeqQ, kHeadsQ, kDimV);
  bw.dq = view(dq, kSeqQ, kHeadsQ, kDimQK);
  bw.dk = view(dk, kSeqK, kHeadsKV, kDimQK);
  bw.dv = view(dv, kSeqK, kHeadsKV, kDimV);
  for (i = 0; i < sizeof dq / sizeof dq[0]; ++i) dq[i] = NAN;
  for (i = 0; i < sizeof dk / sizeof dk[0]; ++i) dk[i] = NAN;
  for (i = 0; i < sizeof dv / sizeof dv[0]; ++i) dv[i] = NAN;
  s = fa4_backward(&p, &bw, workspace, bytes, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "fa4_backward (fp32, CPU) succeeds");
  if (s != FA4_SUCCESS) printf("  message: %s\n", fa4_last_error_message());
  check(all_finite(dq, sizeof dq / sizeof dq[0]), "backward: dq finite");
  check(all_finite(dk, sizeof dk / sizeof dk[0]) && all_finite(dv, sizeof dv / sizeof dv[0]),
        "backward: dk, dv finite");
  if (bytes > 0) {
    s = fa4_backward(&p, &bw, workspace, bytes - 1, NULL, FA4_BACKEND_CPU);
    check(s == FA4_ERROR_WORKSPACE_TOO_SMALL,
          "fa4_backward with one byte too few: workspace too small");
  }
  free(workspace);
}

static void test_errors(void) {
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_status s;
  size_t bytes = 12345;

  small_problem(&p);
  forward_views(&f);
  memset(out, kPoisonByte, sizeof out);
  memset(lse, kPoisonByte, sizeof lse);

  p.struct_size = (uint32_t)sizeof(fa4_problem) - 4u; /* no version's size */
  s = fa4_can_implement(&p, FA4_BACKEND_CPU, FA4_PASS_FORWARD);
  check(s == FA4_ERROR_INVALID_ARGUMENT, "fa4_problem with a wrong struct_size: invalid argument");
  check(fa4_last_error_message()[0] != '\0', "... and fa4_last_error_message() says why");
  s = fa4_workspace_size(&p, FA4_BACKEND_CPU, FA4_PASS_FORWARD, &bytes);
  check(s == FA4_ERROR_INVALID_ARGUMENT && bytes == 12345,
        "fa4_workspace_size with a wrong struct_size fails and leaves the result");
  small_problem(&p);

  f.struct_size = 0;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_ERROR_INVALID_ARGUMENT && fa4_last_error_message()[0] != '\0',
        "fa4_forward_tensors with struct_size 0: invalid argument with a message");
  check(all_bytes(out, sizeof out, kPoisonByte) && all_bytes(lse, sizeof lse, kPoisonByte),
        "... and nothing was written");
  forward_views(&f);

  s = fa4_forward(NULL, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_ERROR_INVALID_ARGUMENT, "fa4_forward with a null problem: invalid argument");

  p.heads_kv = 3;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_ERROR_INVALID_ARGUMENT, "heads_q 4 on heads_kv 3: invalid argument");
  check(strstr(fa4_last_error_message(), "heads_kv") != NULL, "... and the message names heads_kv");
  check(all_bytes(out, sizeof out, kPoisonByte) && all_bytes(lse, sizeof lse, kPoisonByte),
        "... and nothing was written");
  small_problem(&p);

  s = fa4_can_implement(&p, (fa4_backend)7, FA4_PASS_FORWARD);
  check(s == FA4_ERROR_INVALID_ARGUMENT, "an unknown backend: invalid argument");
  s = fa4_can_implement(&p, FA4_BACKEND_CPU, FA4_PASS_FORWARD);
  check(s == FA4_SUCCESS && fa4_last_error_message()[0] == '\0',
        "a success after a failure clears fa4_last_error_message()");

  {
    const fa4_status codes[] = {FA4_SUCCESS,
                                FA4_ERROR_INVALID_ARGUMENT,
                                FA4_ERROR_NOT_SUPPORTED,
                                FA4_ERROR_WORKSPACE_TOO_SMALL,
                                FA4_ERROR_BACKEND_UNAVAILABLE,
                                FA4_ERROR_DEVICE,
                                FA4_ERROR_INTERNAL};
    const size_t n = sizeof codes / sizeof codes[0];
    size_t i, j;
    int distinct = 1;
    for (i = 0; i < n; ++i) {
      const char* a = fa4_status_string(codes[i]);
      if (a == NULL || a[0] == '\0') distinct = 0;
      for (j = 0; distinct && j < i; ++j)
        if (strcmp(a, fa4_status_string(codes[j])) == 0) distinct = 0;
    }
    check(distinct, "fa4_status_string: a distinct non-empty name for every status");
  }
}

/* Overrides: defaults from fa4_overrides_init, the environment reader, the forward with them on
 * the CPU (its thread count), and the refusals, nothing written. */
static void test_overrides(void) {
  fa4_overrides o;
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_status s;
  size_t bytes = 12345;
  size_t i;

  fa4_overrides_init(&o);
  check(o.struct_size == sizeof(fa4_overrides) && o.persistent == -1 && o.pack_gqa == -1 &&
            o.longest_first == -1 && o.chunked_kv == -1 && o.bwd_rotate == -1 &&
            o.bwd_pairs == -1 && o.persistent_ctas == 0 && o.zigzag_group == 0 &&
            o.splits == 0 && o.bwd_group == 0 && o.cpu_threads == 0 && o.narrow == -1 &&
            o.unmasked == -1,
        "fa4_overrides_init: every choice the library's");

  setenv("FA4_SM90_SCHEDULE", "per_tile", 1);
  setenv("FA4_SM90_SPLITS", "3", 1);
  setenv("FA4_CPU_THREADS", "2", 1);
  s = fa4_overrides_from_env(&o);
  check(s == FA4_SUCCESS && o.persistent == 0 && o.splits == 3 && o.cpu_threads == 2 &&
            o.pack_gqa == -1,
        "fa4_overrides_from_env reads FA4_SM90_SCHEDULE, FA4_SM90_SPLITS, FA4_CPU_THREADS");
  setenv("FA4_SM90_PACK_GQA", "yes", 1);
  s = fa4_overrides_from_env(&o);
  check(s == FA4_ERROR_INVALID_ARGUMENT && strstr(fa4_last_error_message(), "FA4_SM90_PACK_GQA"),
        "an invalid value: invalid argument naming the variable");
  check(o.persistent == 0 && o.splits == 3, "... and the overrides are left as they were");
  unsetenv("FA4_SM90_PACK_GQA");
  unsetenv("FA4_SM90_SCHEDULE");
  unsetenv("FA4_SM90_SPLITS");
  unsetenv("FA4_CPU_THREADS");

  small_problem(&p);
  forward_views(&f);
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) out[i] = NAN;
  fa4_overrides_init(&o);
  o.cpu_threads = 1;
  s = fa4_forward_with_overrides(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU, &o);
  check(s == FA4_SUCCESS && all_finite(out, sizeof out / sizeof out[0]),
        "fa4_forward_with_overrides on one CPU thread");
  check(naive_attention_error(1.0 / sqrt((double)kDimQK)) <= kTolerance,
        "... matches the naive attention");
  s = fa4_workspace_size_with_overrides(&p, FA4_BACKEND_CPU, FA4_PASS_FORWARD, NULL, &bytes);
  check(s == FA4_SUCCESS && bytes == 0, "null overrides: the defaults");

  memset(out, kPoisonByte, sizeof out);
  memset(lse, kPoisonByte, sizeof lse);
  o.pack_gqa = 2;
  s = fa4_forward_with_overrides(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU, &o);
  check(s == FA4_ERROR_INVALID_ARGUMENT && strstr(fa4_last_error_message(), "pack_gqa"),
        "a choice outside -1 / 0 / 1: invalid argument naming it");
  o.pack_gqa = -1;
  o.splits = -4;
  s = fa4_forward_with_overrides(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU, &o);
  check(s == FA4_ERROR_INVALID_ARGUMENT && strstr(fa4_last_error_message(), "splits"),
        "a negative count: invalid argument naming it");
  o.splits = 0;
  /* A struct of an earlier version (3: no narrow, 4: no unmasked) is read as far as it reaches,
   * and filled as far. */
  {
    static const struct {
      size_t lacked; /* the offset of the first field it lacks: its size */
      const char *var, *value, *accepted;
    } earlier[] = {
        {offsetof(fa4_overrides, narrow), "FA4_SM90_NARROW", "on",
         "fa4_overrides of ABI version 3: accepted, the field it lacks unread"},
        {offsetof(fa4_overrides, unmasked), "FA4_SM90_UNMASKED", "off",
         "fa4_overrides of ABI version 4: accepted, the field it lacks unread"}};
    for (i = 0; i < sizeof earlier / sizeof earlier[0]; ++i) {
      int32_t* lacked = (int32_t*)((char*)&o + earlier[i].lacked);
      fa4_overrides_init(&o);
      o.struct_size = (uint32_t)earlier[i].lacked;
      *lacked = 7;
      s = fa4_forward_with_overrides(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU, &o);
      check(s == FA4_SUCCESS, earlier[i].accepted);
      setenv(earlier[i].var, earlier[i].value, 1);
      s = fa4_overrides_from_env(&o);
      check(s == FA4_SUCCESS && *lacked == 7 && o.struct_size == earlier[i].lacked,
            "... and fa4_overrides_from_env writes nothing past it");
      unsetenv(earlier[i].var);
    }
  }
  memset(out, kPoisonByte, sizeof out);
  memset(lse, kPoisonByte, sizeof lse);
  o.struct_size = 4;
  s = fa4_forward_with_overrides(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU, &o);
  check(s == FA4_ERROR_INVALID_ARGUMENT,
        "fa4_overrides with a wrong struct_size: invalid argument");
  check(all_bytes(out, sizeof out, kPoisonByte) && all_bytes(lse, sizeof lse, kPoisonByte),
        "... and nothing was written");
}

/* ABI version 2's KV cache through C: the small problem with its keys and values in pages of one
 * row, in reverse order, computes the very output of the contiguous one; and a caller of ABI
 * version 1 (its struct sizes) is served with the defaults of the fields it does not know. */
static void test_kv_cache_and_versions(void) {
  enum { kPages = kBatch * kSeqK };
  static float k_pages[kPages * kHeadsKV * kDimQK], v_pages[kPages * kHeadsKV * kDimV];
  static float out_plain[sizeof out / sizeof out[0]];
  int32_t table[kBatch * kSeqK];
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_status s;
  size_t i;
  int b, r, same = 1;

  fill(q, sizeof q / sizeof q[0], 5u);
  fill(k, sizeof k / sizeof k[0], 6u);
  fill(v, sizeof v / sizeof v[0], 7u);
  small_problem(&p);
  forward_views(&f);
  check(p.page_table == NULL && p.num_splits == 0 && p.rotary_dim == 0 && f.k_new.data == NULL &&
            f.k_new.dim_stride == 1 && f.rotary_cos == NULL,
        "fa4_problem_init / fa4_forward_tensors_init: no KV cache, no splits bound");
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "the contiguous forward");
  memcpy(out_plain, out, sizeof out);

  /* Key row r of sequence b in page kPages - 1 - (b * kSeqK + r). */
  for (b = 0; b < kBatch; ++b)
    for (r = 0; r < kSeqK; ++r) {
      const int page = kPages - 1 - (b * kSeqK + r);
      table[b * kSeqK + r] = page;
      memcpy(&k_pages[page * kHeadsKV * kDimQK], &k[(b * kSeqK + r) * kHeadsKV * kDimQK],
             sizeof(float) * kHeadsKV * kDimQK);
      memcpy(&v_pages[page * kHeadsKV * kDimV], &v[(b * kSeqK + r) * kHeadsKV * kDimV],
             sizeof(float) * kHeadsKV * kDimV);
    }
  p.page_table = table;
  p.page_table_stride = kSeqK;
  p.pages_per_seq = kSeqK;
  p.num_pages = kPages;
  p.page_size = 1;
  f.k = view(k_pages, 1, kHeadsKV, kDimQK);
  f.v = view(v_pages, 1, kHeadsKV, kDimV);
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) out[i] = NAN;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "the paged forward (pages of one row, in reverse order)");
  if (s != FA4_SUCCESS) printf("  message: %s\n", fa4_last_error_message());
  for (i = 0; i < sizeof out / sizeof out[0]; ++i)
    if (memcmp(&out[i], &out_plain[i], sizeof(float)) != 0) same = 0;
  check(same, "... computes the contiguous forward's output bit for bit");

  p.page_size = 0;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_ERROR_INVALID_ARGUMENT && strstr(fa4_last_error_message(), "page_size"),
        "a page table with page_size 0: invalid argument naming it");

  /* A version-1 caller: the structs end before the KV cache. */
  small_problem(&p);
  forward_views(&f);
  p.struct_size = (uint32_t)offsetof(fa4_problem, page_table);
  f.struct_size = (uint32_t)offsetof(fa4_forward_tensors, k_new);
  /* Whatever lies past a version-1 struct is not read. */
  p.page_table = table;
  p.page_size = -5;
  f.k_new.data = k_pages;
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) out[i] = NAN;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "structs of ABI version 1 are accepted");
  same = 1;
  for (i = 0; i < sizeof out / sizeof out[0]; ++i)
    if (memcmp(&out[i], &out_plain[i], sizeof(float)) != 0) same = 0;
  check(same, "... with the fields they lack at their defaults");
}

/* The value of an e4m3 byte with an exponent field in [1, 14] (normal, finite). */
static float e4m3_value(uint8_t b) {
  const int exp = (b >> 3) & 0xf, man = b & 7;
  const float mag = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
  return (b & 0x80) ? -mag : mag;
}

static float bf16_value(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* e4m3 inputs with descales per (batch, kv head): the forward of the dequantised values in fp32,
 * rounded to bf16 (ABI version 3); and a version-2 fa4_problem, which lacks out_dtype, takes
 * bf16. */
static void test_fp8(void) {
  static uint8_t q8[sizeof q / sizeof q[0]], k8[sizeof k / sizeof k[0]], v8[sizeof v / sizeof v[0]];
  static uint16_t out8[sizeof out / sizeof out[0]];
  static float out_fp32[sizeof out / sizeof out[0]], lse_fp32[sizeof lse / sizeof lse[0]];
  float descales[3][kBatch * kHeadsKV];
  uint8_t* bytes[3] = {q8, k8, v8};
  float* deq[3] = {q, k, v};
  const size_t sizes[3] = {sizeof q8, sizeof k8, sizeof v8};
  const int heads[3] = {kHeadsQ, kHeadsKV, kHeadsKV};
  const int dims[3] = {kDimQK, kDimQK, kDimV};
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_status s;
  size_t i;
  int t, worst_ok = 1;
  uint32_t state = 12345u;
  fill(&descales[0][0], sizeof descales / sizeof(float), 99u);
  for (t = 0; t < 3; ++t)
    for (i = 0; i < (size_t)(kBatch * kHeadsKV); ++i)
      descales[t][i] = 0.75f + 0.5f * descales[t][i];
  /* Random bytes with exponent fields 4 to 9 (values 2^-3 to 2^3 in magnitude), dequantised with
   * the descale of their batch entry and kv head. */
  for (t = 0; t < 3; ++t)
    for (i = 0; i < sizes[t]; ++i) {
      const size_t row = i / (size_t)dims[t], head = row % (size_t)heads[t];
      const size_t batch = i / (sizes[t] / kBatch);
      const size_t kv_head = head / (size_t)(heads[t] / kHeadsKV);
      state = state * 1664525u + 1013904223u;
      bytes[t][i] = (uint8_t)(((state >> 24) & 0x80u) | ((4u + (state >> 8) % 6u) << 3) |
                              ((state >> 16) & 7u));
      deq[t][i] = e4m3_value(bytes[t][i]) * descales[t][batch * kHeadsKV + kv_head];
    }
  small_problem(&p);
  forward_views(&f);
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "fp32 forward of the dequantised inputs");
  memcpy(out_fp32, out, sizeof out);
  memcpy(lse_fp32, lse, sizeof lse);

  p.dtype = FA4_DTYPE_E4M3;
  f.q.data = q8;
  f.k.data = k8;
  f.v.data = v8;
  f.out.data = out8;
  f.q_descale.data = descales[0];
  f.k_descale.data = descales[1];
  f.v_descale.data = descales[2];
  f.q_descale.batch_stride = f.k_descale.batch_stride = f.v_descale.batch_stride = kHeadsKV;
  f.q_descale.head_stride = f.k_descale.head_stride = f.v_descale.head_stride = 1;
  memset(out8, 0xff, sizeof out8);
  memset(lse, kPoisonByte, sizeof lse);
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "e4m3 forward with descales");
  if (s != FA4_SUCCESS) printf("  message: %s\n", fa4_last_error_message());
  for (i = 0; i < sizeof out8 / sizeof out8[0]; ++i) {
    const double got = bf16_value(out8[i]), want = out_fp32[i];
    if (!(fabs(got - want) <= 0x1p-8 * fabs(want) + 1e-6)) worst_ok = 0;
  }
  for (i = 0; i < sizeof lse / sizeof lse[0]; ++i)
    if (!(fabs((double)lse[i] - lse_fp32[i]) <= 1e-5 * (1.0 + fabs(lse_fp32[i])))) worst_ok = 0;
  check(worst_ok, "... equals the dequantised fp32 forward to within bf16's rounding");

  f.v_descale.data = NULL;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  worst_ok = 1;
  for (i = 0; i < sizeof out8 / sizeof out8[0]; ++i) {
    const double got = bf16_value(out8[i]), want = out_fp32[i];
    if (!(fabs(got - want) <= 0x1p-8 * fabs(want) + 1e-6)) worst_ok = 0;
  }
  check(s == FA4_SUCCESS && !worst_ok, "... and a missing v_descale changes the output");
  f.v_descale.data = descales[2];

  p.out_dtype = FA4_DTYPE_FP32;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_ERROR_INVALID_ARGUMENT && strstr(fa4_last_error_message(), "out_dtype"),
        "e4m3 with an fp32 output: invalid argument naming out_dtype");
  p.out_dtype = FA4_DTYPE_BF16;
  s = fa4_can_implement(&p, FA4_BACKEND_CPU, FA4_PASS_BACKWARD);
  check(s == FA4_ERROR_NOT_SUPPORTED && strstr(fa4_last_error_message(), "e4m3"),
        "e4m3 backward: not supported, naming e4m3");

  p.struct_size = (uint32_t)offsetof(fa4_problem, out_dtype);
  p.out_dtype = 77; /* past a version-2 struct: not read */
  memset(out8, 0xff, sizeof out8);
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS && out8[0] != 0xffff, "a version-2 fa4_problem with e4m3 gives bf16");
  small_problem(&p);
  forward_views(&f);
}

/* Score variants through C (ABI version 3): a sink of −1e30 and ALiBi slopes of 0 change no bit;
 * a sink of 100 takes every row's weight (O ≈ 0, LSE ≈ 100); the backward fills dsinks; and a
 * version-2 fa4_backward_tensors, which has no dsinks, is accepted. */
static void test_score_variants(void) {
  static float out_plain[sizeof out / sizeof out[0]];
  float sinks[kHeadsQ], dsinks[kHeadsQ], slopes[kHeadsQ];
  fa4_problem p;
  fa4_forward_tensors f;
  fa4_backward_tensors b;
  fa4_status s;
  size_t i, bytes = 0;
  int same = 1, sunk = 1;
  void* ws;
  fill(q, sizeof q / sizeof q[0], 11u);
  fill(k, sizeof k / sizeof k[0], 12u);
  fill(v, sizeof v / sizeof v[0], 13u);
  small_problem(&p);
  forward_views(&f);
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  memcpy(out_plain, out, sizeof out);
  for (i = 0; i < kHeadsQ; ++i) {
    sinks[i] = -1e30f;
    slopes[i] = 0.0f;
  }
  p.sinks = sinks;
  p.alibi_slopes = slopes;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  for (i = 0; i < sizeof out / sizeof out[0]; ++i)
    if (memcmp(&out[i], &out_plain[i], sizeof(float)) != 0) same = 0;
  check(s == FA4_SUCCESS && same, "a sink of -1e30 and ALiBi slopes of 0 change no bit");
  for (i = 0; i < kHeadsQ; ++i) sinks[i] = 100.0f;
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  for (i = 0; i < sizeof out / sizeof out[0]; ++i)
    if (!(fabs(out[i]) < 1e-20)) sunk = 0;
  for (i = 0; i < sizeof lse / sizeof lse[0]; ++i)
    if (!(fabs(lse[i] - 100.0) < 1e-4)) sunk = 0;
  check(s == FA4_SUCCESS && sunk, "a sink of 100 takes every row's weight");

  for (i = 0; i < kHeadsQ; ++i) {
    sinks[i] = 0.5f * (float)i;
    dsinks[i] = NAN;
  }
  s = fa4_forward(&p, &f, NULL, 0, NULL, FA4_BACKEND_CPU);
  fa4_backward_tensors_init(&b);
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.out = f.out;
  b.lse = f.lse;
  fill(dout, sizeof dout / sizeof dout[0], 14u);
  b.dout = view(dout, kSeqQ, kHeadsQ, kDimV);
  b.dq = view(dq, kSeqQ, kHeadsQ, kDimQK);
  b.dk = view(dk, kSeqK, kHeadsKV, kDimQK);
  b.dv = view(dv, kSeqK, kHeadsKV, kDimV);
  b.dsinks = dsinks;
  fa4_workspace_size(&p, FA4_BACKEND_CPU, FA4_PASS_BACKWARD, &bytes);
  ws = malloc(bytes + 256);
  s = fa4_backward(&p, &b, (void*)(((uintptr_t)ws + 255) & ~(uintptr_t)255), bytes, NULL,
                   FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS && all_finite(dsinks, kHeadsQ), "the backward fills dsinks");
  b.struct_size = (uint32_t)offsetof(fa4_backward_tensors, dsinks);
  s = fa4_backward(&p, &b, (void*)(((uintptr_t)ws + 255) & ~(uintptr_t)255), bytes, NULL,
                   FA4_BACKEND_CPU);
  check(s == FA4_SUCCESS, "a version-2 fa4_backward_tensors (no dsinks) is accepted");
  free(ws);
}

int main(void) {
  test_versions();
  test_fp8();
  test_score_variants();
  test_kv_cache_and_versions();
  test_init_defaults();
  test_forward_and_backward();
  test_errors();
  test_overrides();
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
