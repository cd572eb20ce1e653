// Memory for fa4-bench's tensors: host memory for the CPU backend, device memory (cudaMalloc) for
// the GPU backend. Inputs are always generated on the host (the reference reads them there).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fa4/attention.hpp"

namespace fa4::bench {

enum class Memory { kHost, kDevice };

// Owns `bytes` bytes, 256-byte aligned (what fa4::Workspace asks for). Move-only. A failed
// allocation or CUDA call throws std::runtime_error saying which.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Memory memory, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Memory memory() const { return memory_; }

  void upload(const void* host);          // bytes() bytes from host memory into the buffer
  std::vector<std::byte> download() const;  // a host copy of the contents
  // Every byte 0xFF: a NaN in bf16, fp16 and fp32 alike, so an element a kernel fails to write
  // stays visible to the check.
  void poison();

 private:
  void release();
  Memory memory_ = Memory::kHost;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Fills `count` elements of `dtype` at host memory `data` with standard normal values (rounded to
// the dtype). The values depend only on (seed, stream), not on the number of threads used.
void fill_normal(void* data, DType dtype, int64_t count, uint64_t seed, uint64_t stream);

}  // namespace fa4::bench
