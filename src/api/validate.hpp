// Generic validation of what a caller hands the API, before any backend sees it. Every check returns
// kInvalidArgument with a message naming the offending field; nothing is written on failure.
#pragma once

#include "common/status.hpp"
#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"

namespace fa4::detail {

// Shapes, enums, scalars: checks that need no memory access.
Status validate_problem(const Problem& problem);

// cu_seqlens / seqused_k contents. Reads the arrays, so only for host-resident arrays (CPU backend).
Status validate_sequence_arrays(const Problem& problem);

// Pointers, strides, overlap of outputs, offset overflow.
Status validate_forward_tensors(const Problem& problem, const ForwardTensors& t);
Status validate_backward_tensors(const Problem& problem, const BackwardTensors& t);

// Choices among kAuto / kOff / kOn, counts not negative.
Status validate_overrides(const Overrides& overrides);

}  // namespace fa4::detail
