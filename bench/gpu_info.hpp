// What fa4-bench records about the GPU it runs on. Everything here is false / empty in a build
// without CUDA.
#pragma once

#include <string>

namespace fa4::bench {

// Is a CUDA device usable from this process?
bool cuda_device_present();

struct GpuInfo {
  std::string name;            // e.g. "NVIDIA H200"
  std::string compute_capability;  // e.g. "9.0"
  int sm_count = 0;
  int sm_clock_mhz = 0;        // peak SM clock
  int memory_clock_mhz = 0;    // peak memory clock
};

// The current device's properties; empty name when there is none.
GpuInfo current_gpu();

}  // namespace fa4::bench
