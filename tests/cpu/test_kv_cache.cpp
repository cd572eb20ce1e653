// The KV cache (Problem::kv_cache) on the CPU backend, against a reference assembled here
// independently of the library's cache code: pages (sizes 1 to 256, shuffled, shared between
// sequences, NHD and HND layouts), cache rows picked by batch_idx, left pads, appends of 1, 3 and
// 200 rows (fixed and varlen) with and without a rotary embedding of either form, queries from one
// row (decode) to chunks, fixed-length and varlen, under every mask.
//   - The appends: each appended row holds k_new rotated at its position (to within the dtype's
//     rounding of the exact rotation) and v_new; every other element of the cache is unchanged.
//   - The attention: each sequence's keys gathered from the cache the call left (through this
//     file's own page arithmetic) into a plain varlen problem, and O and LSE checked against the
//     double reference on it by the accuracy rule (docs/testing.md), the queries rotated by the
//     reference itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/reference.hpp"
#include "common/test_util.hpp"
#include "fa4/attention.hpp"

namespace fa4::test {
namespace {

struct CacheCase {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t batch = 3, heads_q = 4, heads_kv = 2, dim = 64;
  int64_t page_size = 0;     // 0: not paged
  bool head_major = false;   // the cache laid out (pages, heads, rows, dim)
  bool shared_pages = false; // neighbouring sequences share their first pages
  bool batch_idx = false;    // cache rows picked by a permutation of a larger cache
  bool leftpad = false;
  int64_t append = 0;        // rows appended per sequence
  bool varlen_append = false;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  int64_t seqlen_q = 1;      // rows per sequence (fixed), or the longest (varlen)
  bool varlen_q = false;
  int64_t capacity = 300;    // keys per cache row
  bool causal = false;
  Window window{};
  float softcap = 0.0f;
};

std::string describe(const CacheCase& c) {
  std::string s = c.name + ": " + dtype_name(c.dtype) + " b" + std::to_string(c.batch) + " h" +
                  std::to_string(c.heads_q) + "/" + std::to_string(c.heads_kv) + " d" +
                  std::to_string(c.dim) + " page " + std::to_string(c.page_size) + " append " +
                  std::to_string(c.append) + " rotary " + std::to_string(c.rotary_dim) +
                  (c.interleaved ? " interleaved" : "") + " q " + std::to_string(c.seqlen_q);
  if (c.causal) s += " causal";
  if (c.window.left >= 0 || c.window.right >= 0)
    s += " window " + std::to_string(c.window.left) + "," + std::to_string(c.window.right);
  return s;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A case made concrete: arrays, tensors and the problem pointing at them.
struct CacheSetup {
  Problem p;
  std::vector<int32_t> cache_len, leftpad, batch_idx, page_table, cu_new, cu_q;
  std::vector<int64_t> new_rows, q_rows;
  HostTensor q, k, v, k_new, v_new, out, cos, sin;
  HostLse lse;
  int64_t cache_rows = 0;
};

std::unique_ptr<CacheSetup> make_cache_setup(const CacheCase& c, std::mt19937_64& rng) {
  auto s = std::make_unique<CacheSetup>();
  Problem& p = s->p;
  p.batch = c.batch;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim_qk = p.head_dim_v = c.dim;
  p.dtype = c.dtype;
  p.causal = c.causal;
  p.window = c.window;
  p.softcap = c.softcap;
  p.return_lse = true;
  KvCache& kc = p.kv_cache;

  // Per sequence: appended rows, query rows, cache length (room left for the append), left pad.
  const bool banded = c.causal || c.window.left >= 0 || c.window.right >= 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t n = c.varlen_append ? int64_t(rng() % uint64_t(c.append + 1)) : c.append;
    s->new_rows.push_back(n);
    s->q_rows.push_back(c.varlen_q ? int64_t(rng() % uint64_t(c.seqlen_q + 1)) : c.seqlen_q);
    // Rotary positions run to cache_len + max(n, q rows) − 1: keep them inside the capacity.
    const int64_t room = c.capacity - std::max(n, banded ? s->q_rows.back() : int64_t(1));
    const int64_t len = b == 0 && c.batch > 2 ? 0 : int64_t(rng() % uint64_t(room + 1));
    s->cache_len.push_back(int32_t(len));
    s->leftpad.push_back(c.leftpad && len > 0 ? int32_t(rng() % uint64_t(len + 1)) : 0);
  }
  // Cache rows: one per sequence, or a permutation into twice as many.
  s->cache_rows = c.batch_idx ? 2 * c.batch + 1 : c.batch;
  std::vector<int32_t> rows(size_t(s->cache_rows));
  std::iota(rows.begin(), rows.end(), 0);
  if (c.batch_idx) std::shuffle(rows.begin(), rows.end(), rng);
  // The cache: pages or rows, random values everywhere (the attention must not read the unused).
  const int64_t elements_per_key = c.heads_kv * c.dim;
  int64_t outer = s->cache_rows, inner = c.capacity;
  std::vector<int32_t> table;
  if (c.page_size > 0) {
    const int64_t per_row = ceil_div(c.capacity, c.page_size);
    kc.pages_per_seq = per_row;
    kc.page_size = c.page_size;
    kc.page_table_stride = per_row + 3;  // padded rows
    p.seqlen_k = per_row * c.page_size;
    // Every row's pages distinct, in a shuffled order; with sharing, a sequence starts with its
    // predecessor's first pages (those below both cache lengths: read, never appended to).
    kc.num_pages = s->cache_rows * per_row + 5;
    std::vector<int32_t> pages(size_t(kc.num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    table.assign(size_t(s->cache_rows * kc.page_table_stride), -1);  // -1: never read
    for (int64_t r = 0; r < s->cache_rows; ++r)
      for (int64_t i = 0; i < per_row; ++i)
        table[size_t(r * kc.page_table_stride + i)] = pages[size_t(r * per_row + i)];
    if (c.shared_pages)
      for (int64_t b = 1; b < c.batch; ++b) {
        const int64_t shared =
            std::min(s->cache_len[size_t(b - 1)], s->cache_len[size_t(b)]) / c.page_size;
        for (int64_t i = 0; i < shared; ++i)
          table[size_t(rows[size_t(b)] * kc.page_table_stride + i)] =
              table[size_t(rows[size_t(b - 1)] * kc.page_table_stride + i)];
      }
    outer = kc.num_pages;
    inner = c.page_size;
  } else {
    p.seqlen_k = c.capacity;
  }
  s->page_table = table;
  const int64_t strides_nhd[4] = {inner * elements_per_key, elements_per_key, c.dim, 1};
  const int64_t strides_hnd[4] = {inner * elements_per_key, c.dim, inner * c.dim, 1};
  for (HostTensor* t : {&s->k, &s->v}) {
    *t = HostTensor::strided(c.dtype, {outer, inner, c.heads_kv, c.dim},
                             c.head_major ? strides_hnd : strides_nhd, 0, outer * inner *
                                                                              elements_per_key);
    t->fill_normal(rng);
  }
  kc.page_table = c.page_size > 0 ? s->page_table.data() : nullptr;
  kc.cache_batch = s->cache_rows;
  if (c.batch_idx) {
    s->batch_idx.assign(rows.begin(), rows.begin() + c.batch);
    kc.batch_idx = s->batch_idx.data();
  }
  if (c.leftpad) kc.leftpad = s->leftpad.data();
  p.seqused_k = s->cache_len.data();
  // Appends.
  if (c.varlen_append) {
    s->cu_new.push_back(0);
    for (int64_t n : s->new_rows) s->cu_new.push_back(s->cu_new.back() + int32_t(n));
    kc.cu_seqlens_new = s->cu_new.data();
    kc.total_new = s->cu_new.back();
    kc.seqlen_new = c.append;
    for (HostTensor* t : {&s->k_new, &s->v_new}) {
      *t = HostTensor(c.dtype, {1, kc.total_new, c.heads_kv, c.dim});
      t->fill_normal(rng);
    }
  } else if (c.append > 0) {
    kc.seqlen_new = c.append;
    for (HostTensor* t : {&s->k_new, &s->v_new}) {
      *t = HostTensor(c.dtype, {c.batch, c.append, c.heads_kv, c.dim}, Layout::kPadded);
      t->fill_normal(rng);
    }
  }
  // Rotary tables: the usual RoPE frequencies, rounded to the dtype.
  if (c.rotary_dim > 0) {
    kc.rotary_dim = c.rotary_dim;
    kc.rotary_interleaved = c.interleaved;
    kc.rotary_seqlen = c.capacity + 7;
    const int64_t half = c.rotary_dim / 2;
    s->cos = HostTensor(c.dtype, {1, kc.rotary_seqlen, 1, half});
    s->sin = HostTensor(c.dtype, {1, kc.rotary_seqlen, 1, half});
    for (int64_t pos = 0; pos < kc.rotary_seqlen; ++pos)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = double(pos) * std::pow(10000.0, -2.0 * double(i) / c.rotary_dim);
        s->cos.set(pos * half + i, std::cos(angle));
        s->sin.set(pos * half + i, std::sin(angle));
      }
  }
  // Queries and outputs: fixed-length (batch, rows, heads, dim), or packed varlen.
  if (c.varlen_q) {
    s->cu_q.push_back(0);
    for (int64_t n : s->q_rows) s->cu_q.push_back(s->cu_q.back() + int32_t(n));
    p.varlen.cu_seqlens_q = s->cu_q.data();
    p.varlen.total_q = s->cu_q.back();
    p.seqlen_q = c.seqlen_q;
    s->q = HostTensor(c.dtype, {1, p.varlen.total_q, c.heads_q, c.dim});
    s->out = HostTensor(c.dtype, {1, p.varlen.total_q, c.heads_q, c.dim});
    s->lse = HostLse(1, c.heads_q, p.varlen.total_q, false);
  } else {
    p.seqlen_q = c.seqlen_q;
    s->q = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.dim});
    s->out = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.dim});
    s->lse = HostLse(c.batch, c.heads_q, c.seqlen_q, false);
  }
  s->q.fill_normal(rng);
  return s;
}

