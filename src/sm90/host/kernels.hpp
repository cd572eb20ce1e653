// The kernel instances as the (host-only) backend sees them: one forward and one backward function
// per (head dim qk, head dim v) × dtype, defined in the .cu files that cmake/fa4_sm90.cmake
// generates from its kernel table.
#pragma once

#include "fa4/attention.hpp"
#include "sm90/host/bwd_plan.hpp"
#include "sm90/host/fwd_plan.hpp"

namespace fa4::sm90 {

// Launches the forward's kernels of `plan` on `stream` (a cudaStream_t). The problem has passed the
// backend's can_implement and check_tensors; `workspace` holds plan.workspace.bytes.
// Asynchronous: no allocation, no host synchronization.
template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_forward(const FwdPlan& plan, const Problem& problem, const ForwardTensors& tensors,
                   Workspace workspace, void* stream);

// The backward's kernels of `plan`, likewise; `workspace` holds plan.workspace.bytes.
template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_backward(const BwdPlan& plan, const Problem& problem, const BackwardTensors& tensors,
                    Workspace workspace, void* stream);

}  // namespace fa4::sm90
