// The backward kernel instances as the (host-only) backend sees them: one function per head dims ×
// dtype, defined in the .cu files that cmake/fa4_sm90.cmake generates from its kernel table.
#pragma once

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// Runs the backward on `stream` (a cudaStream_t) with the caller's workspace (workspace_size
// bytes). The problem has passed the backend's can_implement and check_tensors. Asynchronous.
template <int kHeadDimQK, int kHeadDimV, DType kDType>
Status run_backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                    void* stream);

}  // namespace fa4::sm90
