// A forward plan (fwd_plan.hpp) → kernel parameters (TMA descriptors encoded on the host, passed
// by value) → launches on the caller's stream: a KV cache's prepare kernel, the varlen tile order
// where the plan orders, the forward kernel, split-KV's combine where it splits. Nothing here
// allocates, waits or decides, so a launch can be captured in a graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/numeric.hpp"
#include "common/status.hpp"
#include "sm90/cache/kv_prepare.cuh"
#include "sm90/common/element.cuh"
#include "sm90/fwd/fwd_config.cuh"
#include "sm90/fwd/fwd_kernel.cuh"
#include "sm90/fwd/split_kv.cuh"
#include "sm90/fwd/tile_order.cuh"
#include "sm90/host/fwd_plan.hpp"
#include "sm90/host/kernels.hpp"
#include "sm90/host/launch.cuh"

namespace fa4::sm90 {

// The plan's tiles and their numbering as the kernels read them (tile_scheduler.cuh), with the
// grid's `tiles` entries read through `order` when it is not null.
inline TileScheduler::Params scheduler_params(const FwdPlan& plan, int batch, int32_t* order,
                                              int tiles, int splits, int group) {
  const GroupedOrder grouped{plan.m_blocks, plan.tile_heads * batch, group};
  return {plan.m_blocks, plan.tile_heads, tiles,  plan.heavy_last_rows,
          order,         splits,          grouped, GroupedUnits::of(grouped, plan.tile_heads)};
}

// A KV cache's prepare kernel (cache/kv_prepare.cuh): it checks the sequences, appends and rotates
// Q; the attention then reads the sequences' marks, and Q from the workspace where it was rotated
// (`sequences` and `kernel_tensors` say so).
inline cudaError_t prepare_cache(const FwdPlan& plan, const Problem& p, const ForwardTensors& t,
                                 Workspace workspace, void* stream,
                                 SequenceParams* sequences, ForwardTensors* kernel_tensors) {
  if (!p.kv_cache.enabled()) return cudaSuccess;
  auto* base = static_cast<char*>(workspace.data);
  auto* valid = reinterpret_cast<int32_t*>(base + plan.workspace.cache_valid);
  void* q_rotated = base + plan.workspace.q_rotated;
  const KvPrepareParams prepare = make_kv_prepare_params(p, t, valid, q_rotated);
  sequences->cache = prepare.sequences;
  if (prepare.q_rotated != nullptr) {
    const int64_t row = p.heads_q * p.head_dim_qk;
    kernel_tensors->q =
        TensorView{q_rotated, p.is_varlen() ? 0 : p.seqlen_q * row, row, p.head_dim_qk, 1};
  }
  return launch_kv_prepare(prepare, p, stream);
}

template <class Config, DType kDType, bool kAlibiLinear = false>
Status launch_forward(const FwdPlan& plan, const Problem& p, const ForwardTensors& t,
                      Workspace workspace, void* stream) {
  using Kernel = FwdKernel<Config, kAlibiLinear>;
  constexpr int kHeadDimQK = Config::kHeadDimQK;
  constexpr int kHeadDimV = Config::kHeadDimV;
  // The wide-pieces kernel's boxes hold 64 keys: only pages of whole 64-key pieces may reach it.
  if (Config::kWidePieces && !wide_key_pieces(p, Config::kBlockN))
    return detail::make_status(StatusCode::kInternalError,
                               "sm90 forward: the wide-pieces kernel planned for pages of %lld "
                               "keys",
                               static_cast<long long>(p.kv_cache.page_size));
  // The kernels without gathering warps load whole key tiles only.
  if (!Config::kGathers && !pages_hold_key_tiles(p, Config::kBlockN))
    return detail::make_status(StatusCode::kInternalError,
                               "sm90 forward: a kernel of whole %d-key tiles planned for pages of "
                               "%lld keys",
                               Config::kBlockN, static_cast<long long>(p.kv_cache.page_size));
  if (plan.block_m != Config::kBlockM || plan.block_n != Config::kBlockN)
    return detail::make_status(StatusCode::kInternalError,
                               "sm90 forward (head dims %d / %d): the plan's %d x %d tiles are not "
                               "the kernel's %d x %d",
                               kHeadDimQK, kHeadDimV, plan.block_m, plan.block_n, Config::kBlockM,
                               Config::kBlockN);
  const SoftcapScores softcap = SoftcapScores::make(Softcap{p.softcap}, p.scale());
  const BandMask band = BandMask::make(p.seqlen_q, p.seqlen_k, p.causal, p.window.left,
                                       p.window.right);
  // With pack-GQA a tile belongs to a kv head and holds the rows of its query heads.
  const QueryRows rows{cutlass::FastDivmod(plan.pack_group)};
  SequenceParams sequences{p.varlen.cu_seqlens_q, p.varlen.cu_seqlens_k, p.seqused_k,
                           int32_t(p.seqlen_q),    int32_t(p.seqlen_k),
                           int32_t(p.varlen.total_q), int32_t(p.varlen.total_k)};
  auto* base = static_cast<char*>(workspace.data);
  ForwardTensors kernel_tensors = t;
  cudaError_t err = prepare_cache(plan, p, t, workspace, stream, &sequences,
                                  &kernel_tensors);
  int32_t* const order = plan.ordered ? reinterpret_cast<int32_t*>(base) : nullptr;
  SplitPartials partials{};
  if (plan.splits > 1) partials = SplitPartials::at(base + plan.workspace.partials, p, plan.splits);

  // The order kernel writes the grid's entries in the plain numbering, unsplit.
  if (err == cudaSuccess && plan.ordered)
    err = launch_order_tiles(
        {sequences, rows,
         scheduler_params(plan, int(p.batch), order, plan.ordered_entries, 1, 1),
         plan.ordered_entries, int(p.batch), Config::kBlockM},
        stream);
  const typename Kernel::Params params{
      Kernel::Load::make_params(p, kernel_tensors),
      Kernel::Epilogue::make_params(p, t),
      scheduler_params(plan, int(p.batch), order, plan.entries, plan.splits, plan.group),
      sequences,
      rows,
      partials,
      band,
      softcap,
      softcap.enabled() ? p.softcap : p.scale(),
      ScoreVariantParams{p.alibi.data, int(p.alibi.batch_stride), int(p.alibi.head_stride),
                         1.0f / (softcap.enabled() ? p.softcap : p.scale()), p.sinks},
      fp8::Descales{t.q_descale, t.k_descale, t.v_descale}};

  auto* kernel = &fwd_kernel<Kernel>;
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Kernel::kSmemBytes);
  const dim3 grid{unsigned(plan.ctas)}, block{unsigned(Kernel::kThreads)};
  const size_t smem = size_t(Kernel::kSmemBytes);
  if (err == cudaSuccess)
    err = plan.ordered || p.kv_cache.enabled()
              ? launch_kernel_dependent(kernel, grid, block, smem, stream, params)
              : launch_kernel(kernel, grid, block, smem, stream, params);
  if (err == cudaSuccess && partials.enabled()) {
    const CombineParams combine{partials,
                                plan.splits,
                                kHeadDimV,
                                sequences,
                                t.out.data,
                                p.is_varlen() ? 0 : t.out.batch_stride,
                                t.out.seq_stride,
                                t.out.head_stride,
                                p.return_lse ? t.lse.data : nullptr,
                                p.is_varlen() ? 0 : t.lse.batch_stride,
                                t.lse.head_stride,
                                t.lse.seq_stride,
                                p.sinks};
    err = launch_combine_splits(combine, output_dtype(p), p.batch, p.seqlen_q, stream);
  }
  if (err != cudaSuccess)
    return detail::make_status(StatusCode::kDeviceError,
                               "sm90 forward kernel (head dims %d / %d) failed to launch: %s",
                               kHeadDimQK, kHeadDimV, cudaGetErrorString(err));
  return Status::success();
}