ForwardTensors tensors_of(const CacheSetup& s) {
  ForwardTensors t;
  t.q = s.q.view();
  t.k = s.k.view();
  t.v = s.v.view();
  t.out = s.out.view();
  t.lse = s.lse.view();
  if (s.p.kv_cache.appends()) {
    t.k_new = s.k_new.view();
    t.v_new = s.v_new.view();
  }
  if (s.p.kv_cache.rotary_dim > 0) {
    t.rotary.cos = s.cos.view().data;
    t.rotary.sin = s.sin.view().data;
    t.rotary.row_stride = s.p.kv_cache.rotary_dim / 2;
  }
  return t;
}

// Dense index of (cache position pos, head h, dim c) of sequence b's cache row, by this file's own
// page arithmetic.
int64_t cache_index(const CacheSetup& s, int64_t b, int64_t pos, int64_t h, int64_t c) {
  const KvCache& kc = s.p.kv_cache;
  const int64_t row = kc.batch_idx != nullptr ? s.batch_idx[size_t(b)] : b;
  const Dims& d = s.k.dims();
  if (kc.page_table == nullptr) return ((row * d.seq + pos) * d.heads + h) * d.dim + c;
  const int64_t page = s.page_table[size_t(row * kc.page_table_stride + pos / kc.page_size)];
  return ((page * d.seq + pos % kc.page_size) * d.heads + h) * d.dim + c;
}

