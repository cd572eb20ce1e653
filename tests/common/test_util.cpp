#include "common/test_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>

#include "common/numeric.hpp"

namespace fa4::test {

// ---- Seeds

uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FA4_TEST_SEED"); env != nullptr && *env != '\0')
      return uint64_t(std::strtoull(env, nullptr, 0));
    std::random_device device;
    return (uint64_t(device()) << 32) ^ uint64_t(device());
  }();
  return seed;
}

std::string seed_note() {
  const std::string s = std::to_string(base_seed());
  return "seed " + s + " (rerun with FA4_TEST_SEED=" + s + ")";
}

namespace {
// splitmix64's finaliser: spreads the name's hash over every bit before it seeds the generator.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a: a name hash that is the same with every standard library, unlike std::hash.
uint64_t name_hash(const std::string& name) {
  constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull, kPrime = 0x100000001b3ull;
  uint64_t h = kOffsetBasis;
  for (unsigned char c : name) h = (h ^ c) * kPrime;
  return h;
}
}  // namespace

std::mt19937_64 make_rng(const std::string& name) {
  return std::mt19937_64(mix(base_seed() ^ mix(name_hash(name))));
}

// ---- Host tensors

namespace {

// Quiet NaNs with a payload no arithmetic produces, so "still poison" means "never written".
constexpr uint64_t kPoisonBF16 = 0x7fe1;
constexpr uint64_t kPoisonFP16 = 0x7f21;
constexpr uint64_t kPoisonFP32 = 0x7fe1dead;
// e4m3 has two NaNs and no payload: the negative one, which no rounding of ours produces from a
// number.
constexpr uint64_t kPoisonE4M3 = 0xff;

uint64_t poison_bits(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return kPoisonBF16;
    case DType::kFP16: return kPoisonFP16;
    case DType::kE4M3: return kPoisonE4M3;
    default: return kPoisonFP32;
  }
}

// Padding of Layout::kPadded, in elements: odd, so that rows start at every alignment.
constexpr int64_t kLeadPad = 13;
constexpr int64_t kHeadPad = 5;
constexpr int64_t kRowPad = 3;
constexpr int64_t kBatchPad = 11;
constexpr int64_t kTailPad = 7;
// Layout::kPadded16's unit: 16 elements, 16 bytes for e4m3. Rows start 16-byte aligned but at
// varied offsets within a 128-byte line.
constexpr int64_t kAlignedPad = 16;

}  // namespace

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kPadded: return "padded";
    case Layout::kHeadMajor: return "head-major";
    case Layout::kPadded16: return "padded (16-element units)";
  }
  return "?";
}

HostTensor::HostTensor(DType dtype, Dims d, Layout layout) {
  const int64_t B = d.batch, S = d.seq, H = d.heads, D = d.dim;
  switch (layout) {
    case Layout::kContiguous: {
      const int64_t strides[4] = {S * H * D, H * D, D, 1};
      *this = strided(dtype, d, strides, 0, B * S * H * D);
      break;
    }
    case Layout::kPadded: {
      const int64_t head = D + kHeadPad, row = H * head + kRowPad, batch = S * row + kBatchPad;
      const int64_t strides[4] = {batch, row, head, 1};
      *this = strided(dtype, d, strides, kLeadPad, kLeadPad + B * batch + kTailPad);
      break;
    }
    case Layout::kHeadMajor: {
      const int64_t strides[4] = {H * S * D, D, S * D, 1};
      *this = strided(dtype, d, strides, 0, B * S * H * D);
      break;
    }
    case Layout::kPadded16: {
      const int64_t head = D + kAlignedPad, row = H * head + 3 * kAlignedPad,
                    batch = S * row + 5 * kAlignedPad;
      const int64_t strides[4] = {batch, row, head, 1};
      *this = strided(dtype, d, strides, kAlignedPad, kAlignedPad + B * batch + kAlignedPad);
      break;
    }
  }
}

HostTensor HostTensor::strided(DType dtype, Dims dims, const int64_t (&strides)[4], int64_t base,
                               int64_t buffer_elems) {
  HostTensor t;
  t.dtype_ = dtype;
  t.dims_ = dims;
  std::copy(strides, strides + 4, t.strides_);
  t.base_ = base;
  // At least one element, so that even an empty view has a non-null pointer.
  t.buffer_elems_ = std::max<int64_t>(buffer_elems, 1);
  t.buffer_ =
      std::make_shared<std::vector<unsigned char>>(size_t(t.buffer_elems_) * dtype_size(dtype));
  for (int64_t e = 0; e < t.buffer_elems_; ++e) t.store_bits(e, poison_bits(dtype));
  return t;
}

std::vector<HostTensor> HostTensor::packed_qkv(DType dtype, int64_t batch, int64_t seq,
                                               int64_t heads_q, int64_t heads_kv, int64_t dim) {
  const int64_t row = (heads_q + 2 * heads_kv) * dim;
  const int64_t strides[4] = {seq * row, row, dim, 1};
  HostTensor q = strided(dtype, {batch, seq, heads_q, dim}, strides, 0, batch * seq * row);
  HostTensor k = q, v = q;
  k.dims_.heads = v.dims_.heads = heads_kv;
  k.base_ = heads_q * dim;
  v.base_ = (heads_q + heads_kv) * dim;
  return {q, k, v};
}

TensorView HostTensor::view() const {
  TensorView v;
  v.data = buffer_->data() + size_t(base_) * dtype_size(dtype_);
  v.batch_stride = strides_[0];
  v.seq_stride = strides_[1];
  v.head_stride = strides_[2];
  v.dim_stride = strides_[3];
  return v;
}

