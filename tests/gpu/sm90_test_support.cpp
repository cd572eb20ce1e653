#include "sm90_test_support.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "common/numeric.hpp"

namespace fa4::test {
namespace {

// A positive decimal number and nothing else.
bool parse_dim(const std::string& text, int64_t* dim) {
  constexpr size_t kMaxDigits = 6;
  if (text.empty() || text.size() > kMaxDigits ||
      !std::all_of(text.begin(), text.end(), [](unsigned char ch) { return std::isdigit(ch); }))
    return false;
  *dim = std::stoll(text);
  return *dim > 0;
}

}  // namespace

std::vector<Kernel> parse_kernel_list(const std::string& list, const std::string& what) {
  std::vector<Kernel> kernels;
  std::stringstream text(list);
  std::string entry;
  while (std::getline(text, entry, ',')) {
    if (entry.empty()) continue;
    const size_t colon = entry.find(':');
    const std::string dims = entry.substr(0, colon);
    const std::string dtype = colon == std::string::npos ? "" : entry.substr(colon + 1);
    const size_t x = dims.find('x');
    Kernel k{};
    bool ok = parse_dim(dims.substr(0, x), &k.dim_qk);
    k.dim_v = k.dim_qk;
    if (x != std::string::npos) ok = ok && parse_dim(dims.substr(x + 1), &k.dim_v);
    if (!ok || (dtype != "bf16" && dtype != "fp16" && dtype != "e4m3"))
      throw std::invalid_argument(what + ": cannot read '" + entry +
                                  "' (expected head_dim[xhead_dim_v]:bf16|fp16|e4m3)");
    k.dtype = dtype == "fp16" ? DType::kFP16 : dtype == "e4m3" ? DType::kE4M3 : DType::kBF16;
    kernels.push_back(k);
  }
  return kernels;
}

bool kernel_listed(const std::vector<Kernel>& list, int64_t dim_qk, int64_t dim_v, DType dtype) {
  for (const Kernel& k : list)
    if (k.dim_qk == dim_qk && k.dim_v == dim_v && k.dtype == dtype) return true;
  return false;
}

#if !defined(FA4_SM90_BUILT_KERNELS) || !defined(FA4_SM90_BUILT_BWD_KERNELS)
#error "tests/gpu/CMakeLists.txt passes the built kernel lists"
#endif

const std::vector<Kernel>& built_kernels() {
  static const std::vector<Kernel> kernels =
      parse_kernel_list(FA4_SM90_BUILT_KERNELS, "FA4_SM90_BUILT_KERNELS");
  return kernels;
}

const std::vector<Kernel>& built_16bit_kernels() {
  static const std::vector<Kernel> kernels = [] {
    std::vector<Kernel> picked;
    for (const Kernel& k : built_kernels())
      if (k.dtype != DType::kE4M3) picked.push_back(k);
    return picked;
  }();
  return kernels;
}

const std::vector<Kernel>& built_backward_kernels() {
  static const std::vector<Kernel> kernels =
      parse_kernel_list(FA4_SM90_BUILT_BWD_KERNELS, "FA4_SM90_BUILT_BWD_KERNELS");
  return kernels;
}

bool is_full_kernel(const Kernel& k) {
  return k.dim_qk == 128 && k.dim_v == 128 && k.dtype == DType::kBF16;
}

Case base_case(const Kernel& k, const Shape& s) {
  Case c;
  c.batch = s.batch;
  c.seqlen_q = s.sq;
  c.seqlen_k = s.sk;
  c.dim_qk = k.dim_qk;
  c.dim_v = k.dim_v;
  c.dtype = k.dtype;
  return c;
}

std::string kernel_tag(const Kernel& k) {
  std::string dims = std::to_string(k.dim_qk);
  if (k.dim_v != k.dim_qk) dims += "x" + std::to_string(k.dim_v);
  return "d" + dims + "_" + dtype_name(k.dtype);
}

std::string window_tag(const Window& w) {
  return (w.left >= 0 ? "L" + std::to_string(w.left) : "") +
         (w.right >= 0 ? "R" + std::to_string(w.right) : "");
}

std::string gqa_tag(const Case& c) { return "_gqa" + std::to_string(c.heads_q / c.heads_kv); }

DeviceMirror::View array_view(const std::vector<int32_t>& a) {
  const int64_t n = int64_t(a.size());
  return {a.data(), {1, 1, 1, n}, {n, n, n, 1}};
}
DeviceMirror::View array_view(const std::vector<float>& a) {
  const int64_t n = int64_t(a.size());
  return {a.data(), {1, 1, 1, n}, {n, n, n, 1}};
}

DeviceRun::DeviceRun(const CaseData& s)
    : setup(s),
      problem(s.problem),
      out(output_dtype(s.problem),
          query_dims(s.problem, s.problem.heads_q, s.problem.head_dim_v),
          s.layout == Layout::kHeadMajor ? Layout::kHeadMajor : Layout::kContiguous),
      lse(make_lse(s.problem, /*padded=*/false)) {
  const size_t elem = dtype_size(s.problem.dtype);
  const DeviceMirror* q_mirror;
  const DeviceMirror* k_mirror;
  const DeviceMirror* v_mirror;
  if (s.packed) {
    inputs.push_back(std::make_unique<DeviceMirror>(
        std::vector<DeviceMirror::View>{mirror_view(s.q), mirror_view(s.k), mirror_view(s.v)},
        elem));
    q_mirror = k_mirror = v_mirror = inputs[0].get();
  } else {
    for (const HostTensor* t : {&s.q, &s.k, &s.v})
      inputs.push_back(std::make_unique<DeviceMirror>(
          std::vector<DeviceMirror::View>{mirror_view(*t)}, elem));
    q_mirror = inputs[0].get();
    k_mirror = inputs[1].get();
    v_mirror = inputs[2].get();
  }
  // The arrays the problem points at, each in device memory of its own.
  auto device_array = [&](const std::vector<int32_t>& a) -> const int32_t* {
    inputs.push_back(std::make_unique<DeviceMirror>(
        std::vector<DeviceMirror::View>{array_view(a)}, sizeof(int32_t)));
    return static_cast<const int32_t*>(inputs.back()->device(a.data()));
  };
  if (s.problem.is_varlen()) {
    problem.varlen.cu_seqlens_q = device_array(s.cu_q);
    problem.varlen.cu_seqlens_k = device_array(s.cu_k);
  }
  if (s.problem.seqused_k != nullptr) problem.seqused_k = device_array(s.used_k);
  // The score variants' arrays: sink logits, ALiBi slopes (their strides as the host's).
  auto device_floats = [&](const std::vector<float>& a) -> const float* {
    inputs.push_back(std::make_unique<DeviceMirror>(
        std::vector<DeviceMirror::View>{array_view(a)}, sizeof(float)));
    return static_cast<const float*>(inputs.back()->device(a.data()));
  };
  if (s.problem.sinks != nullptr) problem.sinks = device_floats(s.sinks);
  if (s.problem.alibi.data != nullptr) problem.alibi.data = device_floats(s.alibi_slopes);
  d_out = std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{mirror_view(out)},
                                         dtype_size(out.dtype()));
  d_lse = std::make_unique<DeviceMirror>(std::vector<DeviceMirror::View>{mirror_view(lse)}, 4);
  tensors.q = q_mirror->device_view(s.q.view());
  tensors.k = k_mirror->device_view(s.k.view());
  tensors.v = v_mirror->device_view(s.v.view());
  tensors.out = d_out->device_view(out.view());
  if (s.problem.return_lse) tensors.lse = d_lse->device_view(lse.view());
}

