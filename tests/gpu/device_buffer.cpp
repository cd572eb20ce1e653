#include "device_buffer.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <stdexcept>

#include "common/numeric.hpp"

namespace fa4::test {

bool hopper_present(std::string* why) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why = "no CUDA device is present";
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    *why = "cudaGetDeviceProperties failed";
    return false;
  }
  if (prop.major != 9 || prop.minor != 0) {
    *why = std::string("device 0 (") + prop.name + ") is not a Hopper GPU (sm_90)";
    return false;
  }
  return true;
}

namespace {

// Bytes from a view's first element to one past its last (0 for an empty view).
size_t span_bytes(const DeviceMirror::View& v, size_t elem) {
  int64_t last = 0;
  for (int i = 0; i < 4; ++i) {
    if (v.extents[i] == 0) return 0;
    last += (v.extents[i] - 1) * v.strides[i];
  }
  return size_t(last + 1) * elem;
}

std::string cuda_error(const char* what, cudaError_t err) {
  return err == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(err);
}

}  // namespace

DeviceMirror::DeviceMirror(const std::vector<View>& views, size_t elem_bytes) {
  const unsigned char* hi = nullptr;
  for (const View& v : views) {
    const size_t span = span_bytes(v, elem_bytes);
    if (span == 0) continue;
    const auto* lo = static_cast<const unsigned char*>(v.data);
    host_lo_ = host_lo_ == nullptr ? lo : std::min(host_lo_, lo);
    hi = std::max(hi, lo + span);
  }
  bytes_ = host_lo_ == nullptr ? 0 : size_t(hi - host_lo_);
  if (cudaMalloc(reinterpret_cast<void**>(&device_), bytes_ + 2 * kGuardBytes) != cudaSuccess)
    throw std::runtime_error("cudaMalloc failed");
}

DeviceMirror::~DeviceMirror() { cudaFree(device_); }

void* DeviceMirror::device(const void* host) const {
  if (host == nullptr || host_lo_ == nullptr) return nullptr;
  return device_ + kGuardBytes + (static_cast<const unsigned char*>(host) - host_lo_);
}

TensorView DeviceMirror::device_view(const TensorView& host) const {
  TensorView d = host;
  d.data = device(host.data);
  return d;
}

LseView DeviceMirror::device_view(const LseView& host) const {
  LseView d = host;
  d.data = static_cast<float*>(device(host.data));
  return d;
}

std::string DeviceMirror::upload() {
  if (bytes_ == 0) return "";
  return cuda_error("upload",
                    cudaMemcpy(device_ + kGuardBytes, host_lo_, bytes_, cudaMemcpyHostToDevice));
}

std::string DeviceMirror::download(void* host) {
  if (bytes_ == 0) return "";
  void* dst = host != nullptr ? host : const_cast<unsigned char*>(host_lo_);
  return cuda_error("download",
                    cudaMemcpy(dst, device_ + kGuardBytes, bytes_, cudaMemcpyDeviceToHost));
}

std::string DeviceMirror::poison() {
  return cuda_error("poison", cudaMemset(device_, 0xFF, bytes_ + 2 * kGuardBytes));
}

std::string DeviceMirror::guards_intact(bool* intact) {
  std::vector<unsigned char> guard(kGuardBytes);
  *intact = true;
  for (const unsigned char* at : {device_, device_ + kGuardBytes + bytes_}) {
    const cudaError_t err = cudaMemcpy(guard.data(), at, kGuardBytes, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) return cuda_error("guard read", err);
    *intact = *intact && std::all_of(guard.begin(), guard.end(), [](unsigned char b) { return b == 0xFF; });
  }
  return "";
}

DeviceMirror::View mirror_view(const HostTensor& t) {
  const TensorView v = t.view();
  const Dims& d = t.dims();
  return {v.data, {d.batch, d.seq, d.heads, d.dim},
          {v.batch_stride, v.seq_stride, v.head_stride, v.dim_stride}};
}

DeviceMirror::View mirror_view(const HostLse& l) {
  const LseView v = l.view();
  return {v.data, {l.batch(), l.heads(), l.seq(), 1},
          {v.batch_stride, v.head_stride, v.seq_stride, 1}};
}

DeviceWorkspace::~DeviceWorkspace() { cudaFree(base_); }

std::string DeviceWorkspace::allocate(size_t bytes) {
  cudaFree(base_);
  base_ = data_ = nullptr;
  bytes_ = bytes;
  if (bytes == 0) return "";
  const cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&base_), bytes + 2 * kGuardBytes);
  if (err != cudaSuccess) return std::string("workspace cudaMalloc: ") + cudaGetErrorString(err);
  data_ = base_ + kGuardBytes;
  return poison(poison_);
}

std::string DeviceWorkspace::poison(unsigned char byte) {
  poison_ = byte;
  if (bytes_ == 0) return "";
  const cudaError_t err = cudaMemset(base_, byte, bytes_ + 2 * kGuardBytes);
  return err == cudaSuccess ? "" : std::string("workspace poison: ") + cudaGetErrorString(err);
}

std::string DeviceWorkspace::download(void* host) const {
  if (bytes_ == 0) return "";
  const cudaError_t err = cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost);
  return err == cudaSuccess ? "" : std::string("workspace download: ") + cudaGetErrorString(err);
}

std::string DeviceWorkspace::guards_intact(bool* intact) const {
  *intact = true;
  if (bytes_ == 0) return "";
  std::vector<unsigned char> guard(kGuardBytes);
  for (const unsigned char* at : {base_, data_ + bytes_}) {
    const cudaError_t err = cudaMemcpy(guard.data(), at, kGuardBytes, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) return std::string("workspace guard read: ") + cudaGetErrorString(err);
    const unsigned char want = poison_;
    *intact = *intact &&
              std::all_of(guard.begin(), guard.end(), [want](unsigned char b) { return b == want; });
  }
  return "";
}

}  // namespace fa4::test