int64_t HostTensor::offset(int64_t index) const {
  const int64_t c = index % dims_.dim;
  index /= dims_.dim;
  const int64_t h = index % dims_.heads;
  index /= dims_.heads;
  const int64_t s = index % dims_.seq;
  const int64_t b = index / dims_.seq;
  return base_ + b * strides_[0] + s * strides_[1] + h * strides_[2] + c * strides_[3];
}

void HostTensor::store_bits(int64_t off, uint64_t bits) {
  unsigned char* p = buffer_->data() + size_t(off) * dtype_size(dtype_);
  if (dtype_ == DType::kFP32) {
    const uint32_t b = uint32_t(bits);
    std::memcpy(p, &b, 4);
  } else if (dtype_ == DType::kE4M3) {
    *p = uint8_t(bits);
  } else {
    const uint16_t b = uint16_t(bits);
    std::memcpy(p, &b, 2);
  }
}

uint64_t HostTensor::load_bits(int64_t off) const {
  const unsigned char* p = buffer_->data() + size_t(off) * dtype_size(dtype_);
  if (dtype_ == DType::kFP32) {
    uint32_t b;
    std::memcpy(&b, p, 4);
    return b;
  }
  if (dtype_ == DType::kE4M3) return *p;
  uint16_t b;
  std::memcpy(&b, p, 2);
  return b;
}

uint64_t HostTensor::bits(int64_t index) const { return load_bits(offset(index)); }

double HostTensor::get(int64_t index) const {
  const uint64_t b = bits(index);
  switch (dtype_) {
    case DType::kBF16: return to_float(bf16_t{uint16_t(b)});
    case DType::kFP16: return to_float(fp16_t{uint16_t(b)});
    case DType::kE4M3: return to_float(e4m3_t{uint8_t(b)});
    default: return bits_float(uint32_t(b));
  }
}

void HostTensor::set(int64_t index, double value) {
  const float f = float(value);
  uint64_t b;
  switch (dtype_) {
    case DType::kBF16: b = to_bf16(f).bits; break;
    case DType::kFP16: b = to_fp16(f).bits; break;
    case DType::kE4M3: b = to_e4m3(f).bits; break;
    default: b = float_bits(f); break;
  }
  store_bits(offset(index), b);
}

std::vector<double> HostTensor::dense() const {
  std::vector<double> out(static_cast<size_t>(size()));
  for (int64_t e = 0; e < size(); ++e) out[size_t(e)] = get(e);
  return out;
}

void HostTensor::fill_normal(std::mt19937_64& rng, double stddev) {
  std::normal_distribution<double> normal(0.0, stddev);
  for (int64_t e = 0; e < size(); ++e) set(e, normal(rng));
}

void HostTensor::fill_spiky(std::mt19937_64& rng, double fraction, double factor) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::bernoulli_distribution spike(fraction);
  const int64_t rows = dims_.batch * dims_.seq * dims_.heads;
  for (int64_t r = 0; r < rows; ++r) {
    const double gain = spike(rng) ? factor : 1.0;
    for (int64_t c = 0; c < dims_.dim; ++c) set(r * dims_.dim + c, gain * normal(rng));
  }
}

void HostTensor::poison() {
  for (int64_t e = 0; e < size(); ++e) store_bits(offset(e), poison_bits(dtype_));
}

void HostTensor::poison_rows(int64_t batch, int64_t first, int64_t count) {
  const int64_t per_row = dims_.heads * dims_.dim;
  const int64_t start = (batch * dims_.seq + first) * per_row;
  for (int64_t e = start; e < start + count * per_row; ++e)
    store_bits(offset(e), poison_bits(dtype_));
}

bool HostTensor::is_poison(int64_t index) const { return bits(index) == poison_bits(dtype_); }

int64_t HostTensor::stray_writes(const std::vector<const HostTensor*>& views) {
  if (views.empty()) return 0;
  const HostTensor& first = *views.front();
  std::vector<unsigned char> covered(size_t(first.buffer_elems_), 0);
  for (const HostTensor* t : views)
    for (int64_t e = 0; e < t->size(); ++e) covered[size_t(t->offset(e))] = 1;
  int64_t strays = 0;
  for (int64_t off = 0; off < first.buffer_elems_; ++off)
    if (!covered[size_t(off)] && first.load_bits(off) != poison_bits(first.dtype_)) ++strays;
  return strays;
}

HostLse::HostLse(int64_t batch, int64_t heads, int64_t seq, bool padded) {
  const Dims dims{batch, heads, seq, 1};
  if (padded) {
    const int64_t head = seq + kRowPad, b = heads * head + kBatchPad;
    const int64_t strides[4] = {b, head, 1, 1};
    t_ =
        HostTensor::strided(DType::kFP32, dims, strides, kLeadPad, kLeadPad + batch * b + kTailPad);
  } else {
    const int64_t strides[4] = {heads * seq, seq, 1, 1};
    t_ = HostTensor::strided(DType::kFP32, dims, strides, 0, batch * heads * seq);
  }
}

LseView HostLse::view() const {
  const TensorView v = t_.view();  // its (batch, seq, heads) are the LSE's (batch, heads, seq)
  LseView l;
  l.data = static_cast<float*>(v.data);
  l.batch_stride = v.batch_stride;
  l.head_stride = v.seq_stride;
  l.seq_stride = v.head_stride;
  return l;
}

HostWorkspace::HostWorkspace(size_t bytes) : storage_(bytes + 256), bytes_(bytes) {
  void* p = storage_.data();
  size_t space = storage_.size();
  aligned_ = std::align(256, bytes, p, space);
}

