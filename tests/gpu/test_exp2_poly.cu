// The software exp2's device path (floor by a rounded-down add, the exponent by an integer add)
// against its host path, bit for bit, on a dense grid; the host path's accuracy is checked in
// tests/cpu/test_exp2_poly.cpp.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/exp2_poly.hpp"
#include "device_buffer.hpp"

namespace fa4 {
namespace {

__global__ void exp2_poly_kernel(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = exp2_poly(x[i]);
}

TEST(Exp2PolyDevice, MatchesTheHostPathBitForBit) {
  std::string why;
  if (!test::hopper_present(&why)) GTEST_SKIP() << "needs a Hopper GPU: " << why;
  // [-140, 130) at 2^-12 steps: the normal range, the clamp below it, and the softmax's [x ≤ 8].
  std::vector<float> x;
  for (int64_t i = -140 * 4096; i < 130 * 4096; ++i) x.push_back(float(i) / 4096.0f);
  x.push_back(-INFINITY);
  const int n = int(x.size());
  float *dx = nullptr, *dy = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dy, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dy, 0xFF, n * sizeof(float)), cudaSuccess);  // NaN: every y must be written
  exp2_poly_kernel<<<(n + 255) / 256, 256>>>(dx, dy, n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> y(n);
  ASSERT_EQ(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(dx);
  cudaFree(dy);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    const float host = exp2_poly(x[i]);
    if (std::memcmp(&host, &y[i], sizeof(float)) != 0 && ++mismatches <= 5)
      ADD_FAILURE() << "x = " << x[i] << ": device " << y[i] << ", host " << host;
  }
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace fa4