// The rotation of one row in double at `pos`, and each element's error bound in a computation
// in fp32 rounded to the dtype: half an ulp of the result, plus the fp32 products' and difference's
// rounding, which scales with the terms (a result that cancels keeps their absolute error).
struct Rotated {
  std::vector<double> value, bound;
};
Rotated rotated(const CacheSetup& s, const std::vector<double>& x, int64_t pos) {
  const KvCache& kc = s.p.kv_cache;
  const DType dtype = s.p.dtype;
  const double unit = dtype == DType::kBF16 ? 0x1p-8 : dtype == DType::kFP16 ? 0x1p-11 : 0x1p-24;
  Rotated r{x, std::vector<double>(x.size(), 0.0)};
  const int64_t half = kc.rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double cs = s.cos.get(pos * half + i), sn = s.sin.get(pos * half + i);
    const size_t a = size_t(kc.rotary_interleaved ? 2 * i : i);
    const size_t z = size_t(kc.rotary_interleaved ? 2 * i + 1 : i + half);
    r.value[a] = x[a] * cs - x[z] * sn;
    r.value[z] = x[a] * sn + x[z] * cs;
    const double terms = std::fabs(x[a]) * (std::fabs(cs) + std::fabs(sn)) +
                         std::fabs(x[z]) * (std::fabs(cs) + std::fabs(sn));
    for (size_t e : {a, z}) r.bound[e] = unit * std::fabs(r.value[e]) + 0x1p-22 * terms;
  }
  return r;
}

