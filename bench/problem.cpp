#include "problem.hpp"

#include <algorithm>
#include <sstream>

#include "common/mask.hpp"
#include "common/numeric.hpp"

namespace fa4::bench {
namespace {

// The backward pass recomputes S and P (2 GEMMs' worth) and computes dV, dP, dQ, dK (4 more) on
// top of the forward's 2: FlashAttention's convention counts it as 2.5 forwards.
constexpr double kBackwardFlopRatio = 2.5;

std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> offsets(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) offsets[i + 1] = offsets[i] + lengths[i];
  return offsets;
}

}  // namespace

std::string make_problem(const Options& o, SequenceArrays& arrays, Problem* problem) {
  Problem p;
  p.heads_q = o.heads_q;
  p.heads_kv = o.heads_kv;
  p.head_dim_qk = o.head_dim;
  p.head_dim_v = o.head_dim_v;
  p.dtype = o.dtype;
  p.causal = o.causal;
  p.window = o.window;
  p.softcap = o.softcap;
  p.softmax_scale = o.scale;
  p.return_lse = o.lse;
  p.deterministic = o.deterministic;

  if (!o.varlen_q.empty()) {
    int64_t total_q = 0, total_k = 0;
    for (int32_t n : o.varlen_q) total_q += n;
    for (int32_t n : o.varlen_k) total_k += n;
    if (total_q > INT32_MAX || total_k > INT32_MAX)
      return "the --varlen / --varlen-k lengths add up to more than 2^31 - 1 rows";
    arrays.cu_seqlens_q = prefix_sums(o.varlen_q);
    arrays.cu_seqlens_k = prefix_sums(o.varlen_k);
    p.batch = int64_t(o.varlen_q.size());
    p.seqlen_q = *std::max_element(o.varlen_q.begin(), o.varlen_q.end());
    p.seqlen_k = *std::max_element(o.varlen_k.begin(), o.varlen_k.end());
    p.varlen.cu_seqlens_q = arrays.cu_seqlens_q.data();
    p.varlen.cu_seqlens_k = arrays.cu_seqlens_k.data();
    p.varlen.total_q = total_q;
    p.varlen.total_k = total_k;
  } else {
    p.batch = o.batch;
    p.seqlen_q = o.seqlen_q;
    p.seqlen_k = o.seqlen_k;
  }

  if (!o.seqused_k.empty()) {
    arrays.seqused_k = o.seqused_k;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t keys = p.is_varlen() ? o.varlen_k[b] : p.seqlen_k;
      if (arrays.seqused_k[b] > keys) {
        std::ostringstream msg;
        msg << "--seqused-k: sequence " << b << " uses " << arrays.seqused_k[b]
            << " keys but has only " << keys;
        return msg.str();
      }
    }
    p.seqused_k = arrays.seqused_k.data();
  }
  *problem = p;
  return {};
}

int64_t query_rows(const Problem& p) { return p.is_varlen() ? p.varlen.total_q : p.seqlen_q; }
int64_t key_rows(const Problem& p) { return p.is_varlen() ? p.varlen.total_k : p.seqlen_k; }

int64_t sequence_queries(const Problem& p, int64_t b) {
  return p.is_varlen() ? p.varlen.cu_seqlens_q[b + 1] - p.varlen.cu_seqlens_q[b] : p.seqlen_q;
}

int64_t sequence_keys(const Problem& p, int64_t b) {
  if (p.seqused_k != nullptr) return p.seqused_k[b];
  return p.is_varlen() ? p.varlen.cu_seqlens_k[b + 1] - p.varlen.cu_seqlens_k[b] : p.seqlen_k;
}

int64_t visible_pairs(const Problem& p) {
  int64_t pairs = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t sq = sequence_queries(p, b), sk = sequence_keys(p, b);
    const BandMask mask = BandMask::make(sq, sk, p.causal, p.window.left, p.window.right);
    for (int64_t i = 0; i < sq; ++i) {
      int64_t lo = 0, hi = 0;
      mask.key_range(i, &lo, &hi);
      pairs += std::max<int64_t>(0, hi - lo);
    }
  }
  return pairs;
}

int64_t score_elements(const Problem& p) {
  int64_t scores = 0;
  for (int64_t b = 0; b < p.batch; ++b) scores += sequence_queries(p, b) * sequence_keys(p, b);
  return scores * p.heads_q;
}

double forward_flops(const Problem& p) {
  // QKᵀ: 2·d_qk FLOPs per visible pair; PV: 2·d_v.
  return 2.0 * double(p.head_dim_qk + p.head_dim_v) * double(p.heads_q) * double(visible_pairs(p));
}

double backward_flops(const Problem& p) { return kBackwardFlopRatio * forward_flops(p); }

std::string describe(const Problem& p) {
  std::ostringstream s;
  s << dtype_name(p.dtype);
  if (p.is_varlen()) {
    s << " varlen b=" << p.batch << " q=";
    for (int64_t b = 0; b < p.batch; ++b) s << (b ? ":" : "") << sequence_queries(p, b);
    s << " k=";
    for (int64_t b = 0; b < p.batch; ++b)
      s << (b ? ":" : "") << p.varlen.cu_seqlens_k[b + 1] - p.varlen.cu_seqlens_k[b];
  } else {
    s << " b=" << p.batch << " sq=" << p.seqlen_q << " sk=" << p.seqlen_k;
  }
  if (p.seqused_k != nullptr) {
    s << " seqused_k=";
    for (int64_t b = 0; b < p.batch; ++b) s << (b ? ":" : "") << p.seqused_k[b];
  }
  s << " hq=" << p.heads_q << " hkv=" << p.heads_kv << " d=" << p.head_dim_qk << " dv=" << p.head_dim_v;
  if (p.causal) s << " causal";
  if (p.window.left >= 0 || p.window.right >= 0)
    s << " window=" << p.window.left << "," << p.window.right;
  if (p.softcap > 0.0f) s << " softcap=" << p.softcap;
  if (p.softmax_scale != 0.0f) s << " scale=" << p.softmax_scale;
  return s.str();
}

}  // namespace fa4::bench
