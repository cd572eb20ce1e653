// Device copies of the test utilities' host tensors, with the host views' strides, so that the
// kernels see the same layouts the reference reads (non-contiguous slices of a packed qkv too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "fa4/attention.hpp"

namespace fa4::test {

// Is there a device this build's sm90 kernels run on? `why` says why not.
bool hopper_present(std::string* why);

// One device allocation mirroring a host byte range that holds one or more views, plus guard
// bytes on both sides that must still hold their poison after a kernel has run.
class DeviceMirror {
 public:
  // views: (host view, its extents, element bytes); all inside one host allocation.
  struct View {
    const void* data;
    int64_t extents[4];  // batch, seq, heads, dim (an LSE: batch, heads, seq, 1)
    int64_t strides[4];
  };
  explicit DeviceMirror(const std::vector<View>& views, size_t elem_bytes);
  ~DeviceMirror();
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  // The device address of host address `host` (inside the mirrored range).
  void* device(const void* host) const;
  TensorView device_view(const TensorView& host) const;
  LseView device_view(const LseView& host) const;

  std::string upload();              // host range → device; "" on success, else the CUDA error
  std::string download(void* host);  // device range → host (into the mirrored range when null)
  std::string poison();              // every device byte, guards included, = 0xFF (NaN)
  std::string guards_intact(bool* intact);
  size_t bytes() const { return bytes_; }

 private:
  static constexpr size_t kGuardBytes = 4096;
  const unsigned char* host_lo_ = nullptr;
  size_t bytes_ = 0;
  unsigned char* device_ = nullptr;  // kGuardBytes, then bytes_, then kGuardBytes
};

// Device workspace as the API asks for it (cudaMalloc's alignment is 256 bytes or more), with
// guard bytes on both sides that must keep their poison.
class DeviceWorkspace {
 public:
  DeviceWorkspace() = default;
  ~DeviceWorkspace();
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;

  std::string allocate(size_t bytes);  // "" on success, else the CUDA error
  // `byte` in every byte, guards included: 0xFF (NaN floats, -1 integers) by default, so that a
  // kernel that reads what it did not write shows.
  std::string poison(unsigned char byte = 0xFF);
  std::string download(void* host) const;  // all bytes() bytes
  std::string guards_intact(bool* intact) const;
  Workspace view() const { return {data_, bytes_}; }
  size_t bytes() const { return bytes_; }

 private:
  static constexpr size_t kGuardBytes = 4096;  // a multiple of 256: the view stays aligned
  unsigned char* base_ = nullptr;
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0;
  unsigned char poison_ = 0xFF;
};

DeviceMirror::View mirror_view(const HostTensor& t);
DeviceMirror::View mirror_view(const HostLse& l);

}  // namespace fa4::test