void check_appends(const CacheSetup& s, const std::vector<double>& k_before,
                   const std::vector<double>& v_before) {
  const Problem& p = s.p;
  const KvCache& kc = p.kv_cache;
  std::vector<double> k_want = k_before, v_want = v_before, k_bound(k_before.size(), 0.0);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t n = s.new_rows[size_t(b)];
    const int64_t first = kc.cu_seqlens_new != nullptr ? s.cu_new[size_t(b)] : 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = s.cache_len[size_t(b)] + j;
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        std::vector<double> kx(size_t(p.head_dim_qk)), vx(size_t(p.head_dim_v));
        const Dims& nd = s.k_new.dims();
        const int64_t base = kc.cu_seqlens_new != nullptr
                                 ? ((first + j) * nd.heads + h) * nd.dim
                                 : ((b * nd.seq + j) * nd.heads + h) * nd.dim;
        for (int64_t c = 0; c < p.head_dim_qk; ++c) kx[size_t(c)] = s.k_new.get(base + c);
        for (int64_t c = 0; c < p.head_dim_v; ++c) vx[size_t(c)] = s.v_new.get(base + c);
        const Rotated kr =
            kc.rotary_dim > 0 ? rotated(s, kx, pos) : Rotated{kx, std::vector<double>(kx.size())};
        for (int64_t c = 0; c < p.head_dim_qk; ++c) {
          const size_t at = size_t(cache_index(s, b, pos, h, c));
          k_want[at] = kr.value[size_t(c)];
          k_bound[at] = kr.bound[size_t(c)];
        }
        for (int64_t c = 0; c < p.head_dim_v; ++c)
          v_want[size_t(cache_index(s, b, pos, h, c))] = vx[size_t(c)];
      }
    }
  }
  const DenseShape shape = tensor_shape(s.k.dims());
  const CheckResult k = check_bounded("k cache", shape, s.k.dense(), k_want, k_bound);
  EXPECT_TRUE(k.ok) << k.message;
  const CheckResult v = check_bounded("v cache", shape, s.v.dense(), v_want,
                                      std::vector<double>(v_want.size(), 0.0));
  EXPECT_TRUE(v.ok) << v.message;
}

