// Validation: every class of bad input is rejected with the right status, a message that names
// the offending field, and not one byte written to any output. Each test starts from a small
// problem that runs (the Control* tests prove it), so a rejection can only come from the one thing
// broken.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <ostream>
#include <string>
#include <vector>

#include "fa4/attention.hpp"

namespace fa4 {
// Lets gtest print status codes by name.
void PrintTo(StatusCode code, std::ostream* os) {
  *os << to_string(code) << " (" << int(code) << ")";
}
}  // namespace fa4

namespace {

using fa4::Backend;
using fa4::BackwardTensors;
using fa4::DType;
using fa4::ForwardTensors;
using fa4::LseView;
using fa4::Pass;
using fa4::Problem;
using fa4::Status;
using fa4::StatusCode;
using fa4::TensorView;
using fa4::Workspace;

constexpr unsigned char kPoison = 0xA5;
// Workspace and TMA both want generous alignment; every buffer gets it so that only the deliberate
// misalignments below are misaligned.
constexpr size_t kBufferAlign = 256;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr float kFloatInf = std::numeric_limits<float>::infinity();
constexpr float kFloatNaN = std::numeric_limits<float>::quiet_NaN();

class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(size_t bytes) : size_(bytes) {
    const size_t rounded = (bytes / kBufferAlign + 1) * kBufferAlign;  // never 0, a multiple
    data_.reset(static_cast<unsigned char*>(std::aligned_alloc(kBufferAlign, rounded)));
    if (!data_) throw std::bad_alloc();
    std::memset(data_.get(), 0, rounded);
  }
  unsigned char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  void fill(unsigned char byte) { std::memset(data_.get(), byte, size_); }
  bool all(unsigned char byte) const {
    for (size_t i = 0; i < size_; ++i)
      if (data_.get()[i] != byte) return false;
    return true;
  }

 private:
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> data_;
  size_t size_ = 0;
};

int64_t elem_bytes(DType dtype) { return dtype == DType::kFP32 ? 4 : 2; }

// A valid problem with contiguous tensors, fixed-length or varlen, in fp32 or bf16.
// GQA (4 query heads on 2 kv heads) and head_dim_v != head_dim_qk so that mixing up two extents
// in a check would show.
struct Case {
  Problem problem;
  AlignedBytes q, k, v, out, dout, lse, dq, dk, dv;
  ForwardTensors fwd;
  BackwardTensors bwd;
  AlignedBytes workspace;  // exactly workspace_size(problem, kCpu, kBackward) bytes
  int32_t cu_q[4] = {0, 3, 3, 8};   // lengths 3, 0, 5
  int32_t cu_k[4] = {0, 4, 6, 12};  // lengths 4, 2, 6
  int32_t seqused[3] = {0, 0, 0};

  Workspace ws() const { return {workspace.data(), workspace.size()}; }

  void poison_outputs() {
    for (AlignedBytes* b : {&out, &lse, &dq, &dk, &dv}) b->fill(kPoison);
  }
  // Backward's outputs, and forward's (which backward only reads).
  bool outputs_untouched() const {
    for (const AlignedBytes* b : {&out, &lse, &dq, &dk, &dv})
      if (!b->all(kPoison)) return false;
    return true;
  }
};

TensorView contiguous(const AlignedBytes& buf, const Problem& p, int64_t seqlen, int64_t heads,
                      int64_t dim) {
  TensorView t;
  t.data = buf.data();
  t.dim_stride = 1;
  t.head_stride = dim;
  t.seq_stride = heads * dim;
  t.batch_stride = p.is_varlen() ? 0 : seqlen * heads * dim;
  return t;
}

// Fills an fp32 buffer with a fixed spread of values in [-1, 1]; bf16 inputs stay 0 (valid too).
void fill_inputs(AlignedBytes& buf, DType dtype) {
  if (dtype != DType::kFP32) return;
  float* f = reinterpret_cast<float*>(buf.data());
  const size_t n = buf.size() / sizeof(float);
  uint32_t state = 12345u;
  for (size_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;  // LCG: deterministic, no library dependence
    f[i] = float(state >> 8) / float(1u << 24) * 2.0f - 1.0f;
  }
}

