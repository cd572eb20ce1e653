// Test utilities: host tensors in every layout the API accepts, random inputs whose seed is
// reported, the test problems ("cases") the numerical suites run, and the checks they apply —
// docs/testing.md's rule, and the tighter fp32-accumulation bounds the CPU backend must meet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/reference.hpp"
#include "fa4/attention.hpp"

namespace fa4::test {

// ---- Seeds: fresh inputs on every run, reproducible on demand.

// FA4_TEST_SEED when set, else drawn once per process from std::random_device.
uint64_t base_seed();
// "seed 1234 (rerun with FA4_TEST_SEED=1234)": put it in every failure message (SCOPED_TRACE).
std::string seed_note();
// A generator for one test: the base seed mixed with the test's name, so that rerunning a single
// test with FA4_TEST_SEED reproduces its inputs.
std::mt19937_64 make_rng(const std::string& name);

// ---- Host tensors

enum class Layout {
  kContiguous,  // (batch, seq, heads, dim), densely packed
  kPadded,     // every stride padded (odd gaps after each head, row and batch, and before the data)
  kHeadMajor,  // memory order (batch, heads, seq, dim): a permuted view, seq_stride = dim
  // Padded in odd numbers of 16-element units: every stride a multiple of 16 bytes, as the sm90
  // backend's TMA needs, even for one-byte (e4m3) elements.
  kPadded16,
};
const char* layout_name(Layout layout);

// Extents of a (batch, seq, heads, dim) view; varlen tensors are batch = 1, seq = total rows.
struct Dims {
  int64_t batch = 1, seq = 0, heads = 0, dim = 0;
  int64_t size() const { return batch * seq * heads * dim; }
};

// A view of `dims` over a buffer it owns or shares (q, k, v packed in one buffer). Elements are
// addressed by their index in the dense [batch][seq][heads][dim] order, the reference's order.
// The whole buffer, gaps included, starts out poisoned (NaN with a recognisable payload).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Dims dims, Layout layout = Layout::kContiguous);
  // Any strides; `buffer_elems` elements are allocated and the view starts at `base`.
  static HostTensor strided(DType dtype, Dims dims, const int64_t (&strides)[4], int64_t base,
                            int64_t buffer_elems);
  // q, k, v as slices of one buffer whose token rows hold [q heads | k heads | v heads], as a
  // packed qkv projection would produce them: non-contiguous views with a shared row stride.
  static std::vector<HostTensor> packed_qkv(DType dtype, int64_t batch, int64_t seq,
                                            int64_t heads_q, int64_t heads_kv, int64_t dim);

  DType dtype() const { return dtype_; }
  const Dims& dims() const { return dims_; }
  int64_t size() const { return dims_.size(); }
  TensorView view() const;

  double get(int64_t index) const;
  void set(int64_t index, double value);  // rounds to the dtype
  std::vector<double> dense() const;

  void fill_normal(std::mt19937_64& rng, double stddev = 1.0);
  // Normal values, then a fraction of the (batch, seq, head) rows scaled by `factor`: a few large
  // logits at random positions, so the online softmax meets new maxima late and must rescale.
  void fill_spiky(std::mt19937_64& rng, double fraction, double factor);
  void poison();  // every element of this view
  // Every element of rows [first, first + count) of batch entry `batch` (all heads).
  void poison_rows(int64_t batch, int64_t first, int64_t count);
  bool is_poison(int64_t index) const;
  uint64_t bits(int64_t index) const;  // the stored bit pattern, for bitwise comparisons

  // Elements of the shared buffer covered by none of `views` (all over one buffer) that no longer
  // hold the poison: writes out of bounds or into gaps.
  static int64_t stray_writes(const std::vector<const HostTensor*>& views);