const Overrides& test_overrides() {
  static const Overrides overrides = [] {
    Overrides o;
    const Status s = overrides_from_env(&o);
    if (!s.ok()) {
      std::fprintf(stderr, "fa4_gpu_tests: %s\n", s.message.c_str());
      std::exit(2);
    }
    return o;
  }();
  return overrides;
}

std::string DeviceRun::upload() {
  // A problem the backend refuses gets no workspace: the refusal is what its test checks.
  size_t bytes = 0;
  if (!workspace_size(problem, Backend::kSm90, Pass::kForward, overrides, &bytes).ok()) bytes = 0;
  const std::string allocated = workspace.allocate(bytes);
  if (!allocated.empty()) return allocated;
  for (auto& m : inputs) {
    const std::string e = m->upload();
    if (!e.empty()) return e;
  }
  return device_sync();
}

std::string DeviceRun::device_sync() {
  const cudaError_t err = cudaDeviceSynchronize();
  return err == cudaSuccess ? "" : std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(err);
}

void run_and_check_writes(DeviceRun& run, std::vector<unsigned char>* rows) {
  const Problem& p = run.setup.problem;
  const Status can = can_implement(run.problem, Backend::kSm90, Pass::kForward);
  ASSERT_TRUE(can.ok()) << to_string(can.code) << ": " << can.message;
  ASSERT_CUDA(run.upload());
  Stream stream;
  Status status;
  ASSERT_CUDA(run.run(stream.get(), /*graph=*/false, &status));
  ASSERT_TRUE(status.ok()) << to_string(status.code) << ": " << status.message;

  *rows = rows_in_sequences(p, /*keys=*/false);
  const CheckResult written = check_written("out", run.out, *rows);
  EXPECT_TRUE(written.ok) << written.message;
  const std::vector<unsigned char> lse_rows =
      p.return_lse ? *rows : std::vector<unsigned char>(rows->size(), 0);
  const CheckResult lse_written = check_written("lse", run.lse, lse_rows);
  EXPECT_TRUE(lse_written.ok) << lse_written.message;
  bool intact = false;
  ASSERT_CUDA(run.d_out->guards_intact(&intact));
  EXPECT_TRUE(intact) << "out: bytes around the tensor were written";
  ASSERT_CUDA(run.d_lse->guards_intact(&intact));
  EXPECT_TRUE(intact) << "lse: bytes around the tensor were written";
}

