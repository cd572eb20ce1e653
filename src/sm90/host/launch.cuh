// One kernel launch on the caller's stream, returning that launch's own error: cudaGetLastError
// after <<<>>> would also return (and clear) an error the caller's earlier work left behind.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

namespace fa4::sm90 {

// A type carried as a value, for generic lambdas that launch one of several kernel types.
template <class T>
struct TypeTag {
  using type = T;
};

// dependent: see launch_kernel_dependent. cluster: CTAs per cluster along x (1: no clusters).
struct LaunchOptions {
  bool dependent = false;
  unsigned cluster = 1;
};

template <class... KernelArgs, class... Args>
cudaError_t launch_kernel_with(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                               size_t smem_bytes, void* stream, LaunchOptions options,
                               Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (options.dependent) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (options.cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {options.cluster, 1, 1};
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = count > 0 ? attributes : nullptr;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <class... KernelArgs, class... Args>
cudaError_t launch_kernel_ex(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                             size_t smem_bytes, void* stream, bool dependent, Args&&... args) {
  return launch_kernel_with(kernel, grid, block, smem_bytes, stream, LaunchOptions{dependent, 1},
                            std::forward<Args>(args)...);
}

template <class... KernelArgs, class... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                          void* stream, Args&&... args) {
  return launch_kernel_ex(kernel, grid, block, smem_bytes, stream, false,
                          std::forward<Args>(args)...);
}

// A launch that may start while the kernel before it on the stream still runs (programmatic
// dependent launch): the kernel must execute griddepcontrol.wait before it touches global memory
// that kernel writes. The kernel before it lets it start with griddepcontrol.launch_dependents, or
// else as its last CTAs exit.
template <class... KernelArgs, class... Args>
cudaError_t launch_kernel_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                                    size_t smem_bytes, void* stream, Args&&... args) {
  return launch_kernel_ex(kernel, grid, block, smem_bytes, stream, true,
                          std::forward<Args>(args)...);
}

}  // namespace fa4::sm90
