// Named barriers (bar.sync ids) of the kernels' consumer warpgroups, after the ids CUTLASS
// reserves for itself.
#pragma once

#include <cstdint>

namespace fa4::sm90 {

enum class ConsumerBarrier : uint32_t {
  kTurn0 = 0,     // consumer warpgroup 0 may issue its GEMMs (WarpgroupTurns)
  kTurn1 = 1,     // consumer warpgroup 1 may issue its GEMMs
  kEpilogue = 2,  // all consumers: Q's buffer is free for O / O is staged for the TMA store
  kTurn2 = 3,     // consumer warpgroup 2 may issue its GEMMs (three consumer warpgroups)
};

// The backward kernel's one named barrier: dS of both MMA warpgroups is in shared memory.
constexpr uint32_t kBwdDsReadyBarrier = 0;

}  // namespace fa4::sm90
