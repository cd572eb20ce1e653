// fa4-bench: runs attention forward and/or backward for one problem given on the command line,
// reports the median time and TFLOP/s per pass, and checks a sample against the double reference.
// `fa4-bench --help` lists the options; bench/README.md shows typical runs.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "buffers.hpp"
#include "check.hpp"
#include "common/numeric.hpp"
#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"
#include "gpu_info.hpp"
#include "options.hpp"
#include "problem.hpp"
#include "report.hpp"
#include "timing.hpp"

namespace fa4::bench {
namespace {

enum ExitCode { kExitOk = 0, kExitCheckFailed = 1, kExitUsage = 2, kExitRunFailed = 3 };

constexpr int kGpuWarmup = 5;
constexpr int kGpuIters = 50;  // the median of at least 50 runs (docs/benchmarks.md)
constexpr int kCpuWarmup = 1;
constexpr int kCpuIters = 3;   // the default problem takes seconds per run on a few cores

// Seeds of the random streams, so that q, k, v and dO differ for one --seed.
enum InputStream : uint64_t { kStreamQ = 1, kStreamK, kStreamV, kStreamDout };

// A run could not go on; main prints the message and exits with the code.
struct Failure {
  ExitCode code;
  std::string message;
};

const char* backend_name(Backend b) { return b == Backend::kCpu ? "cpu" : "sm90"; }

Backend choose_backend(const std::string& name) {
  if (name == "cpu") return Backend::kCpu;
  if (name == "sm90") return Backend::kSm90;
  return cuda_device_present() ? Backend::kSm90 : Backend::kCpu;
}

// The CPU backend's rule (src/cpu/parallel.cpp): the overrides' count, else every hardware thread.
int cpu_threads(const Overrides& overrides) {
  if (overrides.cpu_threads > 0) return overrides.cpu_threads;
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

// Found out before a long run rather than after it; leaves no empty file behind.
bool writable(const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  const bool ok = bool(std::ofstream(path, std::ios::app));
  if (ok && !existed) std::filesystem::remove(path, ec);
  return ok;
}

void require(const Status& status, Backend backend, Pass pass) {
  if (status.ok()) return;
  std::string msg = std::string("the ") + backend_name(backend) + " backend cannot run the " +
                    (pass == Pass::kForward ? "forward" : "backward") + " pass of this problem (" +
                    to_string(status.code) + "): " + status.message;
  if (backend == Backend::kSm90 && (status.code == StatusCode::kBackendUnavailable ||
                                    status.code == StatusCode::kNotSupported))
    msg += "\n  (--backend cpu runs it on the CPU)";
  throw Failure{kExitUsage, msg};
}

void run_ok(const Status& status, const char* what) {
  if (!status.ok())
    throw Failure{kExitRunFailed, std::string(what) + " failed (" + to_string(status.code) + "): " + status.message};
}

// A (rows, heads, dim) tensor in fa4-bench's contiguous layout: generated on the host, mirrored in
// the backend's memory when that is the device.
struct Tensor {
  Buffer host;
  Buffer backend;  // empty when the backend computes in host memory
  int64_t rows_per_batch = 0, heads = 0, dim = 0;

  void* backend_data() const { return backend.data() != nullptr ? backend.data() : host.data(); }
};

TensorView view_of(const Problem& p, const Tensor& t, void* data) {
  TensorView v;
  v.data = data;
  v.dim_stride = 1;
  v.head_stride = t.dim;
  v.seq_stride = t.heads * t.dim;
  v.batch_stride = p.is_varlen() ? 0 : t.rows_per_batch * t.heads * t.dim;
  return v;
}

int64_t tensor_rows(const Problem& p, bool query_side) {
  const int64_t per_batch = query_side ? query_rows(p) : key_rows(p);
  return p.is_varlen() ? per_batch : per_batch * p.batch;
}

// A tensor's shape, with no memory yet; `bytes` receives the size of its storage.
Tensor shaped(const Problem& p, bool query_side, int64_t heads, int64_t dim, size_t* bytes) {
  Tensor t;
  t.rows_per_batch = query_side ? query_rows(p) : key_rows(p);
  t.heads = heads;
  t.dim = dim;
  *bytes = size_t(tensor_rows(p, query_side) * heads * dim) * dtype_size(p.dtype);
  return t;
}

// An input tensor of random normal values, present in the backend's memory.
Tensor random_input(const Problem& p, Memory memory, bool query_side, int64_t heads, int64_t dim,
                    uint64_t seed, InputStream stream) {
  size_t bytes = 0;
  Tensor t = shaped(p, query_side, heads, dim, &bytes);
  t.host = Buffer(Memory::kHost, bytes);
  fill_normal(t.host.data(), p.dtype, tensor_rows(p, query_side) * heads * dim, seed, stream);
  if (memory == Memory::kDevice) {
    t.backend = Buffer(Memory::kDevice, bytes);
    t.backend.upload(t.host.data());
  }
  return t;
}

// An output tensor: only backend memory, read back for the check.
Tensor output_tensor(const Problem& p, Memory memory, bool query_side, int64_t heads, int64_t dim) {
  size_t bytes = 0;
  Tensor t = shaped(p, query_side, heads, dim, &bytes);
  t.backend = Buffer(memory, bytes);
  return t;
}

struct Lse {
  Buffer buffer;
  LseView view;
};

Lse make_lse(const Problem& p, Memory memory) {
  Lse l;
  const int64_t rows = query_rows(p);
  const int64_t count = p.is_varlen() ? p.heads_q * rows : p.batch * p.heads_q * rows;
  l.buffer = Buffer(memory, size_t(count) * sizeof(float));
  l.view.data = static_cast<float*>(l.buffer.data());
  l.view.seq_stride = 1;
  l.view.head_stride = rows;
  l.view.batch_stride = p.is_varlen() ? 0 : p.heads_q * rows;
  return l;
}

Buffer copy_array(const std::vector<int32_t>& values, Memory memory) {
  Buffer b(memory, values.size() * sizeof(int32_t));
  b.upload(values.data());
  return b;
}

class Bench {
 public:
  explicit Bench(const Options& options) : o_(options) {}

  int run() {
    // The launch-plan overrides the FA4_SM90_* and FA4_CPU_THREADS variables name (a tool's
    // way to force a plan's choice; docs/developing.md), passed to every call.
    if (Status s = overrides_from_env(&overrides_); !s.ok()) throw Failure{kExitUsage, s.message};
    if (std::string err = make_problem(o_, arrays_, &problem_); !err.empty())
      throw Failure{kExitUsage, err};
    backend_ = choose_backend(o_.backend_name);
    // The backward pass reads the outputs (O and the LSE) of a forward pass on the same backend.
    require(can_implement(problem_, backend_, Pass::kForward), backend_, Pass::kForward);
    if (o_.run_backward) {
      Problem with_lse = problem_;
      with_lse.return_lse = true;
      require(can_implement(with_lse, backend_, Pass::kForward), backend_, Pass::kForward);
      require(can_implement(problem_, backend_, Pass::kBackward), backend_, Pass::kBackward);
    }
    memory_ = backend_ == Backend::kCpu ? Memory::kHost : Memory::kDevice;
#ifndef FA4_WITH_CUDA
    if (memory_ == Memory::kDevice)
      throw Failure{kExitUsage, "the sm90 backend needs a build with CUDA (FA4_WITH_CUDA)"};
#endif

    if (!o_.json_path.empty() && !writable(o_.json_path))
      throw Failure{kExitUsage, "--json: cannot write to '" + o_.json_path + "'"};

    info_.backend = backend_name(backend_);
    info_.cpu_threads = cpu_threads(overrides_);
    if (memory_ == Memory::kDevice) info_.gpu = current_gpu();
    info_.seed = o_.seed_given ? o_.seed : fresh_seed();
    info_.warmup = o_.warmup >= 0 ? o_.warmup : (memory_ == Memory::kDevice ? kGpuWarmup : kCpuWarmup);
    info_.iters = o_.iters >= 0 ? o_.iters : (memory_ == Memory::kDevice ? kGpuIters : kCpuIters);
    info_.timestamp_utc = utc_timestamp();
    std::printf("%s\n", header_line(problem_, info_).c_str());
    std::fflush(stdout);

    prepare_inputs();
    std::vector<PassReport> passes;
    if (o_.run_forward) passes.push_back(forward_pass());
    if (o_.run_backward) passes.push_back(backward_pass());

    if (!o_.json_path.empty()) {
      if (std::string err = write_json(o_.json_path, problem_, info_, passes); !err.empty())
        throw Failure{kExitRunFailed, err};
      std::printf("results written to %s\n", o_.json_path.c_str());
    }
    for (const PassReport& p : passes)
      if (p.check.failed()) return kExitCheckFailed;
    return kExitOk;
  }

 private:
  static uint64_t fresh_seed() {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ rd();
  }

  void prepare_inputs() {
    const Problem& p = problem_;
    const uint64_t seed = info_.seed;
    q_ = random_input(p, memory_, true, p.heads_q, p.head_dim_qk, seed, kStreamQ);
    k_ = random_input(p, memory_, false, p.heads_kv, p.head_dim_qk, seed, kStreamK);
    v_ = random_input(p, memory_, false, p.heads_kv, p.head_dim_v, seed, kStreamV);
    out_ = output_tensor(p, memory_, true, p.heads_q, p.head_dim_v);
    lse_ = make_lse(p, memory_);

    // The backend reads the sequence arrays from its own memory.
    run_problem_ = p;
    if (memory_ == Memory::kDevice) {
      if (p.is_varlen()) {
        cu_q_ = copy_array(arrays_.cu_seqlens_q, memory_);
        cu_k_ = copy_array(arrays_.cu_seqlens_k, memory_);
        run_problem_.varlen.cu_seqlens_q = static_cast<const int32_t*>(cu_q_.data());
        run_problem_.varlen.cu_seqlens_k = static_cast<const int32_t*>(cu_k_.data());
      }
      if (p.seqused_k != nullptr) {
        seqused_ = copy_array(arrays_.seqused_k, memory_);
        run_problem_.seqused_k = static_cast<const int32_t*>(seqused_.data());
      }
    }
  }

  HostTensors host_inputs() const {
    HostTensors h;
    h.q = view_of(problem_, q_, q_.host.data());
    h.k = view_of(problem_, k_, k_.host.data());
    h.v = view_of(problem_, v_, v_.host.data());
    if (dout_.host.data() != nullptr) h.dout = view_of(problem_, dout_, dout_.host.data());
    return h;
  }

  ForwardTensors forward_tensors() const {
    ForwardTensors t;
    t.q = view_of(problem_, q_, q_.backend_data());
    t.k = view_of(problem_, k_, k_.backend_data());
    t.v = view_of(problem_, v_, v_.backend_data());
    t.out = view_of(problem_, out_, out_.backend_data());
    t.lse = lse_.view;
    return t;
  }

  Buffer workspace_for(const Problem& p, Pass pass) const {
    size_t bytes = 0;
    run_ok(workspace_size(p, backend_, pass, overrides_, &bytes), "workspace_size");
    return Buffer(memory_, bytes);
  }

  PassReport timed(const char* name, double flops, const std::function<Status()>& run) {
    PassReport r;
    r.pass = name;
    run_ok(time_runs(memory_, info_.warmup, info_.iters, run, &r.times_ms),
           (std::string("the ") + name + " pass").c_str());
    r.median_ms = median(r.times_ms);
    r.flops = flops;
    r.tflops = tflops(flops, r.median_ms);
    return r;
  }

  PassReport forward_pass() {
    const Problem fwd = run_problem_;  // return_lse as asked on the command line
    Buffer ws = workspace_for(fwd, Pass::kForward);
    const ForwardTensors t = forward_tensors();
    out_.backend.poison();
    lse_.buffer.poison();
    PassReport r = timed("fwd", forward_flops(problem_), [&] {
      return forward(fwd, t, Workspace{ws.data(), ws.bytes()}, nullptr, backend_, overrides_);
    });
    if (o_.check_rows > 0) {
      const std::vector<std::byte> out = out_.backend.download();
      const std::vector<std::byte> lse = problem_.return_lse ? lse_.buffer.download() : std::vector<std::byte>{};
      r.check = check_forward(problem_, host_inputs(), out, problem_.return_lse ? &lse : nullptr,
                              o_.check_rows, info_.seed);
    }
    std::printf("%s\n", pass_line(r).c_str());
    std::fflush(stdout);
    return r;
  }

  PassReport backward_pass() {
    const Problem& p = problem_;
    // The backward pass reads O and the LSE as a forward pass wrote them.
    Problem fwd = run_problem_;
    fwd.return_lse = true;
    {
      Buffer ws = workspace_for(fwd, Pass::kForward);
      run_ok(forward(fwd, forward_tensors(), Workspace{ws.data(), ws.bytes()}, nullptr, backend_,
                     overrides_),
             "the forward pass computing the backward pass's inputs");
    }
    dout_ = random_input(p, memory_, true, p.heads_q, p.head_dim_v, info_.seed, kStreamDout);
    Tensor dq = output_tensor(p, memory_, true, p.heads_q, p.head_dim_qk);
    Tensor dk = output_tensor(p, memory_, false, p.heads_kv, p.head_dim_qk);
    Tensor dv = output_tensor(p, memory_, false, p.heads_kv, p.head_dim_v);
    dq.backend.poison();
    dk.backend.poison();
    dv.backend.poison();

    const Problem bwd = run_problem_;
    BackwardTensors t;
    t.q = view_of(p, q_, q_.backend_data());
    t.k = view_of(p, k_, k_.backend_data());
    t.v = view_of(p, v_, v_.backend_data());
    t.out = view_of(p, out_, out_.backend_data());
    t.dout = view_of(p, dout_, dout_.backend_data());
    t.lse = lse_.view;
    t.dq = view_of(p, dq, dq.backend_data());
    t.dk = view_of(p, dk, dk.backend_data());
    t.dv = view_of(p, dv, dv.backend_data());
    Buffer ws = workspace_for(bwd, Pass::kBackward);
    PassReport r = timed("bwd", backward_flops(p), [&] {
      return backward(bwd, t, Workspace{ws.data(), ws.bytes()}, nullptr, backend_, overrides_);
    });
    if (o_.check_rows > 0)
      r.check = check_backward(p, host_inputs(), dq.backend.download(), dk.backend.download(),
                               dv.backend.download());
    std::printf("%s\n", pass_line(r).c_str());
    std::fflush(stdout);
    return r;
  }

  const Options& o_;
  SequenceArrays arrays_;
  Problem problem_;      // sequence arrays in host memory: for the reference and the reports
  Problem run_problem_;  // the same, with the arrays in the backend's memory
  Backend backend_ = Backend::kCpu;
  Overrides overrides_;
  Memory memory_ = Memory::kHost;
  RunInfo info_;
  Tensor q_, k_, v_, out_, dout_;
  Lse lse_;
  Buffer cu_q_, cu_k_, seqused_;
};

}  // namespace
}  // namespace fa4::bench

int main(int argc, char** argv) {
  using namespace fa4::bench;
  const ParseResult parsed = parse_args(argc, argv);
  if (parsed.kind == ParseResult::kHelp) {
    std::fputs(usage().c_str(), stdout);
    return kExitOk;
  }
  if (parsed.kind == ParseResult::kError) {
    std::fprintf(stderr, "fa4-bench: %s\n(fa4-bench --help lists the options)\n", parsed.error.c_str());
    return kExitUsage;
  }
  try {
    Bench bench(parsed.options);
    return bench.run();
  } catch (const Failure& f) {
    std::fprintf(stderr, "fa4-bench: %s\n", f.message.c_str());
    return f.code;
  } catch (const std::exception& e) {  // allocation and CUDA failures
    std::fprintf(stderr, "fa4-bench: %s\n", e.what());
    return kExitRunFailed;
  }
}