std::unique_ptr<Case> make_case(DType dtype, bool varlen, int64_t head_dim_qk = 16,
                                int64_t head_dim_v = 8) {
  auto c = std::make_unique<Case>();
  Problem& p = c->problem;
  p.batch = varlen ? 3 : 2;
  p.seqlen_q = 5;
  p.seqlen_k = varlen ? 6 : 7;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.head_dim_qk = head_dim_qk;
  p.head_dim_v = head_dim_v;
  p.dtype = dtype;
  p.return_lse = true;
  if (varlen) {
    p.varlen.cu_seqlens_q = c->cu_q;
    p.varlen.cu_seqlens_k = c->cu_k;
    p.varlen.total_q = c->cu_q[3];
    p.varlen.total_k = c->cu_k[3];
  }
  const int64_t rows_q = varlen ? p.varlen.total_q : p.batch * p.seqlen_q;
  const int64_t rows_k = varlen ? p.varlen.total_k : p.batch * p.seqlen_k;
  const int64_t seq_q = varlen ? p.varlen.total_q : p.seqlen_q;
  const int64_t seq_k = varlen ? p.varlen.total_k : p.seqlen_k;
  const int64_t e = elem_bytes(dtype);

  c->q = AlignedBytes(rows_q * p.heads_q * p.head_dim_qk * e);
  c->k = AlignedBytes(rows_k * p.heads_kv * p.head_dim_qk * e);
  c->v = AlignedBytes(rows_k * p.heads_kv * p.head_dim_v * e);
  c->out = AlignedBytes(rows_q * p.heads_q * p.head_dim_v * e);
  c->dout = AlignedBytes(rows_q * p.heads_q * p.head_dim_v * e);
  c->lse = AlignedBytes(rows_q * p.heads_q * sizeof(float));
  c->dq = AlignedBytes(rows_q * p.heads_q * p.head_dim_qk * e);
  c->dk = AlignedBytes(rows_k * p.heads_kv * p.head_dim_qk * e);
  c->dv = AlignedBytes(rows_k * p.heads_kv * p.head_dim_v * e);
  for (AlignedBytes* b : {&c->q, &c->k, &c->v, &c->dout}) fill_inputs(*b, dtype);

  const TensorView q = contiguous(c->q, p, seq_q, p.heads_q, p.head_dim_qk);
  const TensorView k = contiguous(c->k, p, seq_k, p.heads_kv, p.head_dim_qk);
  const TensorView v = contiguous(c->v, p, seq_k, p.heads_kv, p.head_dim_v);
  const TensorView out = contiguous(c->out, p, seq_q, p.heads_q, p.head_dim_v);
  LseView lse;
  lse.data = reinterpret_cast<float*>(c->lse.data());
  lse.seq_stride = 1;
  lse.head_stride = seq_q;
  lse.batch_stride = varlen ? 0 : p.heads_q * p.seqlen_q;

  c->fwd = {q, k, v, out, lse};
  c->bwd.q = q;
  c->bwd.k = k;
  c->bwd.v = v;
  c->bwd.out = out;
  c->bwd.dout = contiguous(c->dout, p, seq_q, p.heads_q, p.head_dim_v);
  c->bwd.lse = lse;
  c->bwd.dq = contiguous(c->dq, p, seq_q, p.heads_q, p.head_dim_qk);
  c->bwd.dk = contiguous(c->dk, p, seq_k, p.heads_kv, p.head_dim_qk);
  c->bwd.dv = contiguous(c->dv, p, seq_k, p.heads_kv, p.head_dim_v);

  size_t bytes = 0;
  if (fa4::workspace_size(p, Backend::kCpu, Pass::kBackward, &bytes).ok())
    c->workspace = AlignedBytes(bytes);
  return c;
}

bool is_identifier_char(char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
         ch == '_';
}

// `field` occurs in `message` as a whole identifier ("q" matches "q.data", not "dq.data" or
// "seqlen_q"), so a message blaming the wrong tensor does not pass.
bool names_field(const std::string& message, const std::string& field) {
  for (size_t at = message.find(field); at != std::string::npos; at = message.find(field, at + 1)) {
    const size_t end = at + field.size();
    const bool starts = at == 0 || !is_identifier_char(message[at - 1]);
    const bool ends = end == message.size() || !is_identifier_char(message[end]);
    if (starts && ends) return true;
  }
  return false;
}

using Fields = std::initializer_list<const char*>;

void expect_status(const Status& s, StatusCode code, Fields fields) {
  EXPECT_EQ(s.code, code) << "message: \"" << s.message << "\"";
  for (const char* f : fields)
    EXPECT_TRUE(names_field(s.message, f)) << "the message \"" << s.message << "\" does not name "
                                           << f;
}

void expect_forward_rejected(Case& c, const Problem& p, const ForwardTensors& t, StatusCode code,
                             Fields fields, Backend backend = Backend::kCpu) {
  SCOPED_TRACE("forward");
  c.poison_outputs();
  expect_status(fa4::forward(p, t, c.ws(), nullptr, backend), code, fields);
  EXPECT_TRUE(c.outputs_untouched()) << "forward wrote an output before failing";
}

void expect_backward_rejected(Case& c, const Problem& p, const BackwardTensors& t, StatusCode code,
                              Fields fields, Backend backend = Backend::kCpu) {
  SCOPED_TRACE("backward");
  c.poison_outputs();
  expect_status(fa4::backward(p, t, c.ws(), nullptr, backend), code, fields);
  EXPECT_TRUE(c.outputs_untouched()) << "backward wrote an output before failing";
}

// A problem broken on its own: every entry point refuses it, and workspace_size leaves its result.
void expect_problem_rejected(Case& c, const Problem& p, StatusCode code, Fields fields,
                             Backend backend = Backend::kCpu) {
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    SCOPED_TRACE(pass == Pass::kForward ? "can_implement/workspace_size, forward pass"
                                        : "can_implement/workspace_size, backward pass");
    expect_status(fa4::can_implement(p, backend, pass), code, fields);
    constexpr size_t kUnset = 0xA5A5A5A5u;
    size_t bytes = kUnset;
    expect_status(fa4::workspace_size(p, backend, pass, &bytes), code, fields);
    EXPECT_EQ(bytes, kUnset) << "workspace_size wrote its result before failing";
  }
  expect_forward_rejected(c, p, c.fwd, code, fields, backend);
  expect_backward_rejected(c, p, c.bwd, code, fields, backend);
}

void expect_all_finite(const AlignedBytes& buf, const char* name) {
  const float* f = reinterpret_cast<const float*>(buf.data());
  for (size_t i = 0; i < buf.size() / sizeof(float); ++i)
    if (!std::isfinite(f[i])) {
      ADD_FAILURE() << name << "[" << i << "] = " << f[i];
      return;
    }
}

