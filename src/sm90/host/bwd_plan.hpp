// The backward's launch plan: every choice its launcher makes (bwd_launch.cuh), from the problem,
// the device's facts and the caller's overrides, computed on the host without touching the device.
// The backend's workspace_size and the launcher both read its workspace layout.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"
#include "sm90/bwd/bwd_workspace.hpp"
#include "sm90/host/device_facts.hpp"

namespace fa4::sm90 {

struct BwdPlan {
  BwdWorkspace workspace;
  // Rows inside some sequence (a varlen tensor may have rows but every sequence be empty).
  int64_t q_total = 0, k_total = 0;
  int block_m = 0, block_n = 0;  // bwd/bwd_tile_shape.hpp
  int n_blocks = 0;              // key tiles of the longest sequence: the main grid's CTAs per row
  // Key-tile pairs (bwd/bwd_pair.cuh): clusters of the CTAs of key tiles 2j and 2j + 1.
  bool pairs = false;
  // (head, batch entry) rows whose CTAs run together, key tile by key tile (GroupedOrder).
  int group = 1;
  // Key tiles start at their own query tiles (QueryOrder), in the configs that rotate.
  bool rotate = false;
  // dQ's rows converted as the CTAs of their (batch entry, head) finish (bwd/bwd_rows.cuh),
  // rather than after the whole main kernel.
  bool dq_counts = false;

  bool empty() const { return q_total == 0 && k_total == 0; }
};

// The plan for a problem the backend's can_implement accepted.
BwdPlan plan_backward(const Problem& problem, const DeviceFacts& device,
                      const Overrides& overrides);

}  // namespace fa4::sm90