// ---- Test problems

namespace {
std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ":" : "") + std::to_string(v[i]);
  return s;
}
}  // namespace

const char* descaling_tag(Descaling how) {
  switch (how) {
    case Descaling::kNone: return "_nodescale";
    case Descaling::kShared: return "_shared_descale";
    case Descaling::kPerHead: return "_descale";
  }
  return "";
}

DescaleView descale_view(const float* data, const Problem& p, Descaling how) {
  if (how == Descaling::kNone) return {};
  if (how == Descaling::kShared) return {data, 0, 0};
  return {data, p.heads_kv, 1};
}

std::string describe(const Case& c) {
  std::ostringstream o;
  o << c.name << " [";
  if (c.lens_q.empty())
    o << "batch " << c.batch << ", seqlen_q " << c.seqlen_q << ", seqlen_k " << c.seqlen_k;
  else
    o << "varlen q " << join(c.lens_q) << " k " << join(c.lens_k);
  if (!c.seqused_k.empty()) o << ", seqused_k " << join(c.seqused_k);
  o << ", heads " << c.heads_q << "/" << c.heads_kv << ", dims " << c.dim_qk << "/" << c.dim_v
    << ", " << dtype_name(c.dtype) << ", causal " << c.causal << ", window (" << c.window.left
    << ", " << c.window.right << "), softcap " << c.softcap << ", scale " << c.scale << ", "
    << (c.packed_qkv ? "packed qkv" : layout_name(c.layout)) << ", "
    << (c.spiky ? "spiky" : "normal") << " inputs"
    << (c.sinks ? ", sinks" : "")
    << (c.alibi == Case::Alibi::kPerHead        ? ", alibi per head"
        : c.alibi == Case::Alibi::kPerBatchHead ? ", alibi per (batch, head)"
                                                : "")
    << ", return_lse " << c.return_lse
    << ", deterministic " << c.deterministic << "]";
  return o.str();
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

Dims query_dims(const Problem& p, int64_t heads, int64_t dim) {
  return p.is_varlen() ? Dims{1, p.varlen.total_q, heads, dim}
                       : Dims{p.batch, p.seqlen_q, heads, dim};
}

Dims key_dims(const Problem& p, int64_t heads, int64_t dim) {
  return p.is_varlen() ? Dims{1, p.varlen.total_k, heads, dim}
                       : Dims{p.batch, p.seqlen_k, heads, dim};
}

HostLse make_lse(const Problem& p, bool padded) {
  return p.is_varlen() ? HostLse(1, p.heads_q, p.varlen.total_q, padded)
                       : HostLse(p.batch, p.heads_q, p.seqlen_q, padded);
}

namespace {
// Inputs of spiky cases: a few query rows ×4 and key rows ×8 make logits up to ~30× the usual.
constexpr double kSpikyQueryFraction = 0.05, kSpikyQueryGain = 4.0;
constexpr double kSpikyKeyFraction = 0.03, kSpikyKeyGain = 8.0;

std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(1, 0);
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}
}  // namespace

Case with_variant(Case c, size_t n) {
  switch (n % 3) {
    case 0:
      c.sinks = true;
      c.name += "_sinks";
      break;
    case 1:
      c.alibi = Case::Alibi::kPerHead;
      c.name += "_alibi";
      break;
    default:
      c.sinks = true;
      c.alibi = Case::Alibi::kPerBatchHead;
      c.name += "_sinks_alibi_per_batch";
  }
  return c;
}

std::unique_ptr<CaseData> make_setup(const Case& c, std::mt19937_64& rng) {
  auto s = std::make_unique<CaseData>();
  Problem& p = s->problem;
  if (!c.lens_q.empty()) {
    s->cu_q = prefix_sums(c.lens_q);
    s->cu_k = prefix_sums(c.lens_k);
    p.batch = int64_t(c.lens_q.size());
    p.seqlen_q = *std::max_element(c.lens_q.begin(), c.lens_q.end());
    p.seqlen_k = *std::max_element(c.lens_k.begin(), c.lens_k.end());
    p.varlen.cu_seqlens_q = s->cu_q.data();
    p.varlen.cu_seqlens_k = s->cu_k.data();
    p.varlen.total_q = s->cu_q.back() + kVarlenSpareRows;
    p.varlen.total_k = s->cu_k.back() + kVarlenSpareRows;
  } else {
    p.batch = c.batch;
    p.seqlen_q = c.seqlen_q;
    p.seqlen_k = c.seqlen_k;
  }
  if (!c.seqused_k.empty()) {
    s->used_k = c.seqused_k;
    p.seqused_k = s->used_k.data();
  }
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim_qk = c.dim_qk;
  p.head_dim_v = c.dim_v;
  p.dtype = c.dtype;
  p.causal = c.causal;
  p.window = c.window;
  p.softcap = c.softcap;
  p.softmax_scale = c.scale;
  p.return_lse = c.return_lse;
  p.deterministic = c.deterministic;

  const Dims qd = query_dims(p, p.heads_q, p.head_dim_qk);
  const Dims kd = key_dims(p, p.heads_kv, p.head_dim_qk);
  s->layout = c.layout;
  s->packed = c.packed_qkv && qd.batch == kd.batch && qd.seq == kd.seq && c.dim_qk == c.dim_v;
  if (s->packed) {
    std::vector<HostTensor> qkv =
        HostTensor::packed_qkv(c.dtype, qd.batch, qd.seq, c.heads_q, c.heads_kv, c.dim_qk);
    s->q = qkv[0];
    s->k = qkv[1];
    s->v = qkv[2];
  } else {
    s->q = HostTensor(c.dtype, qd, c.layout);
    s->k = HostTensor(c.dtype, kd, c.layout);
    s->v = HostTensor(c.dtype, key_dims(p, p.heads_kv, p.head_dim_v), c.layout);
  }
  if (c.spiky) {
    s->q.fill_spiky(rng, kSpikyQueryFraction, kSpikyQueryGain);
    s->k.fill_spiky(rng, kSpikyKeyFraction, kSpikyKeyGain);
  } else {
    s->q.fill_normal(rng);
    s->k.fill_normal(rng);
  }
  s->v.fill_normal(rng);
  draw_score_variants(c.sinks, c.alibi, p, &s->sinks, &s->alibi_slopes, rng);
  return s;
}

