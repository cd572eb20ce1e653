// Problem → kernel parameters (TMA descriptors encoded on the host, passed by value) → launch on
// the caller's stream. Nothing here allocates or waits, so a launch can be captured in a graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.hpp"
#include "sm90/common/element.cuh"
#include "sm90/host/chunked_kv_rule.hpp"
#include "sm90/host/env_switch.hpp"
#include "sm90/fwd/fwd_config.cuh"
#include "sm90/fwd/fwd_kernel.cuh"
#include "sm90/host/fwd_launch.hpp"
#include "sm90/host/launch.cuh"
#include "sm90/fwd/split_kv.cuh"
#include "sm90/fwd/tile_order.cuh"

namespace fa4::sm90 {

template <class Config, DType kDType>
Status launch_forward(const Problem& p, const ForwardTensors& t, const BandMask& band,
                      Workspace workspace, void* stream) {
  using Kernel = FwdKernel<Config>;
  constexpr int kHeadDimQK = Config::kHeadDimQK;
  constexpr int kHeadDimV = Config::kHeadDimV;
  const SoftcapScores softcap = SoftcapScores::make(Softcap{p.softcap}, p.scale());
  // With pack-GQA a tile belongs to a kv head and holds the rows of its query heads.
  const QueryRows rows = QueryRows::make(p, Config::kBlockM);
  const int64_t group = rows.group.divisor;
  TileScheduler::Params scheduler = TileScheduler::make(
      (rows.count(p.seqlen_q) + Config::kBlockM - 1) / Config::kBlockM, p.heads_q / group, p.batch,
      /*heavy_last_rows=*/band.right >= 0);
  int sm_count = 0, l2_bytes = 0;
  cudaError_t err = current_device_attribute(cudaDevAttrMultiProcessorCount, sm_count);
  // The L2's size and a (head, batch entry) pair's K and V rows in it, for the numberings in
  // groups under a causal diagonal (unpacked GQA: a kv head's K / V counted once per query head of
  // it).
  if (err == cudaSuccess && band.right >= 0)
    err = current_device_attribute(cudaDevAttrL2CacheSize, l2_bytes);
  const int64_t pairs = int64_t(scheduler.heads) * p.batch;
  const int64_t sharing = p.heads_kv > 0 ? p.heads_q / p.heads_kv / group : 1;
  const int64_t kv_row_bytes =
      ((p.head_dim_qk + p.head_dim_v) * int64_t(sizeof(typename Config::Element)) + sharing - 1) /
      sharing;
  // Persistent CTAs take tiles in a fixed order (tile_scheduler.cuh): balanced when every
  // sequence has the same length and nothing but the sequence end masks keys, and, with the
  // causal diagonal, where the zig-zag's share per CTA comes out even. With the diagonal alone
  // (no window) and seqlen_q = seqlen_k, unpacked, a model with each tile's key tiles decides, and
  // may number the zig-zag's tiles in groups (causal_schedule.hpp); otherwise (a right-only
  // window, seqlen_q ≠ seqlen_k, pack-GQA) a query tile counts as its index.
  const bool fixed_lengths = !p.is_varlen() && p.seqused_k == nullptr;
  const bool causal_model = fixed_lengths && band.left < 0 && band.right == 0 &&
                            p.seqlen_q == p.seqlen_k && !rows.packed() && err == cudaSuccess;
  CausalSchedule causal{false, 1};
  if (causal_model) {
    const int64_t fit = GroupedOrder::l2_pairs(pairs, p.seqlen_k, kv_row_bytes, l2_bytes);
    causal = TileScheduler::causal_schedule({int(p.seqlen_q), Config::kBlockM, Config::kBlockN,
                                             int(pairs), sm_count, int(fit < pairs ? fit : pairs)});
  }
  const bool balanced_static_order =
      fixed_lengths && band.left < 0 &&
      (band.right < 0 ||
       (causal_model ? causal.persistent : TileScheduler::zigzag_balanced(scheduler, sm_count)));
  const int zigzag_group = causal.persistent ? causal.group : 1;
  const SequenceParams sequences{p.varlen.cu_seqlens_q, p.varlen.cu_seqlens_k, p.seqused_k,
                                 int32_t(p.seqlen_q),    int32_t(p.seqlen_k),
                                 int32_t(p.varlen.total_q), int32_t(p.varlen.total_k)};
  // The workspace: the varlen tile order, then split-KV's partials (workspace_size).
  const size_t order_bytes = tile_order_workspace_bytes(p);
  // Split-KV (split_kv.cuh) when the tiles leave SMs idle: each tile's keys shared out.
  const int splits = err == cudaSuccess
                         ? choose_splits(p, scheduler.tiles,
                                         (p.seqlen_k + Config::kBlockN - 1) / Config::kBlockN,
                                         sm_count)
                         : 1;
  SplitPartials partials{};
  if (splits > 1 && workspace.data != nullptr &&
      workspace.bytes >= order_bytes + split_workspace_bytes(p, splits))
    partials = SplitPartials::at(static_cast<char*>(workspace.data) + order_bytes, p, splits);
  // Varlen tiles longest-first (tile_order.cuh): the grid becomes the ordered entries.
  const bool ordered = err == cudaSuccess &&
                       order_longest_first(p, scheduler.tiles, sm_count, workspace);
  static_assert(Config::kBlockM >= kMinQueryTileRows, "the workspace's bound needs it");
  if (ordered) {
    const int entries = int(ordered_tile_entries(p.batch, rows.count(p.seqlen_q),
                                                 rows.count(p.varlen.total_q), scheduler.heads,
                                                 Config::kBlockM));
    scheduler.order = static_cast<int32_t*>(workspace.data);
    scheduler.tiles = entries;
    err = launch_order_tiles({sequences, rows, scheduler, entries, int(p.batch), Config::kBlockM},
                             stream);
  }
  if (partials.enabled()) {
    scheduler.splits = splits;
    scheduler.tiles *= splits;
  }
  const int ctas = TileScheduler::grid(scheduler, TileScheduler::persistent(balanced_static_order),
                                       sm_count);
  // One CTA per tile under a causal diagonal, more tiles than SMs: the grid numbered in groups of
  // a few heads, query tile by query tile (grouped_order.hpp), so that the hardware's greedy
  // hand-out ends on light tiles (head by head it ends on the last head's heaviest: a model puts
  // the busiest SM 11.7 % over the mean at d256 causal 8k, 0.8 % grouped). The persistent zig-zag
  // in the group the causal schedule chose (1: head by head). Not for the varlen order, whose
  // entries use the plain numbering.
  if (err == cudaSuccess && !ordered) {
    if (scheduler.heavy_last_rows && ctas == scheduler.tiles && ctas > sm_count)
      TileScheduler::set_group(scheduler, GroupedOrder::dividing_group_for(
                                              pairs, p.seqlen_k, kv_row_bytes, l2_bytes));
    else if (ctas < scheduler.tiles)
      TileScheduler::set_group(scheduler, TileScheduler::zigzag_group(zigzag_group, pairs));
  }

  const typename Kernel::Params params{Kernel::Load::make_params(p, t),
                                       Kernel::Epilogue::make_params(p, t),
                                       scheduler,
                                       sequences,
                                       rows,
                                       partials,
                                       band,
                                       softcap,
                                       softcap.enabled() ? p.softcap : p.scale()};

  auto* kernel = &fwd_kernel<Kernel>;
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Kernel::kSmemBytes);
  const dim3 grid{unsigned(ctas)}, block{unsigned(Kernel::kThreads)};
  const size_t smem = size_t(Kernel::kSmemBytes);
  if (err == cudaSuccess)
    err = ordered ? launch_kernel_dependent(kernel, grid, block, smem, stream, params)
                  : launch_kernel(kernel, grid, block, smem, stream, params);
  if (err == cudaSuccess && partials.enabled()) {
    const CombineParams combine{partials,
                                splits,
                                kHeadDimV,
                                sequences,
                                t.out.data,
                                p.is_varlen() ? 0 : t.out.batch_stride,
                                t.out.seq_stride,
                                t.out.head_stride,
                                p.return_lse ? t.lse.data : nullptr,
                                p.is_varlen() ? 0 : t.lse.batch_stride,
                                t.lse.head_stride,
                                t.lse.seq_stride};
    err = launch_combine_splits(combine, kDType, p.batch, p.seqlen_q, stream);
  }
  if (err != cudaSuccess)
    return detail::make_status(StatusCode::kDeviceError,
                               "sm90 forward kernel (head dims %d / %d) failed to launch: %s",
                               kHeadDimQK, kHeadDimV, cudaGetErrorString(err));
  return Status::success();
}

