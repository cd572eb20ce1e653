// Naive attention: one query row at a time, its visible keys visited one by one. Masking, sequence
// addressing and the GQA head mapping are written out here again on purpose, so that a mistake in
// the library's shared pieces (src/common/mask.hpp, seq_layout.hpp) cannot hide in both.
#include "common/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/numeric.hpp"

namespace fa4::ref {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

double load(const void* data, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kBF16: return to_float(static_cast<const bf16_t*>(data)[offset]);
    case DType::kFP16: return to_float(static_cast<const fp16_t*>(data)[offset]);
    case DType::kE4M3: return to_float(static_cast<const e4m3_t*>(data)[offset]);
    default: return static_cast<const float*>(data)[offset];
  }
}

// The descale of batch entry b, kv head h: 1 without one.
float descale_of(const Descales* d, DescaleView Descales::*which, int64_t b, int64_t h) {
  if (d == nullptr || (d->*which).data == nullptr) return 1.0f;
  const DescaleView& v = d->*which;
  return v.data[b * v.batch_stride + h * v.head_stride];
}

// Batch entry b: where its rows are and how many of them take part.
struct Sequence {
  int64_t index = 0;    // b
  int64_t batch = 0;    // fixed-length: b; varlen: 0 (rows are absolute in the packed tensors)
  int64_t first_q = 0;  // varlen: first row of the sequence in the packed tensors
  int64_t first_k = 0;
  int64_t len_q = 0;
  int64_t len_k = 0;   // keys that take part: seqused_k[b] when given
  int64_t rows_k = 0;  // key rows the sequence owns (≥ len_k); gradients of the rest are 0
};

Sequence sequence_of(const Problem& p, int64_t b) {
  Sequence s;
  s.index = b;
  if (p.is_varlen()) {
    s.first_q = p.varlen.cu_seqlens_q[b];
    s.first_k = p.varlen.cu_seqlens_k[b];
    s.len_q = p.varlen.cu_seqlens_q[b + 1] - s.first_q;
    s.rows_k = p.varlen.cu_seqlens_k[b + 1] - s.first_k;
  } else {
    s.batch = b;
    s.len_q = p.seqlen_q;
    s.rows_k = p.seqlen_k;
  }
  s.len_k = p.seqused_k != nullptr ? p.seqused_k[b] : s.rows_k;
  return s;
}

// The band around the bottom-right aligned diagonal: query i's own key is i + len_k − len_q.
bool sees(const Problem& p, const Sequence& s, int64_t i, int64_t j) {
  const int64_t diagonal = i + s.len_k - s.len_q;
  const int64_t right = p.causal ? 0 : p.window.right;
  if (p.window.left >= 0 && j < diagonal - p.window.left) return false;
  if (right >= 0 && j > diagonal + right) return false;
  return true;
}

// ALiBi's bias of (i, j), −slope · |i + len_k − len_q − j| (0 without ALiBi), in double.
double alibi_bias(const Problem& p, const Sequence& s, int64_t h, int64_t i, int64_t j) {
  if (p.alibi.data == nullptr) return 0.0;
  const double slope = p.alibi.data[s.index * p.alibi.batch_stride + h * p.alibi.head_stride];
  return -slope * std::fabs(double(i + s.len_k - s.len_q - j));
}

// The sink logit of query head h; −inf without sinks.
double sink_logit(const Problem& p, int64_t h) { return p.sinks != nullptr ? p.sinks[h] : -kInf; }

double exact_scale(const Problem& p) {
  return p.softmax_scale != 0.0f ? double(p.softmax_scale) : 1.0 / std::sqrt(double(p.head_dim_qk));
}

// The kernels' scale: the same formula evaluated in fp32.
float fp32_scale(const Problem& p) {
  return p.softmax_scale != 0.0f ? p.softmax_scale : 1.0f / std::sqrt(float(p.head_dim_qk));
}

