// Named barriers (bar.sync ids) of the forward kernel's consumer warpgroups, after the ids CUTLASS
// reserves for itself.
#pragma once

#include <cstdint>

namespace fa4::sm90 {

enum class ConsumerBarrier : uint32_t {
  kTurn0 = 0,     // consumer warpgroup 0 may issue its GEMMs (WarpgroupTurns)
  kTurn1 = 1,     // consumer warpgroup 1 may issue its GEMMs
  kEpilogue = 2,  // all consumers: Q's buffer is free for O / O is staged for the TMA store
};

}  // namespace fa4::sm90
