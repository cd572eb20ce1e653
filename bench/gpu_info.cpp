#include "gpu_info.hpp"

#ifdef FA4_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fa4::bench {

#ifdef FA4_WITH_CUDA
namespace {
constexpr int kKhzPerMhz = 1000;

int attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  return cudaDeviceGetAttribute(&value, attr, device) == cudaSuccess ? value : 0;
}
}  // namespace
#endif

bool cuda_device_present() {
#ifdef FA4_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess) return count > 0;
  cudaGetLastError();  // no driver or no device: clear the error so later calls start clean
#endif
  return false;
}

GpuInfo current_gpu() {
  GpuInfo info;
#ifdef FA4_WITH_CUDA
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return info;
  }
  info.name = prop.name;
  info.compute_capability = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  info.sm_count = prop.multiProcessorCount;
  // The clock fields left cudaDeviceProp in CUDA 13; the attributes exist in every version.
  info.sm_clock_mhz = attribute(cudaDevAttrClockRate, device) / kKhzPerMhz;
  info.memory_clock_mhz = attribute(cudaDevAttrMemoryClockRate, device) / kKhzPerMhz;
#endif
  return info;
}

}  // namespace fa4::bench