// Rows [first, first + rows) of one head of a view, as a dense rows × dim matrix.
std::vector<double> gather(const TensorView& t, DType dtype, int64_t batch, int64_t first,
                           int64_t rows, int64_t head, int64_t dim) {
  std::vector<double> m(static_cast<size_t>(rows * dim));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = batch * t.batch_stride + (first + r) * t.seq_stride + head * t.head_stride;
    for (int64_t c = 0; c < dim; ++c)
      m[size_t(r * dim + c)] = load(t.data, dtype, base + c * t.dim_stride);
  }
  return m;
}

std::vector<float> to_fp32(const std::vector<double>& m) { return {m.begin(), m.end()}; }

// Row indices in the dense result layouts.
int64_t dense_q_row(const Problem& p, const Sequence& s, int64_t i) {
  return p.is_varlen() ? s.first_q + i : s.batch * p.seqlen_q + i;
}
int64_t dense_k_row(const Problem& p, const Sequence& s, int64_t j) {
  return p.is_varlen() ? s.first_k + j : s.batch * p.seqlen_k + j;
}
int64_t rows_q_total(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
}
int64_t rows_k_total(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_k : p.batch * p.seqlen_k;
}
int64_t lse_index(const Problem& p, const Sequence& s, int64_t h, int64_t i) {
  return p.is_varlen() ? h * p.varlen.total_q + s.first_q + i
                       : (s.batch * p.heads_q + h) * p.seqlen_q + i;
}

// One query row's softmax over its visible keys, in double.
struct ExactRow {
  std::vector<int64_t> keys;  // visible keys, ascending
  std::vector<double> score;  // their scores after softcap
  std::vector<double> p;      // their probabilities
  double lse = kInf;
  double score_abs = 0.0;
};

ExactRow exact_row(const Problem& p, const Sequence& s, int64_t h, int64_t i, const double* q,
                   const std::vector<double>& keys_matrix, double scale) {
  const int64_t d = p.head_dim_qk;
  const double cap = p.softcap;
  ExactRow row;
  for (int64_t j = 0; j < s.len_k; ++j) {
    if (!sees(p, s, i, j)) continue;
    const double* kj = &keys_matrix[size_t(j * d)];
    double dot = 0.0, dot_abs = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      dot += q[c] * kj[c];
      dot_abs += std::fabs(q[c] * kj[c]);
    }
    double score = scale * dot;
    if (cap > 0.0) score = cap * std::tanh(score / cap);
    const double bias = alibi_bias(p, s, h, i, j);
    score += bias;
    row.keys.push_back(j);
    row.score.push_back(score);
    // The bias is one more term of the score, rounded like the dot product's.
    row.score_abs = std::max(row.score_abs, std::fabs(scale) * dot_abs + std::fabs(bias));
  }
  // A sink joins the denominator (and is the whole of it for a row without keys).
  const double sink = sink_logit(p, h);
  if (row.keys.empty()) {
    if (sink != -kInf) row.lse = sink;
    return row;
  }
  const double m = std::max(*std::max_element(row.score.begin(), row.score.end()), sink);
  double sum = sink != -kInf ? std::exp(sink - m) : 0.0;
  for (double sc : row.score) sum += std::exp(sc - m);
  row.lse = m + std::log(sum);
  row.p.reserve(row.score.size());
  for (double sc : row.score) row.p.push_back(std::exp(sc - m) / sum);
  return row;
}

// O = Σ_j P_ij·V_j of a row, and Σ_j P_ij·|V_j| beside it.
void weighted_values(const ExactRow& row, const std::vector<double>& values, int64_t dv,
                     double* out, double* out_abs) {
  std::fill(out, out + dv, 0.0);
  std::fill(out_abs, out_abs + dv, 0.0);
  for (size_t n = 0; n < row.keys.size(); ++n) {
    const double* vj = &values[size_t(row.keys[n] * dv)];
    for (int64_t c = 0; c < dv; ++c) {
      out[c] += row.p[n] * vj[c];
      out_abs[c] += row.p[n] * std::fabs(vj[c]);
    }
  }
}

// The same row the kernels' way: fp32 scores and softmax, P rounded to the dtype before P·V.
struct LowPrecisionRow {
  std::vector<int64_t> keys;
  std::vector<float> score;  // after softcap
  float lse = std::numeric_limits<float>::infinity();
  std::vector<double> out;  // rounded to the dtype; zeros for a row that sees no key
};

