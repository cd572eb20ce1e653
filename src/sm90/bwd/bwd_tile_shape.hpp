// The backward's tile shapes per head dims. Plain C++, so that the host's launch plan
// (host/bwd_plan.hpp) and the kernels' configs (bwd_config.cuh) read the same numbers.
#pragma once

namespace fa4::sm90 {

// Query rows per step of the backward kernel (bwd_config.cuh): 128 at head dim 64, where Sᵀ and
// dPᵀ of 128 queries fit in the registers beside dK and dV; 64 above.
constexpr int bwd_block_m(int head_dim_qk) { return head_dim_qk <= 64 ? 128 : 64; }
// Keys per CTA: 128 up to head dim 128 (BwdConfig), 64 above (BwdWideConfig), where dK and dV of
// more keys do not fit in the registers.
constexpr int bwd_block_n(int head_dim_qk) { return head_dim_qk <= 128 ? 128 : 64; }
// Whether dQ's accumulator may be in fragment order (DqFragments, bwd_workspace.hpp), which places
// it by stat rows: the narrow kernel's (BwdConfig::kDqFragments); the wide kernel keeps the rows'
// order, numbered by query rows.
constexpr bool bwd_dq_fragments(int head_dim_qk) { return head_dim_qk <= 128; }
// Whether the head dims' config has one-stage Q and dO rings (BwdWideConfig::kStages): two stages
// need 64 KB more than the 227 KB of shared memory above 384 columns of Q and dO together. Such
// configs walk each key tile's query tiles from their own (QueryOrder) and have key-tile pairs
// (bwd_pair.cuh), both where the problem allows them (host/bwd_plan.hpp).
constexpr bool bwd_one_stage(int head_dim_qk, int head_dim_v) {
  return head_dim_qk > 128 && head_dim_qk + head_dim_v > 384;
}

}  // namespace fa4::sm90