// The attention against the reference on a plain varlen problem: each sequence's keys gathered
// from the cache the call left.
void check_attention(const CacheSetup& s) {
  const Problem& p = s.p;
  const KvCache& kc = p.kv_cache;
  Problem r;
  r.batch = p.batch;
  r.heads_q = p.heads_q;
  r.heads_kv = p.heads_kv;
  r.head_dim_qk = p.head_dim_qk;
  r.head_dim_v = p.head_dim_v;
  r.dtype = p.dtype;
  r.causal = p.causal;
  r.window = p.window;
  r.softcap = p.softcap;
  r.return_lse = true;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t first = kc.leftpad != nullptr ? s.leftpad[size_t(b)] : 0;
    cu_q.push_back(cu_q.back() + int32_t(s.q_rows[size_t(b)]));
    cu_k.push_back(cu_k.back() +
                   int32_t(s.cache_len[size_t(b)] + s.new_rows[size_t(b)] - first));
  }
  r.varlen = {cu_q.data(), cu_k.data(), cu_q.back(), cu_k.back()};
  r.seqlen_q = *std::max_element(s.q_rows.begin(), s.q_rows.end());
  r.seqlen_k = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    r.seqlen_k = std::max<int64_t>(r.seqlen_k, cu_k[size_t(b + 1)] - cu_k[size_t(b)]);
  HostTensor keys(p.dtype, {1, r.varlen.total_k, p.heads_kv, p.head_dim_qk});
  HostTensor values(p.dtype, {1, r.varlen.total_k, p.heads_kv, p.head_dim_v});
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t first = kc.leftpad != nullptr ? s.leftpad[size_t(b)] : 0;
    for (int64_t j = cu_k[size_t(b)]; j < cu_k[size_t(b + 1)]; ++j) {
      const int64_t pos = first + j - cu_k[size_t(b)];
      for (int64_t h = 0; h < p.heads_kv; ++h)
        for (int64_t c = 0; c < p.head_dim_qk; ++c) {
          keys.set((j * p.heads_kv + h) * p.head_dim_qk + c,
                   s.k.get(cache_index(s, b, pos, h, c)));
          values.set((j * p.heads_kv + h) * p.head_dim_v + c,
                     s.v.get(cache_index(s, b, pos, h, c)));
        }
    }
  }
  // The queries as a packed view: fixed-length ones are contiguous, sequence after sequence.
  const TensorView q = s.q.view();
  ref::QueryRotary rotary;
  const ref::QueryRotary* rot = nullptr;
  if (kc.rotary_dim > 0) {
    rotary = {s.cos.view().data, s.sin.view().data, kc.rotary_dim / 2, kc.rotary_dim,
              kc.rotary_interleaved, {}, p.causal || p.window.left >= 0 || p.window.right >= 0};
    for (int64_t b = 0; b < p.batch; ++b) rotary.position.push_back(s.cache_len[size_t(b)]);
    rot = &rotary;
  }
  const ref::ForwardResult exact =
      ref::forward(r, q, keys.view(), values.view(), ref::Precision::kExact, {}, rot);
  const ref::ForwardResult lp =
      ref::forward(r, q, keys.view(), values.view(), ref::Precision::kLowPrecision, {}, rot);
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const Dims out_dims{1, r.varlen.total_q, p.heads_q, p.head_dim_v};
  const CheckResult o = check_flash_rule("out", tensor_shape(out_dims), s.out.dense(), exact.out,
                                         lp.out, rule.multiplier, rule.atol);
  EXPECT_TRUE(o.ok) << o.message;
  // LSE: the call's layout (batch, heads, rows) or (heads, total) to the reference's (heads, total).
  std::vector<double> lse(exact.lse.size());
  const std::vector<double> got = s.lse.dense();
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < s.q_rows[size_t(b)]; ++i)
        lse[size_t(h * r.varlen.total_q + cu_q[size_t(b)] + i)] =
            p.is_varlen() ? got[size_t(h * p.varlen.total_q + cu_q[size_t(b)] + i)]
                          : got[size_t((b * p.heads_q + h) * p.seqlen_q + i)];
  const CheckResult l = check_flash_rule("lse", lse_shape(r), lse, exact.lse, lp.lse,
                                         rule.multiplier, rule.atol);
  EXPECT_TRUE(l.ok) << l.message;
}

void check_cache_case(const CacheCase& c) {
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
  const std::vector<double> k_before = s->k.dense(), v_before = s->v.dense();
  s->out.poison();
  s->lse.poison();
  size_t bytes = 1;
  ASSERT_TRUE(workspace_size(s->p, Backend::kCpu, Pass::kForward, &bytes).ok());
  HostWorkspace ws(bytes);
  const Status st = forward(s->p, tensors_of(*s), ws.view(), nullptr, Backend::kCpu);
  ASSERT_TRUE(st.ok()) << st.message;
  check_appends(*s, k_before, v_before);
  check_attention(*s);
}

