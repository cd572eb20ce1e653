// The dispatch layer's view of a backend: what the API layer calls once the problem and the tensors
// have passed validation (src/api/validate.hpp). Each backend owns its workspace layout and launch
// state; nothing of it leaks into the public structs.
#pragma once

#include <cstddef>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"

namespace fa4::detail {

struct BackendOps {
  const char* name;
  // Shape-level support (head dims, dtypes, features) for a validated problem.
  Status (*can_implement)(const Problem& problem, Pass pass);
  // Requirements on the tensors beyond the generic ones (e.g. TMA alignment). Host-only checks.
  Status (*check_tensors)(const Problem& problem, const ForwardTensors* fwd,
                          const BackwardTensors* bwd);
  // The same for every device; the overrides' choices included.
  size_t (*workspace_size)(const Problem& problem, Pass pass, const Overrides& overrides);
  // Is the backend usable in this process (built in, a suitable device present)?
  Status (*available)();
  Status (*forward)(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
                    void* stream, const Overrides& overrides);
  Status (*backward)(const Problem& problem, const BackwardTensors& tensors, Workspace workspace,
                     void* stream, const Overrides& overrides);
};

const BackendOps& cpu_backend();
const BackendOps& sm90_backend();  // present in every build; unavailable without CUDA

// True when p is CUDA device (or managed) memory; false in a CPU-only build.
bool is_device_pointer(const void* p);
// True when p is device memory the host cannot read (not managed); false in a CPU-only build.
bool is_device_only_pointer(const void* p);

// kAuto resolved: the GPU backend when the library has CUDA and q_data is device memory.
Backend resolve(Backend requested, const void* q_data);
const BackendOps& backend_ops(Backend resolved);

}  // namespace fa4::detail