void draw_score_variants(bool sinks, Case::Alibi alibi, Problem& p, std::vector<float>* sinks_out,
                         std::vector<float>* slopes_out, std::mt19937_64& rng) {
  if (sinks) {
    std::normal_distribution<float> logit(1.0f, 3.0f);
    for (int64_t h = 0; h < p.heads_q; ++h) sinks_out->push_back(logit(rng));
    p.sinks = sinks_out->data();
  }
  if (alibi != Case::Alibi::kNone) {
    const bool per_batch = alibi == Case::Alibi::kPerBatchHead;
    for (int64_t b = 0; b < (per_batch ? p.batch : 1); ++b)
      for (int64_t h = 0; h < p.heads_q; ++h)
        slopes_out->push_back(float(std::exp2(-8.0 * double(h + 1) / double(p.heads_q)) *
                                    (per_batch ? 1.0 + 0.5 * double(b) : 1.0)));
    p.alibi = {slopes_out->data(), per_batch ? p.heads_q : 0, 1};
  }
}

void poison_unused_rows(CaseData& s) {
  const Problem& p = s.problem;
  if (p.is_varlen()) {
    const int64_t end_q = s.cu_q[size_t(p.batch)], end_k = s.cu_k[size_t(p.batch)];
    s.q.poison_rows(0, end_q, p.varlen.total_q - end_q);
    s.k.poison_rows(0, end_k, p.varlen.total_k - end_k);
    s.v.poison_rows(0, end_k, p.varlen.total_k - end_k);
  }
  if (p.seqused_k == nullptr) return;
  for (int64_t b = 0; b < p.batch; ++b) {
    // Fixed-length entries are batch entries of the view; varlen sequences are row ranges of it.
    const int64_t entry = p.is_varlen() ? 0 : b;
    const int64_t first = p.is_varlen() ? s.cu_k[size_t(b)] : 0;
    const int64_t rows = p.is_varlen() ? s.cu_k[size_t(b) + 1] - first : p.seqlen_k;
    const int64_t used = p.seqused_k[b];
    s.k.poison_rows(entry, first + used, rows - used);
    s.v.poison_rows(entry, first + used, rows - used);
  }
}

namespace {

struct Heads {
  int64_t q, kv;
};
// GQA ratios 1, 4, 7 (MQA and two groups), 8 (MQA and 64/8), and plain multi-head. Large shapes
// step down this list from their pick; 4/1 follows 64/8 so that they land on a cheap GQA case.
constexpr Heads kHeads[] = {{1, 1}, {4, 4}, {7, 1}, {8, 1}, {14, 2}, {64, 8}, {4, 1}};
struct HeadDims {
  int64_t qk, v;
};
constexpr HeadDims kHeadDims[] = {{32, 32}, {64, 64}, {96, 96}, {128, 128}, {192, 128}, {256, 256}};

struct WindowKind {
  const char* tag;
  bool causal;
  Window window;
};
// (0, 0): every query sees exactly its own diagonal key.
const WindowKind kWindows[] = {{"local32", false, {32, 0}},       {"band16_8", false, {16, 8}},
                               {"right5", false, {-1, 5}},        {"left40", false, {40, -1}},
                               {"causal_left24", true, {24, -1}}, {"diagonal", false, {0, 0}}};

enum class MaskKind { kNone, kCausal, kWindow };
constexpr DType kDtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
constexpr float kSoftcaps[] = {5.0f, 30.0f};

// A fixed, well-spread choice among n for case k and parameter `salt`.
size_t pick(uint64_t k, uint64_t salt, size_t n) { return size_t(mix(k * 0x100 + salt) % n); }

// Query-key pairs of a shape: the reference's work grows with pairs × heads × (dqk + dv).
int64_t pairs(const CaseShape& s) {
  if (s.lens_q.empty()) return s.batch * s.seqlen_q * s.seqlen_k;
  int64_t n = 0;
  for (size_t i = 0; i < s.lens_q.size(); ++i) n += int64_t(s.lens_q[i]) * s.lens_k[i];
  return n;
}

}  // namespace