LowPrecisionRow low_precision_row(const Problem& p, const Sequence& s, int64_t h, int64_t i,
                                  const float* q,
                                  const std::vector<float>& keys_matrix,
                                  const std::vector<float>& values_matrix, float scale,
                                  float out_scale) {
  const int64_t d = p.head_dim_qk, dv = p.head_dim_v;
  const float cap = p.softcap;
  LowPrecisionRow row;
  row.out.assign(size_t(dv), 0.0);
  for (int64_t j = 0; j < s.len_k; ++j) {
    if (!sees(p, s, i, j)) continue;
    const float* kj = &keys_matrix[size_t(j * d)];
    float dot = 0.0f;
    for (int64_t c = 0; c < d; ++c) dot += q[c] * kj[c];
    float score = dot * scale;
    if (cap > 0.0f) score = cap * std::tanh(score / cap);
    score += float(alibi_bias(p, s, h, i, j));
    row.keys.push_back(j);
    row.score.push_back(score);
  }
  const float sink = float(sink_logit(p, h));
  if (row.keys.empty()) {
    if (sink != -std::numeric_limits<float>::infinity()) row.lse = sink;
    return row;
  }
  const float m = std::max(*std::max_element(row.score.begin(), row.score.end()), sink);
  float sum = sink != -std::numeric_limits<float>::infinity() ? std::exp(sink - m) : 0.0f;
  std::vector<float> acc(size_t(dv), 0.0f);
  for (size_t n = 0; n < row.keys.size(); ++n) {
    const float w = std::exp(row.score[n] - m);
    sum += w;
    const float w_stored = round_to(p.dtype, w);
    const float* vj = &values_matrix[size_t(row.keys[n] * dv)];
    for (int64_t c = 0; c < dv; ++c) acc[size_t(c)] += w_stored * vj[c];
  }
  for (int64_t c = 0; c < dv; ++c)
    row.out[size_t(c)] = round_to(output_dtype(p), acc[size_t(c)] / sum * out_scale);
  row.lse = m + std::log(sum);
  return row;
}

// Which rows of each (batch, head) to compute: all of them, or the sample.
class RowSelection {
 public:
  RowSelection(const Problem& p, const std::vector<RowSample>& rows) : heads_(p.heads_q) {
    if (rows.empty()) return;
    per_head_.resize(size_t(p.batch * p.heads_q));
    for (const RowSample& r : rows)
      if (r.batch >= 0 && r.batch < p.batch && r.head >= 0 && r.head < p.heads_q)
        per_head_[size_t(r.batch * heads_ + r.head)].push_back(r.row);
  }
  std::vector<int64_t> rows(int64_t b, int64_t h, int64_t len_q) const {
    std::vector<int64_t> out;
    if (per_head_.empty()) {
      for (int64_t i = 0; i < len_q; ++i) out.push_back(i);
    } else {
      for (int64_t i : per_head_[size_t(b * heads_ + h)])
        if (i >= 0 && i < len_q) out.push_back(i);
    }
    return out;
  }

 private:
  int64_t heads_;
  std::vector<std::vector<int64_t>> per_head_;
};

}  // namespace

namespace {

// Rotates query row `x` of sequence b, row i, as `r` says: in double, or (low) in fp32 with the
// result rounded to the dtype.
void rotate_query(const Problem& p, const QueryRotary& r, int64_t b, int64_t i, bool low,
                  std::vector<double>& x) {
  const int64_t pos = r.position[size_t(b)] + (r.per_row ? i : 0);
  const int64_t half = r.dim / 2;
  for (int64_t n = 0; n < half; ++n) {
    const double c = load(r.cos, output_dtype(p), pos * r.row_stride + n);
    const double sn = load(r.sin, output_dtype(p), pos * r.row_stride + n);
    const size_t a = size_t(r.interleaved ? 2 * n : n);
    const size_t z = size_t(r.interleaved ? 2 * n + 1 : n + half);
    if (low) {
      const float xa = float(x[a]), xz = float(x[z]), c32 = float(c), s32 = float(sn);
      x[a] = round_to(p.dtype, xa * c32 - xz * s32);
      x[z] = round_to(p.dtype, xa * s32 + xz * c32);
    } else {
      const double xa = x[a], xz = x[z];
      x[a] = xa * c - xz * sn;
      x[z] = xa * sn + xz * c;
    }
  }
}

}  // namespace

