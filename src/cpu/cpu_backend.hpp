// CPU backend: the portable default and the oracle the GPU kernels are tested against.
// A tiled online-softmax forward and a tiled backward, multithreaded over (batch, head, tile) or
// (batch, kv head), fp32 accumulation for every input dtype. Inputs and outputs are host memory.
#pragma once

#include <cstddef>

#include "fa4/attention.hpp"

namespace fa4::cpu {

// Called only with a validated problem and validated tensors (src/api/validate.hpp).
// `threads` > 0: that many threads; 0: every hardware thread.
size_t workspace_size(const Problem& problem, Pass pass, int threads);
Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
               int threads);
Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                int threads);

}  // namespace fa4::cpu