std::vector<Case> covering_cases(const std::vector<CaseShape>& shapes, int64_t budget,
                                 const char* prefix) {
  std::vector<Case> cases;
  uint64_t k = 0;
  size_t window_turn = 0;
  for (const CaseShape& shape : shapes)
    for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindow})
      for (bool capped : {false, true})
        for (DType dtype : kDtypes) {
          Case c;
          c.batch = shape.batch;
          c.seqlen_q = shape.seqlen_q;
          c.seqlen_k = shape.seqlen_k;
          c.lens_q = shape.lens_q;
          c.lens_k = shape.lens_k;
          c.seqused_k = shape.used_k;
          c.dtype = dtype;
          std::string mask_tag = "nomask";
          if (mask == MaskKind::kCausal) {
            c.causal = true;
            mask_tag = "causal";
          } else if (mask == MaskKind::kWindow) {
            const WindowKind& w = kWindows[window_turn++ % std::size(kWindows)];
            c.causal = w.causal;
            c.window = w.window;
            mask_tag = w.tag;
          }
          if (capped) c.softcap = kSoftcaps[pick(k, 1, std::size(kSoftcaps))];

          const size_t h0 = pick(k, 2, std::size(kHeads)), d0 = pick(k, 3, std::size(kHeadDims));
          // Smaller head dims first, then other head counts: the GQA ratio is the rarer thing.
          for (size_t t = 0; t < std::size(kHeads) * std::size(kHeadDims); ++t) {
            const Heads& h = kHeads[(h0 + t / std::size(kHeadDims)) % std::size(kHeads)];
            const HeadDims& d = kHeadDims[(d0 + std::size(kHeadDims) - t % std::size(kHeadDims)) %
                                          std::size(kHeadDims)];
            c.heads_q = h.q;
            c.heads_kv = h.kv;
            c.dim_qk = d.qk;
            c.dim_v = d.v;
            if (pairs(shape) * h.q * (d.qk + d.v) <= budget) break;
          }

          const size_t layout = pick(k, 4, 4);
          c.layout = layout == 1   ? Layout::kPadded
                     : layout == 2 ? Layout::kHeadMajor
                                   : Layout::kContiguous;
          c.packed_qkv = layout == 3;
          if (c.packed_qkv &&
              (c.seqlen_q != c.seqlen_k || c.lens_q != c.lens_k || c.dim_qk != c.dim_v)) {
            c.packed_qkv = false;  // q and k rows must pair up: padded strides instead
            c.layout = Layout::kPadded;
          }
          c.spiky = pick(k, 5, 5) < 2;
          if (pick(k, 6, 8) == 0) c.scale = float(1.7 / std::sqrt(double(c.dim_qk)));
          c.return_lse = pick(k, 7, 6) != 0;
          c.deterministic = pick(k, 8, 4) == 0;

          char dims[80];
          std::snprintf(dims, sizeof dims, "h%lldx%lld_d%lldx%lld", (long long)c.heads_q,
                        (long long)c.heads_kv, (long long)c.dim_qk, (long long)c.dim_v);
          c.name = std::string(prefix) + std::to_string(k) + "_" + shape.tag + "_" + mask_tag +
                   (capped ? "_softcap" : "") + "_" + dtype_name(dtype) + "_" + dims;
          cases.push_back(std::move(c));
          ++k;
        }
  return cases;
}

std::vector<unsigned char> rows_in_sequences(const Problem& p, bool keys) {
  if (!p.is_varlen())
    return std::vector<unsigned char>(size_t(p.batch * (keys ? p.seqlen_k : p.seqlen_q)), 1);
  const int32_t* cu = keys ? p.varlen.cu_seqlens_k : p.varlen.cu_seqlens_q;
  std::vector<unsigned char> rows(size_t(keys ? p.varlen.total_k : p.varlen.total_q), 0);
  // Sequences are consecutive from row 0, so rows below the last end belong to one of them.
  std::fill(rows.begin(), rows.begin() + cu[p.batch], 1);
  return rows;
}

// ---- Checks

std::string DenseShape::where(int64_t index) const {
  std::vector<int64_t> coords(extents.size());
  for (size_t n = extents.size(); n-- > 0;) {
    coords[n] = index % extents[n];
    index /= extents[n];
  }
  std::string s;
  for (size_t n = 0; n < coords.size(); ++n)
    s += (n ? " " : "") + names[n] + "=" + std::to_string(coords[n]);
  return s;
}

DenseShape tensor_shape(const Dims& d) {
  return {{"b", "s", "h", "d"}, {d.batch, d.seq, d.heads, d.dim}};
}

DenseShape lse_shape(const Problem& p) {
  if (p.is_varlen()) return {{"h", "s"}, {p.heads_q, p.varlen.total_q}};
  return {{"b", "h", "s"}, {p.batch, p.heads_q, p.seqlen_q}};
}

namespace {

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

// |x − ref|, with infinities equal only to themselves.
double distance(double x, double ref) {
  if (std::isinf(ref) || std::isinf(x))
    return x == ref ? 0.0 : std::numeric_limits<double>::infinity();
  return std::fabs(x - ref);
}

// The first NaN among the compared elements, or -1.
int64_t first_nan(const std::vector<double>& actual, const std::vector<double>& ref) {
  for (size_t e = 0; e < ref.size(); ++e)
    if (!std::isnan(ref[e]) && std::isnan(actual[e])) return int64_t(e);
  return -1;
}

bool sizes_match(const std::string& what, size_t a, size_t b, CheckResult& r) {
  if (a == b) return true;
  r.message = what + ": sizes differ (" + std::to_string(a) + " vs " + std::to_string(b) + ")";
  return false;
}

}  // namespace

