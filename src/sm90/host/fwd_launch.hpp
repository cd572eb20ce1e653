// The forward kernel instances as the (host-only) backend sees them: one function per (head dim qk,
// head dim v) × dtype, defined in the .cu files that cmake/fa4_sm90.cmake generates from its
// kernel table.
#pragma once

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// Launches the forward kernel on `stream` (a cudaStream_t). The problem has passed the backend's
// can_implement and check_tensors; `workspace` holds at least tile_order_workspace_bytes
// (tile_order.hpp). Asynchronous: no allocation, no host synchronization.
template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
                   void* stream);

}  // namespace fa4::sm90