ForwardResult forward(const Problem& p, const TensorView& q, const TensorView& k,
                      const TensorView& v, Precision precision,
                      const std::vector<RowSample>& rows, const QueryRotary* rotary,
                      const Descales* descales) {
  const bool exact = precision == Precision::kExact;
  const int64_t d = p.head_dim_qk, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  const size_t lse_size = size_t(rows_q_total(p) * p.heads_q);
  ForwardResult r;
  r.out.assign(lse_size * size_t(dv), kNaN);
  r.lse.assign(lse_size, kNaN);
  if (exact) {
    r.out_abs.assign(r.out.size(), kNaN);
    r.score_abs.assign(lse_size, kNaN);
  }
  const RowSelection selection(p, rows);
  for (int64_t b = 0; b < p.batch; ++b) {
    const Sequence s = sequence_of(p, b);
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const float qd = descale_of(descales, &Descales::q, b, hk);
      const float kd = descale_of(descales, &Descales::k, b, hk);
      const float vd = descale_of(descales, &Descales::v, b, hk);
      const double scale = exact_scale(p) * double(qd) * double(kd);
      const float scale32 = fp32_scale(p) * qd * kd;
      const std::vector<double> keys = gather(k, p.dtype, s.batch, s.first_k, s.len_k, hk, d);
      const std::vector<double> values = gather(v, p.dtype, s.batch, s.first_k, s.len_k, hk, dv);
      const std::vector<float> keys32 = exact ? std::vector<float>{} : to_fp32(keys);
      const std::vector<float> values32 = exact ? std::vector<float>{} : to_fp32(values);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i : selection.rows(b, h, s.len_q)) {
          std::vector<double> qrow = gather(q, p.dtype, s.batch, s.first_q + i, 1, h, d);
          if (rotary != nullptr) rotate_query(p, *rotary, b, i, !exact, qrow);
          double* out = &r.out[size_t((dense_q_row(p, s, i) * p.heads_q + h) * dv)];
          const size_t li = size_t(lse_index(p, s, h, i));
          if (exact) {
            const ExactRow row = exact_row(p, s, h, i, qrow.data(), keys, scale);
            double* out_abs = &r.out_abs[size_t((dense_q_row(p, s, i) * p.heads_q + h) * dv)];
            weighted_values(row, values, dv, out, out_abs);
            for (int64_t c = 0; c < dv; ++c) {
              out[c] *= double(vd);
              out_abs[c] *= std::fabs(double(vd));
            }
            r.lse[li] = row.lse;
            r.score_abs[li] = row.score_abs;
          } else {
            const std::vector<float> qrow32 = to_fp32(qrow);
            const LowPrecisionRow row =
                low_precision_row(p, s, h, i, qrow32.data(), keys32, values32, scale32, vd);
            std::copy(row.out.begin(), row.out.end(), out);
            r.lse[li] = row.lse;
          }
        }
      }
    }
  }
  return r;
}