CheckResult check_flash_rule(const std::string& what, const DenseShape& shape,
                             const std::vector<double>& actual, const std::vector<double>& ref,
                             const std::vector<double>& lp, double multiplier, double atol) {
  CheckResult r;
  if (!sizes_match(what, actual.size(), ref.size(), r) ||
      !sizes_match(what, lp.size(), ref.size(), r))
    return r;
  double lp_error = 0.0;
  for (size_t e = 0; e < ref.size(); ++e) {
    if (std::isnan(ref[e])) continue;
    if (std::isnan(lp[e])) {
      r.message = what + ": the low-precision reference is NaN at " + shape.where(int64_t(e));
      return r;
    }
    lp_error = std::max(lp_error, distance(lp[e], ref[e]));
  }
  const double tolerance = multiplier * lp_error + atol;
  if (const int64_t e = first_nan(actual, ref); e >= 0) {
    r.message = what + ": NaN at " + shape.where(e) + " (reference " + num(ref[size_t(e)]) + ")";
    return r;
  }
  int64_t worst = -1;
  for (size_t e = 0; e < ref.size(); ++e) {
    if (std::isnan(ref[e])) continue;
    ++r.compared;
    const double err = distance(actual[e], ref[e]);
    if (worst < 0 || err > r.max_error) {
      r.max_error = err;
      worst = int64_t(e);
    }
  }
  r.ok = r.max_error <= tolerance;
  std::ostringstream o;
  o << what << ": max |X - ref| = " << num(r.max_error);
  if (worst >= 0)
    o << " at " << shape.where(worst) << " (X = " << num(actual[size_t(worst)])
      << ", ref = " << num(ref[size_t(worst)]) << ")";
  o << "; allowed " << num(multiplier) << " * max|lp - ref| + atol = " << num(multiplier) << " * "
    << num(lp_error) << " + " << num(atol) << " = " << num(tolerance) << "; " << r.compared
    << " elements compared";
  r.message = o.str();
  return r;
}

FlashRule flash_rule(const Problem& p, Pass pass) {
  constexpr double kForwardAtol = 1e-5, kBackwardAtol = 1e-4;
  return {p.softcap > 0.0f ? 3.0 : 2.0, pass == Pass::kForward ? kForwardAtol : kBackwardAtol};
}

double max_finite_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

double alibi_slack(const Problem& p, double magnitude, double score_abs_max) {
  const AlibiSlopes& a = p.alibi;
  if (a.data == nullptr) return 0.0;
  double slope = 0.0;
  for (int64_t b = 0; b < (a.batch_stride != 0 ? p.batch : 1); ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      slope = std::max(slope, std::fabs(double(a.data[b * a.batch_stride + h * a.head_stride])));
  const double largest_bias = slope * double(p.seqlen_q + p.seqlen_k);
  return 4.0 * 0x1p-24 * (score_abs_max + largest_bias) * magnitude;
}

CheckResult check_bounded(const std::string& what, const DenseShape& shape,
                          const std::vector<double>& actual, const std::vector<double>& ref,
                          const std::vector<double>& bound) {
  CheckResult r;
  if (!sizes_match(what, actual.size(), ref.size(), r) ||
      !sizes_match(what, bound.size(), ref.size(), r))
    return r;
  if (const int64_t e = first_nan(actual, ref); e >= 0) {
    r.message = what + ": NaN at " + shape.where(e) + " (reference " + num(ref[size_t(e)]) + ")";
    return r;
  }
  int64_t worst = -1, failures = 0;
  double worst_ratio = -1.0;
  for (size_t e = 0; e < ref.size(); ++e) {
    if (std::isnan(ref[e])) continue;
    ++r.compared;
    const double err = distance(actual[e], ref[e]);
    r.max_error = std::max(r.max_error, err);
    const double ratio = err == 0.0 ? 0.0 : err / bound[e];  // inf when the bound is 0
    if (!(err <= bound[e])) ++failures;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = int64_t(e);
    }
  }
  r.ok = failures == 0;
  std::ostringstream o;
  o << what << ": " << failures << " of " << r.compared
    << " elements outside their bound; max |X - ref| = " << num(r.max_error);
  if (worst >= 0)
    o << "; closest to / furthest over its bound at " << shape.where(worst)
      << ": X = " << num(actual[size_t(worst)]) << ", ref = " << num(ref[size_t(worst)])
      << ", |X - ref| = " << num(distance(actual[size_t(worst)], ref[size_t(worst)])) << ", bound "
      << num(bound[size_t(worst)]) << " (" << num(worst_ratio) << " of it)";
  r.message = o.str();
  return r;
}

// ---- The CPU backend's bounds
//
// Standard rounding-error analysis (Higham, "Accuracy and Stability of Numerical Algorithms",
// ch. 3), first order in u = 2⁻²⁴, with the √n growth of rounding errors that are not all of one
// sign (Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019) in place
// of the worst case n·u, which no real summation approaches and which would hide mistakes:
//  · a score s = scale·q·k summed over d terms is off by ≤ c_dot·√d·u·|scale|·Σ|q_c k_c|
//    (score_abs); P = exp(s − max) inherits that as a relative error (softcap's derivative is ≤ 1);
//  · softcap's cap·tanh(s / cap) adds its own evaluation error, ≤ c_tanh·u·cap absolute (the
//    vector tanh's 1–4 ulps of a value ≤ 1, the argument's and the product's roundings), which
//    saturated scores (spiky inputs) reach whatever their size;
//  · exp, the rescale factors and the final division add a few ulps relative to each P;
//  · Σ_j P_j V_j over n keys adds ≤ c_acc·√n·u relative to Σ_j P_j |V_j| (out_abs), the same
//    scale every other relative error of the P_j is measured against;
//  · the output is rounded once to the dtype: a half-ulp of the value, ≤ u_dtype·|value|.
// With these constants, two fp32 implementations — the CPU backend (tiled online softmax in log2
// units) and a plain sequential one (the reference's low-precision mode at fp32) — stayed below a
// third of every bound over the test matrices (LSE and gradients below a fifth), while a one-key
// mask error, a wrong scale, a missing softcap or a wrong GQA mapping lands far outside them
// (CpuForwardTolerance / CpuBackwardTolerance check that the bounds reject each of them).
namespace {

constexpr double kUnitRoundoff = 0x1p-24;  // fp32
constexpr double kAccumulation = 2.0;      // c_acc, × √(terms summed)
constexpr double kExpUlps = 16.0;          // c_exp: exp, rescales, division, in ulps
constexpr double kDotProduct = 1.0;        // c_dot, × √d × score_abs
constexpr double kLseUlps = 4.0;           // rounding of max + log(sum) and of the final value
constexpr double kExpArgument = 2.0;       // exp's argument s − m rounded, × (|s| + 1) ulps
constexpr double kTanhUlps = 8.0;          // c_tanh: softcap's tanh and its two products, × cap

// Softcap's evaluation error per score, in units of u (0 without softcap).
double softcap_error(const Problem& p) { return kTanhUlps * std::fabs(double(p.softcap)); }

// Half an ulp, relative: the largest relative error of rounding to the dtype.
double half_ulp(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 0x1p-8;
    case DType::kFP16: return 0x1p-11;
    default: return 0x1p-24;
  }
}