std::string DeviceRun::run(cudaStream_t stream, bool graph, Status* status) {
  out.poison();
  lse.poison();
  std::string e = d_out->poison();
  if (e.empty()) e = d_lse->poison();
  if (e.empty()) e = workspace.poison(workspace_poison);
  if (e.empty()) e = d_out->upload();
  if (e.empty()) e = d_lse->upload();
  if (e.empty()) e = device_sync();
  if (!e.empty()) return e;
  if (graph) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
      return "cudaStreamBeginCapture failed";
    *status = forward(problem, tensors, workspace.view(), stream, Backend::kSm90, overrides);
    if (cudaStreamEndCapture(stream, &g) != cudaSuccess) return "cudaStreamEndCapture failed";
    if (cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) return "cudaGraphInstantiate failed";
    const cudaError_t launched = cudaGraphLaunch(exec, stream);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    if (launched != cudaSuccess) return "cudaGraphLaunch failed";
  } else {
    *status = forward(problem, tensors, workspace.view(), stream, Backend::kSm90, overrides);
  }
  const cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return std::string("kernel: ") + cudaGetErrorString(err);
  bool intact = false;
  e = workspace.guards_intact(&intact);
  if (e.empty() && !intact) e = "the bytes around the workspace were written";
  if (e.empty()) e = d_out->download(nullptr);
  if (e.empty()) e = d_lse->download(nullptr);
  return e;
}

void expect_refused(DeviceRun& run, const Problem& problem, Workspace workspace, StatusCode code,
                    const std::string& named) {
  run.out.poison();  // the host pattern check_written recognises, uploaded
  ASSERT_CUDA(run.d_out->upload());
  ASSERT_CUDA(DeviceRun::device_sync());
  const Status s = forward(problem, run.tensors, workspace, nullptr, Backend::kSm90, run.overrides);
  EXPECT_EQ(s.code, code) << s.message;
  if (!named.empty()) EXPECT_NE(s.message.find(named), std::string::npos) << s.message;
  ASSERT_CUDA(DeviceRun::device_sync());
  ASSERT_CUDA(run.d_out->download(nullptr));
  const std::vector<unsigned char> no_rows(rows_in_sequences(run.setup.problem, false).size(), 0);
  const CheckResult untouched = check_written("out", run.out, no_rows);
  EXPECT_TRUE(untouched.ok) << untouched.message;
}

}  // namespace fa4::test
