// The KV cache cases and checks both backends' tests run (kv_cache_cases.hpp).
#include "common/kv_cache_cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/reference.hpp"

namespace fa4::test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// e4m3 cases: stored values this many times their true size (descales of 1/32 to 1/16).
constexpr double kFp8Stored = 16.0;

bool is_fp8(const Problem& p) { return p.dtype == DType::kE4M3; }

// The largest error of rounding a value near y (computed with an error of e) to the cache's dtype:
// half an ulp of it, and of the smallest subnormal.
double rounding_bound(DType dtype, double y, double e) {
  switch (dtype) {
    case DType::kBF16: return 0x1p-8 * (std::fabs(y) + e) + 0x1p-134;
    case DType::kFP16: return 0x1p-11 * (std::fabs(y) + e) + 0x1p-25;
    case DType::kE4M3: return 0x1p-4 * (std::fabs(y) + e) + 0x1p-10;
    default: return 0x1p-24 * (std::fabs(y) + e) + 0x1p-150;
  }
}

// The (batch, kv head) descale of a dense array: 1 without one.
double descale_at(const std::vector<float>& d, const Problem& p, int64_t b, int64_t h) {
  return d.empty() ? 1.0 : double(d[size_t(b * p.heads_kv + h)]);
}

}  // namespace

std::string describe(const CacheCase& c) {
  std::string s = c.name + ": " + dtype_name(c.dtype) +
                  (c.quantize_appends ? " (bf16 appends quantised)" : "") + " b" +
                  std::to_string(c.batch) + " h" +
                  std::to_string(c.heads_q) + "/" + std::to_string(c.heads_kv) + " d" +
                  std::to_string(c.dim) + " page " + std::to_string(c.page_size) + " append " +
                  std::to_string(c.append) + " rotary " + std::to_string(c.rotary_dim) +
                  (c.interleaved ? " interleaved" : "") + " q " + std::to_string(c.seqlen_q);
  if (c.causal) s += " causal";
  if (c.window.left >= 0 || c.window.right >= 0)
    s += " window " + std::to_string(c.window.left) + "," + std::to_string(c.window.right);
  if (c.sinks) s += " sinks";
  if (c.alibi != Case::Alibi::kNone)
    s += c.alibi == Case::Alibi::kPerHead ? " alibi per head" : " alibi per (batch, head)";
  return s;
}

void PrintTo(const CacheCase& c, std::ostream* os) { *os << c.name; }

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
  const bool fp8 = c.dtype == DType::kE4M3;
  p.fp8.quantize_appends = c.quantize_appends;
  const DType out_dtype = output_dtype(p);  // of the output and the rotary tables
  const DType new_dtype = fp8 && c.quantize_appends ? out_dtype : c.dtype;
  // Stored values of e4m3 tensors kFp8Stored times their true size.
  const double stored = fp8 ? kFp8Stored : 1.0;
  if (fp8) {
    std::uniform_real_distribution<float> descale(1.0f / 32.0f, 1.0f / 16.0f);
    for (auto* d : {&s->q_descale, &s->k_descale, &s->v_descale})
      for (int64_t e = 0; e < c.batch * c.heads_kv; ++e) d->push_back(descale(rng));
  }

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
    t->fill_normal(rng, stored);
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
      *t = HostTensor(new_dtype, {1, kc.total_new, c.heads_kv, c.dim});
      t->fill_normal(rng, new_dtype == c.dtype ? stored : 1.0);
    }
  } else if (c.append > 0) {
    kc.seqlen_new = c.append;
    for (HostTensor* t : {&s->k_new, &s->v_new}) {
      *t = HostTensor(new_dtype, {c.batch, c.append, c.heads_kv, c.dim}, Layout::kPadded);
      t->fill_normal(rng, new_dtype == c.dtype ? stored : 1.0);
    }
  }
  // Rotary tables: the usual RoPE frequencies, rounded to the dtype.
  if (c.rotary_dim > 0) {
    kc.rotary_dim = c.rotary_dim;
    kc.rotary_interleaved = c.interleaved;
    kc.rotary_seqlen = c.capacity + 7;
    const int64_t half = c.rotary_dim / 2;
    s->cos = HostTensor(out_dtype, {1, kc.rotary_seqlen, 1, half});
    s->sin = HostTensor(out_dtype, {1, kc.rotary_seqlen, 1, half});
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
    s->out = HostTensor(out_dtype, {1, p.varlen.total_q, c.heads_q, c.dim});
    s->lse = HostLse(1, c.heads_q, p.varlen.total_q, false);
  } else {
    p.seqlen_q = c.seqlen_q;
    s->q = HostTensor(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.dim});
    s->out = HostTensor(out_dtype, {c.batch, c.seqlen_q, c.heads_q, c.dim});
    s->lse = HostLse(c.batch, c.heads_q, c.seqlen_q, false);
  }
  s->q.fill_normal(rng, stored);
  draw_score_variants(c.sinks, c.alibi, p, &s->sinks, &s->alibi_slopes, rng);
  s->k_initial = s->k.dense();
  s->v_initial = s->v.dense();
  s->out.poison();
  s->lse.poison();
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
  if (is_fp8(s.p)) {
    const int64_t heads = s.p.heads_kv;
    t.q_descale = {s.q_descale.data(), heads, 1};
    t.k_descale = {s.k_descale.data(), heads, 1};
    t.v_descale = {s.v_descale.data(), heads, 1};
  }
  return t;
}

