// One kernel launch on the caller's stream, returning that launch's own error: cudaGetLastError
// after <<<>>> would also return (and clear) an error the caller's earlier work left behind.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

namespace fa4::sm90 {

template <class... KernelArgs, class... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                          void* stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = static_cast<cudaStream_t>(stream);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fa4::sm90