class Validation : public ::testing::Test {
 protected:
  void SetUp() override {
    fixed_ = make_case(DType::kFP32, /*varlen=*/false);
    varlen_ = make_case(DType::kFP32, /*varlen=*/true);
    ASSERT_GT(fixed_->workspace.size(), 0u) << "the CPU backward is expected to need workspace";
    ASSERT_GT(varlen_->workspace.size(), 0u);
  }
  Case& fixed() { return *fixed_; }
  Case& varlen() { return *varlen_; }

 private:
  std::unique_ptr<Case> fixed_, varlen_;
};

// The unbroken problems run, so every rejection below is caused by what its test breaks.
TEST_F(Validation, ControlValidProblemsRun) {
  for (Case* c : {&fixed(), &varlen()}) {
    SCOPED_TRACE(c->problem.is_varlen() ? "varlen" : "fixed-length");
    const Problem& p = c->problem;
    for (Pass pass : {Pass::kForward, Pass::kBackward}) {
      EXPECT_TRUE(fa4::can_implement(p, Backend::kCpu, pass).ok());
      size_t bytes = 0;
      EXPECT_TRUE(fa4::workspace_size(p, Backend::kCpu, pass, &bytes).ok());
    }
    EXPECT_EQ(fa4::resolve_backend(Backend::kAuto, c->q.data()), Backend::kCpu);

    c->poison_outputs();
    const Status f = fa4::forward(p, c->fwd, {}, nullptr, Backend::kCpu);
    ASSERT_TRUE(f.ok()) << f.message;
    EXPECT_TRUE(f.message.empty());
    EXPECT_FALSE(c->out.all(kPoison));
    EXPECT_FALSE(c->lse.all(kPoison));

    // Every row of these problems sees a key and every varlen row belongs to a sequence, so
    // every element is written and finite.
    expect_all_finite(c->out, "out");
    expect_all_finite(c->lse, "lse");

    c->dq.fill(kPoison);
    c->dk.fill(kPoison);
    c->dv.fill(kPoison);
    const Status b = fa4::backward(p, c->bwd, c->ws(), nullptr, Backend::kCpu);
    ASSERT_TRUE(b.ok()) << b.message;
    expect_all_finite(c->dq, "dq");
    expect_all_finite(c->dk, "dk");
    expect_all_finite(c->dv, "dv");
  }
}

// seqused_k and kAuto (host pointers resolve to the CPU) are accepted too.
TEST_F(Validation, ControlSequsedAndAutoRun) {
  Case& c = varlen();
  Problem p = c.problem;
  c.seqused[0] = 4;
  c.seqused[1] = 0;
  c.seqused[2] = 3;
  p.seqused_k = c.seqused;
  c.poison_outputs();
  const Status s = fa4::forward(p, c.fwd, {}, nullptr, Backend::kAuto);
  EXPECT_TRUE(s.ok()) << s.message;
}

// Empty views are never touched, so they may be null: batch 0 with every pointer null succeeds.
TEST_F(Validation, ControlEmptyProblemAcceptsNullPointers) {
  Problem p = fixed().problem;
  p.batch = 0;
  const Status f = fa4::forward(p, ForwardTensors{}, {}, nullptr, Backend::kCpu);
  EXPECT_TRUE(f.ok()) << f.message;
  size_t bytes = 0;
  ASSERT_TRUE(fa4::workspace_size(p, Backend::kCpu, Pass::kBackward, &bytes).ok());
  AlignedBytes ws(bytes);
  const Status b =
      fa4::backward(p, BackwardTensors{}, {ws.data(), ws.size()}, nullptr, Backend::kCpu);
  EXPECT_TRUE(b.ok()) << b.message;
}

// Either answer is right, by machine: a CPU-only build or no Hopper GPU, or an sm90 backend that
// has no kernel for the problem. What must not happen is success with nothing run, or a write.
TEST_F(Validation, ControlSm90ReportsUnavailableOrNotSupported) {
  auto c = make_case(DType::kBF16, /*varlen=*/false, 128, 128);
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    const Status s = fa4::can_implement(c->problem, Backend::kSm90, pass);
    EXPECT_TRUE(s.code == StatusCode::kBackendUnavailable || s.code == StatusCode::kNotSupported)
        << fa4::to_string(s.code) << ": " << s.message;
    EXPECT_FALSE(s.message.empty());
    // The tensors are host memory: a backend that accepted the problem must not be run on them.
    if (s.ok()) return;
  }
  c->poison_outputs();
  const Status f = fa4::forward(c->problem, c->fwd, {}, nullptr, Backend::kSm90);
  EXPECT_TRUE(f.code == StatusCode::kBackendUnavailable || f.code == StatusCode::kNotSupported)
      << fa4::to_string(f.code) << ": " << f.message;
  EXPECT_TRUE(c->outputs_untouched());
}

