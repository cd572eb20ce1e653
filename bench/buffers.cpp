#include "buffers.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/numeric.hpp"

#ifdef FA4_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace fa4::bench {
namespace {

constexpr size_t kAlignment = 256;
constexpr unsigned char kPoisonByte = 0xFF;
// Elements per independently seeded block of random values: large enough that seeding is noise,
// small enough to spread a tensor over every core.
constexpr int64_t kFillBlock = int64_t(1) << 16;

#ifdef FA4_WITH_CUDA
void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
}
#else
[[noreturn]] void no_device_memory() {
  throw std::runtime_error("device memory requested, but fa4-bench was built without CUDA");
}
#endif

// SplitMix64's finaliser: decorrelates the seeds of neighbouring blocks.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
void fill_block(T* out, int64_t count, uint64_t block_seed) {
  std::mt19937_64 rng(block_seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) out[i] = from_float<T>(normal(rng));
}

}  // namespace

Buffer::Buffer(Memory memory, size_t bytes) : memory_(memory), bytes_(bytes) {
  // An empty tensor (a zero-length sequence axis) still gets a valid pointer, so that a check for
  // null data pointers cannot mistake it for a missing tensor.
  const size_t rounded = std::max<size_t>(1, (bytes + kAlignment - 1) / kAlignment) * kAlignment;
  if (memory == Memory::kHost) {
    data_ = std::aligned_alloc(kAlignment, rounded);
    if (data_ == nullptr)
      throw std::runtime_error("out of host memory allocating " + std::to_string(bytes) + " bytes");
    return;
  }
#ifdef FA4_WITH_CUDA
  cuda_check(cudaMalloc(&data_, rounded), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
#else
  no_device_memory();
#endif
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : memory_(other.memory_), data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    memory_ = other.memory_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void Buffer::release() {
  if (data_ == nullptr) return;
  if (memory_ == Memory::kHost) std::free(data_);
#ifdef FA4_WITH_CUDA
  else cudaFree(data_);  // nothing sensible to do with a failure while releasing
#endif
  data_ = nullptr;
}

void Buffer::upload(const void* host) {
  if (bytes_ == 0) return;
  if (memory_ == Memory::kHost) {
    std::memcpy(data_, host, bytes_);
    return;
  }
#ifdef FA4_WITH_CUDA
  cuda_check(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
#else
  no_device_memory();
#endif
}

std::vector<std::byte> Buffer::download() const {
  std::vector<std::byte> host(bytes_);
  if (bytes_ == 0) return host;
  if (memory_ == Memory::kHost) {
    std::memcpy(host.data(), data_, bytes_);
    return host;
  }
#ifdef FA4_WITH_CUDA
  cuda_check(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
#else
  no_device_memory();
#endif
  return host;
}

void Buffer::poison() {
  if (bytes_ == 0) return;
  if (memory_ == Memory::kHost) {
    std::memset(data_, kPoisonByte, bytes_);
    return;
  }
#ifdef FA4_WITH_CUDA
  cuda_check(cudaMemset(data_, kPoisonByte, bytes_), "cudaMemset");
  cuda_check(cudaDeviceSynchronize(), "cudaMemset");
#else
  no_device_memory();
#endif
}

void fill_normal(void* data, DType dtype, int64_t count, uint64_t seed, uint64_t stream) {
  const int64_t blocks = (count + kFillBlock - 1) / kFillBlock;
  const int64_t threads =
      std::min<int64_t>(blocks, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t blk; (blk = next.fetch_add(1)) < blocks;) {
      const int64_t begin = blk * kFillBlock;
      const int64_t n = std::min(kFillBlock, count - begin);
      const uint64_t block_seed = mix(mix(mix(seed) ^ stream) ^ uint64_t(blk));
      visit_dtype(dtype, [&](auto tag) {
        using T = decltype(tag);
        fill_block(static_cast<T*>(data) + begin, n, block_seed);
      });
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace fa4::bench