 private:
  int64_t offset(int64_t index) const;
  void store_bits(int64_t offset, uint64_t bits);
  uint64_t load_bits(int64_t offset) const;
  DType dtype_ = DType::kFP32;
  Dims dims_{};
  int64_t strides_[4] = {0, 0, 0, 1};  // batch, seq, head, dim
  int64_t base_ = 0;
  std::shared_ptr<std::vector<unsigned char>> buffer_;
  int64_t buffer_elems_ = 0;
};

// fp32 log-sum-exp, (batch, heads, seq) or varlen (1, heads, total); dense order
// [batch][heads][seq].
class HostLse {
 public:
  HostLse() = default;
  HostLse(int64_t batch, int64_t heads, int64_t seq, bool padded);
  LseView view() const;
  int64_t size() const { return t_.size(); }
  int64_t batch() const { return t_.dims().batch; }
  int64_t heads() const { return t_.dims().seq; }
  int64_t seq() const { return t_.dims().heads; }
  double get(int64_t index) const { return t_.get(index); }
  std::vector<double> dense() const { return t_.dense(); }
  void poison() { t_.poison(); }
  bool is_poison(int64_t index) const { return t_.is_poison(index); }
  int64_t stray_writes() const { return HostTensor::stray_writes({&t_}); }

 private:
  HostTensor t_;  // dims (batch, heads, seq, 1)
};

// Host memory for the backend's workspace, 256-byte aligned as the API asks.
class HostWorkspace {
 public:
  explicit HostWorkspace(size_t bytes);
  Workspace view() { return {aligned_, bytes_}; }

 private:
  std::vector<unsigned char> storage_;
  void* aligned_ = nullptr;
  size_t bytes_ = 0;
};

// ---- Test problems

struct Case {
  std::string name;  // a valid GoogleTest name, unique in its suite
  int64_t batch = 1, seqlen_q = 0,
          seqlen_k = 0;                 // fixed-length shape (batch from lens_q in varlen)
  std::vector<int32_t> lens_q, lens_k;  // non-empty: varlen with these sequence lengths
  std::vector<int32_t> seqused_k;       // optional, one per sequence
  int64_t heads_q = 1, heads_kv = 1, dim_qk = 64, dim_v = 64;
  DType dtype = DType::kBF16;
  bool causal = false;
  Window window{};
  float softcap = 0.0f;
  float scale = 0.0f;
  Layout layout = Layout::kContiguous;
  bool packed_qkv = false;  // needs seqlen_q == seqlen_k (lens_q == lens_k) and dim_qk == dim_v
  bool spiky = false;
  bool return_lse = true;
  bool deterministic = false;
  // Score variants: learnable sinks (logits drawn around the rows' LSE scale, some dominant) and
  // ALiBi slopes per query head or per (batch entry, query head).
  bool sinks = false;
  enum class Alibi { kNone, kPerHead, kPerBatchHead } alibi = Alibi::kNone;
};
std::string describe(const Case& c);  // every parameter, for failure messages
// How GoogleTest prints a Case parameter (its name, not its bytes).
void PrintTo(const Case& c, std::ostream* os);

// How an e4m3 case passes its descales: none, one shared by all through zero strides, or one per
// (batch entry, kv head).
enum class Descaling { kNone, kShared, kPerHead };
const char* descaling_tag(Descaling how);  // the case name's "_nodescale", "_shared_descale", ...
// A dense (batch, heads_kv) descale array at `data` (host or device memory) as `how` passes it.
DescaleView descale_view(const float* data, const Problem& p, Descaling how);

// The shape part of a case: fixed-length (batch, seqlen_q, seqlen_k), or varlen when lens_q is
// non-empty; seqused_k when used_k is non-empty.
struct CaseShape {
  const char* tag;
  int64_t batch, seqlen_q, seqlen_k;
  std::vector<int32_t> lens_q, lens_k, used_k;
};

