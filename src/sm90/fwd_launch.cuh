// Problem → kernel parameters (TMA descriptors encoded on the host, passed by value) → launch on
// the caller's stream. Nothing here allocates or waits, so a launch can be captured in a graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include <cutlass/numeric_types.h>

#include "api/validate.hpp"
#include "sm90/fwd_config.cuh"
#include "sm90/fwd_kernel.cuh"
#include "sm90/fwd_launch.hpp"

namespace fa4::sm90 {

template <DType kDType>
struct CutlassElement;
template <>
struct CutlassElement<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<DType::kFP16> {
  using type = cutlass::half_t;
};

template <int kHeadDim, DType kDType>
Status run_forward(const Problem& p, const ForwardTensors& t, void* stream) {
  using Config = FwdConfig<kHeadDim, typename CutlassElement<kDType>::type>;
  using Kernel = FwdKernel<Config>;

  if (p.batch == 0 || p.seqlen_q == 0) return Status::success();  // nothing to write

  const BandMask band = BandMask::make(p.seqlen_q, p.seqlen_k, p.causal, p.window.left,
                                       p.window.right);
  const SoftcapScores softcap = SoftcapScores::make(Softcap{p.softcap}, p.scale());
  const StaticTileScheduler::Params scheduler{
      int((p.seqlen_q + Config::kBlockM - 1) / Config::kBlockM), int(p.heads_q),
      /*heavy_last_rows=*/band.right >= 0};
  const int64_t tiles = StaticTileScheduler::num_tiles(scheduler, p.batch);

  const typename Kernel::Params params{
      Kernel::Load::make_params(p, t), Kernel::Epilogue::make_params(p, t), scheduler, band,
      softcap, softcap.enabled() ? p.softcap : p.scale()};

  auto* kernel = &fwd_kernel<Kernel>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Kernel::kSmemBytes);
  if (err == cudaSuccess) {
    kernel<<<dim3(unsigned(tiles)), dim3(Kernel::kThreads), Kernel::kSmemBytes,
             static_cast<cudaStream_t>(stream)>>>(params);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess)
    return detail::make_status(StatusCode::kDeviceError,
                               "sm90 forward kernel (head dim %d) failed to launch: %s", kHeadDim,
                               cudaGetErrorString(err));
  return Status::success();
}

}  // namespace fa4::sm90