TEST_F(Validation, NullPointers) {
  Case& c = fixed();
  const Problem& p = c.problem;
  const struct {
    const char* name;
    TensorView ForwardTensors::*view;
  } forward_views[] = {{"q", &ForwardTensors::q},
                       {"k", &ForwardTensors::k},
                       {"v", &ForwardTensors::v},
                       {"out", &ForwardTensors::out}};
  for (const auto& fv : forward_views) {
    SCOPED_TRACE(fv.name);
    ForwardTensors t = c.fwd;
    (t.*fv.view).data = nullptr;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {fv.name});
  }
  {
    SCOPED_TRACE("lse with return_lse");
    ForwardTensors t = c.fwd;
    t.lse.data = nullptr;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"lse"});
  }
  {
    // Without return_lse the lse view is not read: null is fine there.
    Problem no_lse = p;
    no_lse.return_lse = false;
    ForwardTensors t = c.fwd;
    t.lse.data = nullptr;
    c.poison_outputs();
    EXPECT_TRUE(fa4::forward(no_lse, t, {}, nullptr, Backend::kCpu).ok());
    EXPECT_TRUE(c.lse.all(kPoison)) << "lse written although return_lse is false";
  }

  const struct {
    const char* name;
    TensorView BackwardTensors::*view;
  } backward_views[] = {{"q", &BackwardTensors::q},       {"k", &BackwardTensors::k},
                        {"v", &BackwardTensors::v},       {"out", &BackwardTensors::out},
                        {"dout", &BackwardTensors::dout}, {"dq", &BackwardTensors::dq},
                        {"dk", &BackwardTensors::dk},     {"dv", &BackwardTensors::dv}};
  for (const auto& bv : backward_views) {
    SCOPED_TRACE(bv.name);
    BackwardTensors t = c.bwd;
    (t.*bv.view).data = nullptr;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {bv.name});
  }
  {
    // Backward always reads lse, whatever return_lse says.
    SCOPED_TRACE("backward lse");
    Problem no_lse = p;
    no_lse.return_lse = false;
    BackwardTensors t = c.bwd;
    t.lse.data = nullptr;
    expect_backward_rejected(c, no_lse, t, StatusCode::kInvalidArgument, {"lse"});
  }
}

TEST_F(Validation, OverlappingOutputStrides) {
  Case& c = fixed();
  const Problem& p = c.problem;
  {
    SCOPED_TRACE("out: every query row at the same address");
    ForwardTensors t = c.fwd;
    t.out.seq_stride = 0;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"out"});
  }
  {
    SCOPED_TRACE("out: heads half a head apart");
    ForwardTensors t = c.fwd;
    t.out.head_stride = p.head_dim_v / 2;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"out"});
  }
  {
    SCOPED_TRACE("out: batch entries one row apart");
    ForwardTensors t = c.fwd;
    t.out.batch_stride = t.out.seq_stride;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"out"});
  }
  {
    SCOPED_TRACE("lse: heads one element apart");
    ForwardTensors t = c.fwd;
    t.lse.head_stride = 1;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"lse"});
  }
  {
    SCOPED_TRACE("dq: seq_stride 0");
    BackwardTensors t = c.bwd;
    t.dq.seq_stride = 0;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {"dq"});
  }
  {
    SCOPED_TRACE("dk: kv heads overlapping");
    BackwardTensors t = c.bwd;
    t.dk.head_stride = 1;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {"dk"});
  }
  {
    SCOPED_TRACE("dv: batch_stride 0");
    BackwardTensors t = c.bwd;
    t.dv.batch_stride = 0;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {"dv"});
  }
  {
    // Inputs may broadcast (stride 0): they are only read.
    SCOPED_TRACE("control: k shared across the batch");
    ForwardTensors t = c.fwd;
    t.k.batch_stride = 0;
    c.poison_outputs();
    const Status s = fa4::forward(p, t, {}, nullptr, Backend::kCpu);
    EXPECT_TRUE(s.ok()) << s.message;
  }
}

TEST_F(Validation, UnpairedCuSeqlens) {
  Case& c = varlen();
  {
    Problem p = c.problem;
    p.varlen.cu_seqlens_q = nullptr;
    SCOPED_TRACE("cu_seqlens_k without cu_seqlens_q");
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"cu_seqlens_q"});
  }
  {
    Problem p = c.problem;
    p.varlen.cu_seqlens_k = nullptr;
    SCOPED_TRACE("cu_seqlens_q without cu_seqlens_k");
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"cu_seqlens_k"});
  }
}

TEST_F(Validation, NegativeSizes) {
  Case& c = fixed();
  const struct {
    const char* name;
    int64_t Problem::*field;
  } sizes[] = {{"batch", &Problem::batch},
               {"seqlen_q", &Problem::seqlen_q},
               {"seqlen_k", &Problem::seqlen_k}};
  for (const auto& s : sizes) {
    SCOPED_TRACE(s.name);
    Problem p = c.problem;
    p.*s.field = -1;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {s.name});
  }
  Case& vc = varlen();
  for (int which = 0; which < 2; ++which) {
    const char* name = which == 0 ? "total_q" : "total_k";
    SCOPED_TRACE(name);
    Problem p = vc.problem;
    (which == 0 ? p.varlen.total_q : p.varlen.total_k) = -1;
    expect_problem_rejected(vc, p, StatusCode::kInvalidArgument, {name});
  }
}

TEST_F(Validation, Heads) {
  Case& c = fixed();
  {
    SCOPED_TRACE("heads_q not a multiple of heads_kv");
    Problem p = c.problem;
    p.heads_kv = 3;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"heads_kv"});
  }
  for (int64_t bad : {int64_t(0), int64_t(-2)}) {
    SCOPED_TRACE("heads = " + std::to_string(bad));
    Problem p = c.problem;
    p.heads_q = bad;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"heads_q"});
    p = c.problem;
    p.heads_kv = bad;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"heads_kv"});
  }
}