std::vector<CacheCase> cache_cases() {
  std::vector<CacheCase> cases;
  auto add = [&](CacheCase c) { cases.push_back(std::move(c)); };
  // Pages of every size, decode and a few query rows, with and without appends.
  for (int64_t page : {int64_t(0), int64_t(1), int64_t(7), int64_t(16), int64_t(64),
                       int64_t(128), int64_t(256)}) {
    CacheCase c;
    c.page_size = page;
    c.name = "page" + std::to_string(page) + "_decode";
    add(c);
    c.append = 1;
    c.causal = true;
    c.name = "page" + std::to_string(page) + "_decode_append1";
    add(c);
    c.append = 3;
    c.seqlen_q = 3;
    c.shared_pages = page > 0;
    c.name = "page" + std::to_string(page) + "_spec3_append3_causal" + (page > 0 ? "_shared" : "");
    add(c);
  }
  // Rotary, both forms, whole and half the head dim, with and without a mask.
  for (bool interleaved : {false, true})
    for (int64_t rotary : {int64_t(64), int64_t(32)})
      for (bool causal : {false, true}) {
        CacheCase c;
        c.page_size = 16;
        c.append = 3;
        c.seqlen_q = 3;
        c.rotary_dim = rotary;
        c.interleaved = interleaved;
        c.causal = causal;
        c.name = std::string("rotary") + std::to_string(rotary) +
                 (interleaved ? "_gptj" : "_neox") + (causal ? "_causal" : "");
        add(c);
      }
  // A chunked prefill: 200 rows appended and attended to causally, against a long cache.
  {
    CacheCase c;
    c.page_size = 64;
    c.append = 200;
    c.seqlen_q = 200;
    c.capacity = 700;
    c.causal = true;
    c.rotary_dim = 64;
    c.name = "chunk200_causal_rotary";
    add(c);
    c.dtype = DType::kFP32;
    c.name = "chunk200_causal_rotary_fp32";
    add(c);
  }
  // Cache rows picked by batch_idx, left pads, HND layouts, windows, softcap, GQA 8, fp16.
  {
    CacheCase c;
    c.batch_idx = true;
    c.leftpad = true;
    c.append = 3;
    c.seqlen_q = 3;
    c.causal = true;
    c.rotary_dim = 64;
    c.name = "batch_idx_leftpad_rotary";
    add(c);
    c.page_size = 7;
    c.name = "batch_idx_leftpad_rotary_page7";
    add(c);
    c.head_major = true;
    c.name = "batch_idx_leftpad_rotary_page7_hnd";
    add(c);
  }
  {
    CacheCase c;
    c.page_size = 16;
    c.head_major = true;
    c.window = {40, 0};
    c.seqlen_q = 16;
    c.append = 16;
    c.softcap = 20.0f;
    c.heads_q = 16;
    c.dtype = DType::kFP16;
    c.name = "window_softcap_gqa8_fp16_hnd";
    add(c);
  }
  // Varlen queries and appends (an engine's batch of decode and prefill), zero-length included.
  {
    CacheCase c;
    c.batch = 5;
    c.page_size = 16;
    c.varlen_q = true;
    c.varlen_append = true;
    c.seqlen_q = 9;
    c.append = 9;
    c.causal = true;
    c.rotary_dim = 32;
    c.interleaved = true;
    c.name = "varlen_q_varlen_append_rotary";
    add(c);
    c.varlen_append = false;
    c.append = 0;
    c.rotary_dim = 0;
    c.interleaved = false;
    c.name = "varlen_q_no_append";
    add(c);
  }
  return cases;
}

class CpuKvCache : public ::testing::TestWithParam<CacheCase> {};

TEST_P(CpuKvCache, MatchesReference) { check_cache_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CpuKvCache, ::testing::ValuesIn(cache_cases()),
                         [](const ::testing::TestParamInfo<CacheCase>& info) {
                           return info.param.name;
                         });

// The page-table entry of sequence b's first appended row.
int32_t& appended_page(CacheSetup& s, int64_t b) {
  const KvCache& kc = s.p.kv_cache;
  return s.page_table[size_t(s.batch_idx[size_t(b)] * kc.page_table_stride +
                             s.cache_len[size_t(b)] / kc.page_size)];
}