// The chunked variant (fwd_config.cuh) where these head dims have one, no causal or window band
// cuts the key tiles and the sequences are long (chunked_kv_rule.hpp): its wider key tiles leave
// each tile's first QKᵀ and last P·V exposed twice as long, which short sequences and the tiles
// under a diagonal pay for (d256 causal 2k / 4k −3 / −2 %, bench/NOTES.md, nineteenth session).
// FA4_SM90_CHUNKED_KV=on / off forces it, where it exists, for tests and measurements.
template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_forward(const Problem& p, const ForwardTensors& t, Workspace workspace, void* stream) {
  using Element = typename CutlassElement<kDType>::type;
  // Nothing to write (and Q / O may be views without memory).
  if (p.batch == 0 || p.seqlen_q == 0 || (p.is_varlen() && p.varlen.total_q == 0))
    return Status::success();
  const BandMask band = BandMask::make(p.seqlen_q, p.seqlen_k, p.causal, p.window.left,
                                       p.window.right);
  if constexpr (FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kExists) {
    static const int forced = env_switch("FA4_SM90_CHUNKED_KV", "on", "off");
    if (takes_chunked_kv(p, band.banded(),
                         FwdChunkedTileSize<kHeadDimQK, kHeadDimV>::kMinKeys, forced))
      return launch_forward<FwdConfig<kHeadDimQK, kHeadDimV, Element, true>, kDType>(
          p, t, band, workspace, stream);
  }
  return launch_forward<FwdConfig<kHeadDimQK, kHeadDimV, Element>, kDType>(p, t, band, workspace,
                                                                           stream);
}

}  // namespace fa4::sm90