TEST_F(Validation, HeadDims) {
  Case& c = fixed();
  for (int which = 0; which < 2; ++which) {
    const char* name = which == 0 ? "head_dim_qk" : "head_dim_v";
    int64_t Problem::*field = which == 0 ? &Problem::head_dim_qk : &Problem::head_dim_v;
    {
      // Tensors laid out for 257, so that the head dim is the only thing wrong.
      SCOPED_TRACE(std::string(name) + " = 257 on the CPU");
      std::unique_ptr<Case> wide = which == 0 ? make_case(DType::kFP32, false, 257, 8)
                                              : make_case(DType::kFP32, false, 16, 257);
      expect_problem_rejected(*wide, wide->problem, StatusCode::kNotSupported, {name});
    }
    for (int64_t bad : {int64_t(0), int64_t(-16)}) {
      SCOPED_TRACE(std::string(name) + " = " + std::to_string(bad));
      Problem p = c.problem;
      p.*field = bad;
      expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {name});
    }
  }
}

TEST_F(Validation, DTypes) {
  Case& c = fixed();
  for (int bad : {4, -1, 7}) {
    SCOPED_TRACE("dtype " + std::to_string(bad));
    Problem p = c.problem;
    p.dtype = static_cast<DType>(bad);
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"dtype"});
  }
  {
    // A valid dtype the GPU backend has no kernel for. The message names the value: "fp32".
    SCOPED_TRACE("fp32 on sm90");
    expect_problem_rejected(c, c.problem, StatusCode::kNotSupported, {"fp32"}, Backend::kSm90);
  }
}

TEST_F(Validation, InnermostStrideNotOne) {
  Case& c = fixed();
  const Problem& p = c.problem;
  const struct {
    const char* name;
    TensorView ForwardTensors::*view;
  } forward_views[] = {{"q", &ForwardTensors::q},
                       {"k", &ForwardTensors::k},
                       {"v", &ForwardTensors::v},
                       {"out", &ForwardTensors::out}};
  for (const auto& fv : forward_views) {
    for (int64_t bad : {int64_t(2), int64_t(0)}) {
      SCOPED_TRACE(std::string(fv.name) + ".dim_stride = " + std::to_string(bad));
      ForwardTensors t = c.fwd;
      (t.*fv.view).dim_stride = bad;
      expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {fv.name, "dim_stride"});
    }
  }
  const struct {
    const char* name;
    TensorView BackwardTensors::*view;
  } backward_views[] = {{"dout", &BackwardTensors::dout},
                        {"dq", &BackwardTensors::dq},
                        {"dk", &BackwardTensors::dk},
                        {"dv", &BackwardTensors::dv}};
  for (const auto& bv : backward_views) {
    SCOPED_TRACE(std::string(bv.name) + ".dim_stride = 2");
    BackwardTensors t = c.bwd;
    (t.*bv.view).dim_stride = 2;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {bv.name, "dim_stride"});
  }
  {
    SCOPED_TRACE("forward lse.seq_stride = 2");
    ForwardTensors t = c.fwd;
    t.lse.seq_stride = 2;
    t.lse.head_stride = 2 * p.seqlen_q;  // still no overlap: only seq_stride is wrong
    t.lse.batch_stride = p.heads_q * t.lse.head_stride;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"lse", "seq_stride"});
  }
  {
    SCOPED_TRACE("backward lse.seq_stride = 2");
    BackwardTensors t = c.bwd;
    t.lse.seq_stride = 2;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {"lse", "seq_stride"});
  }
}

TEST_F(Validation, CuSeqlensContents) {
  Case& c = varlen();
  const Problem& p = c.problem;
  const int32_t original_q[4] = {0, 3, 3, 8}, original_k[4] = {0, 4, 6, 12};
  const auto reset = [&] {
    std::memcpy(c.cu_q, original_q, sizeof original_q);
    std::memcpy(c.cu_k, original_k, sizeof original_k);
  };
  const auto both = [&](Problem problem, Fields fields) {
    expect_forward_rejected(c, problem, c.fwd, StatusCode::kInvalidArgument, fields);
    expect_backward_rejected(c, problem, c.bwd, StatusCode::kInvalidArgument, fields);
    reset();
  };
  {
    SCOPED_TRACE("cu_seqlens_q[0] = 1");
    c.cu_q[0] = 1;
    both(p, {"cu_seqlens_q"});
  }
  {
    SCOPED_TRACE("cu_seqlens_k[0] = -1");
    c.cu_k[0] = -1;
    both(p, {"cu_seqlens_k"});
  }
  {
    SCOPED_TRACE("cu_seqlens_k decreasing");
    c.cu_k[2] = 3;  // {0, 4, 3, 12}: caught at the decrease, before the third length is looked at
    both(p, {"cu_seqlens_k"});
  }
  {
    SCOPED_TRACE("cu_seqlens_q decreasing");
    c.cu_q[1] = 4;  // {0, 4, 3, 8}
    both(p, {"cu_seqlens_q"});
  }
  {
    SCOPED_TRACE("cu_seqlens_q[batch] > total_q");
    c.cu_q[2] = 4;
    c.cu_q[3] = 9;  // lengths 3, 1, 5: each within seqlen_q = 5, but 9 rows > total_q = 8
    both(p, {"cu_seqlens_q"});
  }
  {
    SCOPED_TRACE("cu_seqlens_k[batch] > total_k");
    c.cu_k[3] = 13;  // lengths 4, 2, 7
    Problem wide = p;
    wide.seqlen_k = 7;
    both(wide, {"cu_seqlens_k"});
  }
  {
    SCOPED_TRACE("a q length above seqlen_q");
    Problem narrow = p;
    narrow.seqlen_q = 4;  // the third sequence has 5 queries
    both(narrow, {"cu_seqlens_q"});
  }
  {
    SCOPED_TRACE("a k length above seqlen_k");
    Problem narrow = p;
    narrow.seqlen_k = 5;  // the third sequence has 6 keys
    both(narrow, {"cu_seqlens_k"});
  }
}