int64_t cache_index(const CacheSetup& s, int64_t b, int64_t pos, int64_t h, int64_t c) {
  const KvCache& kc = s.p.kv_cache;
  const int64_t row = kc.batch_idx != nullptr ? s.batch_idx[size_t(b)] : b;
  const Dims& d = s.k.dims();
  if (kc.page_table == nullptr) return ((row * d.seq + pos) * d.heads + h) * d.dim + c;
  const int64_t page = s.page_table[size_t(row * kc.page_table_stride + pos / kc.page_size)];
  return ((page * d.seq + pos % kc.page_size) * d.heads + h) * d.dim + c;
}

Rotated rotated(const CacheSetup& s, const std::vector<double>& x, int64_t pos) {
  const KvCache& kc = s.p.kv_cache;
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
    for (size_t e : {a, z}) r.bound[e] = 0x1p-22 * terms;
  }
  return r;
}

std::vector<CheckResult> check_appends(const CacheSetup& s) {
  const Problem& p = s.p;
  const KvCache& kc = p.kv_cache;
  // Rows quantised on write are divided by their descale, in fp32, before the rounding.
  const bool quantized = is_fp8(p) && p.fp8.quantize_appends;
  std::vector<double> k_want = s.k_initial, v_want = s.v_initial,
                      k_bound(s.k_initial.size(), 0.0), v_bound(s.v_initial.size(), 0.0);
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
        const bool rotates = kc.rotary_dim > 0;
        const Rotated kr =
            rotates ? rotated(s, kx, pos) : Rotated{kx, std::vector<double>(kx.size())};
        const double kd = quantized ? descale_at(s.k_descale, p, b, h) : 1.0;
        const double vd = quantized ? descale_at(s.v_descale, p, b, h) : 1.0;
        // A row copied as given is exact; one computed (rotated or divided) carries its fp32
        // error and one rounding to the cache's dtype.
        for (int64_t c = 0; c < p.head_dim_qk; ++c) {
          const size_t at = size_t(cache_index(s, b, pos, h, c));
          k_want[at] = kr.value[size_t(c)] / kd;
          const double e =
              kr.bound[size_t(c)] / kd + (quantized ? 0x1p-23 * std::fabs(k_want[at]) : 0.0);
          k_bound[at] = rotates || quantized ? e + rounding_bound(p.dtype, k_want[at], e) : 0.0;
        }
        for (int64_t c = 0; c < p.head_dim_v; ++c) {
          const size_t at = size_t(cache_index(s, b, pos, h, c));
          v_want[at] = vx[size_t(c)] / vd;
          const double e = quantized ? 0x1p-23 * std::fabs(v_want[at]) : 0.0;
          v_bound[at] = quantized ? e + rounding_bound(p.dtype, v_want[at], e) : 0.0;
        }
      }
    }
  }
  const DenseShape shape = tensor_shape(s.k.dims());
  return {check_bounded("k cache", shape, s.k.dense(), k_want, k_bound),
          check_bounded("v cache", shape, s.v.dense(), v_want, v_bound)};
}