// Half the smallest subnormal: the absolute rounding error near zero.
double subnormal_half_ulp(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 0x1p-134;
    case DType::kFP16: return 0x1p-25;
    default: return 0x1p-150;
  }
}

double rounded_bound(DType dtype, double e32, double ref) {
  return e32 + half_ulp(dtype) * (std::fabs(ref) + e32) + subnormal_half_ulp(dtype);
}

// Index in the dense LSE layout of dense query row `row`, head h.
int64_t lse_index(const Problem& p, int64_t row, int64_t h) {
  if (p.is_varlen()) return h * p.varlen.total_q + row;
  return (row / p.seqlen_q * p.heads_q + h) * p.seqlen_q + row % p.seqlen_q;
}

int64_t query_rows(const Problem& p) {
  return p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
}

}  // namespace

std::vector<double> cpu_out_bound(const Problem& p, const ref::ForwardResult& exact) {
  const double u = kUnitRoundoff;
  const double per_key = kAccumulation * std::sqrt(double(p.seqlen_k)) + kExpUlps;
  const double per_score = kDotProduct * std::sqrt(double(p.head_dim_qk));
  const double capped = softcap_error(p);
  std::vector<double> bound(exact.out.size());
  const int64_t dv = p.head_dim_v;
  for (int64_t row = 0; row < query_rows(p); ++row)
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const double score = exact.score_abs[size_t(lse_index(p, row, h))];
      for (int64_t c = 0; c < dv; ++c) {
        const size_t e = size_t((row * p.heads_q + h) * dv + c);
        const double e32 = u * (per_key + per_score * score + capped) * exact.out_abs[e];
        bound[e] = rounded_bound(output_dtype(p), e32, exact.out[e]);
      }
    }
  return bound;
}

// LSE = max + log Σ exp(s − max): the scores' errors enter once through max and once through the
// sum (2·(c_dot + c_tanh)), the sum's relative error becomes an absolute one through the log.
std::vector<double> cpu_lse_bound(const Problem& p, const ref::ForwardResult& exact) {
  const double u = kUnitRoundoff;
  const double n = double(p.seqlen_k);
  std::vector<double> bound(exact.lse.size());
  for (size_t e = 0; e < bound.size(); ++e) {
    const double score = exact.score_abs[e];
    bound[e] = u * (2.0 * (kDotProduct * std::sqrt(double(p.head_dim_qk)) * score +
                           softcap_error(p)) +
                    kAccumulation * std::sqrt(n) + kExpUlps +
                    kLseUlps * (std::fabs(exact.lse[e]) + score + std::log1p(n)));
  }
  return bound;
}

std::vector<double> fp8_lse_bound(const Problem& p, const ref::ForwardResult& exact) {
  std::vector<double> bound = cpu_lse_bound(p, exact);
  for (size_t e = 0; e < bound.size(); ++e) bound[e] += kFp8ScoreShare * exact.score_abs[e];
  return bound;
}