TEST_F(Validation, SequsedK) {
  for (Case* c : {&fixed(), &varlen()}) {
    SCOPED_TRACE(c->problem.is_varlen() ? "varlen" : "fixed-length");
    // Each sequence's own key count: the fixed-length seqlen_k, or the varlen lengths.
    const int32_t lengths[3] = {c->problem.is_varlen() ? 4 : 7, c->problem.is_varlen() ? 2 : 7, 6};
    Problem p = c->problem;
    p.seqused_k = c->seqused;
    std::memcpy(c->seqused, lengths, sizeof lengths);
    c->poison_outputs();
    const Status control = fa4::forward(p, c->fwd, {}, nullptr, Backend::kCpu);
    ASSERT_TRUE(control.ok()) << "seqused_k equal to every length must pass: " << control.message;
    for (int b = 0; b < int(p.batch); ++b) {
      std::memcpy(c->seqused, lengths, sizeof lengths);
      {
        SCOPED_TRACE("seqused_k[" + std::to_string(b) + "] one above its sequence");
        c->seqused[b] = lengths[b] + 1;
        expect_forward_rejected(*c, p, c->fwd, StatusCode::kInvalidArgument, {"seqused_k"});
        expect_backward_rejected(*c, p, c->bwd, StatusCode::kInvalidArgument, {"seqused_k"});
      }
      {
        SCOPED_TRACE("seqused_k[" + std::to_string(b) + "] negative");
        c->seqused[b] = -1;
        expect_forward_rejected(*c, p, c->fwd, StatusCode::kInvalidArgument, {"seqused_k"});
        expect_backward_rejected(*c, p, c->bwd, StatusCode::kInvalidArgument, {"seqused_k"});
      }
    }
  }
}

TEST_F(Validation, Window) {
  Case& c = fixed();
  for (int64_t bad : {int64_t(-2), std::numeric_limits<int64_t>::min()}) {
    SCOPED_TRACE("window " + std::to_string(bad));
    Problem p = c.problem;
    p.window.left = bad;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"window.left"});
    p = c.problem;
    p.window.right = bad;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"window.right"});
  }
}

TEST_F(Validation, Softcap) {
  Case& c = fixed();
  for (float bad : {-1.0f, -0.0001f, kFloatNaN, kFloatInf, -kFloatInf}) {
    SCOPED_TRACE("softcap " + std::to_string(bad));
    Problem p = c.problem;
    p.softcap = bad;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"softcap"});
  }
}

TEST_F(Validation, SoftmaxScale) {
  Case& c = fixed();
  for (float bad : {kFloatNaN, kFloatInf, -kFloatInf}) {
    SCOPED_TRACE("softmax_scale " + std::to_string(bad));
    Problem p = c.problem;
    p.softmax_scale = bad;
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"softmax_scale"});
  }
}

TEST_F(Validation, Workspace) {
  Case& c = fixed();
  const Problem& p = c.problem;
  const size_t need = c.workspace.size();
  {
    SCOPED_TRACE("one byte short");
    c.poison_outputs();
    const Status s =
        fa4::backward(p, c.bwd, {c.workspace.data(), need - 1}, nullptr, Backend::kCpu);
    expect_status(s, StatusCode::kWorkspaceTooSmall, {"workspace"});
    EXPECT_TRUE(c.outputs_untouched());
  }
  {
    SCOPED_TRACE("no workspace at all");
    c.poison_outputs();
    const Status s = fa4::backward(p, c.bwd, {}, nullptr, Backend::kCpu);
    expect_status(s, StatusCode::kWorkspaceTooSmall, {"workspace"});
    EXPECT_TRUE(c.outputs_untouched());
  }
  {
    SCOPED_TRACE("enough bytes, null pointer");
    c.poison_outputs();
    const Status s = fa4::backward(p, c.bwd, {nullptr, need}, nullptr, Backend::kCpu);
    expect_status(s, StatusCode::kInvalidArgument, {"workspace.data"});
    EXPECT_TRUE(c.outputs_untouched());
  }
}

// Found in review: the sm90 kernel keeps the running max of raw scores, which is the max of the
// logits only for a positive scale; other scales are refused there (the CPU backend runs them).
// Score variants: ALiBi slopes and sinks are arrays of floats (aligned, strides ≥ 0); d(sinks)
// needs sinks.
TEST_F(Validation, ScoreVariants) {
  Case& c = fixed();
  alignas(16) static float slopes[64] = {0.5f, 0.25f, 0.125f, 0.0625f};
  {
    SCOPED_TRACE("alibi with a negative stride");
    Problem p = c.problem;
    p.alibi = {slopes, 0, -1};
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"alibi"});
  }
  {
    SCOPED_TRACE("misaligned alibi slopes");
    Problem p = c.problem;
    p.alibi = {reinterpret_cast<const float*>(reinterpret_cast<const char*>(slopes) + 2), 0, 1};
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"alibi", "aligned"});
  }
  {
    SCOPED_TRACE("misaligned sinks");
    Problem p = c.problem;
    p.sinks = reinterpret_cast<const float*>(reinterpret_cast<const char*>(slopes) + 1);
    expect_problem_rejected(c, p, StatusCode::kInvalidArgument, {"sinks", "aligned"});
  }
  {
    SCOPED_TRACE("dsinks without sinks");
    BackwardTensors t = c.bwd;
    t.dsinks = slopes + 8;
    expect_backward_rejected(c, c.problem, t, StatusCode::kInvalidArgument, {"dsinks"});
  }
}