namespace {

// Gradients of one (batch entry, kv head): the rows of dQ of its query heads, and dK / dV.
struct HeadGradients {
  std::vector<double> dk, dv, dk_abs, dv_abs, dk_ds_abs, dk_via_d, dk_tiny, dv_tiny;
};

void exact_backward_head(const Problem& p, const Sequence& s, int64_t hk, const TensorView& q,
                         const TensorView& dout, const TensorView* given_out,
                         const std::vector<double>& keys, const std::vector<double>& values,
                         BackwardResult& r, HeadGradients& g) {
  const int64_t d = p.head_dim_qk, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  const double scale = exact_scale(p), scale_abs = std::fabs(scale);
  const double cap = p.softcap;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t i = 0; i < s.len_q; ++i) {
      const std::vector<double> qi = gather(q, p.dtype, s.batch, s.first_q + i, 1, h, d);
      const std::vector<double> doi = gather(dout, p.dtype, s.batch, s.first_q + i, 1, h, dv);
      const ExactRow row = exact_row(p, s, h, i, qi.data(), keys, scale);
      r.score_abs_max = std::max(r.score_abs_max, row.score_abs);
      // O and its absolute-value counterpart, then D = rowsum(dO ∘ O).
      std::vector<double> o(static_cast<size_t>(dv)), o_abs(static_cast<size_t>(dv));
      weighted_values(row, values, dv, o.data(), o_abs.data());
      if (given_out) o = gather(*given_out, p.dtype, s.batch, s.first_q + i, 1, h, dv);
      double D = 0.0, D_abs = 0.0;
      for (int64_t c = 0; c < dv; ++c) {
        D += doi[size_t(c)] * o[size_t(c)];
        D_abs += std::fabs(doi[size_t(c)]) * o_abs[size_t(c)];
      }
      // The sink's probability exp(sink − LSE) times D, summed over the head's rows.
      if (p.sinks != nullptr) {
        const double p_sink = std::exp(sink_logit(p, h) - row.lse);
        r.dsinks[size_t(h)] -= p_sink * D;
        r.dsinks_abs[size_t(h)] += p_sink * D_abs;
      }
      std::vector<double> dqi(size_t(d), 0.0), dqi_abs(size_t(d), 0.0), dqi_ds_abs(size_t(d), 0.0),
          dqi_via_d(size_t(d), 0.0), dqi_tiny(size_t(d), 0.0);
      for (size_t n = 0; n < row.keys.size(); ++n) {
        const int64_t j = row.keys[n];
        const double* vj = &values[size_t(j * dv)];
        const double* kj = &keys[size_t(j * d)];
        double dP = 0.0, dP_abs = 0.0;
        for (int64_t c = 0; c < dv; ++c) {
          dP += doi[size_t(c)] * vj[c];
          dP_abs += std::fabs(doi[size_t(c)] * vj[c]);
        }
        // Softcap: d(capped)/d(scaled) = 1 − t², t = capped / cap. Its error grows with |dt/ds|
        // = 2|t| / cap per unit of score error, hence the extra weight in the error scales.
        double chain = 1.0, chain_abs = 1.0;
        if (cap > 0.0) {
          const double t = (row.score[n] - alibi_bias(p, s, h, i, j)) / cap;  // before ALiBi
          chain = 1.0 - t * t;
          chain_abs = std::fabs(chain) + 2.0 * std::fabs(t) / cap;
        }
        const double pj = row.p[n];
        const double dS = pj * (dP - D) * chain;
        const double dS_abs = pj * (dP_abs + D_abs) * chain_abs;
        const double dS_magnitude = pj * std::fabs(dP - D) * chain_abs;
        const double dS_via_d = given_out ? 0.0 : pj * D_abs * chain_abs;
        // An absolute error of P reaches dS times |dP − D|, dS's own rounding adds one.
        const double dS_tiny = std::fabs(dP - D) * chain_abs + 1.0;
        for (int64_t c = 0; c < d; ++c) {
          dqi[size_t(c)] += scale * dS * kj[c];
          dqi_abs[size_t(c)] += scale_abs * dS_abs * std::fabs(kj[c]);
          dqi_ds_abs[size_t(c)] += scale_abs * dS_magnitude * std::fabs(kj[c]);
          dqi_via_d[size_t(c)] += scale_abs * dS_via_d * std::fabs(kj[c]);
          dqi_tiny[size_t(c)] += scale_abs * (dS_tiny * std::fabs(kj[c]) + 1.0) + 1.0;
          const size_t kc = size_t(j * d + c);
          g.dk[kc] += scale * dS * qi[size_t(c)];
          g.dk_abs[kc] += scale_abs * dS_abs * std::fabs(qi[size_t(c)]);
          g.dk_ds_abs[kc] += scale_abs * dS_magnitude * std::fabs(qi[size_t(c)]);
          g.dk_via_d[kc] += scale_abs * dS_via_d * std::fabs(qi[size_t(c)]);
          g.dk_tiny[kc] += scale_abs * (dS_tiny * std::fabs(qi[size_t(c)]) + 1.0) + 1.0;
        }
        for (int64_t c = 0; c < dv; ++c) {
          const size_t vc = size_t(j * dv + c);
          g.dv[vc] += pj * doi[size_t(c)];
          g.dv_abs[vc] += pj * std::fabs(doi[size_t(c)]);
          g.dv_tiny[vc] += std::fabs(doi[size_t(c)]) + 1.0;
        }
      }
      const size_t base = size_t((dense_q_row(p, s, i) * p.heads_q + h) * d);
      std::copy(dqi.begin(), dqi.end(), r.dq.begin() + long(base));
      std::copy(dqi_abs.begin(), dqi_abs.end(), r.dq_abs.begin() + long(base));
      std::copy(dqi_ds_abs.begin(), dqi_ds_abs.end(), r.dq_ds_abs.begin() + long(base));
      std::copy(dqi_via_d.begin(), dqi_via_d.end(), r.dq_via_d.begin() + long(base));
      std::copy(dqi_tiny.begin(), dqi_tiny.end(), r.dq_tiny.begin() + long(base));
    }
  }
}

