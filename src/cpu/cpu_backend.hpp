// CPU backend: the portable default and the oracle the GPU kernels are tested against.
// A tiled online-softmax forward and a tiled backward, multithreaded over (batch, head, tile),
// fp32 accumulation for every input dtype. Inputs and outputs are host memory.
#pragma once

#include <cstddef>

#include "fa4/attention.hpp"

namespace fa4::cpu {

// Called only with a validated problem and validated tensors (src/api/validate.hpp).
size_t workspace_size(const Problem& problem, Pass pass);
// `threads` > 0: that many threads; 0: every hardware thread.
Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
               int threads);
Status backward(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                int threads);

}  // namespace fa4::cpu