// Bad input: a clear kInvalidArgument naming what is wrong, and nothing written — neither the
// output nor the cache.
TEST(CpuKvCache, RefusesBadInputWritingNothing) {
  CacheCase c;
  c.name = "refusals";
  c.page_size = 16;
  c.append = 3;
  c.seqlen_q = 3;
  c.causal = true;
  c.rotary_dim = 32;
  c.batch_idx = true;
  c.leftpad = true;
  std::mt19937_64 rng = make_rng(c.name);
  struct Refusal {
    const char* what;
    const char* named;  // in the message
    void (*spoil)(CacheSetup&);
  } refusals[] = {
      // (The pages the appends write: entries of pages no key is read from are never read.)
      {"a page out of range", "page_table",
       [](CacheSetup& s) { appended_page(s, 1) = int32_t(s.p.kv_cache.num_pages); }},
      {"a negative page", "page_table", [](CacheSetup& s) { appended_page(s, 2) = -1; }},
      {"an append past the capacity", "capacity",
       [](CacheSetup& s) { s.cache_len[1] = int32_t(s.p.seqlen_k - 1); }},
      {"a cache row out of range", "batch_idx",
       [](CacheSetup& s) { s.batch_idx[0] = int32_t(s.cache_rows); }},
      {"a left pad past the cache length", "leftpad",
       [](CacheSetup& s) { s.leftpad[2] = s.cache_len[2] + 1; }},
      {"an odd rotary dim", "rotary_dim", [](CacheSetup& s) { s.p.kv_cache.rotary_dim = 31; }},
      {"a rotary dim past the head dim", "rotary_dim",
       [](CacheSetup& s) { s.p.kv_cache.rotary_dim = 66; }},
      {"rotary positions past the tables", "rotary",
       [](CacheSetup& s) { s.p.kv_cache.rotary_seqlen = 2; }},
      {"rotary without appends", "rotary_dim", [](CacheSetup& s) { s.p.kv_cache.seqlen_new = 0; }},
      {"packed keys with a cache", "cu_seqlens_k",
       [](CacheSetup& s) { s.p.varlen.cu_seqlens_k = s.cache_len.data(); }},
      {"a page table row shorter than its pages", "page_table_stride",
       [](CacheSetup& s) { s.p.kv_cache.page_table_stride = s.p.kv_cache.pages_per_seq - 1; }},
      {"a capacity other than the pages'", "seqlen_k", [](CacheSetup& s) { s.p.seqlen_k += 1; }},
      {"page sizes without a page table", "page_table",
       [](CacheSetup& s) { s.p.kv_cache.page_table = nullptr; }},
      {"no k_new", "k_new.data", nullptr},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.what);
    const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
    if (r.spoil != nullptr) r.spoil(*s);
    ForwardTensors t = tensors_of(*s);
    if (r.spoil == nullptr) t.k_new.data = nullptr;
    const std::vector<double> k_before = s->k.dense(), v_before = s->v.dense();
    s->out.poison();
    const Status st = forward(s->p, t, {}, nullptr, Backend::kCpu);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << st.message;
    EXPECT_NE(st.message.find(r.named), std::string::npos) << st.message;
    const std::vector<double> k_after = s->k.dense(), v_after = s->v.dense();
    EXPECT_TRUE(std::equal(k_before.begin(), k_before.end(), k_after.begin()))
        << "the k cache was written";
    EXPECT_TRUE(std::equal(v_before.begin(), v_before.end(), v_after.begin()))
        << "the v cache was written";
    for (int64_t i = 0; i < s->out.size(); ++i)
      ASSERT_TRUE(s->out.is_poison(i)) << "out was written at " << i;
  }
}

// What the library does not compute with a cache says so: the backward, and the sm90 kernels.
TEST(CpuKvCache, UnsupportedPassesAndBackends) {
  CacheCase c;
  c.name = "unsupported";
  c.page_size = 16;
  c.append = 1;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CacheSetup> s = make_cache_setup(c, rng);
  Status st = can_implement(s->p, Backend::kCpu, Pass::kBackward);
  EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
  EXPECT_NE(st.message.find("forward-only"), std::string::npos) << st.message;
  st = can_implement(s->p, Backend::kSm90, Pass::kForward);
  EXPECT_TRUE(st.code == StatusCode::kNotSupported ||
              st.code == StatusCode::kBackendUnavailable)
      << st.message;
  EXPECT_TRUE(can_implement(s->p, Backend::kCpu, Pass::kForward).ok());
}

// num_splits is a count: 0 the library's choice, 1 none, n at most n; negative is refused.
TEST(CpuKvCache, NumSplitsIsValidated) {
  Problem p;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = 16;
  p.heads_q = p.heads_kv = 1;
  p.head_dim_qk = p.head_dim_v = 64;
  p.num_splits = -1;
  const Status st = can_implement(p, Backend::kCpu, Pass::kForward);
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("num_splits"), std::string::npos) << st.message;
  p.num_splits = 3;
  EXPECT_TRUE(can_implement(p, Backend::kCpu, Pass::kForward).ok());
}

}  // namespace
}  // namespace fa4::test