void low_precision_backward_head(const Problem& p, const Sequence& s, int64_t hk,
                                 const TensorView& q, const TensorView& dout,
                                 const TensorView* given_out, const std::vector<double>& keys,
                                 const std::vector<double>& values, BackwardResult& r,
                                 std::vector<float>& dk_acc, std::vector<float>& dv_acc) {
  const int64_t d = p.head_dim_qk, dv = p.head_dim_v, group = p.heads_q / p.heads_kv;
  const float scale = fp32_scale(p);
  const float cap = p.softcap;
  const std::vector<float> keys32 = to_fp32(keys), values32 = to_fp32(values);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t i = 0; i < s.len_q; ++i) {
      const std::vector<float> qi = to_fp32(gather(q, p.dtype, s.batch, s.first_q + i, 1, h, d));
      const std::vector<float> doi =
          to_fp32(gather(dout, p.dtype, s.batch, s.first_q + i, 1, h, dv));
      const LowPrecisionRow row =
          low_precision_row(p, s, h, i, qi.data(), keys32, values32, scale, 1.0f);
      const std::vector<double> o =
          given_out ? gather(*given_out, p.dtype, s.batch, s.first_q + i, 1, h, dv) : row.out;
      float D = 0.0f;
      for (int64_t c = 0; c < dv; ++c) D += doi[size_t(c)] * float(o[size_t(c)]);
      if (p.sinks != nullptr)
        r.dsinks[size_t(h)] -= double(std::exp(float(sink_logit(p, h)) - row.lse) * D);
      std::vector<float> dq_acc(size_t(d), 0.0f);
      for (size_t n = 0; n < row.keys.size(); ++n) {
        const int64_t j = row.keys[n];
        const float* vj = &values32[size_t(j * dv)];
        const float* kj = &keys32[size_t(j * d)];
        const float pj = std::exp(row.score[n] - row.lse);
        float dP = 0.0f;
        for (int64_t c = 0; c < dv; ++c) dP += doi[size_t(c)] * vj[c];
        float chain = 1.0f;
        if (cap > 0.0f) {
          const float t = (row.score[n] - float(alibi_bias(p, s, h, i, j))) / cap;
          chain = 1.0f - t * t;
        }
        const float dS = round_to(p.dtype, pj * (dP - D) * chain);
        const float p_stored = round_to(p.dtype, pj);
        for (int64_t c = 0; c < d; ++c) {
          dq_acc[size_t(c)] += dS * kj[c];
          dk_acc[size_t(j * d + c)] += dS * qi[size_t(c)];
        }
        for (int64_t c = 0; c < dv; ++c) dv_acc[size_t(j * dv + c)] += p_stored * doi[size_t(c)];
      }
      const size_t base = size_t((dense_q_row(p, s, i) * p.heads_q + h) * d);
      for (int64_t c = 0; c < d; ++c)
        r.dq[base + size_t(c)] = round_to(p.dtype, scale * dq_acc[size_t(c)]);
    }
  }
}

}  // namespace