// The plan's kernel: the variant (fwd_config.cuh) where it chose one; with e4m3
// operands, the one that writes O in the problem's output dtype; with ALiBi slopes, the kernel of
// ALiBi's linear form where the head dims have one.
template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_forward(const FwdPlan& plan, const Problem& p, const ForwardTensors& t,
                   Workspace workspace, void* stream) {
  using Element = typename CutlassElement<kDType>::type;
  if (plan.ctas == 0) {
    // No query rows to compute; a cache's appends are still written.
    if (!p.kv_cache.appends()) return Status::success();
    SequenceParams sequences{};
    ForwardTensors kernel_tensors = t;
    const cudaError_t err =
        prepare_cache(plan, p, t, workspace, stream, &sequences, &kernel_tensors);
    if (err != cudaSuccess)
      return detail::make_status(StatusCode::kDeviceError,
                                 "sm90 KV-cache prepare kernel failed to launch: %s",
                                 cudaGetErrorString(err));
    return Status::success();
  }
  if constexpr (kDType == DType::kE4M3) {
    if (p.fp8.out_dtype == DType::kFP16)
      return launch_forward<
          FwdConfig<kHeadDimQK, kHeadDimV, Element, FwdVariant::kMain, cutlass::half_t>, kDType>(
          plan, p, t, workspace, stream);
    return launch_forward<
        FwdConfig<kHeadDimQK, kHeadDimV, Element, FwdVariant::kMain, cutlass::bfloat16_t>, kDType>(
        plan, p, t, workspace, stream);
  } else {
    if constexpr (FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kExists) {
      if (plan.variant == FwdVariant::kChunked)
        return launch_forward<FwdConfig<kHeadDimQK, kHeadDimV, Element, FwdVariant::kChunked>,
                              kDType>(plan, p, t, workspace, stream);
    }
    if constexpr (FwdNarrowTileSize<kHeadDimQK, kHeadDimV>::kExists) {
      if (plan.variant == FwdVariant::kNarrow)
        return launch_forward<FwdConfig<kHeadDimQK, kHeadDimV, Element, FwdVariant::kNarrow>,
                              kDType>(plan, p, t, workspace, stream);
    }
    if constexpr (FwdWidePiecesTileSize<kHeadDimQK, kHeadDimV>::kExists) {
      if (plan.variant == FwdVariant::kWidePieces)
        return launch_forward<FwdConfig<kHeadDimQK, kHeadDimV, Element, FwdVariant::kWidePieces>,
                              kDType>(plan, p, t, workspace, stream);
    }
    if constexpr (FwdUnmaskedTileSize<kHeadDimQK, kHeadDimV>::kExists) {
      if (plan.variant == FwdVariant::kUnmasked)
        return launch_forward<FwdConfig<kHeadDimQK, kHeadDimV, Element, FwdVariant::kUnmasked>,
                              kDType>(plan, p, t, workspace, stream);
    }
    using Config = FwdConfig<kHeadDimQK, kHeadDimV, Element>;
    if constexpr (Config::kAlibiLinearFits) {
      if (p.alibi.data != nullptr)
        return launch_forward<Config, kDType, true>(plan, p, t, workspace, stream);
    }
    return launch_forward<Config, kDType>(plan, p, t, workspace, stream);
  }
}

}  // namespace fa4::sm90