// A covering design rather than the full product: one case per (shape, mask kind {none, causal,
// window}, softcap off/on, dtype {bf16, fp16, fp32}); window variants, GQA ratio {1, 4, 7, 8,
// 64/8}, head dims {32 … 256, 192/128}, layout {contiguous, padded, head-major, packed qkv}, input
// kind, custom scale, return_lse and deterministic rotate with a fixed hash of the case number, the
// (heads, dims) pair stepping on until pairs·heads_q·(dqk + dv) ≤ budget. The matrix is the same
// on every run (only the input values are fresh), so a failing case keeps its name.
std::vector<Case> covering_cases(const std::vector<CaseShape>& shapes, int64_t budget,
                                 const char* prefix);

// The score variants the suites rotate through, the n-th of three: sinks; ALiBi per head; sinks
// with ALiBi per (batch, head). The case's name says which.
Case with_variant(Case c, size_t n);

// Rows a varlen case's tensors have beyond its last sequence: never to be written.
constexpr int64_t kVarlenSpareRows = 3;

// A case made concrete: the problem (pointing into this object's arrays) and its input tensors.
struct CaseData {
  Problem problem;
  std::vector<int32_t> cu_q, cu_k, used_k;
  std::vector<float> sinks, alibi_slopes;  // the score variants' arrays, when the case has them
  HostTensor q, k, v;
  Layout layout = Layout::kContiguous;  // for the outputs
  bool packed = false;

  CaseData() = default;
  CaseData(const CaseData&) = delete;
  CaseData& operator=(const CaseData&) = delete;
};
std::unique_ptr<CaseData> make_setup(const Case& c, std::mt19937_64& rng);

// The score variants' arrays drawn into *sinks_out and *slopes_out and pointed at by p: sinks
// around the size of the rows' log-sum-exps (a few dominant), ALiBi slopes of ALiBi's geometric
// series 2^(-8 (h + 1) / H), per head or scaled per batch entry. Nothing drawn when neither is on.
void draw_score_variants(bool sinks, Case::Alibi alibi, Problem& p, std::vector<float>* sinks_out,
                         std::vector<float>* slopes_out, std::mt19937_64& rng);

// Overwrites with the poison (NaN) the input rows no query may read: rows of K and V at or beyond
// seqused_k[b] inside sequence b, and varlen rows of Q, K and V past the last sequence. Any
// arithmetic with them shows (a backend that multiplies P = 0 by such a V row gets NaN), so the
// checks prove that they take no part; the reference never reads them.
void poison_unused_rows(CaseData& s);

// Dims of a tensor with the query rows (q, out, dout, dq) or the key rows (k, v, dk, dv).
Dims query_dims(const Problem& p, int64_t heads, int64_t dim);
Dims key_dims(const Problem& p, int64_t heads, int64_t dim);
HostLse make_lse(const Problem& p, bool padded);

// For each row of the dense query (keys = false) or key (keys = true) layout: does it belong to a
// sequence? (Every row does in fixed-length mode.)
std::vector<unsigned char> rows_in_sequences(const Problem& p, bool keys);

// ---- Checks

// How the elements of a dense array are named in messages.
struct DenseShape {
  std::vector<std::string> names;  // outermost first
  std::vector<int64_t> extents;
  std::string where(int64_t index) const;  // e.g. "b=1 s=17 h=3 d=5"
};
DenseShape tensor_shape(const Dims& dims);
DenseShape lse_shape(const Problem& p);

struct CheckResult {
  bool ok = false;
  std::string message;   // what was compared, the largest error, where, and the tolerance
  int64_t compared = 0;  // elements compared: those whose reference is not NaN
  double max_error = 0.0;
};

// docs/testing.md: pass iff max|X − ref| ≤ multiplier·max|lp − ref| + atol over the elements whose
// reference is computed (not NaN). NaN in X never passes; an infinite reference (LSE of a row that
// sees no key) must be matched exactly.
CheckResult check_flash_rule(const std::string& what, const DenseShape& shape,
                             const std::vector<double>& actual, const std::vector<double>& ref,
                             const std::vector<double>& lp, double multiplier, double atol);