TEST_F(Validation, Sm90RefusesScalesItCannotRun) {
  auto c = make_case(DType::kBF16, /*varlen=*/false, 128, 128);
  Problem p = c->problem;
  p.softmax_scale = -0.125f;
  expect_status(fa4::can_implement(p, Backend::kSm90, Pass::kForward), StatusCode::kNotSupported,
                {"softmax_scale"});
  p = c->problem;
  p.softcap = 3e38f;  // finite, but softcap·log2(e) is not
  expect_status(fa4::can_implement(p, Backend::kSm90, Pass::kForward), StatusCode::kNotSupported,
                {"softcap"});
}

TEST_F(Validation, MisalignedLse) {
  Case& c = fixed();
  AlignedBytes shifted(c.lse.size() + sizeof(float));
  ForwardTensors t = c.fwd;
  t.lse.data = reinterpret_cast<float*>(shifted.data() + 2);
  expect_forward_rejected(c, c.problem, t, StatusCode::kInvalidArgument, {"lse"});
  BackwardTensors b = c.bwd;
  b.lse.data = t.lse.data;
  expect_backward_rejected(c, c.problem, b, StatusCode::kInvalidArgument, {"lse"});
}

// Found in review: a window side given as a huge number ("no limit") overflowed the mask's bounds
// and hid every key. Any side at least sq + sk wide must behave exactly like -1.
TEST_F(Validation, HugeWindowSidesAreUnbounded) {
  Case& c = fixed();
  const auto run = [&](int64_t left, int64_t right) {
    Problem p = c.problem;
    p.window = {left, right};
    c.poison_outputs();
    EXPECT_TRUE(fa4::forward(p, c.fwd, c.ws(), nullptr, Backend::kCpu).ok());
    return std::vector<unsigned char>(c.out.data(), c.out.data() + c.out.size());
  };
  const std::vector<unsigned char> unbounded = run(-1, -1);
  const int64_t huge = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(run(huge, -1), unbounded);
  EXPECT_EQ(run(-1, huge), unbounded);
  EXPECT_EQ(run(huge, huge), unbounded);
  const int64_t wide = c.problem.seqlen_q + c.problem.seqlen_k;
  EXPECT_EQ(run(wide, wide), unbounded);
  EXPECT_EQ(run(-1, 0), run(huge, 0)) << "causal-like band with a huge left side";
}

// The alignment checks are host-side and run before can_implement and the availability check, so
// they answer the same in a CPU-only build, on a machine without a GPU, and on an H200. bf16 with head dim 128: a
// problem the sm90 backend is meant to run, so that only the alignment is wrong.
TEST_F(Validation, Sm90Alignment) {
  auto c = make_case(DType::kBF16, /*varlen=*/false, 128, 128);
  const Problem& p = c->problem;
  {
    SCOPED_TRACE("q.data 2 bytes off");
    ForwardTensors t = c->fwd;
    t.q.data = c->q.data() + 2;
    expect_forward_rejected(*c, p, t, StatusCode::kInvalidArgument, {"q"}, Backend::kSm90);
  }
  {
    SCOPED_TRACE("out.data 2 bytes off");
    ForwardTensors t = c->fwd;
    t.out.data = c->out.data() + 2;
    expect_forward_rejected(*c, p, t, StatusCode::kInvalidArgument, {"out"}, Backend::kSm90);
  }
  {
    SCOPED_TRACE("k.seq_stride not a multiple of 16 bytes");
    ForwardTensors t = c->fwd;
    t.k.seq_stride += 1;  // one bf16 more: 2 bytes past a multiple of 16 (batch_stride stays one)
    expect_forward_rejected(*c, p, t, StatusCode::kInvalidArgument, {"k", "seq_stride"},
                            Backend::kSm90);
  }
  {
    SCOPED_TRACE("dq.data 2 bytes off");
    BackwardTensors t = c->bwd;
    t.dq.data = c->dq.data() + 2;
    expect_backward_rejected(*c, p, t, StatusCode::kInvalidArgument, {"dq"}, Backend::kSm90);
  }
}

