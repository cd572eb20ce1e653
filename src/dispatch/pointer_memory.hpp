// Which memory a pointer is in, as CUDA sees it, asked without creating a CUDA context: a process
// that has not used CUDA (and so has no device memory) is never made to initialise it by the CPU
// backend's checks or by kAuto's choice of backend.
#pragma once

namespace fa4::detail {

// kHost also for pinned host memory and for everything in a build without CUDA.
enum class Memory { kHost, kDevice, kManaged };

// `device`, when given, receives the ordinal of device memory's device.
Memory memory_of(const void* ptr, int* device = nullptr);

}  // namespace fa4::detail