BackwardResult backward(const Problem& p, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& dout, Precision precision,
                        const TensorView* out) {
  const bool exact = precision == Precision::kExact;
  const int64_t d = p.head_dim_qk, dv = p.head_dim_v;
  BackwardResult r;
  r.dq.assign(size_t(rows_q_total(p) * p.heads_q * d), kNaN);
  r.dk.assign(size_t(rows_k_total(p) * p.heads_kv * d), kNaN);
  r.dv.assign(size_t(rows_k_total(p) * p.heads_kv * dv), kNaN);
  if (exact) {
    r.dq_abs = r.dq_ds_abs = r.dq_via_d = r.dq_tiny = r.dq;
    r.dk_abs = r.dk_ds_abs = r.dk_via_d = r.dk_tiny = r.dk;
    r.dv_abs = r.dv_tiny = r.dv;
  }
  if (p.sinks != nullptr) {
    r.dsinks.assign(size_t(p.heads_q), 0.0);
    if (exact) r.dsinks_abs.assign(size_t(p.heads_q), 0.0);
  }
  const float scale32 = fp32_scale(p);
  for (int64_t b = 0; b < p.batch; ++b) {
    const Sequence s = sequence_of(p, b);
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const std::vector<double> keys = gather(k, p.dtype, s.batch, s.first_k, s.len_k, hk, d);
      const std::vector<double> values = gather(v, p.dtype, s.batch, s.first_k, s.len_k, hk, dv);
      // Key rows past seqused_k stay zero: no query sees them.
      HeadGradients g;
      g.dk.assign(size_t(s.rows_k * d), 0.0);
      g.dv.assign(size_t(s.rows_k * dv), 0.0);
      if (exact) {
        g.dk_abs = g.dk_ds_abs = g.dk_via_d = g.dk_tiny = g.dk;
        g.dv_abs = g.dv_tiny = g.dv;
        exact_backward_head(p, s, hk, q, dout, out, keys, values, r, g);
      } else {
        std::vector<float> dk_acc(g.dk.size(), 0.0f), dv_acc(g.dv.size(), 0.0f);
        low_precision_backward_head(p, s, hk, q, dout, out, keys, values, r, dk_acc, dv_acc);
        for (size_t n = 0; n < dk_acc.size(); ++n) g.dk[n] = round_to(p.dtype, scale32 * dk_acc[n]);
        for (size_t n = 0; n < dv_acc.size(); ++n) g.dv[n] = round_to(p.dtype, dv_acc[n]);
      }
      for (int64_t j = 0; j < s.rows_k; ++j) {
        const size_t kbase = size_t((dense_k_row(p, s, j) * p.heads_kv + hk) * d);
        const size_t vbase = size_t((dense_k_row(p, s, j) * p.heads_kv + hk) * dv);
        for (int64_t c = 0; c < d; ++c) {
          r.dk[kbase + size_t(c)] = g.dk[size_t(j * d + c)];
          if (exact) {
            r.dk_abs[kbase + size_t(c)] = g.dk_abs[size_t(j * d + c)];
            r.dk_ds_abs[kbase + size_t(c)] = g.dk_ds_abs[size_t(j * d + c)];
            r.dk_via_d[kbase + size_t(c)] = g.dk_via_d[size_t(j * d + c)];
            r.dk_tiny[kbase + size_t(c)] = g.dk_tiny[size_t(j * d + c)];
          }
        }
        for (int64_t c = 0; c < dv; ++c) {
          r.dv[vbase + size_t(c)] = g.dv[size_t(j * dv + c)];
          if (exact) {
            r.dv_abs[vbase + size_t(c)] = g.dv_abs[size_t(j * dv + c)];
            r.dv_tiny[vbase + size_t(c)] = g.dv_tiny[size_t(j * dv + c)];
          }
        }
      }
    }
  }
  return r;
}

}  // namespace fa4::ref
