// Stops the test process at the end of the first test that leaves the CUDA context broken (an
// illegal address, a trap, a launch failure: errors no later CUDA call of the process recovers
// from). Every later test would fail on the same error with something unrelated ("cudaMalloc
// failed"), burying the one that faulted among hundreds of names; stopping names it: the last
// test the log shows running, and the message below.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

namespace fa4::test {
namespace {

bool breaks_the_context(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

class StickyErrorStop : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& test) override {
    // Only a process that has used the GPU has a context to ask about (peek: no new context).
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    const cudaError_t err = cudaDeviceSynchronize();
    if (!breaks_the_context(err)) {
      if (err != cudaSuccess) cudaGetLastError();
      return;
    }
    std::fprintf(stderr,
                 "\n[  FATAL   ] %s.%s left the CUDA context broken (%s: %s); the process stops, as "
                 "every later test would fail on the same error\n",
                 test.test_suite_name(), test.name(), cudaGetErrorName(err),
                 cudaGetErrorString(err));
    std::fflush(stderr);
    std::_Exit(3);
  }
};

// Appended before gtest_main runs the tests.
const bool kRegistered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new StickyErrorStop);
  return true;
}();

}  // namespace
}  // namespace fa4::test
