// What the sm90 forward and backward tests share: the kernel lists CMake passes them, case names,
// and device copies of a case's inputs with the forward call on them.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "device_buffer.hpp"
#include "fa4/overrides.hpp"

#define FA4_SKIP_WITHOUT_HOPPER()                                   \
  do {                                                              \
    std::string why_;                                               \
    if (!::fa4::test::hopper_present(&why_))                        \
      GTEST_SKIP() << "sm90 tests need a Hopper GPU: " << why_;     \
  } while (0)

// For the helpers below that return "" on success and the CUDA error otherwise.
#define ASSERT_CUDA(expr)                                         \
  do {                                                            \
    const std::string err_ = (expr);                              \
    ASSERT_TRUE(err_.empty()) << err_;                            \
  } while (0)

namespace fa4::test {

struct Kernel {
  int64_t dim_qk, dim_v;
  DType dtype;
};

// A list as cmake/fa4_sm90.cmake writes it, entries separated by ',': "128:bf16,64:fp16,
// 192x128:bf16,128:e4m3", head_dim[xhead_dim_v]:dtype. An entry this parser does not understand
// throws (naming `what`, the list's macro) at start-up: a silently skipped kernel would go
// untested.
std::vector<Kernel> parse_kernel_list(const std::string& list, const std::string& what);
bool kernel_listed(const std::vector<Kernel>& list, int64_t dim_qk, int64_t dim_v, DType dtype);
// The kernels this build has (cmake/fa4_sm90.cmake's FA4_SM90_KERNELS, which tests/gpu/CMakeLists.txt
// passes as FA4_SM90_BUILT_KERNELS and FA4_SM90_BUILT_BWD_KERNELS): forward and backward.
// The e4m3 entries have a forward only (CMake leaves them out of the backward list).
const std::vector<Kernel>& built_kernels();
const std::vector<Kernel>& built_backward_kernels();
// The built forward kernels of bf16 / fp16 inputs: what the forward and KV-cache suites run. The
// e4m3 ones take descales and give another output dtype; test_sm90_fp8.cpp runs them.
const std::vector<Kernel>& built_16bit_kernels();

// The kernel every feature is tested on in full; the others share every piece but the tile sizes.
bool is_full_kernel(const Kernel& k);

struct Shape {
  const char* tag;
  int64_t batch, sq, sk;
};
Case base_case(const Kernel& k, const Shape& s);

std::string kernel_tag(const Kernel& k);  // "d128_bf16", "d192x128_fp16", "d64_e4m3"
// "L100R20", "L64" (no right bound), "R7" (no left bound).
std::string window_tag(const Window& w);
std::string gqa_tag(const Case& c);  // "_gqa4"

// A host int32 array (cu_seqlens, seqused_k) as a DeviceMirror view.
DeviceMirror::View array_view(const std::vector<int32_t>& a);
DeviceMirror::View array_view(const std::vector<float>& a);

// The overrides the GPU tests run under: the FA4_SM90_* environment variables scripts/gpu_check.sh
// sets for its test sets (fa4::overrides_from_env), read once; an invalid value fails the binary.
const Overrides& test_overrides();

// Device copies of a case's inputs (one allocation for a packed qkv, else one per tensor), of its
// sequence arrays (the GPU backend reads cu_seqlens and seqused_k in device memory) and of its
// outputs (O in the problem's output dtype: fp8.out_dtype for e4m3 inputs), and the forward call
// on them. `problem` is the case's problem with device arrays;
// the reference reads the host ones.
struct DeviceRun {
  const CaseData& setup;
  Problem problem;
  HostTensor out;
  HostLse lse;
  std::vector<std::unique_ptr<DeviceMirror>> inputs;
  std::unique_ptr<DeviceMirror> d_out, d_lse;
  ForwardTensors tensors;
  // The launch plan's overrides every call of this run passes (test_overrides(), or a test's own).
  Overrides overrides = test_overrides();
  DeviceWorkspace workspace;  // as workspace_size asks for (the varlen tile order, split partials)
  unsigned char workspace_poison = 0xFF;  // the byte run() fills the workspace with first

  explicit DeviceRun(const CaseData& s);

  std::string upload();

  // The copies and memsets run on the legacy stream, the kernel on a non-blocking one: without a
  // device-wide wait, a pageable upload or the poison could land after the kernel has started.
  static std::string device_sync();

  // Poisons the outputs and the workspace, runs the forward on `stream` (directly, or captured in a CUDA graph and
  // replayed), waits, and downloads the outputs into `out` / `lse`. The poison is the host
  // tensors' (a NaN payload check_written recognises, so that rows outside every sequence can be
  // told from rows written with NaN); the guards around it are the mirrors' own.
  std::string run(cudaStream_t stream, bool graph, Status* status);
};

// Runs the forward of `run` (uploaded here; can_implement must accept it) on a fresh stream and
// checks what it wrote: every row inside a sequence of out written (and of lse with return_lse;
// without it nothing), the guards around both intact. `rows` gets the query rows inside
// sequences (rows_in_sequences). Failures are gtest failures: the caller returns on
// HasFatalFailure().
void run_and_check_writes(DeviceRun& run, std::vector<unsigned char>* rows);

// Calls the forward with `problem` and `workspace` on run's tensors, expecting it to be refused
// with `code` (and a message naming `named`, when given) before anything is written: out is
// poisoned before the call and checked untouched after it.
void expect_refused(DeviceRun& run, const Problem& problem, Workspace workspace, StatusCode code,
                    const std::string& named = "");

class Stream {
 public:
  Stream() { cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace fa4::test