std::vector<CheckResult> check_attention(const CacheSetup& s, double lse_ulps, bool fp8_mma) {
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
  r.fp8 = p.fp8;
  // ALiBi's positions are the sequence's keys past its left pad, as the gathered keys are here.
  r.sinks = p.sinks;
  r.alibi = p.alibi;
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
  // The descales are per batch entry, as the call's: the same arrays serve the reference.
  const ForwardTensors t = tensors_of(s);
  const ref::Descales descales{t.q_descale, t.k_descale, t.v_descale};
  const ref::ForwardResult exact = ref::forward(r, q, keys.view(), values.view(),
                                                ref::Precision::kExact, {}, rot, &descales);
  const ref::ForwardResult lp = ref::forward(r, q, keys.view(), values.view(),
                                             ref::Precision::kLowPrecision, {}, rot, &descales);
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const Dims out_dims{1, r.varlen.total_q, p.heads_q, p.head_dim_v};
  const double slack =
      alibi_slack(r, max_finite_abs(exact.out), max_finite_abs(exact.score_abs));
  const CheckResult o = check_flash_rule("out", tensor_shape(out_dims), s.out.dense(), exact.out,
                                         lp.out, rule.multiplier, rule.atol + slack);
  // LSE: the call's layout (batch, heads, rows) or (heads, total) to the reference's
  // (heads, total).
  std::vector<double> lse(exact.lse.size());
  const std::vector<double> got = s.lse.dense();
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < s.q_rows[size_t(b)]; ++i)
        lse[size_t(h * r.varlen.total_q + cu_q[size_t(b)] + i)] =
            p.is_varlen() ? got[size_t(h * p.varlen.total_q + cu_q[size_t(b)] + i)]
                          : got[size_t((b * p.heads_q + h) * p.seqlen_q + i)];
  double max_lse = 0.0, lp_error = 0.0;
  for (size_t e = 0; e < exact.lse.size(); ++e)
    if (std::isfinite(exact.lse[e])) {
      max_lse = std::max(max_lse, std::fabs(exact.lse[e]));
      lp_error = std::max(lp_error, std::fabs(lp.lse[e] - exact.lse[e]));
    }
  const double lse_atol =
      rule.atol + lse_ulps * double(std::numeric_limits<float>::epsilon()) * max_lse;
  if (!fp8_mma || p.dtype != DType::kE4M3)
    return {o, check_flash_rule("lse", lse_shape(r), lse, exact.lse, lp.lse, rule.multiplier,
                                lse_atol)};
  // lp shares the inputs' roundings (rotated queries rounded back to e4m3) but not the FP8
  // tensor cores' shorter sums: each row's LSE may move by their share of its score_abs more.
  std::vector<double> bound(exact.lse.size());
  for (size_t e = 0; e < bound.size(); ++e)
    bound[e] = rule.multiplier * lp_error + lse_atol + kFp8ScoreShare * exact.score_abs[e];
  return {o, check_bounded("lse vs the rule + FP8 accumulation", lse_shape(r), lse, exact.lse,
                           bound)};
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
  // Score variants on caches: gpt-oss's decode (sinks, a window of 128 keys, GQA 8 on pages of
  // 16 with an append); ALiBi past left pads on pages of 7, its positions those of the keys after
  // the pad; both on an engine's varlen batch of chunks.
  {
    CacheCase c;
    c.heads_q = 8;
    c.heads_kv = 1;
    c.page_size = 16;
    c.append = 1;
    c.capacity = 400;
    c.causal = true;
    c.window = {128, 0};
    c.rotary_dim = 64;
    c.sinks = true;
    c.name = "sinks_window128_gqa8_page16_decode";
    add(c);
    CacheCase a;
    a.batch_idx = true;
    a.leftpad = true;
    a.page_size = 7;
    a.append = 3;
    a.seqlen_q = 3;
    a.causal = true;
    a.alibi = Case::Alibi::kPerHead;
    a.name = "alibi_batch_idx_leftpad_page7";
    add(a);
    CacheCase v;
    v.batch = 5;
    v.dim = 128;
    v.page_size = 64;
    v.varlen_q = true;
    v.varlen_append = true;
    v.seqlen_q = 40;
    v.append = 40;
    v.capacity = 500;
    v.causal = true;
    v.sinks = true;
    v.alibi = Case::Alibi::kPerBatchHead;
    v.name = "sinks_alibi_per_batch_varlen_chunks_page64";
    add(v);
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
    // Appends with no query row at all (every sequence empty): the cache is still written.
    c.seqlen_q = 0;
    c.append = 3;
    c.rotary_dim = 32;
    c.name = "appends_without_queries";
    add(c);
  }
  // e4m3 caches: the engine's mode (bf16 rows quantised on write) and e4m3 rows as given, over
  // decode, speculative decode, varlen batches and a chunk; TMA-sized and gathered pages.
  {
    CacheCase c;
    c.dtype = DType::kE4M3;
    c.quantize_appends = true;
    c.page_size = 16;
    c.append = 1;
    c.causal = true;
    c.rotary_dim = 64;
    c.name = "fp8_page16_decode_append1_rotary_quantized";
    add(c);
    c.page_size = 7;
    c.append = 3;
    c.seqlen_q = 3;
    c.rotary_dim = 32;
    c.interleaved = true;
    c.quantize_appends = false;
    c.shared_pages = true;
    c.name = "fp8_page7_spec3_append3_rotary_gptj_shared";
    add(c);
    c.page_size = 0;
    c.batch_idx = true;
    c.leftpad = true;
    c.quantize_appends = true;
    c.name = "fp8_batch_idx_leftpad_rotary_quantized";
    add(c);
  }
  {
    CacheCase c;
    c.dtype = DType::kE4M3;
    c.quantize_appends = true;
    c.batch = 5;
    c.page_size = 16;
    c.varlen_q = true;
    c.varlen_append = true;
    c.seqlen_q = 9;
    c.append = 9;
    c.causal = true;
    c.rotary_dim = 64;
    c.name = "fp8_varlen_q_varlen_append_rotary_quantized";
    add(c);
  }
  {
    CacheCase c;
    c.dtype = DType::kE4M3;
    c.quantize_appends = true;
    c.page_size = 64;
    c.append = 200;
    c.seqlen_q = 200;
    c.capacity = 700;
    c.causal = true;
    c.rotary_dim = 64;
    c.name = "fp8_chunk200_causal_rotary_quantized";
    add(c);
  }
  {
    CacheCase c;
    c.dtype = DType::kE4M3;
    c.page_size = 16;
    c.head_major = true;
    c.window = {40, 0};
    c.seqlen_q = 16;
    c.append = 16;
    c.softcap = 20.0f;
    c.heads_q = 16;
    c.name = "fp8_window_softcap_gqa8_hnd";
    add(c);
  }
  return cases;
}

}  // namespace fa4::test