TEST_F(Validation, OffsetOverflow) {
  Case& c = fixed();
  const Problem& p = c.problem;
  {
    SCOPED_TRACE("one stride whose offset overflows");
    Problem three = p;
    three.batch = 3;
    ForwardTensors t = c.fwd;
    t.q.batch_stride = int64_t(1) << 62;  // (3 - 1) · 2^62 = 2^63 > INT64_MAX
    expect_forward_rejected(c, three, t, StatusCode::kInvalidArgument, {"q"});
  }
  {
    // Each term fits in int64; their sum is 2^64 + 13, which wraps to a harmless-looking 13, so
    // only a check of the sum itself catches it.
    SCOPED_TRACE("terms that fit alone but not summed");
    ForwardTensors t = c.fwd;
    t.k.batch_stride = int64_t(1) << 62;                 // (2 - 1) · 2^62
    t.k.head_stride = int64_t(1) << 62;                  // (2 - 1) · 2^62
    t.k.seq_stride = (kInt64Max - 1) / (p.seqlen_k - 1);  // (7 - 1) · that = 2^63 - 2
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"k"});
  }
  {
    SCOPED_TRACE("element offsets fit, byte offsets do not");
    ForwardTensors t = c.fwd;
    t.v.batch_stride = int64_t(1) << 61;  // 2^61 fp32 elements = 2^63 bytes
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"v"});
  }
  {
    // The largest element offset is exactly INT64_MAX: counting elements (offset + 1) must not
    // overflow either (UBSan, debug preset, watches this one).
    SCOPED_TRACE("largest element offset exactly INT64_MAX");
    ForwardTensors t = c.fwd;
    t.q.seq_stride = 0;  // inputs may broadcast, so only batch_stride and the last row matter
    t.q.head_stride = 0;
    t.q.batch_stride = kInt64Max - (p.head_dim_qk - 1);
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"q"});
  }
  {
    SCOPED_TRACE("huge seqlen_q with an output laid out to match");
    Problem huge = p;
    huge.batch = 1;
    huge.seqlen_q = int64_t(1) << 59;
    ForwardTensors t = c.fwd;
    t.q.seq_stride = 0;  // q may broadcast; out may not, so out is the view that overflows
    // 2^59 rows of heads_q · head_dim_v = 32 elements: 2^64 elements. The problem's own sizes
    // overflow before any view is looked at.
    expect_forward_rejected(c, huge, t, StatusCode::kInvalidArgument, {"seqlen_q"});
  }
  {
    SCOPED_TRACE("lse head_stride too large");
    ForwardTensors t = c.fwd;
    t.lse.head_stride = int64_t(1) << 62;  // (4 - 1) · 2^62
    t.lse.batch_stride = 0;
    Problem one = p;
    one.batch = 1;
    expect_forward_rejected(c, one, t, StatusCode::kInvalidArgument, {"lse"});
  }
  {
    SCOPED_TRACE("dv batch_stride too large");
    BackwardTensors t = c.bwd;
    t.dv.batch_stride = kInt64Max / 2;  // (2 - 1) · that, plus the rows: fits; · 4 bytes: not
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {"dv"});
  }
}

// A problem whose tensors could never exist (more bytes than int64 holds) is rejected before any
// size is derived from it: here one float of workspace per (batch, head, query row) would be
// 2^21 · 2^21 · 2^21 · 4 bytes = 2^65 bytes.
TEST_F(Validation, SizesWhoseElementCountOverflows) {
  Problem p = fixed().problem;
  p.batch = int64_t(1) << 21;
  p.seqlen_q = int64_t(1) << 21;
  p.heads_q = int64_t(1) << 21;
  p.heads_kv = 1;
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    SCOPED_TRACE(pass == Pass::kForward ? "forward" : "backward");
    EXPECT_EQ(fa4::can_implement(p, Backend::kCpu, pass).code, StatusCode::kInvalidArgument);
    size_t bytes = 0;
    const Status s = fa4::workspace_size(p, Backend::kCpu, pass, &bytes);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << "workspace_size said " << bytes << " bytes";
  }
}

TEST_F(Validation, InvalidEnums) {
  Case& c = fixed();
  for (int bad : {3, -1}) {
    SCOPED_TRACE("backend " + std::to_string(bad));
    expect_problem_rejected(c, c.problem, StatusCode::kInvalidArgument, {"backend"},
                            static_cast<Backend>(bad));
  }
  for (int bad : {2, -1}) {
    SCOPED_TRACE("pass " + std::to_string(bad));
    const Pass pass = static_cast<Pass>(bad);
    expect_status(fa4::can_implement(c.problem, Backend::kCpu, pass), StatusCode::kInvalidArgument,
                  {"pass"});
    size_t bytes = 0;
    expect_status(fa4::workspace_size(c.problem, Backend::kCpu, pass, &bytes),
                  StatusCode::kInvalidArgument, {"pass"});
  }
}

TEST_F(Validation, WorkspaceSizeNullResult) {
  for (Pass pass : {Pass::kForward, Pass::kBackward}) {
    expect_status(fa4::workspace_size(fixed().problem, Backend::kCpu, pass, nullptr),
                  StatusCode::kInvalidArgument, {"bytes"});
  }
}

TEST_F(Validation, NegativeStrides) {
  Case& c = fixed();
  const Problem& p = c.problem;
  {
    SCOPED_TRACE("q.seq_stride < 0");
    ForwardTensors t = c.fwd;
    t.q.seq_stride = -t.q.seq_stride;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"q"});
  }
  {
    SCOPED_TRACE("v.head_stride < 0");
    ForwardTensors t = c.fwd;
    t.v.head_stride = -1;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"v"});
  }
  {
    SCOPED_TRACE("out.batch_stride < 0");
    ForwardTensors t = c.fwd;
    t.out.batch_stride = -t.out.batch_stride;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"out"});
  }
  {
    SCOPED_TRACE("lse.head_stride < 0");
    ForwardTensors t = c.fwd;
    t.lse.head_stride = -t.lse.head_stride;
    expect_forward_rejected(c, p, t, StatusCode::kInvalidArgument, {"lse"});
  }
  {
    SCOPED_TRACE("dk.seq_stride < 0");
    BackwardTensors t = c.bwd;
    t.dk.seq_stride = -t.dk.seq_stride;
    expect_backward_rejected(c, p, t, StatusCode::kInvalidArgument, {"dk"});
  }
}

}  // namespace
