// Where kAuto sends a call, and what each backend refuses, by the memory its pointers are in:
// device memory, pageable and pinned host memory, managed memory (src/dispatch/pointer_memory.cpp
// asks the CUDA driver). Checked through the public API only.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fa4/attention.hpp"
#include "sm90_test_support.hpp"

namespace fa4::test {
namespace {

constexpr int64_t kRows = 64, kHeads = 2, kDim = 64;
constexpr size_t kElems = size_t(kRows * kHeads * kDim);

constexpr uint16_t kOne = 0x3F80;     // bf16 1.0
constexpr uint16_t kPoison = 0xFFFF;  // bf16 NaN

// One bf16 (1, kRows, kHeads, kDim) buffer per tensor, in memory of one kind: q, k, v all ones
// (every output is then exactly 1), out poisoned.
struct Buffers {
  enum Kind { kDevice, kPinned, kManaged, kPageable } kind;
  std::vector<void*> ptrs;

  explicit Buffers(Kind k) : kind(k) {
    const size_t bytes = kElems * sizeof(uint16_t);
    for (int i = 0; i < 4; ++i) {
      void* p = nullptr;
      cudaError_t e = cudaSuccess;
      if (k == kDevice) e = cudaMalloc(&p, bytes);
      if (k == kPinned) e = cudaMallocHost(&p, bytes);
      if (k == kManaged) e = cudaMallocManaged(&p, bytes);
      if (k == kPageable) p = std::malloc(bytes);
      EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
      const std::vector<uint16_t> fill(kElems, i < 3 ? kOne : kPoison);
      if (k == kDevice)
        cudaMemcpy(p, fill.data(), bytes, cudaMemcpyHostToDevice);
      else
        std::memcpy(p, fill.data(), bytes);
      ptrs.push_back(p);
    }
  }
  ~Buffers() {
    for (void* p : ptrs) {
      if (kind == kDevice || kind == kManaged) cudaFree(p);
      if (kind == kPinned) cudaFreeHost(p);
      if (kind == kPageable) std::free(p);
    }
  }

  // How many of out's values equal `bits` (after the device has finished).
  size_t out_count(uint16_t bits) const {
    std::vector<uint16_t> out(kElems);
    cudaDeviceSynchronize();
    if (kind == kDevice)
      cudaMemcpy(out.data(), ptrs[3], kElems * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    else
      std::memcpy(out.data(), ptrs[3], kElems * sizeof(uint16_t));
    size_t n = 0;
    for (uint16_t v : out) n += v == bits;
    return n;
  }

  ForwardTensors tensors() const {
    auto view = [](void* p) {
      return TensorView{p, kRows * kHeads * kDim, kHeads * kDim, kDim, 1};
    };
    ForwardTensors t;
    t.q = view(ptrs[0]);
    t.k = view(ptrs[1]);
    t.v = view(ptrs[2]);
    t.out = view(ptrs[3]);
    return t;
  }
};

Problem small_problem() {
  Problem p;
  p.batch = 1;
  p.seqlen_q = p.seqlen_k = kRows;
  p.heads_q = p.heads_kv = kHeads;
  p.head_dim_qk = p.head_dim_v = kDim;
  p.dtype = DType::kBF16;
  return p;
}

TEST(PointerMemory, AutoPicksTheBackendByWhereQLives) {
  FA4_SKIP_WITHOUT_HOPPER();
  const Buffers device(Buffers::kDevice), managed(Buffers::kManaged);
  const Buffers pinned(Buffers::kPinned), pageable(Buffers::kPageable);
  EXPECT_EQ(resolve_backend(Backend::kAuto, device.ptrs[0]), Backend::kSm90);
  EXPECT_EQ(resolve_backend(Backend::kAuto, managed.ptrs[0]), Backend::kSm90);
  EXPECT_EQ(resolve_backend(Backend::kAuto, pinned.ptrs[0]), Backend::kCpu);
  EXPECT_EQ(resolve_backend(Backend::kAuto, pageable.ptrs[0]), Backend::kCpu);
  int on_stack = 0;
  EXPECT_EQ(resolve_backend(Backend::kAuto, &on_stack), Backend::kCpu);
  EXPECT_EQ(resolve_backend(Backend::kCpu, device.ptrs[0]), Backend::kCpu);  // asked for
}

// The CPU backend would crash on device memory: refused, naming the tensor, nothing written.
// Managed and pinned memory the host can read: accepted.
TEST(PointerMemory, CpuBackendRefusesDeviceMemoryOnly) {
  FA4_SKIP_WITHOUT_HOPPER();
  const Problem p = small_problem();
  {
    const Buffers device(Buffers::kDevice);
    const Status s = forward(p, device.tensors(), {}, nullptr, Backend::kCpu);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
    EXPECT_NE(s.message.find("q.data is device memory"), std::string::npos) << s.message;
    EXPECT_EQ(device.out_count(kPoison), kElems);
  }
  for (const auto kind : {Buffers::kManaged, Buffers::kPinned, Buffers::kPageable}) {
    SCOPED_TRACE(int(kind));
    const Buffers host(kind);
    const Status s = forward(p, host.tensors(), {}, nullptr, Backend::kCpu);
    EXPECT_TRUE(s.ok()) << s.message;
    EXPECT_EQ(host.out_count(kOne), kElems);
  }
}

// The GPU backend runs on device and managed memory and refuses host memory, pinned included.
TEST(PointerMemory, GpuBackendRefusesHostMemory) {
  FA4_SKIP_WITHOUT_HOPPER();
  const Problem p = small_problem();
  if (!can_implement(p, Backend::kSm90).ok()) GTEST_SKIP() << "no d64 bf16 kernel in this build";
  for (const auto kind : {Buffers::kPinned, Buffers::kPageable}) {
    SCOPED_TRACE(int(kind));
    const Buffers host(kind);
    const Status s = forward(p, host.tensors(), {}, nullptr, Backend::kSm90);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
    EXPECT_NE(s.message.find("is not device memory"), std::string::npos) << s.message;
    EXPECT_EQ(host.out_count(kPoison), kElems);
  }
  for (const auto kind : {Buffers::kDevice, Buffers::kManaged}) {
    SCOPED_TRACE(int(kind));
    const Buffers gpu(kind);
    const Status s = forward(p, gpu.tensors(), {}, nullptr, Backend::kSm90);
    EXPECT_TRUE(s.ok()) << s.message;
    EXPECT_EQ(gpu.out_count(kOne), kElems);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

}  // namespace
}  // namespace fa4::test
