// The sm90 backward's launch plan (src/sm90/host/bwd_plan.hpp), on the host alone: key-tile pairs
// only where both key tiles of every pair exist and the config has them, CTA groups where a causal
// mask makes the work uneven, the rotated walk where no band cuts the key tiles, and each override
// forcing its choice.
#include <gtest/gtest.h>

#include <cstdint>

#include "fa4/attention.hpp"
#include "fa4/overrides.hpp"
#include "sm90/bwd/bwd_tile_shape.hpp"
#include "sm90/host/bwd_plan.hpp"

namespace {

using fa4::Choice;
using fa4::Overrides;
using fa4::Problem;
using namespace fa4::sm90;

const DeviceFacts kH200{132, 60 << 20};
const int32_t kMarker = 0;

Problem fixed(int64_t batch, int64_t seqlen, int64_t dim_qk, int64_t dim_v) {
  Problem p;
  p.batch = batch;
  p.seqlen_q = p.seqlen_k = seqlen;
  p.heads_q = p.heads_kv = 16;
  p.head_dim_qk = dim_qk;
  p.head_dim_v = dim_v;
  return p;
}

TEST(Sm90BackwardPlan, TilesAndWorkspace) {
  for (int dim : {64, 96, 128, 192, 256}) {
    const Problem p = fixed(2, 1000, dim, dim);
    const BwdPlan plan = plan_backward(p, kH200, {});
    EXPECT_EQ(plan.block_m, bwd_block_m(dim));
    EXPECT_EQ(plan.block_n, bwd_block_n(dim));
    EXPECT_EQ(plan.n_blocks, (1000 + plan.block_n - 1) / plan.block_n);
    EXPECT_EQ(plan.workspace.bytes, BwdWorkspace::layout(p).bytes);
    EXPECT_EQ(plan.q_total, 2000);
    EXPECT_EQ(plan.k_total, 2000);
    EXPECT_TRUE(plan.dq_counts) << "no band";
  }
  EXPECT_TRUE(plan_backward(fixed(0, 1000, 128, 128), kH200, {}).empty());
  Problem keys_only = fixed(2, 1000, 128, 128);
  keys_only.seqlen_q = 0;
  const BwdPlan plan = plan_backward(keys_only, kH200, {});
  EXPECT_FALSE(plan.empty()) << "dK = dV = 0 are still written";
  EXPECT_FALSE(plan.dq_counts);
  // No keys: dQ = 0 is written, no main kernel runs, nothing to pair or group (no key tiles to
  // divide by).
  for (bool causal : {false, true}) {
    Problem queries_only = fixed(2, 1000, 256, 256);
    queries_only.seqlen_k = 0;
    queries_only.causal = causal;
    const BwdPlan q_plan = plan_backward(queries_only, kH200, {});
    EXPECT_FALSE(q_plan.empty());
    EXPECT_EQ(q_plan.n_blocks, 0);
    EXPECT_FALSE(q_plan.pairs);
    EXPECT_EQ(q_plan.group, 1);
    EXPECT_FALSE(q_plan.dq_counts);
  }
}

TEST(Sm90BackwardPlan, KeyTilePairs) {
  EXPECT_TRUE(bwd_one_stage(256, 256));
  EXPECT_FALSE(bwd_one_stage(192, 192));
  EXPECT_FALSE(bwd_one_stage(192, 128));
  EXPECT_FALSE(bwd_one_stage(128, 128));
  EXPECT_TRUE(plan_backward(fixed(2, 1024, 256, 256), kH200, {}).pairs) << "16 key tiles";
  EXPECT_FALSE(plan_backward(fixed(2, 960, 256, 256), kH200, {}).pairs) << "15 key tiles";
  EXPECT_FALSE(plan_backward(fixed(2, 1024, 192, 192), kH200, {}).pairs) << "no paired config";
  Problem det = fixed(2, 1024, 256, 256);
  det.deterministic = true;
  EXPECT_FALSE(plan_backward(det, kH200, {}).pairs);
  Problem used = fixed(2, 1024, 256, 256);
  used.seqused_k = &kMarker;
  EXPECT_FALSE(plan_backward(used, kH200, {}).pairs);
  Problem var = fixed(2, 1024, 256, 256);
  var.varlen.cu_seqlens_q = var.varlen.cu_seqlens_k = &kMarker;
  var.varlen.total_q = var.varlen.total_k = 1500;
  EXPECT_FALSE(plan_backward(var, kH200, {}).pairs);
  Overrides off;
  off.bwd_pairs = Choice::kOff;
  EXPECT_FALSE(plan_backward(fixed(2, 1024, 256, 256), kH200, off).pairs);
  Overrides on;
  on.bwd_pairs = Choice::kOn;  // pairs only where they can run
  EXPECT_FALSE(plan_backward(fixed(2, 960, 256, 256), kH200, on).pairs);
  EXPECT_FALSE(plan_backward(fixed(2, 1024, 128, 128), kH200, on).pairs);
}

TEST(Sm90BackwardPlan, GroupsAndRotation) {
  Problem causal = fixed(2, 4096, 256, 256);
  causal.causal = true;
  const BwdPlan plan = plan_backward(causal, kH200, {});
  EXPECT_GE(plan.group, 1);
  EXPECT_LE(plan.group, 32);
  EXPECT_FALSE(plan.rotate) << "a band";
  EXPECT_FALSE(plan.dq_counts) << "a band";
  EXPECT_EQ(plan_backward(fixed(2, 4096, 256, 256), kH200, {}).group, 1) << "no mask";
  EXPECT_TRUE(plan_backward(fixed(2, 4096, 256, 256), kH200, {}).rotate);
  Overrides o;
  o.bwd_group = 5;
  EXPECT_EQ(plan_backward(fixed(2, 4096, 256, 256), kH200, o).group, 5);
  o.bwd_group = 1000;
  EXPECT_EQ(plan_backward(fixed(2, 4096, 256, 256), kH200, o).group, 32) << "at most all rows";
  o.bwd_rotate = Choice::kOff;
  EXPECT_FALSE(plan_backward(fixed(2, 4096, 256, 256), kH200, o).rotate);
  Problem det = fixed(2, 4096, 256, 256);
  det.deterministic = true;
  EXPECT_FALSE(plan_backward(det, kH200, {}).rotate);
  // Forced groups hold in every mode; the rule's own groups are causal and fixed-length only.
  Overrides three;
  three.bwd_group = 3;
  EXPECT_EQ(plan_backward(det, kH200, three).group, 3);
  Problem var = causal;
  var.varlen.cu_seqlens_q = var.varlen.cu_seqlens_k = &kMarker;
  var.varlen.total_q = var.varlen.total_k = 6000;
  EXPECT_EQ(plan_backward(var, kH200, {}).group, 1);
  EXPECT_EQ(plan_backward(var, kH200, three).group, 3);
  Problem det_causal = causal;
  det_causal.deterministic = true;
  EXPECT_EQ(plan_backward(det_causal, kH200, {}).group, 1);
  // A group needs the device's L2: more of it, at least as large a group.
  EXPECT_LE(plan_backward(causal, {132, 10 << 20}, {}).group, plan.group);
}

}  // namespace