// Backward. P = exp(s − LSE) is computed from the forward's fp32 LSE, whose error λ_i is common
// to every key of row i, and carries per-pair errors too: the score dot product's, the rounding of
// the exponent's argument (≤ u·(|s| + 1) relative, where P is not negligible), exp itself. These,
// dS's own rounding and the √n growth of the dQ / dK sums scale with |dS| (d*_ds_abs); only the
// errors of the dP and D sums (head_dim_v terms) scale with |dP| + |D| (d*_abs), so rows where
// dP − D cancels are not drowned in a bound they could never approach. A common relative error of
// row i's P moves dQ_i by exactly that error times dQ_i (D comes from the given O, not from P), so
// for dQ λ is charged to |dQ|; dK and dV sum over rows of different λ_i. When the reference
// recomputed O rather than using the O the backend was handed (rounded to the dtype), that
// rounding enters through D: the d*_via_d terms.
GradientBounds cpu_gradient_bounds(const Problem& p, const ref::BackwardResult& exact) {
  const double u = kUnitRoundoff;
  const double S = exact.score_abs_max;
  const double dot = kDotProduct * std::sqrt(double(p.head_dim_qk)) * S;
  const double n_keys = double(p.seqlen_k);
  const double n_queries = double(p.seqlen_q * (p.heads_q / p.heads_kv));
  const double lse_error = 2.0 * (dot + softcap_error(p)) + kAccumulation * std::sqrt(n_keys) +
                           kExpUlps +
                           kLseUlps * (2.0 * S + std::log1p(n_keys));
  const double per_pair = dot + softcap_error(p) + kExpArgument * (S + 1.0) + kExpUlps;
  const double dp_and_d = kAccumulation * std::sqrt(double(p.head_dim_v));
  const double o_rounding = p.dtype == DType::kFP32 ? 0.0 : half_ulp(p.dtype);
  // Underflow: each term's P or dS, its product and its partial sum rounded to an fp32
  // subnormal, each off by up to half the smallest one (2⁻¹⁵⁰); twice that per unit of d*_tiny.
  const double tiny = 0x1p-149;

  GradientBounds g;
  g.dq.resize(exact.dq.size());
  for (size_t e = 0; e < g.dq.size(); ++e) {
    const double e32 = u * ((per_pair + kAccumulation * std::sqrt(n_keys)) * exact.dq_ds_abs[e] +
                            dp_and_d * exact.dq_abs[e] + lse_error * std::fabs(exact.dq[e])) +
                       o_rounding * exact.dq_via_d[e] + tiny * exact.dq_tiny[e];
    g.dq[e] = rounded_bound(p.dtype, e32, exact.dq[e]);
  }
  g.dk.resize(exact.dk.size());
  for (size_t e = 0; e < g.dk.size(); ++e) {
    const double e32 =
        u * ((lse_error + per_pair + kAccumulation * std::sqrt(n_queries)) * exact.dk_ds_abs[e] +
             dp_and_d * exact.dk_abs[e]) +
        o_rounding * exact.dk_via_d[e] + tiny * exact.dk_tiny[e];
    g.dk[e] = rounded_bound(p.dtype, e32, exact.dk[e]);
  }
  // dV = Pᵀ dO: only P's errors, and the sum over query rows.
  g.dv.resize(exact.dv.size());
  for (size_t e = 0; e < g.dv.size(); ++e) {
    const double e32 =
        u * (lse_error + per_pair + kAccumulation * std::sqrt(n_queries)) * exact.dv_abs[e] +
        tiny * exact.dv_tiny[e];
    g.dv[e] = rounded_bound(p.dtype, e32, exact.dv[e]);
  }
  return g;
}

namespace {

template <typename T>
CheckResult check_written_impl(const std::string& what, const T& t, int64_t rows_total,
                               const std::function<int64_t(int64_t)>& row_of,
                               const std::vector<unsigned char>& rows, const DenseShape& shape,
                               bool inf_allowed) {
  CheckResult r;
  if (int64_t(rows.size()) != rows_total) {
    r.message = what + ": row flags for " + std::to_string(rows.size()) + " rows, the tensor has " +
                std::to_string(rows_total);
    return r;
  }
  int64_t unwritten = 0, bad = 0, touched = 0, first = -1;
  for (int64_t e = 0; e < t.size(); ++e) {
    const bool poison = t.is_poison(e);
    const double x = t.get(e);
    bool wrong;
    if (rows[size_t(row_of(e))]) {
      wrong = poison || std::isnan(x) || (std::isinf(x) && !(inf_allowed && x > 0));
      unwritten += poison;
      bad += wrong && !poison;
    } else {
      wrong = !poison;
      touched += wrong;
    }
    if (wrong && first < 0) first = e;
  }
  r.ok = first < 0;
  r.compared = t.size();
  r.message = what + ": " + std::to_string(unwritten) + " elements not written, " +
              std::to_string(bad) + " written with NaN or an infinity, " + std::to_string(touched) +
              " outside every sequence written";
  if (first >= 0) r.message += "; first at " + shape.where(first) + " (" + num(t.get(first)) + ")";
  return r;
}

}  // namespace

CheckResult check_written(const std::string& what, const HostTensor& t,
                          const std::vector<unsigned char>& rows) {
  const Dims d = t.dims();
  const int64_t per_row = d.heads * d.dim;
  return check_written_impl(
      what, t, d.batch * d.seq, [&](int64_t e) { return e / per_row; }, rows, tensor_shape(d),
      false);
}

CheckResult check_written(const std::string& what, const HostLse& t,
                          const std::vector<unsigned char>& rows) {
  const int64_t heads = t.heads(), seq = t.seq();
  // Dense [batch][heads][seq]: the query row of element e is batch·seq + s.
  auto row_of = [&](int64_t e) { return e / (heads * seq) * seq + e % seq; };
  DenseShape shape{{"b", "h", "s"}, {t.batch(), heads, seq}};
  return check_written_impl(what, t, t.batch() * seq, row_of, rows, shape, true);
}

std::vector<CheckResult> check_gradients_written(const std::vector<HostTensor>& grads,
                                                 const std::vector<unsigned char>& q_rows,
                                                 const std::vector<unsigned char>& k_rows,
                                                 bool packed) {
  static const char* const kNames[] = {"dq", "dk", "dv"};
  std::vector<CheckResult> results;
  for (size_t g = 0; g < 3; ++g)
    results.push_back(check_written(kNames[g], grads[g], g == 0 ? q_rows : k_rows));
  CheckResult around;
  int64_t stray = 0;
  if (packed) {
    stray = HostTensor::stray_writes({&grads[0], &grads[1], &grads[2]});
  } else {
    for (size_t g = 0; g < 3; ++g) stray += HostTensor::stray_writes({&grads[g]});
  }
  around.ok = stray == 0;
  around.message = std::to_string(stray) + " elements outside the gradients' views written" +
                   (packed ? " (packed dqkv: between the three views)" : "");
  results.push_back(around);
  return results;
}

}  // namespace fa4::test
