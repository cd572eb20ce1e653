#include "sm90/host/bwd_plan.hpp"

#include "common/mask.hpp"
#include "sm90/bwd/bwd_tile_shape.hpp"
#include "sm90/common/grouped_order.hpp"

namespace fa4::sm90 {
namespace {

// bf16 and fp16, the kernels' element types.
constexpr int64_t kElementBytes = 2;

// The main kernel's CTA groups (grouped_order.hpp): several (head, batch entry) rows' key tiles
// together where a causal mask makes the CTAs' work uneven; else, with varlen batches (whose
// sequences' work differs anyway) and in deterministic mode (which orders its key tiles by its
// turns), one row after another. The model counts every key tile of a row, paired or not.
int backward_group(const Problem& p, int n_blocks, const DeviceFacts& device, int forced) {
  const int64_t rows = p.heads_q * p.batch;
  if (forced > 0) return int(forced < rows ? forced : rows);
  if (!p.causal || p.is_varlen() || p.deterministic) return 1;
  // A row's query side in L2: Q, dO, the dQ accumulator and the two stats.
  const int64_t bytes_per_row =
      (p.head_dim_qk + p.head_dim_v) * kElementBytes + 4 * p.head_dim_qk + 8;
  return GroupedOrder::group_for(rows, n_blocks, p.seqlen_q, bytes_per_row, device.sm_count,
                                 device.l2_bytes);
}

}  // namespace

BwdPlan plan_backward(const Problem& p, const DeviceFacts& device, const Overrides& overrides) {
  BwdPlan plan;
  plan.workspace = BwdWorkspace::layout(p);
  if (p.batch == 0) return plan;
  plan.q_total = p.seqlen_q == 0 ? 0 : p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q;
  plan.k_total = p.seqlen_k == 0 ? 0 : p.is_varlen() ? p.varlen.total_k : p.batch * p.seqlen_k;
  if (plan.empty()) return plan;
  plan.block_m = bwd_block_m(int(p.head_dim_qk));
  plan.block_n = bwd_block_n(int(p.head_dim_qk));
  plan.n_blocks = int((p.seqlen_k + plan.block_n - 1) / plan.block_n);
  const BandMask band = BandMask::make(p.seqlen_q, p.seqlen_k, p.causal, p.window.left,
                                       p.window.right);
  // Where no causal or window band cuts the key tiles: each CTA then waits for its reduce-adds to
  // land, which its dK / dV epilogue hides only where CTAs are long; causal ones lost up to 3 %.
  plan.dq_counts = plan.q_total > 0 && plan.k_total > 0 && !band.banded();
  // The main kernel runs only where there are keys (without, dQ stays 0 and nothing is paired or
  // grouped).
  if (plan.k_total > 0) {
    // Pairs where the config has them and both key tiles of every pair exist in every sequence:
    // fixed-length batches without seqused_k (every sequence has all its key tiles), an even
    // number of key tiles, and not in deterministic mode (whose turns order single key tiles).
    plan.pairs = bwd_one_stage(int(p.head_dim_qk), int(p.head_dim_v)) &&
                 overrides.bwd_pairs != Choice::kOff && !p.deterministic && !p.is_varlen() &&
                 p.seqused_k == nullptr && plan.n_blocks % 2 == 0;
    plan.group = backward_group(p, plan.n_blocks, device, overrides.bwd_group);
  }
  // Where every key tile sees every query tile (no band) and the order of the adds is free (not in
  // deterministic mode); only the configs that rotate (BwdWideConfig::kRotateQueries) read it.
  plan.rotate = overrides.bwd_rotate != Choice::kOff && !band.banded() && !p.deterministic;
  return plan;
}

}  // namespace fa4::sm90
