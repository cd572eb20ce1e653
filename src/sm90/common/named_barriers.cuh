// Named barriers (bar.sync ids) of the kernels' consumer warpgroups, after the ids CUTLASS
// reserves for itself.
#pragma once

#include <cstdint>

namespace fa4::sm90 {

enum class ConsumerBarrier : uint32_t {
  kTurn0 = 0,     // consumer warpgroup 0 may issue its GEMMs (WarpgroupTurns)
  kTurn1 = 1,     // consumer warpgroup 1 may issue its GEMMs
  kEpilogue = 2,  // all consumers: V's ring is free for O / O is staged for the TMA store
  kTurn2 = 3,     // consumer warpgroup 2 may issue its GEMMs (three consumer warpgroups)
  // Consumer warpgroup 0's own barrier (+1, +2 for the others): it has seen Q of a keyless tile;
  // its slice of O's buffer is free / staged (FwdEpilogue::store_own_o).
  kWarpgroup0 = 4,
};

// The backward kernel's named barriers: dS of both MMA warpgroups is in shared memory; one
// warpgroup's dQ staging is written / read by the writer warp (bwd_dq_reduce.cuh); in
// deterministic mode, both warpgroups' turn to add dK / dV (bwd_turns.cuh).
constexpr uint32_t kBwdDsReadyBarrier = 0;
constexpr uint32_t kBwdDqFull0 = 1;
constexpr uint32_t kBwdDqFull1 = 2;
constexpr uint32_t kBwdTurnBoth = 3;
constexpr uint32_t kBwdDqEmpty0 = 4;
constexpr uint32_t kBwdDqEmpty1 = 5;

}  // namespace fa4::sm90
