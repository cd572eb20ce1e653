// A backward plan (bwd_plan.hpp) → the backward's kernels on the caller's stream, in order: (GQA:
// clear the dK / dV accumulators) → prepare (D, LSE·log2e, clear dQ's accumulator) → the main
// kernel → dQ (→ dK, dV) rounded into the outputs. Nothing allocates, waits or decides, so the
// sequence can be captured in a graph; the workspace (bwd_workspace.hpp) is the caller's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.hpp"
#include "sm90/common/element.cuh"
#include "sm90/bwd/bwd_config.cuh"
#include "sm90/bwd/bwd_kernel.cuh"
#include "sm90/bwd/bwd_rows.cuh"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/host/bwd_plan.hpp"
#include "sm90/host/kernels.hpp"
#include "sm90/host/launch.cuh"

namespace fa4::sm90 {

inline Status launch_error(const char* what, int head_dim, cudaError_t err) {
  return detail::make_status(StatusCode::kDeviceError,
                             "sm90 backward %s (head dim %d) failed to launch: %s", what, head_dim,
                             cudaGetErrorString(err));
}

template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_backward(const BwdPlan& plan, const Problem& p, const BackwardTensors& t,
                    Workspace workspace, void* stream) {
  constexpr int kHeadDim = kHeadDimQK;  // in messages
  using Element = typename CutlassElement<kDType>::type;
  using Config = BwdConfigFor<kHeadDimQK, kHeadDimV, Element>;
  using PairedConfig = typename BwdPairedConfig<Config>::type;
  static_assert(BwdDqReduce<PairedConfig>::kAccumAtom == BwdDqReduce<Config>::kAccumAtom &&
                    PairedConfig::kDqFragments == Config::kDqFragments,
                "one order of dQ's accumulator for both");
  const DqFragments dq_fragments = BwdDqReduce<Config>::fragments();

  if (plan.empty()) {
    // No row takes part: the sinks' gradient is 0.
    const cudaError_t err =
        p.sinks != nullptr && t.dsinks != nullptr
            ? cudaMemsetAsync(t.dsinks, 0, size_t(p.heads_q) * sizeof(float),
                              static_cast<cudaStream_t>(stream))
            : cudaSuccess;
    return err == cudaSuccess ? Status::success() : launch_error("clearing dsinks", kHeadDim, err);
  }
  if (plan.block_m != Config::kBlockM || plan.block_n != Config::kBlockN)
    return detail::make_status(StatusCode::kInternalError,
                               "sm90 backward (head dim %d): the plan's %d x %d tiles are not the "
                               "kernel's %d x %d",
                               kHeadDim, plan.block_m, plan.block_n, Config::kBlockM,
                               Config::kBlockN);
  const int64_t q_total = plan.q_total, k_total = plan.k_total;
  const BwdWorkspace& ws = plan.workspace;
  auto* base = static_cast<char*>(workspace.data);
  float* dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  float* lse_log2 = reinterpret_cast<float*>(base + ws.lse_log2);
  float* dpsum = reinterpret_cast<float*>(base + ws.dpsum);
  auto* dq_done = reinterpret_cast<int32_t*>(base + ws.dq_done);
  float* dk_accum = ws.gqa ? reinterpret_cast<float*>(base + ws.dk_accum) : nullptr;
  float* dv_accum = ws.gqa ? reinterpret_cast<float*>(base + ws.dv_accum) : nullptr;
  auto* dq_turns = p.deterministic ? reinterpret_cast<int32_t*>(base + ws.dq_turns) : nullptr;
  auto* dkv_turns =
      p.deterministic && ws.gqa ? reinterpret_cast<int32_t*>(base + ws.dkv_turns) : nullptr;

  const SequenceParams sequences{p.varlen.cu_seqlens_q, p.varlen.cu_seqlens_k, p.seqused_k,
                                 int32_t(p.seqlen_q),    int32_t(p.seqlen_k),
                                 int32_t(p.varlen.total_q), int32_t(p.varlen.total_k)};
  const int32_t q_per_batch = p.is_varlen() ? 0 : int32_t(p.seqlen_q);
  const int32_t k_per_batch = p.is_varlen() ? 0 : int32_t(p.seqlen_k);
  auto row_tensor = [&](const TensorView& v) {
    return RowTensor<Element>{static_cast<Element*>(v.data), p.is_varlen() ? 0 : v.batch_stride,
                              v.seq_stride, v.head_stride};
  };
  auto const_rows = [&](const TensorView& v) {
    return RowTensor<const Element>{static_cast<const Element*>(v.data),
                                    p.is_varlen() ? 0 : v.batch_stride, v.seq_stride,
                                    v.head_stride};
  };
  // The row-wise kernels' lanes per row: dQ / dK rows, dV rows, and the prepare kernel's (O and
  // dO rows, dQ's accumulator rows).
  constexpr int kLanesQK = row_lanes(kHeadDimQK), kLanesV = row_lanes(kHeadDimV);
  constexpr int kLanesPrepare = kLanesQK > kLanesV ? kLanesQK : kLanesV;
  const dim3 row_block(32 * kRowWarps);
  auto row_grid = [&](int rows_per_block, int64_t rows, int64_t heads) {
    return dim3(unsigned((rows + rows_per_block - 1) / rows_per_block), unsigned(heads),
                unsigned(p.batch));
  };

  cudaError_t err = cudaSuccess;
  // What the main kernel adds into starts cleared: the GQA accumulators and the deterministic
  // mode's counters, which end the workspace (dQ's accumulator is cleared row by row below).
  const size_t clear_from = ws.gqa ? ws.dk_accum : p.deterministic ? ws.dq_turns : ws.bytes;
  if (k_total > 0 && clear_from < ws.bytes)
    err = cudaMemsetAsync(base + clear_from, 0, ws.bytes - clear_from,
                          static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return launch_error("clearing the accumulators", kHeadDim, err);

  if (q_total > 0) {
    const PrepareParams prepare{sequences,
                                t.lse.data,
                                p.is_varlen() ? 0 : t.lse.batch_stride,
                                t.lse.head_stride,
                                t.lse.seq_stride,
                                lse_log2,
                                dpsum,
                                dq_accum,
                                dq_done,
                                q_total,
                                ws.stat_rows,
                                dq_fragments,
                                q_per_batch,
                                int(p.head_dim_qk),
                                int(p.head_dim_v)};
    // Rows up to the longest sequence's pad end (bwd_workspace.hpp).
    err = launch_kernel(&bwd_prepare_kernel<Element, kLanesPrepare>,
                        row_grid(kRowsPerBlock<kLanesPrepare>, bwd_padded_stat_rows(p.seqlen_q),
                                 p.heads_q),
                        row_block, 0, stream, prepare, const_rows(t.out), const_rows(t.dout));
    if (err != cudaSuccess) return launch_error("prepare kernel", kHeadDim, err);
  }

  const int n_blocks = plan.n_blocks;
  const BandMask band = BandMask::make(p.seqlen_q, p.seqlen_k, p.causal, p.window.left,
                                       p.window.right);
  // dQ's rows converted as the CTAs of their (batch entry, head) finish (dq_done: bwd_rows.cuh).
  int32_t* const dq_counts = plan.dq_counts ? dq_done : nullptr;
  // With no query rows Q and dO may be views without memory or strides; their descriptors are
  // never used but must be encodable, so they borrow K's view.
  BackwardTensors tt = t;
  if (q_total == 0) tt.q = tt.dout = t.k;
  // Also without query rows: every key tile then writes dK = dV = 0.
  // `config`: a tag of Config or PairedConfig.
  auto launch_main = [&](auto config) -> Status {
    using C = typename decltype(config)::type;
    using Kernel = BwdKernel<C, false>;  // and <C, true> in deterministic mode
    using Store = BwdStore<C>;
    const SoftcapScores softcap = SoftcapScores::make(Softcap{p.softcap}, p.scale());
    auto output = [&](const TensorView& v) {
      return typename Store::Output{static_cast<Element*>(v.data),
                                    p.is_varlen() ? 0 : v.batch_stride, v.seq_stride,
                                    v.head_stride};
    };
    const typename Store::Params store{output(t.dk),
                                       output(t.dv),
                                       dk_accum,
                                       dv_accum,
                                       k_total,
                                       k_per_batch,
                                       int(p.heads_q / p.heads_kv),
                                       p.scale(),
                                       dq_turns,
                                       dkv_turns,
                                       int32_t((p.seqlen_q + C::kBlockM - 1) / C::kBlockM),
                                       n_blocks,
                                       int32_t(p.heads_q)};
    const int rows = int(p.heads_q * p.batch);
    // The grid's order is one of key-tile pairs on pairs (BwdKernel::unit).
    const int order_blocks = n_blocks / C::kClusterCtas;
    const typename Kernel::Params params{
        Kernel::Load::make_params(p, tt, lse_log2, dpsum, ws.stat_rows),
        store,
        // Without query rows the reduction never runs, but its parameters (in row order a TMA
        // descriptor) need some address.
        q_total > 0
            ? BwdDqReduce<C>::make_params(p, dq_accum, q_total, ws.stat_rows, dq_counts)
            : BwdDqReduce<C>::make_params(p, static_cast<float*>(t.k.data), 1, 1, nullptr),
        sequences,
        band,
        softcap,
        (softcap.enabled() ? p.softcap : p.scale()) * float(kLog2e),
        ScoreVariantParams{p.alibi.data, int(p.alibi.batch_stride), int(p.alibi.head_stride),
                           1.0f / (softcap.enabled() ? p.softcap : p.scale()), p.sinks},
        GroupedOrder{order_blocks, rows, plan.group},
        int(p.heads_q),
        plan.rotate};
    auto* kernel = &bwd_kernel<Kernel>;
    if constexpr (C::kClusterCtas == 1) {
      static_assert(Kernel::kSmemBytes == BwdKernel<C, true>::kSmemBytes);
      if (p.deterministic) kernel = &bwd_kernel<BwdKernel<C, true>>;
    }
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Kernel::kSmemBytes);
    if (err == cudaSuccess)
      // Dependent on the prepare kernel where there is one: the CTAs start as its last ones exit
      // (not earlier: a main CTA takes the whole register file) and load K and V before they
      // wait for its stats. On pairs, clusters of the pair's two CTAs.
      err = launch_kernel_with(kernel, dim3(unsigned(int64_t(n_blocks) * p.heads_q * p.batch)),
                               dim3(Kernel::kThreads), size_t(Kernel::kSmemBytes), stream,
                               LaunchOptions{q_total > 0, unsigned(C::kClusterCtas)}, params);
    if (err != cudaSuccess) return launch_error("kernel", kHeadDim, err);
    return Status::success();
  };
  if (k_total > 0) {
    // The plan pairs only where the config is pairable (bwd_one_stage, checked in bwd_config.cuh).
    const Status launched =
        plan.pairs ? launch_main(TypeTag<PairedConfig>{}) : launch_main(TypeTag<Config>{});
    if (!launched.ok()) return launched;
  }

  // dQ: scaled and rounded (rows that see no key get 0: their accumulator stayed cleared).
  if (q_total > 0) {
    // With counts its rows wait for the CTAs of their (batch entry, head): n_blocks each.
    const FinishParams finish{sequences,
                              dq_accum,
                              dq_fragments.enabled() ? ws.stat_rows : q_total,
                              q_per_batch,
                              int(p.head_dim_qk),
                              p.scale(),
                              BwdDqReduce<Config>::kAccumAtom,
                              dq_fragments,
                              dq_counts,
                              n_blocks};
    // Dependent on the main kernel where there is one: launched as that kernel ends, or, with
    // counts, as its last CTAs start.
    err = launch_kernel_ex(&bwd_finish_kernel<Element, kLanesQK>,
                           row_grid(kRowsPerBlock<kLanesQK>, p.seqlen_q, p.heads_q), row_block, 0,
                           stream, k_total > 0, finish, row_tensor(t.dq), false);
    if (err != cudaSuccess) return launch_error("dQ kernel", kHeadDim, err);
  }
  if (ws.gqa && k_total > 0) {
    const FinishParams finish_k{sequences, dk_accum, k_total, k_per_batch, int(p.head_dim_qk),
                                1.0f, 0, DqFragments{}, nullptr, 0};
    const FinishParams finish_v{sequences, dv_accum, k_total, k_per_batch, int(p.head_dim_v),
                                1.0f, 0, DqFragments{}, nullptr, 0};
    err = launch_kernel(&bwd_finish_kernel<Element, kLanesQK>,
                        row_grid(kRowsPerBlock<kLanesQK>, p.seqlen_k, p.heads_kv), row_block, 0,
                        stream, finish_k, row_tensor(t.dk), true);
    if (err == cudaSuccess)
      err = launch_kernel(&bwd_finish_kernel<Element, kLanesV>,
                          row_grid(kRowsPerBlock<kLanesV>, p.seqlen_k, p.heads_kv), row_block, 0,
                          stream, finish_v, row_tensor(t.dv), true);
    if (err != cudaSuccess) return launch_error("dK / dV kernel", kHeadDim, err);
  }
  if (p.sinks != nullptr && t.dsinks != nullptr) {
    const SinkGradParams sink{sequences, p.sinks,       t.dsinks,    lse_log2,
                              dpsum,     ws.stat_rows, q_per_batch, int(p.batch)};
    err = launch_kernel(&bwd_sink_grads_kernel<>, dim3(unsigned(p.heads_q)), dim3(kSinkThreads), 0,
                        stream, sink);
    if (err != cudaSuccess) return launch_error("dsinks kernel", kHeadDim, err);
  }
  return Status::success();
}

}  // namespace fa4::sm90