// The rule's constants: multiplier 2 (3 with softcap); atol 1e-5 forward, 1e-4 backward.
struct FlashRule {
  double multiplier, atol;
};
FlashRule flash_rule(const Problem& p, Pass pass);

// What the rule's atol gains with ALiBi, for an output of this magnitude: 4 fp32 ulps of the
// largest logit, |scale · S| (score_abs_max: the reference's largest |scale|·Σ_c |Q_ic·K_jc|)
// plus the largest bias (slope · (seqlen_q + seqlen_k)). The bias adds a rounding to each logit
// that the backend's forward and backward need not make alike, relative to the logit's size:
// the relative error u·|logit| of each P (recomputed in the backward, summed into LSE in the
// forward) is one lp need not share, its forward and backward scoring a pair bit for bit alike.
// Logits reach ~1000 at 2k tokens through the bias, ~100 through spiky inputs' scores. 0 without
// ALiBi.
double alibi_slack(const Problem& p, double magnitude, double score_abs_max);
// The largest |x| over the finite elements of v (0 if none).
double max_finite_abs(const std::vector<double>& v);

// Element by element: |X − ref| ≤ bound, same NaN / infinity handling as check_flash_rule.
CheckResult check_bounded(const std::string& what, const DenseShape& shape,
                          const std::vector<double>& actual, const std::vector<double>& ref,
                          const std::vector<double>& bound);

// The CPU backend's bounds: scores, softmax and sums in fp32, each output rounded once to the
// dtype. Per element, with u = 2⁻²⁴ and the error scales of an exact reference:
//   e32   = u·(c_acc·√n + c_exp + c_dot·√d·score_abs)·out_abs         (forward)
//   bound = e32 + u_dtype·(|ref| + e32)                               (the final rounding)
// n = seqlen_k keys summed, d = head_dim_qk (the score dot products), u_dtype the dtype's half-ulp
// (2⁻⁸ bf16, 2⁻¹¹ fp16, 2⁻²⁴ fp32). See test_util.cpp for the derivation and the backward terms.
std::vector<double> cpu_out_bound(const Problem& p, const ref::ForwardResult& exact);
std::vector<double> cpu_lse_bound(const Problem& p, const ref::ForwardResult& exact);
// Hopper's FP8 tensor cores add the products of QKᵀ with fewer mantissa bits than fp32: each
// score is off by up to about 2⁻¹² (measured) of the sum of |terms| it adds, scale · q_descale ·
// k_descale · Σ_d |q_d·k_d|. LSE, a smooth maximum of the row's scores, moves by at most the
// largest of their errors: cpu_lse_bound plus twice that measured share of the reference's
// score_abs (the sum's maximum over the row's visible keys, with the descales).
constexpr double kFp8ScoreShare = 0x1p-11;
std::vector<double> fp8_lse_bound(const Problem& p, const ref::ForwardResult& exact);
struct GradientBounds {
  std::vector<double> dq, dk, dv;
};
GradientBounds cpu_gradient_bounds(const Problem& p, const ref::BackwardResult& exact);

// Every element of the rows marked in `rows` was written (finite; LSE may also be +inf), and every
// element of the other rows still holds the poison.
CheckResult check_written(const std::string& what, const HostTensor& t,
                          const std::vector<unsigned char>& rows);
CheckResult check_written(const std::string& what, const HostLse& t,
                          const std::vector<unsigned char>& rows);
// dQ, dK, dV of a backward pass: check_written on each (query rows for dQ, key rows for dK / dV),
// and nothing written outside the views (between the three views of a packed dqkv too). One
// result per gradient, then one for the views' surroundings.
std::vector<CheckResult> check_gradients_written(const std::vector<HostTensor>& grads,
                                                 const std::vector<unsigned char>& q_rows,
                                                 const std::vector<unsigned char>& k_rows,
                                                 bool packed);

}  // namespace fa4::test
